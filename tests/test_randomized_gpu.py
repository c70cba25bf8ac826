"""GPU: hypothesis-driven randomized agreement with the fp64 references, every op family.

Families and their cases per run (CASES below, spread evenly over each family's classes
and rounded up: 920 in all; at least 500 is checked by the last test when the whole file
runs):

* dropout_bias_backward (144, 8 classes): shapes (2-D and 3-D), dtypes, p, activations, bias
  dtypes, bool / uint8 masks, row-strided views of bigger buffers;
* layer_norm_backward / rms_norm_backward (140, 14 classes): rows, N in 1..20000 (odd ones too),
  input / grad / weight dtypes, with and without weight and bias;
* attention_bwd_preprocess + compute_delta (54, 6 classes), convert_dq (40, 5),
  convert_dkv (40, 5):
  batch, heads, lengths, head dims (odd ones too), variable lengths, split partials,
  [B, S, H, D] / [total, H, D] views with permuted and padded strides;
* efficient_attention_backward (144, 6 classes): B, H, Mq, Mk, Dqk != Dv up to 256, fp16 / bf16,
  custom_mask_type 0/1/2, windows, variable lengths, num_splits_key, and q / k / v / out /
  dO that are permuted, padded views of bigger buffers (arbitrary strides);
* efficient_attention_backward with bias / bias gradient / dropout (208, 8 classes): every
  broadcast kind of bias (dense, padded and transposed strides), p, masks, windows, split
  keys, variable lengths with dropout, fp16 / bf16 / fp32, head dims to 256; against the
  fp64 reference with torch's dropout mask (tests/test_mem_eff_attention_features_gpu.py).
* the Hopper attention forward (150, 15 classes; sm_90a): every head-dim pair it compiles,
  fp16 / bf16, masks none / top-left / bottom-right (more queries than keys through the
  kernel's torch face; the ops' NotImplementedError checked), windows, grouped- and
  multi-query heads, odd lengths, variable lengths with empty and one-row sequences (the ops'
  refusal of a bias there checked), bias of every broadcast and layout, dropout, padded and
  permuted views, through the kernel's torch face, efficient_attention_forward,
  memory_efficient_attention and SDPA under use_for_sdpa (a call counter asserts ours ran); O
  and the LSE against the fp64 reference with torch's keep mask for the philox state the call
  took (tests/test_attention_fwd_sm90_gpu.py).

Compile time is bounded by design: every distinct kernel configuration is a JIT compile
(seconds each for the attention backward), so each family draws one of a few fixed
*classes* (the arguments that pick a compiled configuration: dtypes, padded head dim,
vector width, varlen, split / no split, alignment; for the norms the tiles, which depend
on N) and randomizes everything else within the class: one pytest case per class. About
115 configurations in all with the default seed, 6 of them attention-backward kernels and
15 attention forwards (seconds each), the rest small kernels (0.2-1 s each).

Comparisons reuse the existing GPU tests' helpers and tolerances. Outputs are NaN before
the kernels write them: dropout / norm cases launch into poisoned outputs and then call
the public op, asserting it bitwise equal (both deterministic); the attention cases call
the public ops after filling the allocator's blocks of the outputs' sizes with NaN.

Reproducible: hypothesis runs with ``@seed(CUTE_KERNELS_RANDOM_SEED)`` (default below)
and no example database; set the environment variable to draw other cases. A failure
names the seed and the case. Shrinking is off (it would compile new configurations);
``CUTE_KERNELS_SHRINK=1`` turns it on.
"""

import collections
import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

import ops
from cute_kernels.layer_norm import config as ln_config
from ops import _compile as cc
from ops import attention_bwd_prepost as A
from ops import attention_fwd_sm90 as fwd_sm90
from ops.reference import (
    attention_backward_ref,
    convert_dkv_ref,
    convert_dq_ref,
    norm_backward_ref,
)

from .helpers import rel_err
from .test_attention_bwd_prepost_gpu import (
    check_converted,
    check_delta,
    nan_padded_dkv_accum,
    nan_padded_dq_accum,
    nan_padded_dq_accum_varlen,
    poison_allocator,
)
from .test_attention_fwd_sm90_gpu import check_forward, forward_reference
from .test_dropout_bias_gpu import check as check_dropout_bias
from .test_layer_norm_gpu import TOL as NORM_TOL
from .test_layer_norm_gpu import _inputs as norm_inputs
from .test_layer_norm_gpu import _run_poisoned as norm_run_poisoned
from .test_mem_eff_attention_gpu import (
    _backward,
    check_grad,
    cu_seqlens,
    key_coverage,
    ref_forward,
    segments,
    seq_args,
    torch_backward_ok,
    torch_forward_ok,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

DEFAULT_SEED = 20240611
SEED = int(os.environ.get("CUTE_KERNELS_RANDOM_SEED", DEFAULT_SEED))
_PHASES = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if os.environ.get("CUTE_KERNELS_SHRINK") == "1" else ())

# cases per family (hypothesis max_examples); the sum must stay >= MIN_TOTAL_CASES
CASES = {
    "dropout_bias": 140,
    "norm": 140,
    "attention_bwd_preprocess": 50,
    "attention_bwd_convert_dq": 40,
    "attention_bwd_convert_dkv": 40,
    "efficient_attention_backward": 140,
    "efficient_attention_backward_bias_dropout": 208,
    "attention_forward": 150,
}
MIN_TOTAL_CASES = 500
assert sum(CASES.values()) >= MIN_TOTAL_CASES

_COUNTS: collections.Counter = collections.Counter()  # cases that ran to the end, per family
_DONE: set = set()  # (family, class) whose hypothesis run completed
_CLASSES: dict = {}  # family -> its classes


def _settings(max_examples):
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,  # @seed(SEED) fixes the draw instead
        phases=_PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=False,
    )


def _run_case(family, spec, fn):
    """Run one case; a failure names the seed and the case."""
    note(f"{family} case (CUTE_KERNELS_RANDOM_SEED={SEED}): {spec}")
    try:
        fn(spec)
    except AssertionError as e:
        raise AssertionError(f"{e}\n[{family}, CUTE_KERNELS_RANDOM_SEED={SEED}, case {spec}]") from e
    _COUNTS[family] += 1


