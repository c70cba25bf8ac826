"""The Hopper-native attention backward on an H100 (sm_90a), through
``ops.efficient_attention_backward(..., backend="sm90")`` on the out / logsumexp of
``aten._efficient_attention_forward``:

* against the fp64 reference: max |g - ref| <= TOL * max |ref| for dQ, dK, dV (partial
  tiles, whole key blocks no query sees, both causal corners). torch's forward is wrong for
  bottom-right with Sq > Sk (``ops.attention_checks.BOTTOM_RIGHT_MSG``): those cases take out /
  logsumexp from the fp64 reference forward instead;
* sliding windows, against fp64 and the memory-efficient kernel;
* against the memory-efficient kernel on identical inputs (and both against fp64),
  bottom-right with Sq > Sk included;
* grouped-query heads (key / value with fewer heads) through both kernels, against fp64;
* layouts: contiguous [B, S, H, D], [B, H, S, D] transposed views, packed QKV;
* Dqk != Dv (every supported pair, both dtypes, masks, grouped heads) against fp64 and the
  memory-efficient kernel.

The other concerns have their own files: tests/test_attention_sm90_{op,schedule,varlen,features}_gpu.py.
"""

import logging

import pytest

from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops.reference import attention_backward_ref

from .attention_sm90_gpu_common import (
    BF16,
    F16,
    LOGGER,
    _grouped_id,
    _id,
    _padded_ref_forward,
    backward,
    check,
    chosen,
    forward,
    make_inputs,
    rounding_floors,
)
from .attention_sm90_gpu_common import _needs_sm90  # noqa: F401 (autouse: an sm_90a device)

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------- vs the fp64 reference

# (B, H, Sq, Sk, D, mask): tile_n = 128 keys (d64 - d128) / 64 (d192, d256); tile_m = 128 (d64) / 64 queries
CASES = [
    (1, 2, 128, 128, 64, 0),  # whole tiles
    (2, 3, 100, 130, 64, 0),  # partial query and key blocks
    (1, 2, 129, 1, 128, 0),  # one key
    (2, 2, 257, 200, 128, 1),  # top-left, Sq > Sk
    (1, 2, 77, 300, 64, 1),  # top-left, Sq < Sk: key blocks 1 and 2 seen by no query (dK, dV 0)
    (2, 2, 130, 257, 128, 2),  # bottom-right, Sq < Sk
    (1, 3, 200, 200, 64, 2),  # bottom-right, Sq == Sk
    (1, 2, 1, 129, 128, 2),  # one query, which sees every key
    # d96: 64-byte Q / dO atoms, 32-byte K / V, dQ parts of 48 columns
    (1, 2, 100, 130, 96, 0),  # partial query and key blocks
    (1, 2, 200, 200, 96, 1),  # top-left, Sq == Sk
    (2, 2, 130, 257, 96, 2),  # bottom-right, Sq < Sk
    # d192 / d256: 64 x 64 tiles, P^T / dS^T through shared memory, dQ in two halves
    (1, 2, 128, 128, 192, 0),  # whole tiles
    (2, 2, 100, 130, 192, 0),  # partial query and key blocks
    (1, 2, 200, 200, 192, 1),  # top-left, Sq == Sk
    (2, 2, 130, 257, 192, 2),  # bottom-right, Sq < Sk
    (1, 2, 1, 129, 192, 2),  # one query, which sees every key
    (1, 2, 128, 128, 256, 0),
    (2, 2, 100, 130, 256, 0),
    (2, 2, 257, 200, 256, 1),  # top-left, Sq > Sk
    (1, 2, 77, 300, 256, 1),  # top-left, Sq < Sk: key blocks seen by no query (dK, dV 0)
    (2, 2, 130, 257, 256, 2),
    (1, 2, 129, 1, 256, 0),  # one key
]
REF_CASES = [(dt,) + c for dt in (BF16, F16) for c in CASES]


