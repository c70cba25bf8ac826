"""GPU: edge numerics and tensors over 2^31 elements.

Edge numerics (cheap, part of the normal GPU run):

* memory-efficient attention backward: fully masked query rows (causal from the bottom
  right with more queries than keys, sliding windows that leave rows without keys), with
  one and several key splits: gradients finite, dQ exactly 0 on those rows, agreement
  with the fp64 reference. The forward's out / logsumexp come from the fp64 reference
  (torch 2.11's forward is wrong for bottom-right masks with Mq > Mk, see
  test_mem_eff_attention_gpu); its logsumexp is 0 on rows without keys as torch writes it.
  The same with -inf / +inf logsumexp on those rows (other forwards' conventions): the
  kernel selects 0 for masked probabilities, so the gradients must be bitwise the same.
* very large logits (exp would overflow fp32 without the logsumexp): a large common
  offset (softmax still spread) and a large spread (softmax nearly one-hot). dV against
  the fp64 reference; dQ / dK against torch's backward on the same inputs (the existing
  tests' criterion): with half-precision out and dS their error against fp64 grows with
  the logit scale for every implementation, so only the comparison with torch is fair.
* dropout_bias_backward with saturated activations (|x + bias| in ~[8, 1e4]) and +-inf
  pre-activations for relu (finite gradients there); LayerNorm / RMSNorm backward with
  magnitudes near the ends of the dtype's range and constant rows; attention Δ of
  values near the dtype's largest.

Large tensors (``@pytest.mark.large``; each test below 25 GB of GPU memory, freed after):

* dropout_bias_backward on 2^31 + 12288 elements (bf16), checked bitwise in chunks
  against torch (p = 0.5 makes every product exact), the last rows explicitly;
* LayerNorm / RMSNorm backward with rows x N > 2^31, checked per chunk of rows against
  the fp64 reference;
* memory-efficient attention backward whose batch (dense) or sequence (packed) offsets
  exceed 2^31 elements in q / k / v / out / dO (views of one 2^32+-element buffer) and in
  the gradients (``shared_storage_dqdkdv``): every gradient element written (finite), and
  a few hundred (batch or sequence, head) slices, drawn with a fixed seed, plus every slice
  of the batches / sequences whose elements straddle element 2^31 or 2^32 of either
  buffer, against the fp64 reference computed slice by slice.
"""

import bisect
import gc
import math
import random

import pytest
import torch

import ops
from ops import norm as N
from ops.reference import (
    activation_grad_ref,
    attention_backward_ref,
    attention_forward_ref,
    norm_backward_ref,
)

from .helpers import poison, rel_err
from .test_attention_bwd_prepost_gpu import check_delta, poison_allocator
from .test_dropout_bias_gpu import DX_TOL
from .test_dropout_bias_gpu import check as check_dropout_bias
from .test_layer_norm_gpu import TOL as NORM_TOL
from .test_layer_norm_gpu import _check as check_norm
from .test_mem_eff_attention_gpu import (
    FLOOR,
    _backward,
    check_grad,
    cu_seqlens,
    key_coverage,
    make_qkv,
    ref_forward,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
FP32_EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)  # ~88.7


def _ours(
    q,
    k,
    v,
    do,
    out,
    lse,
    mask_type,
    window=0,
    scale=None,
    splits=None,
    cq=None,
    ck=None,
    max_q=None,
    max_k=None,
    shared=False,
):
    max_q = q.shape[1] if max_q is None else max_q
    max_k = k.shape[1] if max_k is None else max_k
    empty = torch.empty((), dtype=torch.int64)
    dq, dk, dv, _ = _backward()(
        do,
        q,
        k,
        v,
        None,
        out,
        cq,
        ck,
        max_q,
        max_k,
        lse,
        0.0,
        empty,
        empty,
        mask_type,
        False,
        scale=scale,
        num_splits_key=splits,
        window_size=window or None,
        shared_storage_dqdkdv=shared,
    )
    return dq, dk, dv


