"""The Hopper-native attention backward on an H100 (sm_90a), through
``ops.efficient_attention_backward(..., backend="sm90")`` on the out / logsumexp of
``aten._efficient_attention_forward``:

* against the fp64 reference: max |g - ref| <= TOL * max |ref| for dQ, dK, dV (partial
  tiles, whole key blocks no query sees, both causal corners). torch's forward is wrong for
  bottom-right with Sq > Sk (``ops.attention_checks.BOTTOM_RIGHT_MSG``): those cases take out /
  logsumexp from the fp64 reference forward instead;
* against the memory-efficient kernel on identical inputs (and both against fp64),
  bottom-right with Sq > Sk included;
* ``memory_efficient_attention(backend="sm90")`` autograd (eager and captured) against
  backend="mem_eff" and fp64;
* dispatch on the device: auto takes sm90 where it applies (bias and dropout included) and
  the memory-efficient kernel for key splits / unaligned inputs / fp32, each run's
  gradients against fp64;
* attention bias of every broadcast kind and layout, its gradient, and dropout with torch's
  keep mask (through dV with identity dO rows, bit for bit), with masks, windows, every head
  dim, variable lengths, grouped heads and deterministic mode: against fp64 (the mask torch
  drew), the memory-efficient kernel and torch's own backward;
* grouped-query heads (key / value with fewer heads) through both kernels, against fp64;
* variable lengths (packed sequences, empty ones included) with every mask, grouped heads
  and deterministic mode, against fp64 and the memory-efficient kernel;
* deterministic mode: three runs bitwise equal, and against fp64;
* convert_dq overlapping the kernel's last wave: deterministic bits equal to the late
  convert's, the overlapped runs against fp64 (three, deterministic ones for causal masks);
* store_first (each query block's first dQ stored): the accumulator handed over full of NaN,
  three runs against fp64 and the zeroed accumulator's run;
* zero_ahead (persistent CTAs zero the accumulator themselves: a round of tiles ahead, or with a
  causal mask from a counter of zeroing jobs): the same, over grids of 1 to 132 CTAs, key blocks
  owning several query blocks or none, both causal corners, and grids smaller than a head's key
  blocks (the dQ-store warp zeroing the blocks nobody has reached);
* layouts: contiguous [B, S, H, D], [B, H, S, D] transposed views, packed QKV;
* Dqk != Dv (every supported pair, both dtypes, masks, grouped heads) against fp64 and the
  memory-efficient kernel; with a window, deterministic mode and packed sequences too.

Outputs of the sm90 path are allocated inside it (no poisoning from here): every
gradient is checked finite instead. Small shapes: each (dtype, head dim, mask) compiles
once (a few seconds each).
"""

import logging

import pytest
import torch

import ops
from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops import _compile as cc
from ops.reference import attention_backward_ref, attention_forward_ref

from .helpers import delta_rounding_floors

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TOL = {BF16: 2e-2, F16: 5e-3, F32: 5e-3}  # max |g - ref| / max |ref| (fp32: the memory-efficient kernel only)
LOGGER = "cute_kernels.attention"


@pytest.fixture(autouse=True)
def _needs_sm90():
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("the sm90 attention backward needs an sm_90a device (H100 / H200)")


# ----------------------------------------------------------------------------- helpers


def head_dims(d):
    """(Dqk, Dv) of a case's head dim: an int (both) or a pair."""
    return (d, d) if isinstance(d, int) else tuple(d)


def dims_id(d):
    dqk, dv = head_dims(d)
    return f"{dqk}" if dqk == dv else f"{dqk}v{dv}"


def make_inputs(b, h, sq, sk, d, dtype, seed=0, layout="bshd"):
    """q, k, v, dO [B, S, H, D] (``d`` an int or (Dqk, Dv): v and dO Dv wide): contiguous
    ("bshd"), transposed [B, H, S, D] tensors ("bhsd", dO too) or q, k, v unbound from one
    [B, S, 3, H, D] buffer ("packed", Sq == Sk, Dqk == Dv)."""
    d, dv = head_dims(d)
    gen = torch.Generator(DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    if layout == "bshd":
        return r(b, sq, h, d), r(b, sk, h, d), r(b, sk, h, dv), r(b, sq, h, dv)
    if layout == "bhsd":
        return tuple(r(b, h, s, w).transpose(1, 2) for s, w in ((sq, d), (sk, d), (sk, dv), (sq, dv)))
    assert layout == "packed" and sq == sk and d == dv
    q, k, v = r(b, sq, 3, h, d).unbind(2)
    return q, k, v, r(b, sq, h, d)


def blind_rows(sq, sk, mask_type, window=0):
    """[Sq] bool: the query rows that see no key (key k sees query q when q + offset - window <
    k <= q + offset, offset Sk - Sq bottom-right, else 0; no window: no left end)."""
    if sk == 0 or mask_type == 0:
        return torch.full((sq,), sk == 0, dtype=torch.bool, device=DEV)
    hi = torch.arange(sq, device=DEV) + (sk - sq if mask_type == 2 else 0)
    blind = hi < 0
    if window > 0:
        blind |= hi - window + 1 >= sk
    return blind


def forward(q, k, v, mask_type, scale=None):
    """(out, logsumexp) of torch's forward, as the drop-in backward receives them, with NaN in
    the rows that see no key (torch leaves them unwritten above d128: ``poison``)."""
    out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, mask_type, True, scale=scale
    )
    return poison(out, lse, blind_rows(q.shape[1], k.shape[1], mask_type))


def poison(out, lse, blind):
    """NaN in the query rows ``blind`` of out [B, S, H, D] and lse [B, H, >= S], in place. A
    forward may leave them unwritten (torch's does at head dims above 128: compute-sanitizer's
    initcheck flags the backward's reads; the caching allocator's NaN made a comparison flaky):
    poisoned, every case with such rows checks that the backward ignores them."""
    out[:, blind] = float("nan")
    lse[:, :, : blind.numel()][:, :, blind] = float("nan")
    return out, lse


