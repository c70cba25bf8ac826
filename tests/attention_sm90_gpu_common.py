"""What the GPU tests of the Hopper-native attention backward (tests/test_attention_sm90*_gpu.py)
share: inputs, torch's forward with the rows that see no key poisoned, the backward through
``ops.efficient_attention_backward(..., backend=...)``, the bounds against fp64 with Δ's
rounding floors, the backends the log names, and a skip off sm_90a devices (autouse where
imported).

Outputs of the sm90 path are allocated inside it (no poisoning from here): every
gradient is checked finite instead. Small shapes: each (dtype, head dim, mask) compiles
once (a few seconds each).
"""

import pytest
import torch

import ops
from ops import _compile as cc
from ops.reference import attention_forward_ref

from .helpers import delta_rounding_floors

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


def _id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}q{c[3]}k{c[4]}d{dims_id(c[5])}m{c[6]}"


def _padded_ref_forward(q, k, v, mask_type, window):
    """(out, lse) of the fp64 reference in torch's layout (lse padded with +inf to 32):
    torch's own forward is not used with windows (its bottom-right window has no shift)."""
    out, lse = attention_forward_ref(q, k, v, custom_mask_type=mask_type, window_size=window)
    b, h, n = lse.shape
    padded = torch.full((b, h, (n + 31) // 32 * 32), float("inf"), device=DEV)
    padded[..., :n] = lse.float()
    return poison(out.to(q.dtype), padded, blind_rows(q.shape[1], k.shape[1], mask_type, window))


def _grouped_id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}Hk{c[3]}q{c[4]}k{c[5]}d{dims_id(c[6])}m{c[7]}w{c[8]}"