@pytest.mark.parametrize("case", REF_CASES, ids=[_id(c) for c in REF_CASES])
def test_against_fp64_reference(case, caplog):
    dtype, b, h, sq, sk, d, mask_type = case
    q, k, v, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + sk)
    out, lse = forward(q, k, v, mask_type)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        grads = backward("sm90", q, k, v, do, out, lse, mask_type)
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
        check(f"{name} [{_id(case)}]", g, r, like, dtype, floor)


def test_explicit_scale():
    q, k, v, do = make_inputs(2, 2, 150, 190, 64, BF16, seed=3)
    for scale in (0.05, 1.0):
        out, lse = forward(q, k, v, 1, scale=scale)
        grads = backward("sm90", q, k, v, do, out, lse, 1, scale=scale)
        ref = attention_backward_ref(q, k, v, do, custom_mask_type=1, scale=scale)
        floors = rounding_floors(q, k, do, out, BF16, scale)
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
            check(f"{name} scale {scale}", g, r, like, BF16, floor)


# ------------------------------------------------------------------- sliding window

# (dtype, B, H, Sq, Sk, D, mask, window): key k sees query q when q + shift - window < k <= q + shift
WINDOW_CASES = [
    (BF16, 1, 2, 300, 300, 64, 1, 50),  # windows inside a key block and across blocks
    (F16, 2, 2, 200, 333, 128, 1, 100),  # top-left, Sq < Sk: the last key blocks see no query
    (BF16, 1, 2, 257, 300, 128, 2, 70),  # bottom-right
    (F16, 1, 2, 129, 129, 64, 2, 1),  # a window of one key: the diagonal
    (BF16, 2, 3, 400, 260, 64, 1, 300),  # a window wider than the keys
    (F16, 1, 2, 300, 300, 96, 1, 50),  # d96
    (BF16, 1, 2, 300, 300, 192, 1, 50),  # d192: windows inside a 64-key block and across blocks
    (F16, 1, 2, 257, 300, 256, 2, 70),  # d256, bottom-right
    (BF16, 2, 2, 200, 333, 256, 1, 1),  # d256, a window of one key
    (F16, 1, 2, 300, 300, (128, 64), 1, 50),  # Dqk != Dv: base tiles
    (BF16, 1, 2, 257, 300, (192, 128), 2, 70),  # wide tiles, bottom-right
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[_id(c[:7]) + f"w{c[7]}" for c in WINDOW_CASES])
def test_sliding_window(case, caplog):
    dtype, b, h, sq, sk, d, mask_type, window = case
    q, k, v, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + window)
    out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = backward("auto", q, k, v, do, out, lse, mask_type, window_size=window)
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, ref, (q, k, v), floors):
        check(f"{name} [{_id(case[:7])} w{window}]", g, r, like, dtype, floor)
    theirs = backward("mem_eff", q, k, v, do, out, lse, mask_type, window_size=window)
    floors = [None if f is None else 2 * f for f in floors]
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v), floors):
        check(f"{name} [{_id(case[:7])} w{window}] vs mem_eff", g, r, like, dtype, floor)


# ------------------------------------------------------------ vs the memory-efficient kernel

VS_MEM_EFF = [
    (BF16, 2, 2, 300, 100, 64, 2),  # bottom-right, Sq > Sk: the first 200 rows see no key
    (F16, 1, 2, 257, 130, 128, 2),
    (BF16, 1, 2, 65, 64, 128, 2),  # one row without keys
    (F16, 2, 3, 100, 130, 64, 0),
    (BF16, 1, 2, 200, 333, 128, 1),
    (BF16, 2, 2, 300, 100, 96, 2),  # d96, bottom-right, Sq > Sk
    (F16, 2, 2, 300, 100, 192, 2),  # d192, bottom-right, Sq > Sk
    (BF16, 1, 2, 257, 130, 256, 2),  # d256, bottom-right, Sq > Sk
    (F16, 2, 3, 100, 130, 256, 0),
]