# ======================================================= attention: fully masked rows

# (custom_mask_type, window, Mq, Mk): every case leaves query rows without a key
FULLY_MASKED = [
    (2, 0, 300, 100),  # bottom-right causal, Mq > Mk: the first 200 rows see no key
    (2, 0, 129, 1),
    (2, 0, 65, 64),  # one row without keys
    (2, 0, 400, 257),  # several key blocks (splits > 1 possible)
    (1, 16, 300, 100),  # top-left window 16: rows >= 115 see no key
    (1, 1, 200, 50),  # window 1: one key per row, rows >= 50 none
    (1, 32, 700, 300),
    (2, 8, 300, 100),  # bottom-right causal + window, Mq > Mk
    (2, 100, 257, 1),
    (2, 50, 500, 260),
]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_attention_fully_masked_rows(dtype, splits):
    gen = torch.Generator(DEV).manual_seed(11)
    b, h, d = 2, 2, 64
    for mask_type, window, mq, mk in FULLY_MASKED:
        rows_q, rows_k = key_coverage(b, mq, mk, mask_type, window, None)
        assert (~rows_q).any(), "test precondition: the case has query rows without keys"
        q, k, v, do = make_qkv(b, mq, mk, h, d, d, dtype, gen)
        out, lse = ref_forward(q, k, v, mask_type, window, None, None, None, mq)
        dq, dk, dv = _ours(q, k, v, do, out, lse, mask_type, window, splits=splits)
        ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
        assert all(torch.isfinite(r).all() for r in ref)
        label = f"mask{mask_type} w{window} Mq{mq} Mk{mk} splits{splits}"
        check_grad(f"dq [{label}]", dq, ref[0], dtype, None, rows_q)  # 0 exactly on rows without keys
        check_grad(f"dk [{label}]", dk, ref[1], dtype, None, rows_k)
        check_grad(f"dv [{label}]", dv, ref[2], dtype, None, rows_k)


@pytest.mark.parametrize("fill", [float("-inf"), float("inf")], ids=["lse-neg-inf", "lse-pos-inf"])
def test_attention_empty_rows_with_infinite_lse(fill):
    """Rows without keys: logsumexp -inf / +inf there (flash-style forwards) instead of torch's
    0 gives the same gradients, bitwise (one key split: deterministic)."""
    gen = torch.Generator(DEV).manual_seed(12)
    b, h, d = 2, 2, 64
    for mask_type, window, mq, mk in [(2, 0, 300, 100), (1, 16, 300, 100), (2, 50, 500, 260)]:
        q, k, v, do = make_qkv(b, mq, mk, h, d, d, BF16, gen)
        out, lse = ref_forward(q, k, v, mask_type, window, None, None, None, mq)
        rows_q, _ = key_coverage(b, mq, mk, mask_type, window, None)
        empty = (~rows_q).unsqueeze(1).expand(b, h, mq)  # [B, H, Mq]
        lse_inf = lse.clone()
        lse_inf[:, :, :mq][empty] = fill
        base = _ours(q, k, v, do, out, lse, mask_type, window, splits=1)
        got = _ours(q, k, v, do, out, lse_inf, mask_type, window, splits=1)
        for name, a, c in zip(("dq", "dk", "dv"), got, base):
            assert torch.isfinite(a).all(), (
                f"{name}: NaN / inf with logsumexp {fill} on empty rows (mask{mask_type} w{window})"
            )
            assert torch.equal(a, c), (
                f"{name}: logsumexp {fill} on empty rows changes the gradients (mask{mask_type} w{window})"
            )


# ======================================================= attention: very large logits


def _check_vs_torch(name, got, ref, theirs, dtype):
    """Finite, and max |ours - ref| <= 2 max |torch - ref| + FLOOR max |ref| (the existing
    tests' main criterion, without their absolute sanity bound)."""
    assert torch.isfinite(got).all(), f"{name}: NaN / inf"
    mag = ref.abs().max().item() or 1.0
    ours_err = (got.double() - ref).abs().max().item()
    torch_err = (theirs.double() - ref).abs().max().item()
    bound = 2 * torch_err + FLOOR[dtype] * mag
    assert ours_err <= bound, (
        f"{name}: ours {ours_err:.3g} vs torch {torch_err:.3g} (bound {bound:.3g}, max |ref| {mag:.3g})"
    )


