"""GPU: attention bias (+ its gradient) and dropout in the memory-efficient backward.

* the keep mask, bit for bit: our Philox (``DropoutMaskKernel``, the backward's device
  function) against torch's ``_fill_mem_eff_dropout_mask_`` uniforms and the CPU twin, and
  the backward itself with dO = identity rows so that dV shows the mask it used;
* against the fp64 reference with an explicit mask (torch's), with bias of every
  broadcast kind, bias gradients, causal / window / varlen / split keys;
* against ``torch.ops.aten._efficient_attention_backward`` on the same inputs (dropout with
  the same seed / offset; bias requiring grad, broadcast over batch and over heads);
* ``memory_efficient_attention(attn_bias=, dropout_p=)`` and ``use_for_sdpa`` with both.

Tolerances and the comparison rule are the ones of test_mem_eff_attention_gpu.py.
"""

import math

import numpy as np
import pytest
import torch

import ops
from ops import attention as A
from ops import attention_sdpa as SD
from ops import mem_eff_attention as M
from ops.reference import attention_backward_ref, attention_forward_ref, attention_mask_ref, mem_eff_dropout_keep_mask

from .helpers import UNIT_ROUNDOFF, delta_rounding_floors, tile_error
from .test_mem_eff_attention_gpu import (
    BF16,
    DEV,
    F16,
    F32,
    LSE_ALIGN,
    REF_TOL,
    TILE_ERRORS,
    TILE_TOL,
    check_grad,
    key_coverage,
    seq_args,
)

pytestmark = pytest.mark.gpu


def torch_keep_mask(shape, p, seed, offset):
    """torch's mem-eff dropout mask for (seed, offset): its uniforms > p."""
    u = torch.empty(shape, device=DEV, dtype=torch.float32)
    torch.ops.aten._fill_mem_eff_dropout_mask_(u, p, seed, offset)
    return u > p


def philox_state(b, h, mq, mk, p):
    """A real (seed, offset) pair: what torch's forward returns for a dropout call."""
    q = torch.zeros(b, mq, h, 8, device=DEV, dtype=F16)
    k = torch.zeros(b, mk, h, 8, device=DEV, dtype=F16)
    _, _, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, k, None, None, None, None, None, p, 0, False
    )
    return seed, offset


# ------------------------------------------------------------------ the mask, bit for bit


@pytest.mark.parametrize(
    "shape,p,seed,offset",
    [
        ((2, 3, 64, 128), 0.1, 1234, 0),
        ((1, 2, 77, 45), 0.5, 2**63 + 17, 6),  # a seed with the top bit set, an offset inside a quad
        ((3, 1, 5, 1001), 0.25, 42, 2**33 + 3),
    ],
)
def test_dropout_mask_matches_torch_and_twin(shape, p, seed, offset):
    seed_i64 = seed - 2**64 if seed >= 2**63 else seed
    ours = M.mem_eff_dropout_mask(shape, p, seed_i64, offset)
    theirs = torch_keep_mask(shape, p, seed_i64, offset)
    twin = mem_eff_dropout_keep_mask(seed_i64, offset, *shape, p)
    assert torch.equal(ours.cpu(), twin), "DSL Philox != CPU twin"
    assert torch.equal(ours, theirs), f"{(ours != theirs).sum().item()} flags differ from torch's"


@pytest.mark.parametrize("dtype,mask_type,splits", [(F16, 0, 1), (BF16, 1, 3), (F32, 0, 2)])
def test_backward_uses_torchs_mask(dtype, mask_type, splits):
    check_mask_through_dv(dtype, mask_type, "mem_eff", splits=splits)