def _family(family, classes, specs, case, seed_per_class=False):
    """The hypothesis run of one family for one class (``ci``): CASES[family] spread evenly
    over the classes, so each compiled configuration gets its share of cases. With
    ``seed_per_class`` each class draws from seed SEED + ci (else all from SEED: classes whose
    strategies match then draw the same sizes)."""
    _CLASSES[family] = classes
    per_class = math.ceil(CASES[family] / len(classes))

    def test(ci):
        @seed(SEED + ci if seed_per_class else SEED)
        @_settings(per_class)
        @given(data=st.data())
        def run(data):
            spec = data.draw(specs(ci), label="case")
            _run_case(family, spec, case)

        run()
        _DONE.add((family, ci))

    return test


def _vec_of_len(n, vmax):
    """The widest power of two <= vmax dividing n (the hosts' vector rule for a row of n)."""
    v = vmax
    while n % v:
        v //= 2
    return v


def _dt(dtype):
    return "none" if dtype is None else str(dtype).replace("torch.", "").replace("float", "f")


def _vmax(dtype):
    return 16 // dtype.itemsize  # 128-bit accesses


def into_padded(vals, pads=None, order=None, offset=0):
    """A copy of ``vals`` as a view into a bigger buffer: dims laid out outer to inner in
    ``order`` (dims other than the last; the last is innermost, stride 1), each dim's extent
    grown by ``pads[d]``, the view starting ``offset`` elements into the buffer. Elements
    outside the view are NaN (floats) or 1 (bool / ints), so a kernel reading them shows."""
    nd = vals.dim()
    pads = list(pads) if pads is not None else [0] * nd
    order = list(order) if order is not None else list(range(nd - 1))
    assert sorted(order) == list(range(nd - 1)), order
    ext = [s + p for s, p in zip(vals.shape, pads)]
    strides, acc = [0] * nd, 1
    for d in [nd - 1] + order[::-1]:
        strides[d] = acc
        acc *= ext[d]
    fill = float("nan") if vals.is_floating_point() else 1
    buf = torch.full((offset + acc,), fill, dtype=vals.dtype, device=vals.device)
    view = buf.as_strided(tuple(vals.shape), tuple(strides), offset)
    view.copy_(vals)
    return view


def _layout(st_pad, st_offset, nd):
    """A strategy of (pads, order, offset) for into_padded of an nd-dim tensor."""
    return st.tuples(
        st.lists(st.integers(0, 2), min_size=nd - 1, max_size=nd - 1),
        st_pad,
        st.permutations(list(range(nd - 1))),
        st_offset,
    ).map(lambda t: (tuple(t[0]) + (t[1],), tuple(t[2]), t[3]))


def _apply_layout(t, layout):
    pads, order, offset = layout
    return into_padded(t, pads, order, offset)


def _lengths(max_len, max_seqs=4):
    """Variable sequence lengths (zeros allowed), at least one row in all."""
    return st.lists(st.integers(0, max_len), min_size=1, max_size=max_seqs).filter(lambda ls: sum(ls) > 0)


# ==================================================================== dropout_bias

DB_CLASSES = [
    # (dtype, activation, bias dtype (None: no bias, dBias in dY's dtype), vector width)
    (BF16, None, None, 8),
    (BF16, None, F32, 1),
    (F16, None, None, 2),
    (F32, None, BF16, 4),
    (BF16, "gelu", BF16, 8),
    (F16, "relu", F16, 4),
    (F32, "gelu_erf", F32, 1),
    (BF16, "gelu_erf", BF16, 2),
]
DB_MAX_N = 5000
DB_MAX_ELEMS = 1 << 20