def backward(backend, q, k, v, do, out, lse, mask_type, scale=None, **kw):
    empty = torch.empty((), dtype=torch.int64)
    dq, dk, dv, db = ops.efficient_attention_backward(
        do,
        q,
        k,
        v,
        None,
        out,
        None,
        None,
        q.shape[1],
        k.shape[1],
        lse,
        0.0,
        empty,
        empty,
        mask_type,
        False,
        scale=scale,
        backend=backend,
        **kw,
    )
    assert db is None
    return dq, dk, dv


def check(name, got, want, like, dtype, floor=None):
    """Shape, dtype, fresh contiguous [B, S, H, D] layout, finiteness, max relative error;
    ``floor`` (broadcastable) is an absolute allowance per element for rounding that does
    not shrink with the gradient."""
    assert got.shape == like.shape and got.dtype == dtype, (name, got.shape, got.dtype)
    assert got.is_contiguous(), f"{name}: strides {got.stride()}"
    assert torch.isfinite(got).all(), f"{name}: NaN / inf (unwritten rows?)"
    diff = (got.double() - want.double()).abs()
    if floor is not None:
        diff = (diff - floor).clamp_min(0.0)
    err = (diff.max() / want.double().abs().max().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"{name}: max |g - ref| (beyond the floor) / max |ref| = {err:.3g} >= {TOL[dtype]}"


def rounding_floors(q, k, do, out, dtype, scale=None):
    """dq / dk / dv allowances for Δ's rounding (tests.helpers.delta_rounding_floors); with
    grouped-query heads (k has fewer heads) a key head's dk floor sums its query heads'."""
    group = q.shape[2] // k.shape[2]
    dq_floor, dk_floor = delta_rounding_floors(q, k.repeat_interleave(group, 2), do, out, dtype, scale)
    return dq_floor, dk_floor.unflatten(2, (k.shape[2], group)).sum(3), None


def chosen(caplog):
    """The backends the DEBUG lines of this test name, in order."""
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    return [m.split()[2] for m in msgs if m.startswith("attention backward:")]


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


def _id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}q{c[3]}k{c[4]}d{dims_id(c[5])}m{c[6]}"


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


def _padded_ref_forward(q, k, v, mask_type, window):
    """(out, lse) of the fp64 reference in torch's layout (lse padded with +inf to 32):
    torch's own forward is not used with windows (its bottom-right window has no shift)."""
    out, lse = attention_forward_ref(q, k, v, custom_mask_type=mask_type, window_size=window)
    b, h, n = lse.shape
    padded = torch.full((b, h, (n + 31) // 32 * 32), float("inf"), device=DEV)
    padded[..., :n] = lse.float()
    return poison(out.to(q.dtype), padded, blind_rows(q.shape[1], k.shape[1], mask_type, window))


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


# ------------------------------------------------------------------ autograd op


def _op_grads(backend, q, k, v, do, causal, compile_=False):
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ops.memory_efficient_attention(q, k, v, causal=causal, backend=backend)

    if compile_:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")  # our op as one node, no codegen
    fn(qs, ks, vs).backward(do)
    return qs.grad, ks.grad, vs.grad


MASK_TYPES = {False: 0, True: 1, "bottom_right": 2}  # memory_efficient_attention's causal -> custom_mask_type


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_memory_efficient_attention_autograd(dtype, causal, caplog):
    q, k, v, do = make_inputs(2, 2, 150, 200, 64, dtype, seed=11)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = _op_grads("sm90", q, k, v, do, causal)
        theirs = _op_grads("mem_eff", q, k, v, do, causal)
    assert chosen(caplog) == ["sm90", "mem_eff"]
    for name, g, r, like in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v)):
        check(f"{name} (memory_efficient_attention causal={causal})", g, r, like, dtype)
    mask_type = MASK_TYPES[causal]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    out, _ = attention_forward_ref(q, k, v, custom_mask_type=mask_type)  # (the forward's out, for the floors)
    floors = rounding_floors(q, k, do, out.to(dtype), dtype)
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
            check(f"{name} (memory_efficient_attention causal={causal}, {backend}) vs fp64", g, r, like, dtype, floor)


def test_memory_efficient_attention_captured(caplog):
    """torch.compile(fullgraph=True): the backend reaches the backward through the graph."""
    q, k, v, do = make_inputs(1, 2, 130, 130, 128, BF16, seed=12)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = _op_grads("sm90", q, k, v, do, True, compile_=True)
    torch._dynamo.reset()
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for name, g, r, like in zip(("dq", "dk", "dv"), ours, ref, (q, k, v)):
        check(f"{name} (captured)", g, r, like, BF16)


# ------------------------------------------------------------------------- dispatch


def test_auto_takes_sm90(caplog):
    q, k, v, do = make_inputs(2, 2, 100, 130, 128, F16, seed=13)
    out, lse = forward(q, k, v, 1)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        auto = backward("auto", q, k, v, do, out, lse, 1)
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for name, g, r, like in zip(("dq", "dk", "dv"), auto, ref, (q, k, v)):
        check(f"{name} (auto)", g, r, like, F16)