def check_mask_through_dv(dtype, mask_type, backend, splits=None, d=64):
    """dO = identity rows (query i writes column i): dV[j, i] = P_ij Z_ij, nonzero exactly
    where torch's forward kept (i, j)."""
    b, h, mq, mk, p = 2, 2, d, 200, 0.3
    gen = torch.Generator(DEV).manual_seed(0)
    q = 0.1 * torch.randn(b, mq, h, d, device=DEV, dtype=dtype, generator=gen)
    k = 0.1 * torch.randn(b, mk, h, d, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(b, mk, h, d, device=DEV, dtype=dtype, generator=gen)
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, p, mask_type, True
    )
    do = torch.eye(mq, d, device=DEV, dtype=dtype).view(1, mq, 1, d).expand(b, mq, h, d).contiguous()
    _, _, dv, _ = A.efficient_attention_backward(
        do,
        q,
        k,
        v,
        None,
        out,
        None,
        None,
        mq,
        mk,
        lse,
        p,
        seed,
        offset,
        mask_type,
        False,
        num_splits_key=splits,
        backend=backend,
    )
    keep = torch_keep_mask((b, h, mq, mk), p, int(seed), int(offset))
    seen = dv.permute(0, 2, 3, 1) != 0  # dV[b, j, h, i] -> [B, H, Mq (= head dim), Mk]
    visible = attention_mask_ref(mq, mk, mask_type, 0, device=DEV)  # either causal corner
    assert torch.equal(seen & visible, keep & visible)


# ------------------------------------------------------------- against the fp64 reference


