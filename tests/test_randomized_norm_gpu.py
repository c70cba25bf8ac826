"""GPU: randomized layer_norm_backward / rms_norm_backward against the fp64 reference: rows, N
in 1..20000 (odd ones too), input / grad / weight dtypes, with and without weight and bias
(tests/randomized_common.py describes the suite)."""

import pytest
import torch
from hypothesis import strategies as st

import ops
from cute_kernels.layer_norm import config as ln_config
from ops.reference import norm_backward_ref

from .helpers import rel_err
from .randomized_common import BF16, F16, F32, _family, _vec_of_len
from .test_layer_norm_gpu import TOL as NORM_TOL
from .test_layer_norm_gpu import _inputs as norm_inputs
from .test_layer_norm_gpu import _run_poisoned as norm_run_poisoned

pytestmark = pytest.mark.gpu


# =========================================================== layer_norm / rms_norm

# (is_rms, x dtype, grad dtype (None: x's), weight dtype, has weight, has bias)
NORM_COMBOS = {
    "ln-bf16-w32-b32": (False, BF16, None, F32, True, True),
    "ln-f16-w16": (False, F16, None, F16, True, False),
    "rms-bf16-wbf16": (True, BF16, None, BF16, True, False),
    "ln-f32-gbf16-wbf16-bbf16": (False, F32, BF16, BF16, True, True),
    "ln-bf16-nobias-weightless": (False, BF16, None, BF16, False, True),
    "rms-f32-weightless": (True, F32, None, F32, False, False),
}
# (combo, anchor N): N is drawn among the row lengths sharing the anchor's compiled tiles
NORM_CLASSES = [
    ("ln-bf16-w32-b32", 4096),
    ("ln-bf16-w32-b32", 777),
    ("ln-bf16-w32-b32", 20000),  # a 4-CTA cluster per row
    ("ln-f16-w16", 1),
    ("ln-f16-w16", 1000),
    ("ln-f16-w16", 12290),  # vector of 2, 2-CTA cluster
    ("rms-bf16-wbf16", 64),
    ("rms-bf16-wbf16", 8191),
    ("ln-f32-gbf16-wbf16-bbf16", 100),
    ("ln-f32-gbf16-wbf16-bbf16", 16384),
    ("ln-bf16-nobias-weightless", 7),
    ("ln-bf16-nobias-weightless", 3000),
    ("rms-f32-weightless", 513),
    ("rms-f32-weightless", 19999),
]
NORM_MAX_N = 20000
NORM_MAX_ELEMS = 1 << 21
NORM_ARCH = "sm_90a"  # H100 / H200: the tiles (clusters) the buckets are computed for


def norm_key(combo, n):
    """What picks the compiled kernels for a contiguous [rows, n] problem of ``combo``."""
    is_rms, dt, dz_dt, w_dt, has_w, has_b = NORM_COMBOS[combo]
    in_bits, out_bits = 8 * dt.itemsize, 8 * (dz_dt or dt).itemsize
    w_bits = 8 * (w_dt if has_w else dt).itemsize
    vec = _vec_of_len(n, 128 // max(in_bits, out_bits))
    tiles = ln_config.ln_bwd_tiles(
        n, in_bits, out_bits, w_bits, vec, NORM_ARCH, num_partials=max(1, int(has_w) + int(has_b))
    )
    fin = ln_config.finalize_tiles(n).vec if (has_w or has_b) else None
    return vec, tiles, fin


_norm_buckets: dict = {}


def norm_bucket(combo, anchor):
    """The row lengths around ``anchor`` with its compiled configuration (a contiguous run
    of its vector class)."""
    k = (combo, anchor)
    if k not in _norm_buckets:
        key = norm_key(combo, anchor)
        vec = key[0]
        _, dt, dz_dt, _, _, _ = NORM_COMBOS[combo]
        vmax = 16 // max(dt.itemsize, (dz_dt or dt).itemsize)
        # the row lengths with the anchor's vector: multiples of vmax, or odd multiples of vec
        step = vec if vec == vmax else 2 * vec
        found = [anchor]
        for direction in (-1, 1):
            n = anchor + direction * step
            while 1 <= n <= NORM_MAX_N and norm_key(combo, n) == key:
                found.append(n)
                n += direction * step
        _norm_buckets[k] = sorted(found)
    return _norm_buckets[k]


@st.composite
def norm_specs(draw, ci):
    combo, anchor = NORM_CLASSES[ci]
    bucket = norm_bucket(combo, anchor)
    n = draw(st.sampled_from(bucket))
    rows = draw(st.integers(1, max(1, min(1500, NORM_MAX_ELEMS // n))))
    return dict(combo=combo, anchor=anchor, n=n, rows=rows, seed=draw(st.integers(0, 2**31 - 1)))


def _norm_case(s):
    is_rms, dt, dz_dt, w_dt, has_w, has_b = NORM_COMBOS[s["combo"]]
    x, dz, w, b, mean, rstd = norm_inputs((s["rows"], s["n"]), dt, w_dt, has_w, has_b, is_rms, dz_dt, s["seed"])
    # poisoned launch vs the fp64 reference (test_layer_norm_gpu's _check, keeping the outputs)
    dx, dw, db = norm_run_poisoned(x, dz, w, b, mean, rstd, is_rms)
    rdx, rdw, rdb = norm_backward_ref(dz, x, w, mean, rstd, b is not None)
    tol = NORM_TOL[x.dtype]
    assert torch.isfinite(dx).all(), "dx has NaN / inf (unwritten?)"
    assert rel_err(dx, rdx) < tol, ("dx", rel_err(dx, rdx), tol)
    if w is not None:
        assert torch.isfinite(dw).all() and rel_err(dw, rdw) < max(tol, NORM_TOL[w.dtype]), ("dw", rel_err(dw, rdw))
    if b is not None:
        assert torch.isfinite(db).all() and rel_err(db, rdb) < max(tol, NORM_TOL[b.dtype]), ("db", rel_err(db, rdb))
    # the public op: the same (deterministic) results
    if is_rms:
        pdx, pdw = ops.rms_norm_backward(dz, x, w, rstd)
        pdb = None
    else:
        pdx, pdw, pdb = ops.layer_norm_backward(dz, x, w, mean, rstd, b)
    assert torch.equal(pdx, dx), "public op dx differs from the poisoned launch"
    assert (pdw is None) == (w is None) and (pdw is None or torch.equal(pdw, dw)), "public op dweight differs"
    assert (pdb is None) == (b is None) and (pdb is None or torch.equal(pdb, db)), "public op dbias differs"


_norm_family = _family("norm", NORM_CLASSES, norm_specs, _norm_case)


@pytest.mark.parametrize("ci", range(len(NORM_CLASSES)), ids=[f"{c}-n{n}" for c, n in NORM_CLASSES])
def test_norm_randomized(ci):
    _norm_family(ci)