def test_auto_dispatch_of_features(caplog):
    """bias and dropout: the sm90 kernel; key splits, unaligned inputs, fp32: the memory-efficient
    one. Each run's gradients against fp64 (with the bias, with the keep mask torch's forward drew)."""
    from .test_mem_eff_attention_features_gpu import torch_keep_mask

    gen = torch.Generator(DEV).manual_seed(14)
    b, h, s, d = 1, 2, 96, 64
    q, k, v, do = make_inputs(b, h, s, s, d, BF16, seed=14)
    empty = torch.empty((), dtype=torch.int64)
    runs = []  # (the call, its (q, k, v, dO, out), the reference's keywords)
    # attention bias
    bias = torch.randn(b, h, s, s, device=DEV, dtype=BF16, generator=gen)
    out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, 0.0, 0, True
    )
    runs.append(
        (
            lambda: ops.efficient_attention_backward(
                do, q, k, v, bias, out, None, None, s, s, lse, 0.0, empty, empty, 0, False
            ),
            (q, k, v, do, out),
            dict(custom_mask_type=0, bias=bias),
        )
    )
    # dropout (the forward's philox state)
    out_d, lse_d, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.2, 0, True
    )
    keep = torch_keep_mask((b, h, s, s), 0.2, int(seed), int(offset))
    runs.append(
        (
            lambda: ops.efficient_attention_backward(
                do, q, k, v, None, out_d, None, None, s, s, lse_d, 0.2, seed, offset, 0, False
            ),
            (q, k, v, do, out_d),
            dict(custom_mask_type=0, dropout_mask=keep, dropout_p=0.2),
        )
    )
    # key splits
    out_c, lse_c = forward(q, k, v, 1)
    runs.append(
        (
            lambda: backward("auto", q, k, v, do, out_c, lse_c, 1, num_splits_key=2),
            (q, k, v, do, out_c),
            dict(custom_mask_type=1),
        )
    )
    # an input 2 bytes past a 16-byte boundary (TMA cannot read it)
    q_off = torch.empty(q.numel() + 8, device=DEV, dtype=BF16)[1 : q.numel() + 1].view(q.shape).copy_(q)
    runs.append(
        (lambda: backward("auto", q_off, k, v, do, out_c, lse_c, 1), (q_off, k, v, do, out_c), dict(custom_mask_type=1))
    )
    # fp32
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    out32, lse32 = forward(q32, k32, v32, 0)
    runs.append(
        (
            lambda: backward("auto", q32, k32, v32, do32, out32, lse32, 0),
            (q32, k32, v32, do32, out32),
            dict(custom_mask_type=0),
        )
    )
    reasons = ["supported", "supported", "num_splits_key", "not TMA-aligned", "dtype"]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        results = [run() for run, _, _ in runs]
    assert chosen(caplog) == ["sm90"] * 2 + ["mem_eff"] * (len(runs) - 2)
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    for msg, reason in zip(msgs, reasons):
        assert reason in msg, (reason, msg)
    for (_, (qi, ki, vi, doi, outi), ref_kw), grads, what in zip(
        runs, results, ("bias", "dropout", "key splits", "unaligned", "fp32")
    ):
        ref = attention_backward_ref(qi, ki, vi, doi, **ref_kw)
        floors = rounding_floors(qi, ki, doi, outi, qi.dtype)
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads[:3], ref, (qi, ki, vi), floors):
            check(f"{name} ({what})", g, r, like, qi.dtype, floor)


def test_sm90_refuses_features():
    q, k, v, do = make_inputs(1, 2, 96, 96, 64, BF16, seed=15)
    out, lse = forward(q, k, v, 1)
    for kw, reason in ((dict(num_splits_key=1), "num_splits_key"),):
        with pytest.raises(NotImplementedError, match=reason):
            backward("sm90", q, k, v, do, out, lse, 1, **kw)


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


def _grouped_id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}Hk{c[3]}q{c[4]}k{c[5]}d{dims_id(c[6])}m{c[7]}w{c[8]}"


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


def test_memory_efficient_attention_grouped_heads():
    """The autograd op takes key / value with fewer heads (its forward repeats them for
    torch's kernel); both backwards give the fp64 gradients of the grouped problem."""
    q, _, _, do = make_inputs(2, 6, 140, 140, 64, BF16, seed=17)
    _, k, v, _ = make_inputs(2, 2, 140, 140, 64, BF16, seed=18)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for backend in ("sm90", "mem_eff"):
        grads = _op_grads(backend, q, k, v, do, True)
        for name, g, r, like in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
            check(f"{name} (memory_efficient_attention, grouped heads, {backend})", g, r, like, BF16)


# ---------------------------------------------------------------------- persistent CTAs

# the d64 tiles run persistent CTAs (K / V double-buffered across tiles; causal tiles from a
# counter); with one or three CTAs every CTA walks several tiles, K / V buffers alternate and the
# Q / dO pipelines run on across tiles. (dtype, B, H, Hk, Sq, Sk, D, mask[, window])
PERSISTENT_CASES = [
    (BF16, 2, 3, 3, 300, 257, 64, 0),  # partial query and key blocks: 18 tiles
    (F16, 1, 4, 2, 129, 384, 64, 0),  # grouped-query heads: a tile walks 2 query heads
    (BF16, 3, 2, 2, 1, 200, 64, 0),  # one query
    (BF16, 2, 2, 1, 200, 300, 64, 0),  # multi-query
    # causal: tiles taken from the counter, heavy-first
    (BF16, 2, 3, 3, 300, 257, 64, 1),  # top-left, Sq > Sk
    (F16, 1, 4, 2, 130, 520, 64, 1),  # top-left, Sq < Sk: key blocks no query sees (tiles without steps)
    (BF16, 2, 2, 1, 257, 300, 64, 2),  # bottom-right, multi-query
    # sliding windows (dtype, ..., mask, window)
    (BF16, 2, 2, 2, 600, 600, 64, 1, 100),  # across key blocks
    (F16, 1, 4, 2, 520, 130, 64, 2, 60),  # bottom-right, Sq > Sk, grouped heads
    (BF16, 1, 2, 2, 130, 520, 64, 1, 200),  # top-left, Sq < Sk: key blocks no query sees
]


def _persistent_id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}Hk{c[3]}q{c[4]}k{c[5]}d{dims_id(c[6])}m{c[7]}" + (
        f"w{c[8]}" if len(c) > 8 else ""
    )


# without a mask: each case with carry_dq (a tile's last dQ in the next tile's step 0, which the op
# asks for on tiles of at most CARRY_DQ_MAX_STEPS steps: set to 8 here) and without
PERSISTENT_RUNS = [(c, carry) for c in PERSISTENT_CASES for carry in ((True, False) if c[7] == 0 else (None,))]