def run_feature_case(
    dtype,
    b,
    mq,
    mk,
    h,
    kd,
    kv,
    *,
    bias_shape=None,
    bias_layout="dense",
    bias_grad=False,
    dropout_p=0.0,
    mask_type=0,
    window=0,
    scale=None,
    lengths=None,
    splits=None,
    seed=0,
    compare_torch=False,
    backend="mem_eff",
    kv_heads=None,
    deterministic=False,
):
    """One backward with bias / dropout: ours (``backend``) vs the fp64 reference (torch's
    mask) and, with ``compare_torch``, vs torch's backward on the same inputs. ``kv_heads``:
    key / value heads (grouped-query heads; default ``h``)."""
    hk = h if kv_heads is None else kv_heads
    assert not (compare_torch and hk != h), "torch's backward takes one key head per query head"
    gen = torch.Generator(DEV).manual_seed(seed)
    if lengths is not None:
        b, mq, mk = 1, sum(lengths[0]), sum(lengths[1])
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(b, mq, h, kd), r(b, mk, hk, kd), r(b, mk, hk, kv), r(b, mq, h, kv)
    cq, ck, max_q, max_k = seq_args(mq, mk, lengths)
    bias = None
    if bias_shape is not None:
        if bias_layout == "dense":
            bias = r(*bias_shape)
        elif bias_layout == "padded":  # rows of a wider buffer: strides not multiples of 8
            bias = r(*bias_shape[:-1], bias_shape[-1] + 3)[..., : bias_shape[-1]]
        else:  # "transposed": keys not contiguous
            bias = r(*bias_shape[:-2], bias_shape[-1], bias_shape[-2]).transpose(-1, -2)
    mask = seed_t = offset_t = None
    if dropout_p > 0:
        seed_t, offset_t = philox_state(b if lengths is None else len(lengths[0]), h, max_q, max_k, dropout_p)
    else:
        seed_t = offset_t = torch.empty((), dtype=torch.int64)
    if dropout_p > 0 and lengths is None:
        mask = torch_keep_mask((b, h, mq, mk), dropout_p, int(seed_t), int(offset_t))
    if lengths is None:
        out, lse = attention_forward_ref(
            q,
            k,
            v,
            custom_mask_type=mask_type,
            window_size=window,
            scale=scale,
            bias=bias,
            dropout_mask=mask,
            dropout_p=dropout_p,
        )
        ref = attention_backward_ref(
            q,
            k,
            v,
            do,
            custom_mask_type=mask_type,
            window_size=window,
            scale=scale,
            bias=bias,
            dropout_mask=mask,
            dropout_p=dropout_p,
            return_grad_bias=True,
            out=out.to(dtype),
        )
    else:  # varlen: per sequence, each with its own batch-head offsets (max seqlens)
        ref, out, lse = _varlen_dropout_ref(
            q, k, v, do, lengths, max_q, max_k, dropout_p, seed_t, offset_t, mask_type, window, scale
        )
    rows = lse.shape[0]
    lse_t = torch.full((rows, h, (max_q + LSE_ALIGN - 1) // LSE_ALIGN * LSE_ALIGN), float("inf"), device=DEV)
    lse_t[..., : lse.shape[-1]] = lse.float()
    out = out.to(dtype)
    args = (do, q, k, v, bias, out, cq, ck, max_q, max_k, lse_t, dropout_p, seed_t, offset_t, mask_type, bias_grad)
    kw = dict(scale=scale, num_splits_key=splits, window_size=window or None)
    dq, dk, dv, db = A.efficient_attention_backward(*args, **kw, backend=backend, deterministic=deterministic)
    theirs = [None] * 4
    if compare_torch:
        bias_t = None if bias is None else bias.expand(b, h, mq, mk)
        targs = args[:4] + (bias_t,) + args[5:]
        theirs = list(torch.ops.aten._efficient_attention_backward(*targs, **kw))
        if bias_grad and bias_t.shape != bias.shape:
            theirs[3] = theirs[3].sum_to_size(bias.shape)
    rows_q, rows_k = key_coverage(b, mq, mk, mask_type, window, lengths)
    label = f"{backend} {str(dtype)[6:]} B{b} Mq{mq} Mk{mk} H{h}/{hk} K{kd}/{kv} bias{bias_shape}:{bias_layout} grad{bias_grad} p{dropout_p} mask{mask_type} w{window} splits{splits}"
    # gradients ~0 by construction (one visible key) are judged against Δ's rounding
    dq_floor, dk_floor = delta_rounding_floors(q, k, do, out, dtype, scale)
    check_grad(f"dq [{label}]", dq, ref[0], dtype, theirs[0], rows_q, floor=dq_floor)
    check_grad(f"dk [{label}]", dk, ref[1], dtype, theirs[1], rows_k, floor=dk_floor)
    check_grad(f"dv [{label}]", dv, ref[2], dtype, theirs[2], rows_k)
    if bias_grad:
        check_dbias(f"dbias [{label}]", db, ref[3], bias, do, out, dtype, theirs[3])
    else:
        assert db is None


def check_dbias(name, db, ref_ds, bias, do, out, dtype, theirs=None):
    """The bias gradient against the reference dS [B, H, Mq, Mk] summed to the bias's shape:
    the largest element, and every 64-row tile (helpers.tile_error)."""
    # dB = dS = P (dP - Δ) is a difference of terms as large as Δ's; its rounding scales with
    # them, not with dS (which is ~0 where a row sees one key, or summed over the keys)
    delta_mag = (do.double().abs() * out.double().abs()).sum(-1).max().item()
    want = ref_ds.sum_to_size(bias.shape) if tuple(bias.shape) != tuple(ref_ds.shape) else ref_ds
    mag = max(ref_ds.abs().sum_to_size(bias.shape).max().item(), delta_mag, 1e-6)
    assert db.shape == want.shape and db.dtype == bias.dtype and torch.isfinite(db).all(), name
    err = (db.double() - want).abs().max().item()
    assert err <= REF_TOL[dtype] * mag, f"{name}: max |ours - ref| {err:.3g} > {REF_TOL[dtype]} * {mag:.3g}"
    if bias.shape[-1] > 1:  # summed over the keys, dS is 0 by construction (Σ_j P_ij dP_ij = Δ_i)
        # rows that see one key have dS = 0 too; Δ's rounding is the floor there
        tiles = tile_error(db, want, row_dim=-2, floor=4 * UNIT_ROUNDOFF[dtype] * delta_mag)
        TILE_ERRORS.append((name, dtype, tiles, None))
        assert tiles <= TILE_TOL[dtype], f"{name}: a tile of 64 rows errs by {tiles:.3g} of its norm"
    if theirs is not None:
        err_t = (db.double() - theirs.double()).abs().max().item()
        assert err_t <= REF_TOL[dtype] * mag, f"{name} vs torch: {err_t:.3g} > {REF_TOL[dtype]} * {mag:.3g}"


def _varlen_dropout_ref(q, k, v, do, lengths, max_q, max_k, p, seed_t, offset_t, mask_type, window, scale):
    """Varlen + dropout: sequence i is batch i of torch's draw with [max_q, max_k] offsets,
    element (n, m) at n * Mk_i + m of its (batch, head) stream."""
    cq, ck = np.cumsum([0] + list(lengths[0])), np.cumsum([0] + list(lengths[1]))
    h = q.shape[2]
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v))
    out = torch.zeros(q.shape[:3] + (v.shape[3],), device=DEV, dtype=torch.float64)
    lse = torch.full((len(lengths[0]), h, max_q), float("inf"), device=DEV, dtype=torch.float64)
    words_per_bh = max_q * max_k
    for i, (nq, nk) in enumerate(zip(*lengths)):
        sq, sk = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if nq == 0:
            continue
        mask = None
        if p > 0 and nk > 0:
            # the sequence's (batch i, head) stream, rows of nk keys: the twin of torch's draw
            full = mem_eff_dropout_keep_mask(
                int(seed_t), int(offset_t) + i * h * words_per_bh, 1, h, 1, words_per_bh, p
            )
            mask = full.view(1, h, words_per_bh)[..., : nq * nk].reshape(1, h, nq, nk).to(DEV)
        one = lambda x, s: x[:, s]  # noqa: E731
        o, l_ = attention_forward_ref(
            one(q, sq),
            one(k, sk),
            one(v, sk),
            custom_mask_type=mask_type,
            window_size=window,
            scale=scale,
            dropout_mask=mask,
            dropout_p=p,
        )
        g = attention_backward_ref(
            one(q, sq),
            one(k, sk),
            one(v, sk),
            one(do, sq),
            custom_mask_type=mask_type,
            window_size=window,
            scale=scale,
            dropout_mask=mask,
            dropout_p=p,
            out=o.to(q.dtype),
        )
        out[:, sq], lse[i, :, :nq] = o, l_[0]
        dq[:, sq], dk[:, sk], dv[:, sk] = g
    return (dq, dk, dv), out, lse