@st.composite
def dropout_bias_specs(draw, ci):
    dtype, activation, bias_dtype, vec = DB_CLASSES[ci]
    if vec == _vmax(dtype):
        n = vec * draw(st.integers(1, DB_MAX_N // vec))
    else:  # an odd multiple: the widest legal vector is exactly vec
        n = vec * (2 * draw(st.integers(0, (DB_MAX_N // vec - 1) // 2)) + 1)
    lead = draw(st.sampled_from([(), (2,), (3,)]))
    max_rows = max(1, min(3000, DB_MAX_ELEMS // n) // math.prod(lead))
    rows = draw(st.integers(1, max_rows))
    p = draw(st.one_of(st.sampled_from([0.0, 0.1, 0.5]), st.floats(0.0, 0.95)))
    # per tensor: None (contiguous) or (extra columns, column offset), multiples of vec
    row_layout = st.one_of(
        st.none(), st.tuples(st.integers(1, 4), st.integers(0, 4)).map(lambda t: (vec * t[0], vec * min(t[0], t[1])))
    )
    return dict(
        dtype=dtype,
        activation=activation,
        bias_dtype=bias_dtype,
        vec=vec,
        shape=lead + (rows, n),
        p=p,
        mask_dtype=draw(st.sampled_from(["bool", "uint8"])),
        layouts={name: draw(row_layout) for name in ("grad_out", "mask", "x")},
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _row_strided(t, layout):
    """t itself, or a copy whose rows are ``extra`` elements longer, starting ``c0`` in."""
    if layout is None:
        return t
    extra, c0 = layout
    return into_padded(t, [0] * (t.dim() - 1) + [extra], None, c0)


def dropout_bias_inputs(s, device=None):
    gen = torch.Generator(device or DEV).manual_seed(s["seed"])
    dev = device or DEV
    shape, dtype = s["shape"], s["dtype"]
    dy = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    mask = torch.rand(shape, generator=gen, device=dev) >= s["p"]
    if s["mask_dtype"] == "uint8":
        mask = mask.to(torch.uint8)
    x = torch.randn(shape, generator=gen, device=dev, dtype=dtype) if s["activation"] else None
    bias = None
    if s["bias_dtype"] is not None:
        bias = torch.randn(shape[-1], generator=gen, device=dev, dtype=s["bias_dtype"])
    dy = _row_strided(dy, s["layouts"]["grad_out"])
    mask = _row_strided(mask, s["layouts"]["mask"])
    if x is not None:
        x = _row_strided(x, s["layouts"]["x"])
    return dy, mask, x, bias


def _dropout_bias_case(s):
    dy, mask, x, bias = dropout_bias_inputs(s)
    act, p = s["activation"], s["p"]
    # poisoned launch vs the fp64 reference (test_dropout_bias_gpu's tolerances)
    dx, db = check_dropout_bias(dy, mask, p, x, bias, act)
    # the public op: the same (deterministic) results
    gi, gb = ops.dropout_bias_backward(dy, mask, p, x, bias, act)
    assert gi.shape == dy.shape and gb.dtype == db.dtype
    assert torch.equal(gi, dx), "dropout_bias_backward differs from the poisoned launch"
    assert torch.equal(gb, db), "dropout_bias_backward's grad_bias differs from the poisoned launch"


_dropout_bias_family = _family("dropout_bias", DB_CLASSES, dropout_bias_specs, _dropout_bias_case)


@pytest.mark.parametrize(
    "ci", range(len(DB_CLASSES)), ids=[f"{_dt(c[0])}-{c[1]}-dbias_{_dt(c[2])}-vec{c[3]}" for c in DB_CLASSES]
)
def test_dropout_bias_randomized(ci):
    _dropout_bias_family(ci)


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


# ============================================================ attention_bwd_prepost

# (dtype, padded head dim, vector width): one compiled configuration per (class, varlen, ...)
PP_CLASSES = [
    (BF16, 64, 8),
    (F16, 128, 4),
    (BF16, 256, 1),
    (F16, 32, 1),
    (BF16, 160, 2),
    (F32, 96, 4),  # preprocess / compute_delta only (the conversions write fp16 / bf16)
]
PP_CONVERT_CLASSES = PP_CLASSES[:5]


def pp_head_dims(dtype, hd, vec):
    """Head dims whose padded head dim is hd and whose widest vector is vec."""
    return [d for d in range(hd - 31, hd + 1) if _vec_of_len(d, _vmax(dtype)) == vec]


def _pp_layout(vec, nd):
    """Strided views keeping the class's vector: padded head-dim pitch and start offset in
    multiples of vec; other dims permuted and padded freely."""
    return _layout(st.integers(0, 3).map(lambda k: vec * k), st.integers(0, 3).map(lambda k: vec * k), nd)


@st.composite
def preprocess_specs(draw, ci):
    dtype, hd, vec = PP_CLASSES[ci]
    d = draw(st.sampled_from(pp_head_dims(dtype, hd, vec)))
    varlen = draw(st.booleans())
    spec = dict(
        dtype=dtype,
        head_dim=d,
        vec=vec,
        varlen=varlen,
        heads=draw(st.integers(1, 4)),
        zero_dq_accum=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 0.9, 0.5, 0.0])),
    )
    if varlen:
        spec["lengths"] = draw(_lengths(600))
        spec["max_seqlen"] = max(spec["lengths"]) + draw(st.sampled_from([0, 0, 3, 130]))
    else:
        spec["batch"] = draw(st.integers(1, 3))
        spec["seqlen"] = draw(st.one_of(st.integers(1, 700), st.sampled_from([1, 127, 128, 129, 255, 256, 257])))
    nd = 3 if varlen else 4
    spec["layouts"] = (draw(_pp_layout(vec, nd)), draw(_pp_layout(vec, nd)))
    spec["seed"] = draw(st.integers(0, 2**31 - 1))
    return spec


def preprocess_inputs(s, device=None):
    dev = device or DEV
    gen = torch.Generator(dev).manual_seed(s["seed"])
    h, d = s["heads"], s["head_dim"]
    shape = (sum(s["lengths"]), h, d) if s["varlen"] else (s["batch"], s["seqlen"], h, d)
    out = _apply_layout(torch.randn(shape, generator=gen, device=dev, dtype=s["dtype"]), s["layouts"][0])
    grad_out = _apply_layout(torch.randn(shape, generator=gen, device=dev, dtype=s["dtype"]), s["layouts"][1])
    cu = cu_seqlens(s["lengths"]) if s["varlen"] else None
    return out, grad_out, cu


def _preprocess_case(s):
    out, grad_out, cu = preprocess_inputs(s)
    varlen, h, d = s["varlen"], s["heads"], s["head_dim"]
    max_seqlen = s["max_seqlen"] if varlen else None
    b = len(s["lengths"]) if varlen else s["batch"]
    poison_allocator(b * h * A.seqlen_rounded(max_seqlen if varlen else s["seqlen"]) * 4)
    res = A.attention_bwd_preprocess(
        out, grad_out, scale=s["scale"], cu_seqlens_q=cu, max_seqlen_q=max_seqlen, zero_dq_accum=s["zero_dq_accum"]
    )
    delta = res[0] if s["zero_dq_accum"] else res
    check_delta(delta, out, grad_out, s["scale"], cu, max_seqlen)
    if s["zero_dq_accum"]:
        acc = res[1]
        rows = sum(s["lengths"]) if varlen else s["seqlen"]
        assert acc.shape == A.dq_accum_shape(b, rows, h, d, varlen=varlen) and acc.dtype == torch.float32
        assert (acc == 0).all(), f"{(acc != 0).sum().item()} dQ accumulator elements not zeroed"
    # the mem-eff kernel's Δ on the same inputs: unscaled, unrounded rows
    delta2 = A.attention_bwd_compute_delta(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=max_seqlen)
    check_delta(delta2, out, grad_out, 1.0, cu, max_seqlen, rounded=False)


_preprocess_family = _family("attention_bwd_preprocess", PP_CLASSES, preprocess_specs, _preprocess_case)


@pytest.mark.parametrize("ci", range(len(PP_CLASSES)), ids=[f"{_dt(c[0])}-hd{c[1]}-vec{c[2]}" for c in PP_CLASSES])
def test_attention_bwd_preprocess_randomized(ci):
    _preprocess_family(ci)


def _convert_common(draw, ci):
    dtype, hd, vec = PP_CONVERT_CLASSES[ci]
    varlen = draw(st.booleans())
    spec = dict(
        dtype=dtype,
        head_dim=draw(st.sampled_from(pp_head_dims(dtype, hd, vec))),
        vec=vec,
        varlen=varlen,
        heads=draw(st.integers(1, 4)),
        p_dropout=draw(st.sampled_from([0.0, 0.1, 0.5])),
        scale=draw(st.sampled_from([1.0, 0.125, 0.0625, 0.3])),
    )
    if varlen:
        spec["lengths"] = draw(_lengths(600))
        spec["extra"] = draw(st.sampled_from([0, 0, 5, 200]))
    else:
        spec["batch"] = draw(st.integers(1, 3))
        spec["seqlen"] = draw(st.one_of(st.integers(1, 700), st.sampled_from([1, 31, 32, 33, 127, 128, 129, 256])))
    spec["seed"] = draw(st.integers(0, 2**31 - 1))
    return spec


@st.composite
def convert_dq_specs(draw, ci):
    spec = _convert_common(draw, ci)
    spec["nsplits"] = draw(st.sampled_from([None, 1, 2, 3]))
    spec["acc_pad"] = draw(st.sampled_from([0, 0, 4, 32]))  # extra fp32 columns: a row-strided accumulator
    return spec


def _pad_last(t, extra):
    return t if not extra else into_padded(t, [0] * (t.dim() - 1) + [extra])


def convert_dq_inputs(s, device=None):
    gen = torch.Generator(device or DEV).manual_seed(s["seed"])
    h, d = s["heads"], s["head_dim"]
    if s["varlen"]:
        acc = nan_padded_dq_accum_varlen(s["lengths"], h, d, s["nsplits"], gen)
    else:
        acc = nan_padded_dq_accum(s["batch"], s["seqlen"], h, d, s["nsplits"], gen)
    return _pad_last(acc, s["acc_pad"])


def _convert_dq_case(s):
    acc = convert_dq_inputs(s)
    h, d, dtype, p, scale = s["heads"], s["head_dim"], s["dtype"], s["p_dropout"], s["scale"]
    if s["varlen"]:
        cu = cu_seqlens(s["lengths"])
        max_seqlen = max(s["lengths"]) + s["extra"]
        poison_allocator(sum(s["lengths"]) * h * d * 2)
        dq = A.attention_bwd_convert_dq(
            acc, scale, head_dim=d, cu_seqlens_q=cu, max_seqlen_q=max_seqlen, p_dropout=p, dtype=dtype
        )
        ref = convert_dq_ref(acc, scale, head_dim=d, cu_seqlens_q=cu, p_dropout=p)
    else:
        sq = s["seqlen"]
        poison_allocator(s["batch"] * sq * h * d * 2)
        dq = A.attention_bwd_convert_dq(acc, scale, head_dim=d, seqlen_q=sq, p_dropout=p, dtype=dtype)
        ref = convert_dq_ref(acc, scale, head_dim=d, seqlen_q=sq, p_dropout=p)
    check_converted(dq, ref, dtype)


_convert_dq_family = _family("attention_bwd_convert_dq", PP_CONVERT_CLASSES, convert_dq_specs, _convert_dq_case)
_PP_CONVERT_IDS = [f"{_dt(c[0])}-hd{c[1]}-vec{c[2]}" for c in PP_CONVERT_CLASSES]


@pytest.mark.parametrize("ci", range(len(PP_CONVERT_CLASSES)), ids=_PP_CONVERT_IDS)
def test_attention_bwd_convert_dq_randomized(ci):
    _convert_dq_family(ci)


@st.composite
def convert_dkv_specs(draw, ci):
    return _convert_common(draw, ci)


def convert_dkv_inputs(s, device=None):
    gen = torch.Generator(device or DEV).manual_seed(s["seed"])
    h, d = s["heads"], s["head_dim"]
    if s["varlen"]:
        lengths = s["lengths"]
        max_seqlen = max(lengths) + s["extra"]
    else:
        lengths = [s["seqlen"]] * s["batch"]
        max_seqlen = s["seqlen"]
    dk_acc = nan_padded_dkv_accum(lengths, h, d, max_seqlen, gen)
    dv_acc = nan_padded_dkv_accum(lengths, h, d, max_seqlen, gen)
    return dk_acc, dv_acc


def _convert_dkv_case(s):
    dk_acc, dv_acc = convert_dkv_inputs(s)
    h, d, dtype, p, scale = s["heads"], s["head_dim"], s["dtype"], s["p_dropout"], s["scale"]
    if s["varlen"]:
        cu, total = cu_seqlens(s["lengths"]), sum(s["lengths"])
        kw = dict(seqlen_k=total, cu_seqlens_k=cu)
    else:
        total = s["batch"] * s["seqlen"]
        kw = dict(seqlen_k=s["seqlen"])
    poison_allocator(*[total * h * d * 2] * 2)
    dk, dv = A.attention_bwd_convert_dkv(dk_acc, dv_acc, scale, head_dim=d, p_dropout=p, dtype=dtype, **kw)
    ref_dk, ref_dv = convert_dkv_ref(dk_acc, dv_acc, scale, head_dim=d, p_dropout=p, **kw)
    check_converted(dk, ref_dk, dtype)
    check_converted(dv, ref_dv, dtype)


_convert_dkv_family = _family("attention_bwd_convert_dkv", PP_CONVERT_CLASSES, convert_dkv_specs, _convert_dkv_case)


@pytest.mark.parametrize("ci", range(len(PP_CONVERT_CLASSES)), ids=_PP_CONVERT_IDS)
def test_attention_bwd_convert_dkv_randomized(ci):
    _convert_dkv_family(ci)


# ==================================================== efficient_attention_backward

# (dtype, max_k = round_up(max(Dqk, Dv), 32), 128-bit aligned, varlen, split keys):
# one compiled configuration each (split keys: Δ from compute_delta, not the kernel).
ME_CLASSES = [
    (BF16, 64, True, False, False),
    (F16, 128, True, False, True),
    (BF16, 256, True, False, False),
    (F16, 96, False, False, True),
    (BF16, 128, True, True, False),
    (F16, 64, True, True, True),
]
ME_SEQLENS = st.one_of(st.integers(1, 300), st.sampled_from([1, 63, 64, 65, 127, 128, 129, 255, 256, 257]))


def me_block_j(max_k):
    return 128 if max_k <= 128 else 64  # cute_kernels/mem_eff_attention/config.py's block_size_j


def _me_layout(aligned, nd=4):
    if aligned:  # pitch and start offset multiples of 8 halves: the 128-bit path stays on
        return _layout(st.sampled_from([0, 8, 16]), st.sampled_from([0, 8, 64]), nd)
    return _layout(st.integers(0, 9), st.integers(0, 9), nd)


@st.composite
def mem_eff_specs(draw, ci):
    dtype, max_k, aligned, varlen, split = ME_CLASSES[ci]
    lo = max_k - 31
    if aligned:
        big = draw(st.sampled_from([d for d in range(lo, max_k + 1) if d % 8 == 0]))
        other = big if draw(st.booleans()) else draw(st.sampled_from(list(range(8, big + 1, 8))))
        misalign = None
    else:
        # one source of misalignment is always there: an odd head dim (the gradients' rows)
        # or an odd start of query; the rest of the layouts are free
        misalign = draw(st.sampled_from(["dqk", "dv", "offset"]))
        big = draw(st.integers(lo, max_k))
        other = big if draw(st.booleans()) else draw(st.integers(1, big))
    dqk, dv = (big, other) if draw(st.booleans()) else (other, big)
    if misalign == "dqk" and dqk % 2 == 0:
        dqk -= 1  # stays >= lo (lo is odd), so max_k is unchanged
    if misalign == "dv" and dv % 2 == 0:
        dv -= 1
    bj = me_block_j(max_k)
    spec = dict(
        cls=ci,
        dtype=dtype,
        max_k=max_k,
        aligned=aligned,
        varlen=varlen,
        split=split,
        misalign=misalign,
        dqk=dqk,
        dv=dv,
        heads=draw(st.integers(1, 3)),
        mask_type=draw(st.sampled_from([0, 1, 2])),
        scale=draw(st.sampled_from([None, None, 0.05, 0.3, 1.0])),
    )
    if varlen:
        lq = draw(_lengths(200))
        lk = draw(st.lists(st.integers(0, 200), min_size=len(lq), max_size=len(lq)).filter(lambda ls: sum(ls) > 0))
        if split:  # the longest key sequence spans more than one key block
            i = draw(st.integers(0, len(lk) - 1))
            lk[i] = draw(st.integers(bj + 1, 2 * bj + 40))
        spec.update(batch=1, lengths=(lq, lk), mq=sum(lq), mk=sum(lk))
        keys = max(lk)
    else:
        spec.update(batch=draw(st.integers(1, 3)), lengths=None, mq=draw(ME_SEQLENS))
        spec["mk"] = draw(st.integers(bj + 1, 400)) if split else draw(ME_SEQLENS)
        keys = spec["mk"]
    spec["window"] = 0 if spec["mask_type"] == 0 else draw(st.one_of(st.just(0), st.integers(1, keys + 16)))
    spec["num_splits_key"] = draw(st.sampled_from([None, 2, 3, 4, 8])) if split else 1
    spec["layouts"] = {name: draw(_me_layout(aligned)) for name in ("q", "k", "v", "out", "grad_out")}
    if misalign == "offset":
        pads, order, offset = spec["layouts"]["q"]
        spec["layouts"]["q"] = (pads, order, offset | 1)
    spec["lse_pad"] = draw(st.sampled_from([0, 0, 1, 40]))
    spec["seed"] = draw(st.integers(0, 2**31 - 1))
    return spec


def torch_usable(s):
    """Where torch's mem-eff kernels are safe to call on this case: head dims multiples of 8
    (their 128-bit kernels; odd ones are not what the existing tests ran) and windows only
    where the existing tests ran them (max_k <= 128, Dqk == Dv)."""
    if s["dqk"] % 8 or s["dv"] % 8:
        return False
    return s["window"] == 0 or (s["max_k"] <= 128 and s["dqk"] == s["dv"])


def mem_eff_inputs(s, device=None):
    """q, k, v, dO as padded / permuted views of bigger NaN-filled buffers."""
    dev = device or DEV
    gen = torch.Generator(dev).manual_seed(s["seed"])
    b, mq, mk, h, dqk, dv, dtype = s["batch"], s["mq"], s["mk"], s["heads"], s["dqk"], s["dv"], s["dtype"]
    shapes = {"q": (b, mq, h, dqk), "k": (b, mk, h, dqk), "v": (b, mk, h, dv), "grad_out": (b, mq, h, dv)}
    return {
        name: _apply_layout(torch.randn(shape, generator=gen, device=dev, dtype=dtype), s["layouts"][name])
        for name, shape in shapes.items()
    }


def _torch_forward(q, k, v, cq, ck, max_q, max_k, mask_type, scale, win):
    out, lse, seed_t, offset_t, _, _ = torch.ops.aten._efficient_attention_forward(
        q,
        k,
        v,
        None,
        cq,
        ck,
        max_q if cq is not None else None,
        max_k if cq is not None else None,
        0.0,
        mask_type,
        True,
        scale=scale,
        window_size=win,
    )
    return out, lse, seed_t, offset_t


def _torch_backward(*args, **kw):
    return torch.ops.aten._efficient_attention_backward(*args, **kw)[:3]


def _mem_eff_case(s):
    t = mem_eff_inputs(s)
    q, k, v, do = t["q"], t["k"], t["v"], t["grad_out"]
    b, mq, mk, dtype, mask_type, window, scale = (
        s["batch"],
        s["mq"],
        s["mk"],
        s["dtype"],
        s["mask_type"],
        s["window"],
        s["scale"],
    )
    lengths = s["lengths"]
    cq, ck, max_q, max_k = seq_args(mq, mk, lengths)
    segs = segments(b, mq, mk, lengths)
    win = window or None
    qc, kc, vc, doc = (x.contiguous() for x in (q, k, v, do))
    usable = torch_usable(s)
    if usable and torch_forward_ok(mask_type, segs):
        out_c, lse, seed_t, offset_t = _torch_forward(qc, kc, vc, cq, ck, max_q, max_k, mask_type, scale, win)
    else:
        out_c, lse = ref_forward(q, k, v, mask_type, window, scale, cq, ck, max_q)
        seed_t = offset_t = torch.empty((), dtype=torch.int64)
    out = _apply_layout(out_c, s["layouts"]["out"])
    lse_v = _pad_last(lse, s["lse_pad"])
    args = (do, q, k, v, None, out, cq, ck, max_q, max_k, lse_v, 0.0, seed_t, offset_t, mask_type, False)
    poison_allocator(*(2 * math.prod(x.shape) for x in (q, k, v)))  # unwritten gradients show as NaN
    dq, dk, dv, _ = _backward()(*args, scale=scale, num_splits_key=s["num_splits_key"], window_size=win)
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, window_size=window, scale=scale, cu_seqlens_q=cq, cu_seqlens_k=ck
    )
    theirs = [None] * 3
    if usable and torch_backward_ok(mask_type, window, segs):
        targs = (doc, qc, kc, vc, None, out_c, cq, ck, max_q, max_k, lse, 0.0, seed_t, offset_t, mask_type, False)
        theirs = _torch_backward(*targs, scale=scale, window_size=win)
    rows_q, rows_k = key_coverage(b, mq, mk, mask_type, window, lengths)
    label = f"class {s['cls']} Dqk{s['dqk']} Dv{s['dv']} mask{mask_type} w{window} splits{s['num_splits_key']}"
    check_grad(f"dq [{label}]", dq, ref[0], dtype, theirs[0], rows_q)
    check_grad(f"dk [{label}]", dk, ref[1], dtype, theirs[1], rows_k)
    check_grad(f"dv [{label}]", dv, ref[2], dtype, theirs[2], rows_k)


_mem_eff_family = _family("efficient_attention_backward", ME_CLASSES, mem_eff_specs, _mem_eff_case)
_ME_IDS = [
    f"{_dt(c[0])}-k{c[1]}-{'aligned' if c[2] else 'unaligned'}-{'varlen' if c[3] else 'dense'}-{'split' if c[4] else 'nosplit'}"
    for c in ME_CLASSES
]


@pytest.mark.parametrize("ci", range(len(ME_CLASSES)), ids=_ME_IDS)
def test_efficient_attention_backward_randomized(ci):
    _mem_eff_family(ci)


# ============================================== efficient_attention_backward: bias / dropout

# (dtype, max_k, bias: None / "aligned" / "unaligned", bias grad, dropout, varlen): each a
# compiled configuration (twice: split keys or not)
BD_CLASSES = [
    (F16, 64, "aligned", True, True, False),
    (BF16, 128, "aligned", False, True, False),
    (BF16, 128, "unaligned", True, False, False),
    (F16, 128, None, False, True, True),
    (BF16, 256, "aligned", True, True, False),
    (F32, 64, "unaligned", True, True, False),
    (F16, 96, "aligned", True, False, False),
    (BF16, 64, None, False, True, False),
]


@st.composite
def bias_dropout_specs(draw, ci):
    dtype, max_k, bias, grad, dropout, varlen = BD_CLASSES[ci]
    dqk = draw(st.sampled_from([d for d in range(max_k - 31, max_k + 1) if d % 8 == 0]))
    dv = draw(st.sampled_from([dqk, draw(st.sampled_from(list(range(8, dqk + 1, 8))))]))
    dqk, dv = (dqk, dv) if draw(st.booleans()) else (dv, dqk)
    spec = dict(
        cls=ci,
        dtype=dtype,
        kd=dqk,
        kv=dv,
        h=draw(st.integers(1, 3)),
        mask_type=draw(st.sampled_from([0, 1, 2])),
        scale=draw(st.sampled_from([None, None, 0.3])),
        splits=draw(st.sampled_from([None, 1, 2, 3])),
        dropout_p=draw(st.sampled_from([0.05, 0.1, 0.3, 0.6])) if dropout else 0.0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    if varlen:
        lq = draw(st.lists(st.integers(0, 150), min_size=1, max_size=4).filter(lambda ls: sum(ls) > 0))
        lk = draw(st.lists(st.integers(0, 200), min_size=len(lq), max_size=len(lq)).filter(lambda ls: sum(ls) > 0))
        if spec["mask_type"] == 2:  # bottom right needs Mq <= Mk per sequence (torch's forward)
            lk = [max(a, b) for a, b in zip(lq, lk)]
        spec.update(b=1, mq=0, mk=0, lengths=(lq, lk), keys=max(lk))
    else:
        mq, mk = draw(st.integers(1, 260)), draw(st.integers(1, 300))
        if spec["mask_type"] == 2:
            mq = min(mq, mk)
        spec.update(b=draw(st.integers(1, 3)), mq=mq, mk=mk, lengths=None, keys=mk)
    spec["window"] = 0 if spec["mask_type"] == 0 else draw(st.one_of(st.just(0), st.integers(1, spec["keys"] + 16)))
    if bias is not None:
        b, h, mq, mk = spec["b"], spec["h"], spec["mq"], spec["mk"]
        keep = draw(
            st.sampled_from(
                ["full", "batch", "heads", "both", "queries", "keys"]
                if bias == "unaligned"
                else ["full", "batch", "heads", "both", "queries"]
            )
        )
        shape = {
            "full": (b, h, mq, mk),
            "batch": (1, h, mq, mk),
            "heads": (b, 1, mq, mk),
            "both": (mq, mk),
            "queries": (b, h, 1, mk),
            "keys": (b, h, mq, 1),
        }[keep]
        layout = "dense"
        if bias == "aligned":
            spec["mk"] = mk = -(-mk // 8) * 8  # rows a whole number of 128-bit vectors
            shape = shape[:-1] + (mk,)
        elif keep != "keys":
            layout = draw(st.sampled_from(["padded", "transposed"]))
        spec.update(bias_shape=shape, bias_layout=layout, bias_grad=grad)
    else:
        spec.update(bias_shape=None, bias_layout="dense", bias_grad=False)
    return spec


def _bias_dropout_case(s):
    from .test_mem_eff_attention_features_gpu import run_feature_case

    run_feature_case(
        s["dtype"],
        s["b"],
        s["mq"],
        s["mk"],
        s["h"],
        s["kd"],
        s["kv"],
        bias_shape=s["bias_shape"],
        bias_layout=s["bias_layout"],
        bias_grad=s["bias_grad"],
        dropout_p=s["dropout_p"],
        mask_type=s["mask_type"],
        window=s["window"],
        scale=s["scale"],
        lengths=s["lengths"],
        splits=s["splits"],
        seed=s["seed"],
    )


_bias_dropout_family = _family(
    "efficient_attention_backward_bias_dropout", BD_CLASSES, bias_dropout_specs, _bias_dropout_case
)
_BD_IDS = [
    f"{_dt(c[0])}-k{c[1]}-bias_{c[2]}{'_grad' if c[3] else ''}-{'dropout' if c[4] else 'nodropout'}-{'varlen' if c[5] else 'dense'}"
    for c in BD_CLASSES
]


@pytest.mark.parametrize("ci", range(len(BD_CLASSES)), ids=_BD_IDS)
def test_efficient_attention_backward_bias_dropout_randomized(ci):
    _bias_dropout_family(ci)


# ================================================= attention forward (Hopper, sm_90a)

# (dtype, (Dqk, Dv), mask type, window, varlen, bias, dropout): one compiled forward each
# (ops.attention_fwd_sm90.ForwardConfig). Every head-dim pair the forward compiles, both dtypes,
# every mask, and the features together: bias with dropout under each mask, windows with
# bottom-right masks, variable lengths with dropout (never with a bias: the op refuses it).
FWD_CLASSES = [
    (BF16, (64, 64), 0, False, False, False, False),
    (F16, (64, 64), 2, True, True, False, True),
    (BF16, (64, 64), 1, False, False, True, True),
    (F16, (96, 96), 1, True, False, True, False),
    (BF16, (96, 96), 2, False, True, False, True),
    (F16, (128, 128), 2, True, False, True, True),
    (BF16, (128, 128), 1, True, True, False, True),
    (BF16, (128, 128), 0, False, True, False, False),
    (F16, (192, 192), 0, False, False, True, True),
    (BF16, (192, 192), 2, True, True, False, False),
    (BF16, (192, 128), 1, False, False, False, True),
    (F16, (192, 128), 2, True, True, False, True),
    (F16, (256, 256), 1, True, False, True, False),
    (BF16, (256, 256), 2, False, True, False, True),
    (F16, (256, 256), 0, False, False, True, True),
]
# lengths around the tiles' edges (tile_m 128 / 192, tile_n 64 to 160) and anything up to 400
FWD_SEQLENS = st.one_of(
    st.integers(1, 400),
    st.sampled_from([1, 2, 63, 64, 65, 79, 81, 97, 111, 113, 127, 128, 129, 161, 191, 192, 193, 257, 383, 385]),
)
FWD_BIAS_KINDS = ("full", "batch", "heads", "both", "heads_3d", "queries", "keys", "row")
_CAUSAL = {0: False, 1: True, 2: "bottom_right"}


def _fwd_bias_shape(kind, b, h, mq, mk):
    return {
        "full": (b, h, mq, mk),
        "batch": (1, h, mq, mk),
        "heads": (b, 1, mq, mk),
        "both": (mq, mk),
        "heads_3d": (h, mq, mk),
        "queries": (b, h, 1, mk),
        "keys": (b, h, mq, 1),
        "row": (mk,),
    }[kind]


FWD_ENTRIES = ("kernel", "memory_efficient_attention", "sdpa", "efficient_attention_forward")
SDPA_BIAS_KINDS = ("full", "batch", "heads", "both", "heads_3d")


def _sdpa_class(ci):
    """Whether F.scaled_dot_product_attention expresses the class's problems: dense, Dqk == Dv, no
    mask or top-left causal without a bias, no window (and, per case, one key head per query head)."""
    dtype, (dqk, dv), mask_type, window, varlen, bias, dropout = FWD_CLASSES[ci]
    return not varlen and dqk == dv and not window and (mask_type == 0 or (mask_type == 1 and not bias))


@st.composite
def forward_specs(draw, ci):
    dtype, (dqk, dv), mask_type, window, varlen, bias, dropout = FWD_CLASSES[ci]
    # the entry point: the kernel's torch face, the ops, or SDPA under ops.use_for_sdpa
    entry = draw(st.sampled_from(FWD_ENTRIES if _sdpa_class(ci) else [e for e in FWD_ENTRIES if e != "sdpa"]))
    hk = draw(st.integers(1, 3))
    group = 1 if entry == "sdpa" else draw(st.sampled_from([1, 1, 2, 3, 4]))  # hk 1 with a group: multi-query
    spec = dict(
        cls=ci,
        dtype=dtype,
        dqk=dqk,
        dv=dv,
        mask_type=mask_type,
        hk=hk,
        h=hk * group,
        scale=draw(st.sampled_from([None, None, 0.05, 0.3])),
        p=draw(st.sampled_from([0.1, 0.3, 0.6])) if dropout else 0.0,
        seed=draw(st.integers(0, 2**31 - 1)),
        # the kernel's own philox state (the ops take the generator's): a seed with the top bit
        # set among them, offsets as torch's forward leaves them (multiples of 4)
        philox=(
            draw(st.one_of(st.integers(0, 2**31 - 1), st.just(2**63 + 17 - 2**64))),
            4 * draw(st.integers(0, 2**33)),
        ),
    )
    # bottom-right with more queries than keys: the kernel's business, the ops raise (mostly avoided)
    q_past_k_ok = mask_type == 2 and draw(st.sampled_from([False, False, False, True]))
    if varlen:
        n = draw(st.integers(1, 5))
        length = st.one_of(st.sampled_from([0, 1, 2, 17]), st.integers(0, 300))  # empty and one-row sequences
        lq = draw(st.lists(length, min_size=n, max_size=n).filter(lambda ls: sum(ls) > 0))
        lk = draw(st.lists(length, min_size=n, max_size=n).filter(lambda ls: sum(ls) > 0))
        if mask_type == 2 and not q_past_k_ok:
            lk = [max(a, b) for a, b in zip(lq, lk)]
        # max_seqlen as callers pass them: the longest, or more (within the packed lengths)
        max_q = min(max(lq) + draw(st.sampled_from([0, 0, 0, 1, 40])), sum(lq))
        max_k = min(max(lk) + draw(st.sampled_from([0, 0, 0, 1, 40])), sum(lk))
        spec.update(b=1, lengths=(lq, lk), mq=sum(lq), mk=sum(lk), keys=max(lk), max_q=max_q, max_k=max_k)
        spec["q_past_k"] = mask_type == 2 and any(a > b for a, b in zip(lq, lk))
        spec["try_bias"] = draw(st.booleans())  # the ops refuse a bias with cu_seqlens: checked
    else:
        mq, mk = draw(FWD_SEQLENS), draw(FWD_SEQLENS)
        if mask_type == 2 and mq > mk and not q_past_k_ok:
            mq, mk = mk, mq
        spec.update(b=draw(st.integers(1, 3)), lengths=None, mq=mq, mk=mk, keys=mk, max_q=mq, max_k=mk)
        spec["q_past_k"] = mask_type == 2 and mq > mk
        spec["try_bias"] = False
    spec["window"] = draw(st.integers(1, spec["keys"] + 16)) if window else 0
    spec.update(bias_shape=None, bias_kind=None, bias_layout="dense")
    if bias:
        kind = draw(st.sampled_from(SDPA_BIAS_KINDS if entry == "sdpa" else FWD_BIAS_KINDS))
        shape = _fwd_bias_shape(kind, spec["b"], spec["h"], spec["mq"], spec["mk"])
        layout = draw(st.sampled_from(["dense", "padded", "transposed"])) if len(shape) >= 2 else "dense"
        spec.update(bias_shape=shape, bias_kind=kind, bias_layout=layout)
    # q / k / v as padded, permuted views of NaN-filled buffers, TMA-aligned (pitches and starts
    # multiples of 16 bytes): what the kernel reads past a view shows
    aligned = _layout(st.sampled_from([0, 8, 16]), st.sampled_from([0, 8, 64]), 4)
    spec["layouts"] = {name: draw(aligned) for name in ("q", "k", "v")}
    spec["entry"] = entry
    return spec


def forward_inputs(s, device=None):
    dev = device or DEV
    gen = torch.Generator(dev).manual_seed(s["seed"])
    b, mq, mk, h, hk, dtype = s["b"], s["mq"], s["mk"], s["h"], s["hk"], s["dtype"]
    r = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=dtype)  # noqa: E731
    shapes = {"q": (b, mq, h, s["dqk"]), "k": (b, mk, hk, s["dqk"]), "v": (b, mk, hk, s["dv"])}
    t = {name: _apply_layout(r(*shape), s["layouts"][name]) for name, shape in shapes.items()}
    bias, shape = None, s["bias_shape"]
    if shape is not None:
        if s["bias_layout"] == "padded":  # rows of a wider buffer: strides not multiples of 8
            bias = r(*shape[:-1], shape[-1] + 3)[..., : shape[-1]]
        elif s["bias_layout"] == "transposed":  # keys not contiguous
            bias = r(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
        else:
            bias = r(*shape)
    return t["q"], t["k"], t["v"], bias


@contextlib.contextmanager
def counted_forward():
    """Counts the calls of the forward kernel's torch face (the ops and SDPA reach it through the
    module attribute): a case asserts that ours ran, not torch's forward."""
    calls = []
    real = fwd_sm90.attention_forward_sm90

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    fwd_sm90.attention_forward_sm90 = counted
    try:
        yield calls
    finally:
        fwd_sm90.attention_forward_sm90 = real


def _forward_case(s):
    q, k, v, bias = forward_inputs(s)
    dtype, mask_type, window, scale, p = s["dtype"], s["mask_type"], s["window"], s["scale"], s["p"]
    lengths, max_q, max_k = s["lengths"], s["max_q"], s["max_k"]
    cq, ck = (cu_seqlens(lengths[0]), cu_seqlens(lengths[1])) if lengths else (None, None)
    seqlens = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max_q if lengths else None)
    seqlens["max_seqlen_k"] = max_k if lengths else None
    entry = s["entry"]
    mea = dict(causal=_CAUSAL[mask_type], window_size=window or None, scale=scale, dropout_p=p, return_lse=True)
    if entry != "kernel" and s["q_past_k"]:  # the ops refuse what torch's forward gets wrong
        with pytest.raises(NotImplementedError, match="bottom_right"), torch.no_grad():
            ops.memory_efficient_attention(q, k, v, attn_bias=bias, **seqlens, **mea)
        entry = "kernel"  # the kernel's face takes it
    label = (
        f"class {s['cls']} {entry} {_dt(dtype)} B{s['b']} Mq{s['mq']} Mk{s['mk']} H{s['h']}/{s['hk']} "
        f"D{s['dqk']}/{s['dv']} mask{mask_type} w{window} p{p} bias{s['bias_shape']}:{s['bias_layout']} "
        f"lengths{lengths}"
    )
    why = fwd_sm90.unsupported(q, k, v, mask_type=mask_type, bias=bias, dropout_p=p)
    assert why is None, f"{label}: the forward refuses it ({why})"
    if lengths and s["try_bias"] and not s["q_past_k"]:
        with pytest.raises(NotImplementedError, match="cu_seqlens"), torch.no_grad():
            ops.memory_efficient_attention(q, k, v, attn_bias=q.new_zeros(s["mq"], s["mk"]), **seqlens, **mea)
    seed, offset = s["philox"] if entry == "kernel" else (s["seed"], 0)
    rows = len(lengths[0]) if lengths else s["b"]
    poison_allocator(
        q.shape[0] * q.shape[1] * q.shape[2] * s["dv"] * q.element_size(), rows * s["h"] * -(-max_q // 32) * 128
    )
    lse = None
    with counted_forward() as calls, torch.no_grad():
        if entry == "kernel":
            rng = (torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)) if p else (None,) * 2
            out, lse = fwd_sm90.attention_forward_sm90(
                q, k, v, scale, mask_type, window, cq, ck, max_q, max_k, bias, p, *rng
            )
        elif entry == "efficient_attention_forward":
            out, lse, seed_t, offset_t, _, _ = ops.efficient_attention_forward(
                q,
                k,
                v,
                bias,
                cq,
                ck,
                seqlens["max_seqlen_q"],
                seqlens["max_seqlen_k"],
                p,
                mask_type,
                True,
                scale=scale,
                window_size=window or None,
            )
            if p:
                seed, offset = int(seed_t), int(offset_t)
        elif entry == "memory_efficient_attention":
            torch.manual_seed(seed)  # the generator's philox state: (seed, 0)
            out, lse = ops.memory_efficient_attention(q, k, v, attn_bias=bias, **seqlens, **mea)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            t = lambda x: x.transpose(1, 2)  # noqa: E731
            torch.manual_seed(seed)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa():
                out = t(
                    torch.nn.functional.scaled_dot_product_attention(
                        t(q), t(k), t(v), attn_mask=bias, dropout_p=p, is_causal=mask_type == 1, scale=scale
                    )
                )
    assert len(calls) == 1, f"{label}: our forward ran {len(calls)} times (torch's forward instead?)"
    ref_out, ref_lse = forward_reference(
        q,
        k,
        v,
        mask_type=mask_type,
        window=window,
        scale=scale,
        bias=bias,
        lengths=lengths,
        max_q=max_q,
        max_k=max_k,
        p=p,
        seed=seed,
        offset=offset,
    )
    check_forward(label, out, lse, ref_out, ref_lse, dtype, lengths)


_forward_family = _family("attention_forward", FWD_CLASSES, forward_specs, _forward_case, seed_per_class=True)
_FWD_IDS = [
    f"{_dt(c[0])}-d{c[1][0]}-{c[1][1]}-mask{c[2]}"
    + "".join(f"-{n}" for n, on in zip(("window", "varlen", "bias", "dropout"), c[3:]) if on)
    for c in FWD_CLASSES
]


@pytest.mark.parametrize("ci", range(len(FWD_CLASSES)), ids=_FWD_IDS)
def test_attention_forward_randomized(ci):
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("the Hopper forward runs on sm_90a only")
    _forward_family(ci)


# ======================================================================== the count


def test_randomized_case_count(request):
    """At least MIN_TOTAL_CASES cases ran, when the whole file ran (and every family passed)."""
    expected = {(f, ci) for f, classes in _CLASSES.items() for ci in range(len(classes))}
    tests = {f"test_{f}_randomized": f for f in _CLASSES}
    selected = set()
    for item in request.session.items:
        family = tests.get(getattr(item, "originalname", None))
        if family is not None and item.module is request.module:
            selected.add((family, item.callspec.params["ci"]))
    if selected != expected:
        pytest.skip("only part of the randomized families / classes was selected")
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":  # the Hopper forward's family skips there
        expected = {(f, ci) for f, ci in expected if f != "attention_forward"}
    unfinished = sorted(expected - _DONE)
    if unfinished:
        pytest.skip(
            f"(family, class) runs that failed or did not run: {unfinished} (their failures are reported above)"
        )
    total = sum(_COUNTS.values())
    summary = ", ".join(f"{f}: {_COUNTS[f]}" for f in _CLASSES)
    assert total >= MIN_TOTAL_CASES, f"only {total} randomized cases ran ({summary}), seed {SEED}"
    print(f"\nrandomized cases: {total} ({summary}), CUTE_KERNELS_RANDOM_SEED={SEED}")