@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize(
    "case,carry",
    PERSISTENT_RUNS,
    ids=[_persistent_id(c) + {True: "-carry", False: "-nocarry", None: ""}[k] for c, k in PERSISTENT_RUNS],
)
def test_persistent_ctas_walk_several_tiles(case, carry, ctas, monkeypatch, caplog):
    from ops import attention_sm90 as sm90_ops

    dtype, b, h, hk, sq, sk, d, mask_type = case[:8]
    window = case[8] if len(case) > 8 else 0
    assert bwd_config.attention_sm90_tiles(d).kv_buffers == 2
    monkeypatch.setattr(sm90_ops, "PERSISTENT_CTAS", ctas)
    if carry is not None:
        steps = (h // hk) * -(-sq // bwd_config.attention_sm90_tiles(d).tile_m)
        assert steps <= 8  # so that carry_dq is on with the limit below
        monkeypatch.setattr(bwd_config, "CARRY_DQ_MAX_STEPS", 8 if carry else 0)
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + ctas)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + ctas)
    kw = dict(window_size=window) if window else {}
    if window:
        out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    else:
        out, lse = forward(q, k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2), mask_type)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        grads = backward("sm90", q, k, v, do, out, lse, mask_type, **kw)
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
        check(f"{name} [{_persistent_id(case)}] {ctas} CTAs", g, r, like, dtype, floor)


# -------------------------------------------------------------------- deterministic mode

# (dtype, B, H, Hk, Sq, Sk, D, mask, window): several key blocks add into each query block
DETERMINISTIC_CASES = [
    (BF16, 2, 4, 2, 600, 700, 128, 0, 0),  # grouped heads, no mask
    (F16, 1, 3, 3, 900, 900, 64, 1, 0),
    (BF16, 1, 2, 2, 700, 400, 128, 2, 0),  # bottom-right, Sq > Sk: query blocks no key block sees
    (BF16, 1, 2, 1, 800, 800, 64, 1, 200),  # a window: query block m starts at a later key block
    (F16, 1, 2, 2, 640, 900, 128, 2, 130),
    (BF16, 1, 4, 2, 600, 700, 192, 0, 0),  # d192: joint dQ handoff, ascending key blocks
    (F16, 1, 2, 2, 700, 700, 256, 1, 0),  # d256: descending key blocks
    (BF16, 1, 2, 1, 640, 900, 256, 2, 130),
    (F16, 1, 4, 2, 600, 700, (192, 128), 0, 0),  # Dqk != Dv, wide tiles, ascending key blocks
    (BF16, 1, 2, 1, 800, 800, (64, 128), 1, 200),  # base tiles, a window
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=[_grouped_id(c) for c in DETERMINISTIC_CASES])
def test_deterministic_is_bitwise_repeatable(case):
    """Three runs give the same bits (dQ's fp32 adds in key-block order), and the gradients
    are the fp64 ones."""
    dtype, b, h, hk, sq, sk, d, mask_type, window = case
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + sum(head_dims(d)))
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + sum(head_dims(d)))
    out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    kw = dict(window_size=window) if window else {}
    runs = [backward("sm90", q, k, v, do, out, lse, mask_type, deterministic=True, **kw) for _ in range(3)]
    for later in runs[1:]:
        for name, g0, g in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(g0, g), f"{name}: deterministic runs differ"
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), runs[0], ref, (q, k, v), floors):
        check(f"{name} [{_grouped_id(case)}] deterministic", g, r, like, dtype, floor)


# (dtype, B, H, Hk, Sq, Sk, mask, window, deterministic, tail_m) at d128 (tile_m 80): a partial last
# query block runs on products tail_m queries wide (Sq % 80 rounded up to 16), or whole (0)
TAIL_CASES = [
    (BF16, 2, 2, 2, 81, 200, 0, 0, False, 16),  # one row past a whole block
    (F16, 1, 4, 2, 260, 300, 1, 0, False, 32),  # grouped heads: the partial block once per query head
    (BF16, 1, 2, 2, 208, 160, 2, 0, False, 48),  # bottom-right, Sq > Sk
    (BF16, 1, 2, 2, 300, 300, 1, 0, True, 64),  # deterministic
    (F16, 1, 2, 1, 250, 400, 1, 100, False, 16),  # a window
    (BF16, 2, 8, 8, 2048, 2048, 0, 0, False, 48),  # store_first, ConvertDQReady, many key blocks a block
    (BF16, 1, 2, 2, 230, 230, 0, 0, False, 0),  # 70 rows: rounded up they would be the whole block
]


def _tail_id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}Hk{c[3]}q{c[4]}k{c[5]}m{c[6]}w{c[7]}" + ("-det" if c[8] else "")


@pytest.mark.parametrize("case", TAIL_CASES, ids=[_tail_id(c) for c in TAIL_CASES])
def test_partial_last_block_on_narrow_products(case, monkeypatch):
    """The op compiles d128's partial last query block on tail_m-wide products (the kernel's
    tail_m, chosen per Sq); dQ / dK / dV against fp64, and against the whole-block kernel
    (``TAIL_BLOCK`` off) within twice the rounding floor."""
    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, mask_type, window, det, tail_m = case
    d = 128
    plan = S._plan(
        cc.cute_dtype(dtype),
        d,
        d,
        mask_type,
        "sm_90a",
        window=window > 0,
        deterministic=det,
        varlen=False,
        bias=False,
        grad_bias=False,
        dropout=False,
        rows_q=sq,
        group=h // hk,
        rows_k=sk,
        ctas=132,
    )
    assert plan[2].tail_m == tail_m
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + 11 * h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + 11 * hk)
    out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    kw = dict(deterministic=det, **(dict(window_size=window) if window else {}))
    ours = backward("sm90", q, k, v, do, out, lse, mask_type, **kw)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, ref, (q, k, v), floors):
        check(f"{name} [{_tail_id(case)}]", g, r, like, dtype, floor)
    monkeypatch.setattr(S, "TAIL_BLOCK", False)
    whole = backward("sm90", q, k, v, do, out, lse, mask_type, **kw)
    floors = [None if f is None else 2 * f for f in floors]
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, whole, (q, k, v), floors):
        check(f"{name} [{_tail_id(case)}] vs whole blocks", g, r, like, dtype, floor)