def _torch_forward(q, k, v, mask_type, scale):
    out, lse, seed_t, offset_t, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, mask_type, True, scale=scale
    )
    return out, lse, seed_t, offset_t


def _torch_backward(*args, **kw):
    return torch.ops.aten._efficient_attention_backward(*args, **kw)[:3]


def _large_logit_inputs(regime, b, mq, mk, h, d, dtype, gen):
    """(q, k, v, dO, scale) with logits far beyond exp's fp32 range.

    offset: q = a u + 0.2 n, k = a u + 0.2 m (u a unit vector, a = 56): every logit is
    about a^2 / 8 = 392 give or take a few, so the softmax stays spread.
    spread: standard normal q, k and scale 6: logits of standard deviation 48, a nearly
    one-hot softmax.
    """
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    v, do = r(b, mk, h, d).to(dtype), r(b, mq, h, d).to(dtype)
    if regime == "offset":
        u = r(d)
        u = u / u.norm()
        a = 56.0
        q = (a * u + 0.2 * r(b, mq, h, d)).to(dtype)
        k = (a * u + 0.2 * r(b, mk, h, d)).to(dtype)
        return q, k, v, do, None
    return r(b, mq, h, d).to(dtype), r(b, mk, h, d).to(dtype), v, do, 6.0


@pytest.mark.parametrize("mask_type", [0, 1, 2])
@pytest.mark.parametrize("regime", ["offset", "spread"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_attention_large_logits(dtype, regime, mask_type):
    gen = torch.Generator(DEV).manual_seed(13)
    b, mq, mk, h, d = 2, 200, 300, 2, 64  # Mq <= Mk: torch's forward and backward are right here
    q, k, v, do, scale = _large_logit_inputs(regime, b, mq, mk, h, d, dtype, gen)
    _, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=mask_type, scale=scale)
    assert ref_lse.max().item() > FP32_EXP_OVERFLOW, "test precondition: exp of the logits overflows fp32"
    out, lse, seed_t, offset_t = _torch_forward(q, k, v, mask_type, scale)
    args = (do, q, k, v, None, out, None, None, mq, mk, lse, 0.0, seed_t, offset_t, mask_type, False)
    theirs = _torch_backward(*args, scale=scale)
    for splits in (1, None):
        dq, dk, dv, _ = _backward()(*args, scale=scale, num_splits_key=splits)
        ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, scale=scale)
        assert all(torch.isfinite(r).all() for r in ref)
        label = f"{regime} mask{mask_type} splits{splits}"
        check_grad(f"dv [{label}]", dv, ref[2], dtype, theirs[2])
        _check_vs_torch(f"dq [{label}]", dq, ref[0], theirs[0], dtype)
        _check_vs_torch(f"dk [{label}]", dk, ref[1], theirs[1], dtype)


# =================================================================== dropout_bias


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_erf"])
def test_dropout_bias_saturated_activations(dtype, activation):
    """Saturated pre-activations: |x| log-uniform in [10, 1e4], |bias| small, so act' is 0 or
    1 to far below fp32's resolution (the transition region is the other tests' business),
    and z^3 / exp(-z^2 / 2) must not overflow into NaN; for relu also +-inf (act' 0 / 1,
    gradients finite)."""
    gen = torch.Generator(DEV).manual_seed(14)
    rows, n = 257, 1000
    mag = 10.0 * torch.exp(torch.rand(rows, n, device=DEV, generator=gen) * math.log(1e3))
    sign = torch.where(torch.rand(rows, n, device=DEV, generator=gen) < 0.5, -1.0, 1.0)
    x = (sign * mag).to(dtype)
    bias = (0.5 * torch.randn(n, device=DEV, generator=gen)).to(dtype)
    if activation == "relu":
        x[::7, ::3] = float("inf")
        x[3::7, 1::3] = float("-inf")
    dy = torch.randn(rows, n, device=DEV, generator=gen).to(dtype)
    mask = torch.rand(rows, n, device=DEV, generator=gen) >= 0.2
    ref_act = activation_grad_ref(x.double() + bias.double(), activation)
    assert torch.isfinite(ref_act).all(), "test precondition: the fp64 reference is finite"
    dx, db = check_dropout_bias(dy, mask, 0.2, x, bias, activation)  # no NaN, one rounding of fp64
    assert torch.isfinite(dx).all() and torch.isfinite(db).all()