BIAS_KINDS = [
    ((2, 3, 100, 140), "dense"),
    ((1, 3, 100, 140), "dense"),  # broadcast over batch
    ((2, 1, 100, 140), "dense"),  # over heads
    ((100, 140), "dense"),  # over batch and heads
    ((2, 3, 1, 140), "dense"),  # over queries
    ((2, 3, 100, 1), "dense"),  # over keys (last stride 0: element path)
    ((2, 3, 100, 140), "padded"),  # unaligned strides: element path
    ((2, 3, 100, 140), "transposed"),
]


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape,layout", BIAS_KINDS, ids=[f"{'x'.join(map(str, s))}-{lay}" for s, lay in BIAS_KINDS])
def test_bias_and_grad_vs_reference(dtype, shape, layout):
    for grad in (False, True):
        run_feature_case(
            dtype, 2, 100, 140, 3, 64, 64, bias_shape=shape, bias_layout=layout, bias_grad=grad, mask_type=int(grad)
        )


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
def test_dropout_vs_reference(dtype):
    for p, mask_type, window, splits in ((0.1, 0, 0, None), (0.5, 1, 0, 2), (0.3, 2, 17, 1), (0.2, 1, 40, 3)):
        run_feature_case(dtype, 2, 130, 190, 2, 64, 48, dropout_p=p, mask_type=mask_type, window=window, splits=splits)


@pytest.mark.parametrize("head_dim", [32, 128, 256, 512])
def test_bias_grad_and_dropout_head_dims(head_dim):
    if torch.cuda.get_device_capability()[0] < 9 and head_dim > 384:
        pytest.skip("head dims above 384 need sm_90's shared memory")
    run_feature_case(
        BF16,
        2,
        90,
        150,
        2,
        head_dim,
        head_dim,
        bias_shape=(2, 1, 90, 150),
        bias_grad=True,
        dropout_p=0.2,
        mask_type=1,
        splits=2,
    )