# (dtype, B, H, Hk, Sq, Sk, D, mask): several waves of CTAs, so heads complete while the grid runs
OVERLAP_CASES = [
    (BF16, 2, 8, 8, 2048, 2048, 96, 0),
    (F16, 2, 8, 4, 1536, 2048, 128, 0),  # grouped heads: a key head's count completes its query heads
    (BF16, 1, 4, 4, 1024, 1500, (192, 128), 0),  # wide tiles, Dqk != Dv
    (BF16, 2, 8, 8, 1024, 1024, 128, 1),  # causal: overlapped only in deterministic mode (launch order)
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=[_grouped_id(c + (0,)) for c in OVERLAP_CASES])
def test_convert_overlap_is_the_late_convert(case, monkeypatch):
    """convert_dq overlapping the kernel (ConvertDQReady: a head converted once all its key
    blocks have counted their dQ adds) gives deterministic mode the late convert_dq's bits;
    the overlapped runs against fp64 (a head converted before its adds are all visible would
    be off by whole blocks' contributions): the deterministic one, then three plain runs, or
    with a causal mask (overlapped only when deterministic) two more deterministic ones."""
    from ops import attention_bwd_prepost as P
    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, d, mask_type = case
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + hk)
    out, lse = _padded_ref_forward(q, k, v, mask_type, 0)
    overlapped = []
    launch = P.launch_convert_dq_ready
    monkeypatch.setattr(P, "launch_convert_dq_ready", lambda *a: overlapped.append(1) or launch(*a))
    runs = {}
    for ready in (True, False):
        monkeypatch.setattr(S, "DQ_READY", ready)
        runs[ready] = backward("sm90", q, k, v, do, out, lse, mask_type, deterministic=True)
    assert len(overlapped) == 1, "the overlapping convert was not taken"
    for name, a, c in zip(("dq", "dk", "dv"), runs[True], runs[False]):
        assert torch.equal(a, c), f"{name}: overlapped and late convert_dq differ"
    # equal bits do not make either right: the overlapped runs against fp64 too, the
    # deterministic one and more (a causal mask overlaps only in deterministic mode: its
    # further runs are deterministic too, three overlapped runs in all; without one, three
    # plain runs, whose adds race)
    monkeypatch.setattr(S, "DQ_READY", True)
    deterministic = mask_type != 0
    checked = [("deterministic", runs[True])]
    for i in range(2 if deterministic else 3):
        checked.append((f"run {i}", backward("sm90", q, k, v, do, out, lse, mask_type, deterministic=deterministic)))
    assert len(overlapped) == len(checked), "the overlapping convert was not taken"
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    floors = rounding_floors(q, k, do, out, dtype)
    for label, got in checked:
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), got, ref, (q, k, v), floors):
            check(f"{name} [{_grouped_id(case + (0,))}] {label}", g, r, like, dtype, floor)


def _unzeroed_accumulator_runs(S, monkeypatch, dims, mask_type, seed, taken, off):
    """Three backwards with the op's unzeroed dQ accumulator handed over full of NaN, then one
    with the switches ``off`` (module attributes of ``S`` set False: the preprocess zeroes it),
    all against fp64. ``dims``: (dtype, B, H, Hk, Sq, Sk, D); ``taken``: the assertion message
    when the runs did not take the unzeroed path."""
    dtype, b, h, hk, sq, sk, d = dims
    poisoned = []

    def nan_accum(dq_accum):
        poisoned.append(dq_accum.shape)
        return dq_accum.fill_(float("nan"))

    monkeypatch.setattr(S, "_unzeroed_dq_accum", nan_accum)
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + seed * h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + seed * hk)
    out, lse = _padded_ref_forward(q, k, v, mask_type, 0)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    floors = rounding_floors(q, k, do, out, dtype)
    runs = [backward("sm90", q, k, v, do, out, lse, mask_type) for _ in range(3)]
    assert len(poisoned) == 3, taken
    for name in off:
        monkeypatch.setattr(S, name, False)
    zeroed = backward("sm90", q, k, v, do, out, lse, mask_type)
    assert len(poisoned) == 3
    case_id = _grouped_id(tuple(dims) + (mask_type, 0))
    for i, got in enumerate(runs + [zeroed]):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), got, ref, (q, k, v), floors):
            check(f"{name} [{case_id}] run {i}", g, r, like, dtype, floor)


# (dtype, B, H, Hk, Sq, Sk, D, mask, persistent CTAs or None): every query block is seen, so the
# op asks for store_first; several key blocks reach each query block
STORE_FIRST_CASES = [
    (BF16, 2, 4, 4, 1024, 1024, 64, 0, 3),  # persistent CTAs walking several tiles, carry_dq
    (F16, 1, 4, 2, 700, 900, 64, 0, None),  # grouped heads, a partial last block, rotated order
    (BF16, 2, 8, 8, 2048, 2048, 128, 0, None),  # a CTA per tile, ConvertDQReady overlapping
    (F16, 1, 4, 4, 1000, 1300, 96, 1, None),  # causal top-left, Sq < Sk
    (BF16, 1, 4, 2, 1300, 700, 128, 1, None),  # causal top-left, Sq > Sk
    (BF16, 1, 2, 2, 600, 900, 64, 2, None),  # causal bottom-right, Sq <= Sk (dynamic tiles)
    (F16, 1, 4, 2, 700, 900, (192, 128), 0, None),  # wide tiles: the joint dQ handoff
    (BF16, 1, 2, 2, 640, 640, 256, 1, None),
]