# ======================================================================== norms


def _norm_stats(x, is_rms, eps):
    """fp32 mean / rstd computed in fp64 (no overflow of x^2 on the way)."""
    x64 = x.double()
    if is_rms:
        return None, torch.rsqrt(x64.square().mean(-1) + eps).float()
    var, mean = torch.var_mean(x64, -1, correction=0)
    return mean.float(), torch.rsqrt(var + eps).float()


# (dtype, magnitude): values far from 1 (eps 0, so rstd is 1 / magnitude too)
MAGNITUDES = [(F32, 1e30), (F32, 1e-30), (BF16, 1e30), (BF16, 1e-30), (F16, 1e4), (F16, 1e-3)]


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,magnitude", MAGNITUDES, ids=[f"{str(t)[6:]}-{m:g}" for t, m in MAGNITUDES])
def test_norm_extreme_magnitudes(dtype, magnitude, is_rms):
    gen = torch.Generator(DEV).manual_seed(15)
    rows, n = 129, 1024
    x = ((torch.randn(rows, n, device=DEV, generator=gen) * 0.5 + 1.0) * magnitude).to(dtype)
    assert torch.isfinite(x).all() and (x != 0).any()
    dz = torch.randn(rows, n, device=DEV, generator=gen).to(dtype)
    w = torch.randn(n, device=DEV, generator=gen).to(dtype)
    b = None if is_rms else torch.randn(n, device=DEV, generator=gen).to(dtype)
    mean, rstd = _norm_stats(x, is_rms, 0.0)
    assert torch.isfinite(rstd).all() and (rstd > 0).all(), "test precondition: representable statistics"
    check_norm(x, dz, w, b, mean, rstd, is_rms)  # poisoned launch: finite, within test_layer_norm_gpu's TOL


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_norm_constant_rows(dtype, is_rms):
    """Rows of one value (LayerNorm: zero variance; RMSNorm: zeros): rstd = eps^-1/2."""
    gen = torch.Generator(DEV).manual_seed(16)
    rows, n = 100, 1000
    x = torch.randn(rows, n, device=DEV, generator=gen).to(dtype)
    x[::3] = 0.0 if is_rms else 7.0
    x[1::3] = 0.0
    dz = torch.randn(rows, n, device=DEV, generator=gen).to(dtype)
    w = torch.randn(n, device=DEV, generator=gen).to(dtype)
    b = None if is_rms else torch.randn(n, device=DEV, generator=gen).to(dtype)
    mean, rstd = _norm_stats(x, is_rms, 1e-5)
    check_norm(x, dz, w, b, mean, rstd, is_rms)


# ================================================================ attention Δ


@pytest.mark.parametrize("dtype,magnitude", [(F16, 1e4), (BF16, 1e17), (F32, 1e17)], ids=["fp16", "bf16", "fp32"])
def test_attention_delta_large_magnitudes(dtype, magnitude):
    """Δ = rowsum(O dO) of values near the dtype's largest (products far past fp16 / bf16's
    range stay finite in the fp32 sums)."""
    from ops import attention_bwd_prepost as A

    gen = torch.Generator(DEV).manual_seed(17)
    out = (torch.randn(2, 200, 3, 128, device=DEV, generator=gen).clamp(-5, 5) * magnitude).to(dtype)
    grad_out = (torch.randn(2, 200, 3, 128, device=DEV, generator=gen).clamp(-5, 5) * magnitude).to(dtype)
    assert torch.isfinite(out).all() and torch.isfinite(grad_out).all()
    delta = A.attention_bwd_preprocess(out, grad_out, scale=0.5)
    assert torch.isfinite(delta).all()
    check_delta(delta, out, grad_out, 0.5)
    delta2 = A.attention_bwd_compute_delta(out, grad_out)
    assert torch.isfinite(delta2).all()
    check_delta(delta2, out, grad_out, rounded=False)