def _stats(q, k, v, mask_type):
    """(out, logsumexp) for a backward: torch's forward, or the fp64 reference's where torch's
    is wrong (bottom-right with Sq > Sk; rows without keys poisoned either way)."""
    if mask_type == 2 and q.shape[1] > k.shape[1]:
        return _padded_ref_forward(q, k, v, mask_type, 0)
    group = q.shape[2] // k.shape[2]
    return forward(q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2), mask_type)


@pytest.mark.parametrize("case", VS_MEM_EFF, ids=[_id(c) for c in VS_MEM_EFF])
def test_against_mem_eff(case):
    """Both kernels on the same out / logsumexp, each against fp64 and against each other."""
    dtype, b, h, sq, sk, d, mask_type = case
    q, k, v, do = make_inputs(b, h, sq, sk, d, dtype, seed=7)
    out, lse = _stats(q, k, v, mask_type)
    ours = backward("sm90", q, k, v, do, out, lse, mask_type)
    theirs = backward("mem_eff", q, k, v, do, out, lse, mask_type)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    floors = rounding_floors(q, k, do, out, dtype)
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
            check(f"{name} [{_id(case)}] {backend} vs fp64", g, r, like, dtype, floor)
    # each side carries the rounding floor: twice it between them
    floors = [None if f is None else 2 * f for f in floors]
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v), floors):
        check(f"{name} [{_id(case)}] vs mem_eff", g, r, like, dtype, floor)
    if mask_type == 2 and sq > sk:  # queries that see no key: no dQ from either
        blind = sq - sk
        assert (ours[0][:, :blind] == 0).all() and (theirs[0][:, :blind] == 0).all()


# ------------------------------------------------------------------ grouped-query heads

# (dtype, B, H, Hk, Sq, Sk, D, mask, window): key head j serves query heads j*H/Hk ..
GROUPED_CASES = [
    (BF16, 2, 4, 2, 150, 200, 64, 0, 0),
    (F16, 1, 6, 1, 130, 257, 128, 2, 0),  # multi-query, bottom-right
    (BF16, 1, 8, 2, 300, 300, 128, 1, 0),  # four query heads per key head
    (F16, 2, 4, 1, 200, 200, 64, 1, 50),  # with a sliding window
    (BF16, 1, 6, 2, 130, 257, 192, 2, 0),  # d192, bottom-right
    (F16, 2, 4, 1, 150, 200, 256, 0, 0),  # d256, multi-query
    (BF16, 1, 4, 2, 300, 300, 256, 1, 60),  # d256 with a window
]