@pytest.mark.parametrize("case", STORE_FIRST_CASES, ids=[_grouped_id(c[:8] + (0,)) for c in STORE_FIRST_CASES])
def test_store_first_needs_no_zeroed_accumulator(case, monkeypatch):
    """store_first: each query block's first dQ is stored, not added, so the accumulator is
    handed to the kernel full of NaN; dQ / dK / dV against fp64 (a block added before its
    first store lands, or stored over another's add, is off by whole blocks) and the zeroed
    accumulator's run, in three runs (claims race differently)."""
    import dataclasses

    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, d, mask_type, ctas = case
    if ctas is not None:
        monkeypatch.setattr(S, "PERSISTENT_CTAS", ctas)
    # every tile kind, also those that do not ask for it (tiles.store_first: chosen by speed)
    tiles = S._tiles
    monkeypatch.setattr(S, "_tiles", lambda *a: dataclasses.replace(tiles(*a), store_first=True))
    # (the zeroed run: the preprocess zeroes the accumulator, not the kernel's zero_ahead either)
    _unzeroed_accumulator_runs(
        S,
        monkeypatch,
        (dtype, b, h, hk, sq, sk, d),
        mask_type,
        7,
        "store_first was not taken",
        ("STORE_FIRST", "ZERO_AHEAD"),
    )


# (dtype, B, H, Hk, Sq, Sk, D, persistent CTAs or None, mask): d64 (persistent CTAs; without a mask
# over equal tiles, a head's key blocks within the grid, with one from a tile counter), so the op
# asks for zero_ahead
ZERO_AHEAD_CASES = [
    (BF16, 2, 4, 4, 1024, 384, 64, 3, 0),  # 3 key blocks owning 2-3 query blocks each, 8 tiles a CTA, carry_dq
    (F16, 1, 4, 2, 700, 900, 64, None, 0),  # grouped heads, 8 key blocks over 6 query blocks (some own none)
    (BF16, 1, 2, 2, 300, 3000, 64, 30, 0),  # 24 key blocks a head on 30 CTAs: a head's tiles over two rounds
    (BF16, 1, 2, 2, 2000, 200, 64, 2, 0),  # 2 CTAs, tiles of 16 steps (no carry_dq)
    (BF16, 4, 16, 16, 1024, 1024, 64, None, 0),  # the whole device, 512 tiles
    # fewer CTAs than a head's key blocks (forced: the op would not take it): a tile's blocks whose
    # owners the same CTA runs later are zeroed by its dQ-store warp, as for a CTA not resident
    (BF16, 1, 2, 2, 1000, 1024, 64, 1, 0),
    (F16, 2, 4, 2, 512, 1500, 64, 5, 0),
    # causal (tiles from the counter; every block zeroed at the kernel's start, taken from a counter of jobs)
    (BF16, 2, 4, 4, 1024, 1024, 64, 3, 1),  # 3 CTAs over 32 tiles
    (F16, 1, 4, 2, 700, 900, 64, None, 2),  # bottom-right, Sq < Sk, grouped heads
    (BF16, 1, 2, 2, 1300, 700, 64, 5, 1),  # top-left, Sq > Sk: the last key block owns the blocks past it
    (BF16, 2, 16, 16, 2048, 2048, 64, None, 1),  # the whole device
]


@pytest.mark.parametrize("case", ZERO_AHEAD_CASES, ids=[_grouped_id(c[:7] + (c[8], 0)) for c in ZERO_AHEAD_CASES])
def test_zero_ahead_needs_no_zeroed_accumulator(case, monkeypatch):
    """zero_ahead: persistent CTAs zero each query block's accumulator rows a round of tiles
    before the block's first add (or the dQ-store warp does, at the add, where the owner has not
    got there), so the accumulator is handed to the kernel full of NaN; dQ / dK / dV against fp64
    (a block zeroed twice or late, or added before its zeros, is off by whole blocks or NaN) and
    the preprocess-zeroed run, in three runs."""
    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, d, ctas, mask_type = case
    if ctas is not None:
        monkeypatch.setattr(S, "PERSISTENT_CTAS", ctas)
        ahead = S._zeroes_ahead
        monkeypatch.setattr(
            S,
            "_zeroes_ahead",
            lambda schedule, first, blocks, n, steps, reached=True: ahead(
                schedule, first, min(blocks, n), n, steps, reached
            ),
        )
    _unzeroed_accumulator_runs(
        S, monkeypatch, (dtype, b, h, hk, sq, sk, d), mask_type, 3, "zero_ahead was not taken", ("ZERO_AHEAD",)
    )