# =============================================================== large tensors

GIB = 1 << 30
INT32_LIMIT = 1 << 31


@pytest.fixture
def free_gpu_memory():
    """Frees what a large test left (its tensors are gone when it returns)."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _require_free(nbytes):
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GIB:.1f} GiB of free GPU memory, {free / GIB:.1f} GiB free")


def _chunks(rows, chunk):
    for r0 in range(0, rows, chunk):
        yield slice(r0, min(rows, r0 + chunk))


@pytest.mark.large
@pytest.mark.parametrize("activation", [None, "relu"])
def test_dropout_bias_over_2_31_elements(activation, free_gpu_memory):
    n = 4096
    rows = INT32_LIMIT // n + 3  # 2^31 + 12288 elements
    numel = rows * n
    assert numel > INT32_LIMIT
    _require_free(numel * (2 + 1 + 2 + (2 if activation else 0)) + 4 * GIB)
    gen = torch.Generator(DEV).manual_seed(18)
    dy = torch.randn(rows, n, device=DEV, dtype=BF16, generator=gen)
    mask = torch.empty(rows, n, device=DEV, dtype=torch.uint8).random_(0, 2, generator=gen)
    x = bias = None
    if activation:
        x = torch.randn(rows, n, device=DEV, dtype=BF16, generator=gen)
        bias = torch.randn(n, device=DEV, dtype=BF16, generator=gen)
    p = 0.5  # 1 / (1 - p) = 2: dY * mask * 2 (* relu') is exact in bf16
    poison_allocator(numel * 2)  # dX's block: 0xFF (NaN) bytes where the kernel would not write
    dx, db = ops.dropout_bias_backward(dy, mask, p, x, bias, activation)
    torch.cuda.synchronize()
    ref_db = torch.zeros(n, dtype=torch.float64, device=DEV)

    def expected(sl):
        g = dy[sl].float() * mask[sl] * 2.0
        if activation:
            g = g * (x[sl].float() + bias.float() > 0)
        return g

    for sl in _chunks(rows, 16384):
        g = expected(sl)
        got = dx[sl]
        if not torch.equal(got, g.to(BF16)):
            bad = (got != g.to(BF16)).nonzero()[0].tolist()
            pytest.fail(f"dX rows {sl.start}..{sl.stop}: first mismatch at [{sl.start + bad[0]}, {bad[1]}]")
        ref_db += g.double().sum(0)
    last = slice(rows - 3, rows)  # the rows past 2^31 elements, explicitly
    assert torch.equal(dx[last], expected(last).to(BF16)), "the last rows (past 2^31 elements) are wrong"
    assert torch.isfinite(db).all()
    assert rel_err(db, ref_db) <= DX_TOL[BF16], rel_err(db, ref_db)


# (norm, x dtype, weight dtype, N): N = 4096 (vector 8, one CTA per row) and an odd N
# (one-element vectors, a 2-CTA cluster per row)
LARGE_NORMS = [("layer_norm", BF16, F32, 4096), ("rms_norm", F16, F16, 12289)]


@pytest.mark.large
@pytest.mark.parametrize("norm,dtype,w_dtype,n", LARGE_NORMS, ids=[c[0] for c in LARGE_NORMS])
def test_norm_over_2_31_elements(norm, dtype, w_dtype, n, free_gpu_memory):
    is_rms = norm == "rms_norm"
    rows = INT32_LIMIT // n + 2
    numel = rows * n
    assert numel > INT32_LIMIT
    _require_free(numel * 8 + 4 * GIB)  # x, dz, dx, the public op's dx
    gen = torch.Generator(DEV).manual_seed(19)
    x = torch.randn(rows, n, device=DEV, dtype=dtype, generator=gen)
    dz = torch.randn(rows, n, device=DEV, dtype=dtype, generator=gen)
    w = torch.randn(n, device=DEV, generator=gen).to(w_dtype)
    b = None if is_rms else torch.randn(n, device=DEV, generator=gen).to(w_dtype)
    chunk = max(1, (1 << 25) // n)  # rows per reference chunk (fp64 temporaries of 256 MiB)
    mean = None if is_rms else torch.empty(rows, device=DEV)
    rstd = torch.empty(rows, device=DEV)
    for sl in _chunks(rows, chunk):
        x32 = x[sl].float()
        if is_rms:
            rstd[sl] = torch.rsqrt(x32.square().mean(-1) + 1e-5)
        else:
            var, mean[sl] = torch.var_mean(x32, -1, correction=0)
            rstd[sl] = torch.rsqrt(var + 1e-5)
    # the kernels' own entry point into NaN-filled outputs, so unwritten elements show
    dx = poison(torch.empty_like(x))
    dw = poison(torch.empty_like(w))
    db = None if b is None else poison(torch.empty_like(b))
    N.launch(dz, x, w, mean, rstd, b, is_rms, dx, dw, db)
    torch.cuda.synchronize()
    tol = NORM_TOL[dtype]
    rdw = torch.zeros(n, dtype=torch.float64, device=DEV)
    rdb = torch.zeros(n, dtype=torch.float64, device=DEV)
    for sl in _chunks(rows, chunk):
        rdx, cdw, cdb = norm_backward_ref(dz[sl], x[sl], w, None if is_rms else mean[sl], rstd[sl], b is not None)
        got = dx[sl]
        assert torch.isfinite(got).all(), f"dx rows {sl.start}..{sl.stop}: NaN / inf (unwritten?)"
        assert rel_err(got, rdx) < tol, (f"dx rows {sl.start}..{sl.stop}", rel_err(got, rdx))
        rdw += cdw
        if b is not None:
            rdb += cdb
    last = slice(rows - 2, rows)  # the rows past 2^31 elements, explicitly
    rdx, _, _ = norm_backward_ref(dz[last], x[last], w, None if is_rms else mean[last], rstd[last], False)
    assert rel_err(dx[last], rdx) < tol, ("the last rows", rel_err(dx[last], rdx))
    assert torch.isfinite(dw).all() and rel_err(dw, rdw) < max(tol, NORM_TOL[w_dtype]), ("dw", rel_err(dw, rdw))
    if b is not None:
        assert torch.isfinite(db).all() and rel_err(db, rdb) < max(tol, NORM_TOL[w_dtype]), ("db", rel_err(db, rdb))
    # the public op agrees (deterministic)
    if is_rms:
        pdx, pdw = ops.rms_norm_backward(dz, x, w, rstd)
    else:
        pdx, pdw, _ = ops.layer_norm_backward(dz, x, w, mean, rstd, b)
    assert torch.equal(pdw, dw)
    for sl in _chunks(rows, 65536):
        assert torch.equal(pdx[sl], dx[sl]), f"public op dx rows {sl.start}..{sl.stop} differ"


# Attention over 2^31 elements: q, k, v, out, dO are slots 0..4 of one [B, M, 8, H, D]
# buffer (slots 5..7 unused), so a batch's (or packed row's) offset passes 2^32 elements;
# the gradients share one [B, M, 3, H, D] buffer (shared_storage_dqdkdv), whose last
# batches start past 2^31 elements. Only the checked slices get a consistent forward
# (out, logsumexp from the fp64 reference); the others' out is random and their
# logsumexp 8, which keeps every probability (and gradient) finite.
ATT_M, ATT_H, ATT_D = 256, 4, 64
ATT_SLOTS = 8
ATT_UNCHECKED_LSE = 8.0
ATT_BATCH = 11000  # dense: the gradients' last batches start past 2^31 elements
ATT_SEQS = 11000  # packed: sequences of 200 / 312 rows
ATT_SAMPLE = 320  # (batch or sequence, head) slices drawn at random and checked


def _workspace_bytes(seqs, h, max_q):
    """The kernel's fp32 dQ workspace: one 64 x max_k tile (+ 4 words) per query block."""
    return seqs * h * math.ceil(max_q / 64) * (4 + 64 * ATT_D) * 4