def test_dropout_varlen():
    for splits in (1, 3):
        run_feature_case(
            F16,
            1,
            0,
            0,
            2,
            64,
            64,
            dropout_p=0.25,
            lengths=([70, 0, 129, 5], [90, 3, 200, 0]),
            mask_type=1,
            splits=splits,
        )


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_vs_torch_backward(dtype):
    """Same inputs, same philox seed / offset: same gradients to the usual tolerance."""
    run_feature_case(dtype, 2, 128, 256, 4, 64, 64, dropout_p=0.1, compare_torch=True)
    run_feature_case(dtype, 2, 128, 256, 4, 128, 128, dropout_p=0.3, mask_type=1, compare_torch=True)
    # bias requiring grad, broadcast over batch and over heads (torch gives the full shape: summed)
    run_feature_case(dtype, 2, 128, 256, 4, 64, 64, bias_shape=(1, 4, 128, 256), bias_grad=True, compare_torch=True)
    run_feature_case(
        dtype, 2, 128, 256, 4, 64, 64, bias_shape=(2, 1, 128, 256), bias_grad=True, dropout_p=0.1, compare_torch=True
    )


# ------------------------------------------------------------------------- torch faces


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_memory_efficient_attention_bias_dropout_autograd(dtype):
    """Training op: bias [H, Mq, Mk] requiring grad, dropout; against the math of the same mask."""
    b, h, mq, mk, d, p = 2, 3, 96, 120, 64, 0.2
    gen = torch.Generator(DEV).manual_seed(1)
    q, k, v = (torch.randn(b, m, h, d, device=DEV, dtype=dtype, generator=gen).requires_grad_() for m in (mq, mk, mk))
    bias = torch.randn(h, mq, mk, device=DEV, dtype=dtype, generator=gen).requires_grad_()
    do = torch.randn(b, mq, h, d, device=DEV, dtype=dtype, generator=gen)
    torch.manual_seed(7)
    out = ops.memory_efficient_attention(q, k, v, causal=True, attn_bias=bias, dropout_p=p)
    out.backward(do)
    # the forward's (seed, offset): the same generator state draws the same pair again
    torch.manual_seed(7)
    seed_t, offset_t = philox_state(b, h, mq, mk, p)
    mask = torch_keep_mask((b, h, mq, mk), p, int(seed_t), int(offset_t))
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=1, bias=bias, dropout_mask=mask, dropout_p=p, return_grad_bias=True
    )
    for name, got, want in (
        ("dq", q.grad, ref[0]),
        ("dk", k.grad, ref[1]),
        ("dv", v.grad, ref[2]),
        ("dbias", bias.grad, ref[3].sum(0)),
    ):
        check_grad(name, got, want, dtype)


def test_use_for_sdpa_with_bias_and_dropout(monkeypatch):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = []
    orig = SD.efficient_attention_backward
    monkeypatch.setattr(SD, "efficient_attention_backward", lambda *a, **k: calls.append(1) or orig(*a, **k))
    b, h, m, d = 2, 4, 80, 64
    gen = torch.Generator(DEV).manual_seed(3)
    x = [torch.randn(b, h, m, d, device=DEV, dtype=F16, generator=gen) for _ in range(3)]
    bias = torch.randn(1, h, m, m, device=DEV, dtype=F16, generator=gen)
    do = torch.randn(b, h, m, d, device=DEV, dtype=F16, generator=gen)
    grads = {}
    for label, on in (("torch", False), ("ours", True)):
        leaves = [t.clone().requires_grad_() for t in x] + [bias.clone().requires_grad_()]
        torch.manual_seed(11)  # the same philox state for both forwards
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa(enabled=on):
            F.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], dropout_p=0.1).backward(do)
        grads[label] = [t.grad for t in leaves]
    assert len(calls) == 1
    for name, a, t in zip(("dq", "dk", "dv", "dbias"), grads["ours"], grads["torch"]):
        assert a.shape == t.shape, name
        err = (a.double() - t.double()).abs().max().item()
        assert err <= 5e-3 * max(t.abs().max().item(), 1.0), f"{name}: ours vs torch {err:.3g}"


def test_mask_kernel_handles_empty_and_odd_shapes():
    assert M.mem_eff_dropout_mask((0, 2, 3, 4), 0.5, 1, 2).shape == (0, 2, 3, 4)
    got = M.mem_eff_dropout_mask((1, 1, 3, 7), 0.5, 5, 1)
    assert torch.equal(got.cpu(), mem_eff_dropout_keep_mask(5, 1, 1, 1, 3, 7, 0.5))
    assert math.isclose(M.mem_eff_dropout_mask((4, 4, 64, 64), 0.3, 9, 0).float().mean().item(), 0.7, abs_tol=0.03)