def test_deterministic_follows_torch_flag():
    """deterministic=None: torch.use_deterministic_algorithms(True) makes repeated backwards equal."""
    q, k, v, do = make_inputs(1, 2, 1000, 1000, 128, BF16, seed=21)
    out, lse = forward(q, k, v, 0)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (backward("sm90", q, k, v, do, out, lse, 0) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


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


# ------------------------------------------------------------------ variable lengths

# (dtype, H, Hk, D, mask, window, query lengths, key lengths, deterministic): sequences
# packed along the rows of batch-1 tensors; tiles run past a sequence into the next one
VARLEN_CASES = [
    (BF16, 2, 2, 64, 0, 0, [1, 130, 3], [0, 130, 64], False),  # an empty key sequence
    (F16, 2, 2, 128, 1, 0, [300], [257], False),
    (BF16, 4, 2, 64, 2, 0, [5, 64, 65, 33], [70, 64, 1, 100], False),  # bottom-right, Sq > Sk in one
    (F16, 2, 1, 96, 2, 16, [200, 129, 7], [250, 129, 300], False),  # multi-query, a window
    (BF16, 2, 2, 128, 1, 50, [257, 0, 100], [300, 40, 100], True),  # an empty query sequence
    (F16, 3, 3, 64, 0, 0, [700, 300], [500, 900], True),
    # d192 / d256: 64 x 64 tiles (a tile past a sequence's end reads the next one's rows)
    (BF16, 2, 2, 192, 1, 0, [1, 130, 65], [0, 130, 64], False),
    (F16, 4, 2, 256, 2, 0, [5, 64, 65, 33], [70, 64, 1, 100], False),
    (BF16, 2, 1, 256, 1, 40, [257, 0, 100], [300, 40, 100], True),
    # Dqk != Dv: the dQ accumulator (Dqk wide) is zeroed apart from Δ's launch
    (F16, 4, 2, (128, 64), 2, 0, [5, 64, 65, 33], [70, 64, 1, 100], False),
    (BF16, 2, 1, (192, 128), 1, 40, [257, 0, 100], [300, 40, 100], True),
]


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def _varlen_id(c):
    return (
        f"{str(c[0])[6:]}-H{c[1]}Hk{c[2]}d{dims_id(c[3])}m{c[4]}w{c[5]}-q{'_'.join(map(str, c[6]))}-k{'_'.join(map(str, c[7]))}"
        + ("-det" if c[8] else "")
    )


def _varlen_floors(q, k, do, out, dtype, lengths_q, lengths_k):
    """rounding_floors per packed sequence (dk's floor sums only its own sequence's queries)."""
    dq_floor = torch.zeros(q.shape[:3] + (1,), dtype=torch.float64, device=DEV)
    dk_floor = torch.zeros(k.shape[:3] + (1,), dtype=torch.float64, device=DEV)
    for (q0, nq), (k0, nk) in zip(_bounds(lengths_q), _bounds(lengths_k)):
        if nq and nk:
            fq, fk, _ = rounding_floors(
                *(t[:, a : a + n] for t, a, n in ((q, q0, nq), (k, k0, nk), (do, q0, nq), (out, q0, nq))), dtype
            )
            dq_floor[:, q0 : q0 + nq] = fq
            dk_floor[:, k0 : k0 + nk] = fk
    return dq_floor, dk_floor, None


def _bounds(lengths):
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    return list(zip(starts, lengths))


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[_varlen_id(c) for c in VARLEN_CASES])
def test_varlen(case, caplog):
    """Packed sequences through the sm90 path: against fp64 and the memory-efficient kernel
    (rows past a sequence's end belong to the next one, so any leak shows), and bitwise
    repeatable in deterministic mode."""
    dtype, h, hk, d, mask_type, window, lengths_q, lengths_k, deterministic = case
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, _, _, do = make_inputs(1, h, total_q, total_k, d, dtype, seed=total_q + sum(head_dims(d)))
    _, k, v, _ = make_inputs(1, hk, total_q, total_k, d, dtype, seed=total_k + h)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse = attention_forward_ref(
        q, k, v, custom_mask_type=mask_type, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    padded = torch.full((lse.shape[0], h, (max_q + 31) // 32 * 32), float("inf"), device=DEV)
    padded[..., : lse.shape[2]] = lse.float()
    out = out.to(dtype)
    for i, ((q0, nq), nk) in enumerate(zip(_bounds(lengths_q), lengths_k)):  # each sequence's rows without keys
        poison(out[:, q0 : q0 + nq], padded[i : i + 1], blind_rows(nq, nk, mask_type, window))
    empty = torch.empty((), dtype=torch.int64)

    def run(backend):
        dq, dk, dv, _ = ops.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            out,
            cu_q,
            cu_k,
            max_q,
            max_k,
            padded,
            0.0,
            empty,
            empty,
            mask_type,
            False,
            window_size=window or None,
            backend=backend,
            deterministic=deterministic,
        )
        return dq, dk, dv

    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = run("auto")
        theirs = run("mem_eff")
    assert chosen(caplog) == ["sm90", "mem_eff"]
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    floors = _varlen_floors(q, k, do, out, dtype, lengths_q, lengths_k)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, ref, (q, k, v), floors):
        check(f"{name} [{_varlen_id(case)}]", g, r, like, dtype, floor)
    floors = [None if f is None else 2 * f for f in floors]
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v), floors):
        check(f"{name} [{_varlen_id(case)}] vs mem_eff", g, r, like, dtype, floor)
    if deterministic:
        for _ in range(2):
            for name, g0, g in zip(("dq", "dk", "dv"), ours, run("sm90")):
                assert torch.equal(g0, g), f"{name}: deterministic runs differ"


# -------------------------------------------------------------------- bias and dropout

# (dtype, B, Mq, Mk, H, D, features of run_feature_case): bias of every broadcast kind and
# layout (element reads: strides 0, padded rows, keys not contiguous), with and without its
# gradient; dropout with masks and windows; both together; every head dim
FEATURE_CASES = [
    (BF16, 2, 100, 140, 3, 64, dict(bias_shape=(2, 3, 100, 140), bias_grad=True, mask_type=1)),
    (F16, 2, 100, 140, 3, 64, dict(bias_shape=(100, 140), bias_grad=True)),  # over batch and heads
    (BF16, 2, 100, 140, 3, 128, dict(bias_shape=(2, 3, 100, 1), bias_grad=True, mask_type=2)),  # over keys
    (F16, 2, 100, 140, 3, 128, dict(bias_shape=(2, 3, 1, 140), bias_grad=False)),  # over queries
    (F16, 2, 100, 140, 3, 96, dict(bias_shape=(2, 3, 100, 140), bias_layout="transposed", bias_grad=True)),
    (BF16, 2, 100, 140, 3, 192, dict(bias_shape=(2, 3, 100, 140), bias_layout="padded", mask_type=1)),
    (F16, 2, 100, 140, 3, 256, dict(bias_shape=(1, 3, 100, 140), bias_grad=True, mask_type=2, window=30)),
    (F16, 2, 130, 190, 2, 64, dict(dropout_p=0.1)),
    (BF16, 2, 130, 190, 2, 128, dict(dropout_p=0.5, mask_type=1)),
    (F16, 2, 130, 190, 2, 96, dict(dropout_p=0.3, mask_type=2, window=17)),
    (BF16, 2, 130, 190, 2, 192, dict(dropout_p=0.2, mask_type=1, window=40)),
    (F16, 2, 130, 190, 2, 256, dict(dropout_p=0.2)),
    (BF16, 2, 90, 150, 2, 128, dict(bias_shape=(2, 1, 90, 150), bias_grad=True, dropout_p=0.2, mask_type=1)),
    (F16, 2, 90, 150, 2, 192, dict(bias_shape=(2, 1, 90, 150), bias_grad=True, dropout_p=0.2)),
    (BF16, 1, 300, 520, 2, 64, dict(bias_shape=(1, 2, 300, 520), bias_grad=True, dropout_p=0.15)),  # several blocks
    # Dqk != Dv: (Dqk, Dv)
    (BF16, 2, 100, 140, 3, (192, 128), dict(bias_shape=(2, 3, 100, 140), bias_grad=True, dropout_p=0.2, mask_type=1)),
    (F16, 2, 100, 140, 3, (128, 64), dict(bias_shape=(1, 3, 100, 140), bias_grad=True, dropout_p=0.1)),
    (BF16, 2, 130, 190, 2, (64, 256), dict(dropout_p=0.3, mask_type=2)),
]