def _attention_buffers(b, m, gen):
    buf = torch.empty(b, m, ATT_SLOTS, ATT_H, ATT_D, device=DEV, dtype=BF16)
    buf[:, :, :5].normal_(generator=gen)
    q, k, v, out, do = buf.unbind(2)[:5]
    return buf, q, k, v, out, do


def _checked_slices(units, row_strides, unit_of_row, total_rows, fixed, seed):
    """(unit, head) slices to check, sorted: ``fixed``, ATT_SAMPLE drawn at random (``seed``),
    and every head of the units (batches or sequences) holding element 2^31 - 1, 2^31,
    2^32 - 1 or 2^32 of a buffer whose rows (B * M dense, packed rows) are ``row_strides``
    elements apart (the inputs' buffer, the gradients'): the offsets that cross the limits."""
    rng = random.Random(seed)
    picked = set(fixed)
    picked.update(divmod(i, ATT_H) for i in rng.sample(range(units * ATT_H), ATT_SAMPLE))
    straddling = set()
    for stride in row_strides:
        for limit in (INT32_LIMIT, 2 * INT32_LIMIT):
            for element in (limit - 1, limit):
                if element // stride < total_rows:
                    straddling.add(unit_of_row(element // stride))
    assert straddling, "test precondition: a buffer reaches element 2^31"
    picked.update((u, h) for u in straddling for h in range(ATT_H))
    return sorted(picked)


def _consistent_forward(q, k, v, out, rows, h, lse_at):
    """out and logsumexp of rows ``rows`` (one batch entry or sequence), head h, from the fp64
    reference, in place (``lse_at``: that slice's view of lse)."""
    sel = lambda t: t[:, rows, h : h + 1]  # noqa: E731
    o, l = attention_forward_ref(sel(q), sel(k), sel(v), custom_mask_type=1)
    out[:, rows, h] = o[:, :, 0].to(BF16)
    lse_at.copy_(l[0, 0].float())


def _check_attention_slice(name, grads, q, k, v, do, rows, h):
    """Gradients of rows ``rows`` (one sequence or batch entry), head h, vs the reference."""
    sel = lambda t: t[:, rows, h : h + 1]  # noqa: E731
    ref = attention_backward_ref(sel(q), sel(k), sel(v), sel(do), custom_mask_type=1)
    for g, r, what in zip(grads, ref, ("dq", "dk", "dv")):
        check_grad(f"{what} [{name}]", sel(g), r, BF16)


def _all_finite(grads, dim, name):
    """Every gradient element was written (the allocator's blocks come poisoned with NaN)."""
    for g, what in zip(grads, ("dq", "dk", "dv")):
        for sl in _chunks(g.shape[dim], 1024 if dim == 0 else 1 << 18):
            part = g[sl] if dim == 0 else g[:, sl]
            assert torch.isfinite(part).all(), f"{what} [{name}] rows {sl.start}..{sl.stop}: NaN / inf (unwritten?)"


@pytest.mark.large
@pytest.mark.parametrize("splits", [1, 2])
def test_attention_batch_offsets_over_2_31(splits, free_gpu_memory):
    b, m, h = ATT_BATCH, ATT_M, ATT_H
    slot_elems = b * m * h * ATT_D
    _require_free((ATT_SLOTS + 3) * slot_elems * 2 + _workspace_bytes(b, h, m) + 4 * GIB)
    gen = torch.Generator(DEV).manual_seed(20)
    buf, q, k, v, out, do = _attention_buffers(b, m, gen)
    assert (b - 1) * q.stride(0) > 2 * INT32_LIMIT  # inputs: batch offsets past 2^32
    lse = torch.full((b, h, m), ATT_UNCHECKED_LSE, device=DEV)
    # the gradients' rows (shared_storage_dqdkdv: [B, M, 3, H, D]) are 3 H D elements apart
    checked = _checked_slices(
        b,
        (q.stride(1), 3 * h * ATT_D),
        lambda row: row // m,
        b * m,
        [(0, 0), (b // 2, 1), (b - 1, h - 1), (b - 1, 0)],
        seed=22 + splits,
    )
    for bi, hi in checked:
        _consistent_forward(*(t[bi : bi + 1] for t in (q, k, v, out)), slice(None), hi, lse[bi, hi])
    poison_allocator(3 * slot_elems * 2)
    grads = _ours(q, k, v, do, out, lse, 1, splits=splits, shared=True)
    torch.cuda.synchronize()
    assert (b - 1) * grads[0].stride(0) > INT32_LIMIT, "test precondition: gradient offsets past 2^31"
    assert grads[0].stride(1) == 3 * h * ATT_D and grads[0].storage_offset() == 0, "the gradients' layout changed"
    _all_finite(grads, 0, f"splits {splits}")
    for bi, hi in checked:
        _check_attention_slice(
            f"batch {bi} head {hi} splits {splits}",
            [g[bi : bi + 1] for g in grads],
            *(t[bi : bi + 1] for t in (q, k, v, do)),
            slice(None),
            hi,
        )


@pytest.mark.large
def test_attention_packed_offsets_over_2_31(free_gpu_memory):
    """Variable lengths: ATT_SEQS sequences of 200 / 312 rows packed along M (B = 1)."""
    nseq, h = ATT_SEQS, ATT_H
    lengths = [200 if i % 2 else 312 for i in range(nseq)]
    total = sum(lengths)
    slot_elems = total * h * ATT_D
    _require_free((ATT_SLOTS + 3) * slot_elems * 2 + _workspace_bytes(nseq, h, max(lengths)) + 4 * GIB)
    gen = torch.Generator(DEV).manual_seed(21)
    buf, q, k, v, out, do = _attention_buffers(1, total, gen)
    cu = cu_seqlens(lengths)
    starts = cu.tolist()
    assert starts[-2] * q.stride(1) > 2 * INT32_LIMIT  # the last sequence starts past 2^32 elements
    max_len = max(lengths)
    lse = torch.full((nseq, h, max_len), ATT_UNCHECKED_LSE, device=DEV)
    # a packed row's sequence: the last start at or before it
    checked = _checked_slices(
        nseq,
        (q.stride(1), 3 * h * ATT_D),
        lambda row: bisect.bisect_right(starts, row) - 1,
        total,
        [(0, 0), (nseq // 2, 2), (nseq - 1, h - 1), (nseq - 2, 1)],
        seed=23,
    )
    for si, hi in checked:
        _consistent_forward(q, k, v, out, slice(starts[si], starts[si + 1]), hi, lse[si, hi, : lengths[si]])
    poison_allocator(3 * slot_elems * 2)
    grads = _ours(q, k, v, do, out, lse, 1, splits=1, cq=cu, ck=cu, max_q=max_len, max_k=max_len, shared=True)
    torch.cuda.synchronize()
    assert starts[-2] * grads[0].stride(1) > INT32_LIMIT, "test precondition: gradient offsets past 2^31"
    assert grads[0].stride(1) == 3 * h * ATT_D and grads[0].storage_offset() == 0, "the gradients' layout changed"
    _all_finite(grads, 1, "packed")
    for si, hi in checked:
        _check_attention_slice(f"sequence {si} head {hi}", grads, q, k, v, do, slice(starts[si], starts[si + 1]), hi)