@pytest.mark.parametrize("case", GROUPED_CASES, ids=[_grouped_id(c) for c in GROUPED_CASES])
def test_grouped_query_heads(case, caplog):
    """dK / dV of a key head sum over its query heads: the sm90 kernel walks all of them in
    one CTA, the memory-efficient one runs on repeated key / value and sums; both against fp64."""
    dtype, b, h, hk, sq, sk, d, mask_type, window = case
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + hk)
    if window:
        out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    else:
        out, lse = forward(q, k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2), mask_type)
    kw = dict(window_size=window) if window else {}
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = backward("auto", q, k, v, do, out, lse, mask_type, **kw)
        theirs = backward("mem_eff", q, k, v, do, out, lse, mask_type, **kw)
    assert chosen(caplog) == ["sm90", "mem_eff"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
            check(f"{name} [{_grouped_id(case)}] {backend}", g, r, like, dtype, floor)


# -------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("layout", ["bhsd", "packed"])
@pytest.mark.parametrize(
    "dtype,d",
    [(BF16, 64), (BF16, 96), (F16, 128), (F16, 192), (BF16, 256)],
    ids=["bf16-d64", "bf16-d96", "fp16-d128", "fp16-d192", "bf16-d256"],
)
def test_strided_inputs(layout, dtype, d, caplog):
    """[B, H, S, D] tensors seen as [B, S, H, D] (SDPA's layout, dO too) and a packed QKV:
    the sm90 path takes them (TMA-aligned strides) and writes fresh [B, S, H, D] gradients."""
    b, h, s = 2, 3, 150
    q, k, v, do = make_inputs(b, h, s, s, d, dtype, seed=17, layout=layout)
    assert not q.is_contiguous()
    mask_type = 1
    out, lse = forward(q, k, v, mask_type)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        strided = backward("auto", q, k, v, do, out, lse, mask_type)
        dense = backward("auto", *(t.contiguous() for t in (q, k, v, do, out)), lse, mask_type)
    assert chosen(caplog) == ["sm90", "sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    for name, g, g_dense, r, like in zip(("dq", "dk", "dv"), strided, dense, ref, (q, k, v)):
        check(f"{name} [{layout}]", g, r, like, dtype)
        check(f"{name} [{layout} vs contiguous]", g, g_dense, like, dtype)


# ------------------------------------------------------------------------ Dqk != Dv

# every supported pair (cute_kernels.attention_sm90.backward_config.HEAD_DIM_PAIRS; the wider head dim picks the
# tiles: base 64 / 128 x 128 up to 128, wide 64 x 64 above), both dtypes, shapes looped
# inside (one compile per dtype, pair and mask). (B, H, Hk, Sq, Sk, mask):
PAIR_SHAPES = [
    (2, 2, 2, 100, 130, 0),  # partial query and key blocks
    (1, 2, 2, 257, 200, 1),  # top-left, Sq > Sk
    (2, 2, 2, 130, 257, 2),  # bottom-right, Sq < Sk
    (1, 4, 2, 200, 200, 1),  # grouped-query heads
    (1, 6, 1, 130, 300, 2),  # multi-query, bottom-right
    (2, 2, 2, 300, 100, 2),  # bottom-right, Sq > Sk: out / logsumexp from the reference forward
]
PAIR_IDS = [f"d{a}-dv{b}" for a, b in bwd_config.HEAD_DIM_PAIRS]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim,head_dim_v", bwd_config.HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_unequal_head_dims(head_dim, head_dim_v, dtype, caplog):
    """dQ / dK Dqk wide, dV Dv wide: against fp64 and against the memory-efficient kernel on
    the same out / logsumexp (torch's forward, or the reference's where torch's is wrong)."""
    for i, (b, h, hk, sq, sk, mask_type) in enumerate(PAIR_SHAPES):
        name = f"d{head_dim}-dv{head_dim_v} B{b}H{h}Hk{hk}q{sq}k{sk}m{mask_type}"
        q, _, _, do = make_inputs(b, h, sq, sk, (head_dim, head_dim_v), dtype, seed=10 * i + head_dim)
        _, k, v, _ = make_inputs(b, hk, sq, sk, (head_dim, head_dim_v), dtype, seed=10 * i + head_dim_v)
        # (rows that see no key come poisoned: torch's forward leaves them unwritten here too)
        out, lse = _stats(q, k, v, mask_type)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            ours = backward("auto", q, k, v, do, out, lse, mask_type)
            theirs = backward("mem_eff", q, k, v, do, out, lse, mask_type)
        assert chosen(caplog) == ["sm90", "mem_eff"], name
        assert ours[0].shape[-1] == ours[1].shape[-1] == head_dim and ours[2].shape[-1] == head_dim_v
        floors = rounding_floors(q, k, do, out, dtype)
        ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
        for g_name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, ref, (q, k, v), floors):
            check(f"{g_name} [{name}]", g, r, like, dtype, floor)
        floors = [None if f is None else 2 * f for f in floors]
        for g_name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v), floors):
            check(f"{g_name} [{name}] vs mem_eff", g, r, like, dtype, floor)