def _feature_id(c):
    flags = "-".join(f"{k}{v}" for k, v in c[6].items())
    return f"{str(c[0])[6:]}-B{c[1]}q{c[2]}k{c[3]}H{c[4]}d{c[5]}-{flags}"


@pytest.mark.parametrize("case", FEATURE_CASES, ids=[_feature_id(c) for c in FEATURE_CASES])
def test_bias_and_dropout_vs_reference(case):
    from .test_mem_eff_attention_features_gpu import run_feature_case

    dtype, b, mq, mk, h, d, kw = case
    kd, kv = d if isinstance(d, tuple) else (d, d)
    run_feature_case(dtype, b, mq, mk, h, kd, kv, backend="sm90", seed=mq + kd, **kw)


@pytest.mark.parametrize("dtype,mask_type,d", [(F16, 0, 64), (BF16, 1, 64), (F16, 2, 128), (BF16, 0, 256)])
def test_dropout_uses_torchs_mask(dtype, mask_type, d):
    """Identity dO rows: dV shows, bit for bit, which (query, key) the kernel kept."""
    from .test_mem_eff_attention_features_gpu import check_mask_through_dv

    check_mask_through_dv(dtype, mask_type, "sm90", d=d)


def test_dropout_varlen():
    from .test_mem_eff_attention_features_gpu import run_feature_case

    for mask_type, d in ((1, 64), (0, 128), (2, 192)):
        run_feature_case(
            F16,
            1,
            0,
            0,
            2,
            d,
            d,
            dropout_p=0.25,
            lengths=([70, 0, 129, 5], [90, 3, 200, 0]),
            mask_type=mask_type,
            backend="sm90",
        )


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_bias_and_dropout_vs_torch_backward(dtype):
    """Same inputs, same philox seed / offset as torch's own backward."""
    from .test_mem_eff_attention_features_gpu import run_feature_case

    run_feature_case(dtype, 2, 128, 256, 4, 64, 64, dropout_p=0.1, compare_torch=True, backend="sm90")
    run_feature_case(dtype, 2, 128, 256, 4, 128, 128, dropout_p=0.3, mask_type=1, compare_torch=True, backend="sm90")
    run_feature_case(
        dtype,
        2,
        128,
        256,
        4,
        64,
        64,
        bias_shape=(2, 1, 128, 256),
        bias_grad=True,
        dropout_p=0.1,
        compare_torch=True,
        backend="sm90",
    )


@pytest.mark.parametrize("deterministic", [False, True])
def test_grouped_heads_with_bias_and_dropout(deterministic):
    """Grouped-query heads with a bias requiring grad and dropout: sm90 (one CTA walks the
    group's query heads, the mask of each) against fp64 and the memory-efficient kernel;
    deterministic mode three times bitwise equal."""
    from .test_mem_eff_attention_features_gpu import philox_state, torch_keep_mask

    dtype, b, h, hk, mq, mk, d, p, mask_type = BF16, 2, 4, 2, 150, 200, 128, 0.2, 1
    q, _, _, do = make_inputs(b, h, mq, mk, d, dtype, seed=31)
    _, k, v, _ = make_inputs(b, hk, mq, mk, d, dtype, seed=32)
    bias = torch.randn(b, h, mq, mk, device=DEV, dtype=dtype, generator=torch.Generator(DEV).manual_seed(33))
    seed, offset = philox_state(b, h, mq, mk, p)
    mask = torch_keep_mask((b, h, mq, mk), p, int(seed), int(offset))
    kr, vr = (t.repeat_interleave(h // hk, 2) for t in (k, v))
    out, lse = attention_forward_ref(q, kr, vr, custom_mask_type=mask_type, bias=bias, dropout_mask=mask, dropout_p=p)
    lse_t = torch.full((b, h, -(-mq // 32) * 32), float("inf"), device=DEV)
    lse_t[..., :mq] = lse.float()
    out = out.to(dtype)
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, bias=bias, dropout_mask=mask, dropout_p=p, return_grad_bias=True
    )

    def run(backend):
        return ops.efficient_attention_backward(
            do,
            q,
            k,
            v,
            bias,
            out,
            None,
            None,
            mq,
            mk,
            lse_t,
            p,
            seed,
            offset,
            mask_type,
            True,
            backend=backend,
            deterministic=deterministic,
        )

    ours, theirs = run("sm90"), run("mem_eff")
    if deterministic:
        for _ in range(2):
            assert all(torch.equal(a, c) for a, c in zip(ours, run("sm90"))), "deterministic runs differ"
    floors = rounding_floors(q, k, do, out, dtype)
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads[:3], ref[:3], (q, k, v), floors):
            check(f"{name} {backend}", g, r, like, dtype, floor)
    mag = max(ref[3].abs().max().item(), (do.double().abs() * out.double().abs()).sum(-1).max().item())
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        err = (grads[3].double() - ref[3]).abs().max().item()
        assert err <= TOL[dtype] * mag, f"dbias {backend}: {err:.3g} > {TOL[dtype]} * {mag:.3g}"


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


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (192, 128)], ids=["d128-dv64", "d192-dv128"])
def test_memory_efficient_attention_unequal_head_dims(head_dim, head_dim_v):
    """The autograd op with a value head dim of its own: both backends give the fp64 gradients."""
    q, k, v, do = make_inputs(2, 2, 150, 200, (head_dim, head_dim_v), BF16, seed=19)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for backend in ("sm90", "mem_eff"):
        grads = _op_grads(backend, q, k, v, do, True)
        for name, g, r, like in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
            check(f"{name} (memory_efficient_attention d{head_dim} dv{head_dim_v}, {backend})", g, r, like, BF16)
