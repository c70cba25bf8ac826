"""The workloads of ``python -m benchmarks.sanitize``: every kernel configuration of the GPU
test matrix (tests/*_gpu.py), at sizes small enough for compute-sanitizer's racecheck.

Each configuration builds small random CUDA inputs and calls the public op(s) once; the
worker synchronizes after it. Sizes are ragged (not multiples of the tiles) so that the
predicated edges run. Configurations are grouped: one sanitizer process runs a whole
group, so a group should share start-up and compiles and finish in about the same time
as the others (the attention family is split over three groups because its compiles
dominate).

Every workload also runs under ``FakeTensorMode`` on a machine without a GPU (the CPU
tests do that), which checks the calls against the ops' signatures and validation; so
workloads avoid data-dependent host reads (``.item()``, ``.tolist()``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

DEV = "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

FAMILIES = ("dropout_bias", "norm", "attn_prepost", "mem_eff_attention", "attention_sm90")
CANARY = "canary"


@dataclass(frozen=True)
class Config:
    """One kernel configuration: ``run()`` builds its inputs and calls the op(s) once."""

    name: str  # "family/variant"
    group: str  # configurations of one group share a sanitizer process
    run: Callable[[], None]
    tools: Optional[Tuple[str, ...]] = None  # only these tools (None: every tool)
    expect_errors: bool = False  # a positive control: the tool must report errors here
    gpu_only: bool = False  # cannot run under FakeTensorMode (compiles for the device)
    arch: Optional[str] = None  # runs only on a device of this arch (None: any)

    @property
    def family(self) -> str:
        return self.name.split("/", 1)[0]


def _seed(name: str) -> None:
    torch.manual_seed(zlib.crc32(name.encode()))


def _randn(*shape, dtype=BF16):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def _cu_seqlens(lengths):
    """int32 [len + 1] offsets, built on the host (no device reads)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=DEV)


# ------------------------------------------------------------------------ dropout + bias


def _dropout(rows, n, dtype, activation=None, p=0.1, mask_dtype=torch.bool, bias_dtype=None):
    import ops

    dy = _randn(rows, n, dtype=dtype)
    mask = (torch.rand(rows, n, device=DEV) >= p).to(mask_dtype)
    x = bias = None
    if activation is not None:
        x = _randn(rows, n, dtype=dtype)
        bias = _randn(n, dtype=dtype)
    elif bias_dtype is not None:
        bias = torch.zeros(n, device=DEV, dtype=bias_dtype)  # sets grad_bias's dtype
    ops.dropout_bias_backward(dy, mask, p, x, bias, activation)


def _dropout_strided_views():
    """Row-strided views whose starts break 16-byte alignment: narrower vectors."""
    import ops

    base = _randn(64, 1030, dtype=F16)
    mbase = torch.rand(64, 1030, device=DEV) > 0.3
    for start, n in ((1, 1024), (2, 1024), (3, 1027)):
        ops.dropout_bias_backward(base.narrow(1, start, n), mbase.narrow(1, start, n), 0.3)


def _dropout_leading_dims():
    import ops

    dy = _randn(2, 3, 5, 40)
    mask = torch.rand(2, 3, 5, 40, device=DEV) > 0.2
    ops.dropout_bias_backward(dy, mask, 0.2)


def _dropout_configs():
    g = "dropout_bias"
    c = []

    def add(variant, fn):
        c.append(Config(f"dropout_bias/{variant}", g, fn))

    add("fp32-1x1", lambda: _dropout(1, 1, F32))
    add("bf16-257x1000", lambda: _dropout(257, 1000, BF16))
    add("fp16-33x100-relu", lambda: _dropout(33, 100, F16, "relu", p=0.25))
    add("bf16-129x1024-gelu", lambda: _dropout(129, 1024, BF16, "gelu", p=0.25))
    add("fp32-7x13-gelu_erf", lambda: _dropout(7, 13, F32, "gelu_erf", p=0.25))
    add("bf16-3x12288", lambda: _dropout(3, 12288, BF16))
    add("bf16-20001x24", lambda: _dropout(20001, 24, BF16))
    add("fp16-300x520-uint8mask-p0.5", lambda: _dropout(300, 520, F16, p=0.5, mask_dtype=torch.uint8))
    add("bf16-513x256-fp32bias", lambda: _dropout(513, 256, BF16, bias_dtype=F32))
    add("fp16-64x1024-misaligned-views", _dropout_strided_views)
    add("bf16-2x3x5x40-leading-dims", _dropout_leading_dims)
    return c


# -------------------------------------------------------------------- LayerNorm / RMSNorm


def _norm(rows, n, dtype, w_dtype, has_w=True, has_b=True, rms=False, dz_dtype=None, view=None):
    import ops

    x = (_randn(rows, n, dtype=F32) * 2 + 0.5).to(dtype)
    dz = _randn(rows, n, dtype=F32).to(dz_dtype or dtype)
    if view is not None:  # row-strided views at odd starts (narrower vectors): (x start, dz start, N)
        x, dz = x.narrow(1, view[0], view[2]), dz.narrow(1, view[1], view[2])
        n = view[2]
    w = _randn(n, dtype=F32).to(w_dtype) if has_w else None
    b = _randn(n, dtype=F32).to(w_dtype) if has_b else None
    x32 = x.float()
    if rms:
        rstd = torch.rsqrt(x32.square().mean(-1) + 1e-5)
        ops.rms_norm_backward(dz, x, w, rstd)
    else:
        var, mean = torch.var_mean(x32, -1, correction=0)
        rstd = torch.rsqrt(var + 1e-5)
        ops.layer_norm_backward(dz, x, w, mean, rstd, b)


def _norm_forward(rows, n, dtype, w_dtype, b_dtype=None, rms=False, view=None):
    """The forward kernel alone (no grad), through the public ops."""
    import ops

    x = (_randn(rows, n, dtype=F32) * 2 + 0.5).to(dtype)
    if view is not None:  # a row-strided view at an odd start (narrower vectors): (start, N)
        x = x.narrow(1, view[0], view[1])
        n = view[1]
    w = None if w_dtype is None else _randn(n, dtype=F32).to(w_dtype)
    b = None if b_dtype is None else _randn(n, dtype=F32).to(b_dtype)
    with torch.no_grad():
        if rms:
            ops.rms_norm(x, n, w, 1e-5)
        else:
            ops.layer_norm(x, n, w, b, 1e-5)


def _dropout_add_norm(rows, n, dtype, res_dtype, w_dtype, xb_dtype=None, rms=False, p=0.1, prenorm=True):
    """The fused dropout + add + norm, forward and backward, through the public op (the autograd
    engine wants a device: not under fake tensors)."""
    import ops

    x = _randn(rows, n, dtype=dtype).requires_grad_()
    res = None if res_dtype is None else _randn(rows, n, dtype=res_dtype).requires_grad_()
    w = _randn(n, dtype=w_dtype).requires_grad_()
    b = None if rms else _randn(n, dtype=w_dtype).requires_grad_()
    xb = None if xb_dtype is None else _randn(n, dtype=xb_dtype).requires_grad_()
    fn = ops.dropout_add_rms_norm if rms else ops.dropout_add_layer_norm
    out = fn(x, res, w, b, p, 1e-5, x_bias=xb, prenorm=prenorm)
    y, r = out if prenorm else (out, None)
    (y.float().sum() + (r.float().sum() if prenorm else 0)).backward()


def _norm_configs():
    g = "norm"
    c = []

    def add(variant, fn, **kw):
        c.append(Config(f"norm/{variant}", g, fn, **kw))

    add("ln-bf16-301x7", lambda: _norm(301, 7, BF16, F32))
    add("ln-fp32-301x1000", lambda: _norm(301, 1000, F32, F32))
    add("ln-fp16-131x1000-no-bias", lambda: _norm(131, 1000, F16, F16, has_b=False))
    add("ln-bf16-129x4096-no-weight", lambda: _norm(129, 4096, BF16, BF16, has_w=False))
    add("ln-bf16-37x16384-cluster2", lambda: _norm(37, 16384, BF16, F32))
    add("ln-bf16-5x65536-cluster8", lambda: _norm(5, 65536, BF16, F32))
    add("ln-fp32-3x65536-cluster8-no-bias", lambda: _norm(3, 65536, F32, F32, has_b=False))
    add("rms-bf16-301x1000", lambda: _norm(301, 1000, BF16, BF16, has_b=False, rms=True))
    add("rms-fp32-37x4096", lambda: _norm(37, 4096, F32, F32, has_b=False, rms=True))
    add("rms-bf16-3x65536-cluster8", lambda: _norm(3, 65536, BF16, BF16, has_b=False, rms=True))
    add("ln-fp32x-bf16dz-77x2048", lambda: _norm(77, 2048, F32, BF16, dz_dtype=BF16))
    add("ln-bf16-64x1024-misaligned-views", lambda: _norm(64, 1030, BF16, F32, view=(3, 2, 1024)))
    add("fwd-ln-bf16-301x7", lambda: _norm_forward(301, 7, BF16, F32, F32))
    add("fwd-ln-fp32-301x1000", lambda: _norm_forward(301, 1000, F32, F32, F32))
    add("fwd-ln-fp16-129x4096-no-weight", lambda: _norm_forward(129, 4096, F16, None, F16))
    add("fwd-rms-bf16-301x1000", lambda: _norm_forward(301, 1000, BF16, BF16, rms=True))
    add("fwd-ln-bf16-37x16384-cluster2", lambda: _norm_forward(37, 16384, BF16, F32, F32))
    add("fwd-ln-bf16-5x65536-cluster8", lambda: _norm_forward(5, 65536, BF16, F32, F32))
    add("fwd-rms-fp32-3x131072-cluster8", lambda: _norm_forward(3, 131072, F32, F32, rms=True))
    add("fwd-ln-bf16-64x1024-misaligned-view", lambda: _norm_forward(64, 1030, BF16, F32, F32, view=(3, 1024)))
    add("dan-ln-bf16-301x1000-xbias", lambda: _dropout_add_norm(301, 1000, BF16, BF16, F32, BF16), gpu_only=True)
    add(
        "dan-rms-fp32-37x777-no-residual",
        lambda: _dropout_add_norm(37, 777, F32, None, F32, F32, rms=True),
        gpu_only=True,
    )
    add(
        "dan-ln-bf16-37x16384-cluster2",
        lambda: _dropout_add_norm(37, 16384, BF16, F32, BF16, prenorm=False),
        gpu_only=True,
    )
    return c


# --------------------------------------------------------- attention backward pre / post


def _prepost_preprocess(dtype, d, b, s, h, layout="bshd", zero_dq_accum=False, scale=1.0):
    import ops

    def seq():
        if layout == "bshd":
            return _randn(b, s, h, d, dtype=dtype)
        return _randn(b, h, s, d, dtype=dtype).transpose(1, 2)

    ops.attention_bwd_preprocess(seq(), seq(), scale=scale, zero_dq_accum=zero_dq_accum)


def _packed(total, h, d, dtype, offset=0):
    """[total, H, D] starting ``offset`` elements into a buffer (odd offsets misalign it)."""
    flat = _randn(offset + total * h * d, dtype=dtype)
    return flat.narrow(0, offset, total * h * d).view(total, h, d)


def _prepost_preprocess_varlen(dtype, d, lengths, h=3, zero_dq_accum=False, offset=0, slack=0):
    import ops

    total = sum(lengths)
    out, grad_out = _packed(total, h, d, dtype, offset), _packed(total, h, d, dtype, offset)
    ops.attention_bwd_preprocess(
        out,
        grad_out,
        scale=0.75,
        cu_seqlens_q=_cu_seqlens(lengths),
        max_seqlen_q=max(lengths) + slack,
        zero_dq_accum=zero_dq_accum,
    )


def _prepost_odd_row_slice():
    """base[1:] of a packed tensor whose rows (H x D = 99 elements) are odd-sized."""
    import ops

    base, gbase = _randn(301, 3, 33, dtype=F16), _randn(301, 3, 33, dtype=F16)
    lengths = [100, 0, 1, 199]
    out, grad_out = base.narrow(0, 1, 300), gbase.narrow(0, 1, 300)
    ops.attention_bwd_preprocess(out, grad_out, cu_seqlens_q=_cu_seqlens(lengths), max_seqlen_q=199)


def _prepost_compute_delta(dtype, d, b, s, h, layout="bhsd"):
    import ops

    def seq():
        if layout == "bshd":
            return _randn(b, s, h, d, dtype=dtype)
        return _randn(b, h, s, d, dtype=dtype).transpose(1, 2)

    ops.attention_bwd_compute_delta(seq(), seq())


def _prepost_compute_delta_varlen(dtype, d, lengths, h=2, offset=0):
    import ops

    total = sum(lengths)
    out, grad_out = _packed(total, h, d, dtype, offset), _packed(total, h, d, dtype, offset)
    ops.attention_bwd_compute_delta(out, grad_out, cu_seqlens_q=_cu_seqlens(lengths), max_seqlen_q=max(lengths) + 3)


def _prepost_convert_dq(dtype, d, b, s, h):
    import ops
    from ops import attention_bwd_prepost as A

    for nsplits in (None, 1, 4):
        acc = torch.randn(A.dq_accum_shape(b, s, h, d, nsplits=nsplits), device=DEV)
        ops.attention_bwd_convert_dq(acc, d**-0.5, head_dim=d, seqlen_q=s, p_dropout=0.1, dtype=dtype)


def _prepost_convert_dq_varlen(dtype, d, lengths, h=3):
    import ops
    from ops import attention_bwd_prepost as A

    cu = _cu_seqlens(lengths)
    for nsplits in (None, 3):
        acc = torch.randn(A.dq_accum_shape(len(lengths), sum(lengths), h, d, varlen=True, nsplits=nsplits), device=DEV)
        ops.attention_bwd_convert_dq(
            acc, 0.1, head_dim=d, cu_seqlens_q=cu, max_seqlen_q=max(lengths), p_dropout=0.2, dtype=dtype
        )


def _prepost_convert_dkv(dtype, d, b, s, h):
    import ops
    from ops import attention_bwd_prepost as A

    dk, dv = (torch.randn(A.dkv_accum_shape(b, h, s, d), device=DEV) for _ in range(2))
    ops.attention_bwd_convert_dkv(dk, dv, d**-0.5, head_dim=d, seqlen_k=s, p_dropout=0.2, dtype=dtype)


def _prepost_convert_dkv_varlen(dtype, d, lengths, h=2):
    import ops
    from ops import attention_bwd_prepost as A

    dk, dv = (torch.randn(A.dkv_accum_shape(len(lengths), h, max(lengths), d), device=DEV) for _ in range(2))
    ops.attention_bwd_convert_dkv(
        dk, dv, 0.3, head_dim=d, seqlen_k=sum(lengths), cu_seqlens_k=_cu_seqlens(lengths), p_dropout=0.1, dtype=dtype
    )


def _prepost_clear_dkv_accum(d):
    import ops
    from ops import attention_bwd_prepost as A

    shape = A.dkv_accum_shape(2, 3, 77, d)
    ops.attention_bwd_clear_dkv_accum(torch.empty(shape, device=DEV), torch.empty(shape, device=DEV))
    # views into larger buffers: only the first 256 rows are cleared
    big_k, big_v = (torch.empty(2, 3, 384, d, device=DEV) for _ in range(2))
    ops.attention_bwd_clear_dkv_accum(big_k.narrow(2, 0, 256), big_v.narrow(2, 0, 256))


def _prepost_configs():
    g = "attn_prepost"
    c = []

    def add(variant, fn):
        c.append(Config(f"attn_prepost/{variant}", g, fn))

    lengths = [77, 0, 200]
    add("preprocess-bf16-d128-2x77x3", lambda: _prepost_preprocess(BF16, 128, 2, 77, 3, scale=0.9))
    add("preprocess-bf16-d1-1x1x1", lambda: _prepost_preprocess(BF16, 1, 1, 1, 1))
    add("preprocess-fp32-d33-bhsd", lambda: _prepost_preprocess(F32, 33, 3, 200, 2, layout="bhsd"))
    add(
        "preprocess-zero-dq-bf16-d64-bhsd", lambda: _prepost_preprocess(BF16, 64, 2, 200, 3, "bhsd", zero_dq_accum=True)
    )
    add("preprocess-zero-dq-bf16-d256", lambda: _prepost_preprocess(BF16, 256, 1, 130, 2, zero_dq_accum=True))
    add("preprocess-varlen-fp16-d40", lambda: _prepost_preprocess_varlen(F16, 40, lengths, slack=130))
    add(
        "preprocess-varlen-zero-dq-bf16-d33",
        lambda: _prepost_preprocess_varlen(BF16, 33, [100, 0, 150], zero_dq_accum=True),
    )
    add("preprocess-varlen-bf16-d64-misaligned", lambda: _prepost_preprocess_varlen(BF16, 64, lengths, h=2, offset=1))
    add("preprocess-varlen-fp16-d33-odd-row-slice", _prepost_odd_row_slice)
    add("compute_delta-bf16-d255-bhsd", lambda: _prepost_compute_delta(BF16, 255, 2, 77, 3))
    add("compute_delta-fp32-d100", lambda: _prepost_compute_delta(F32, 100, 1, 200, 2, layout="bshd"))
    add("compute_delta-varlen-bf16-d64-misaligned", lambda: _prepost_compute_delta_varlen(BF16, 64, lengths, offset=2))
    add("convert_dq-bf16-d128-nsplits", lambda: _prepost_convert_dq(BF16, 128, 2, 77, 3))
    add("convert_dq-fp16-d72-nsplits", lambda: _prepost_convert_dq(F16, 72, 3, 200, 2))
    add("convert_dq-varlen-bf16-d40-nsplits", lambda: _prepost_convert_dq_varlen(BF16, 40, lengths))
    add("convert_dkv-bf16-d96", lambda: _prepost_convert_dkv(BF16, 96, 2, 77, 3))
    add("convert_dkv-fp16-d255", lambda: _prepost_convert_dkv(F16, 255, 1, 200, 2))
    add("convert_dkv-varlen-fp16-d33", lambda: _prepost_convert_dkv_varlen(F16, 33, lengths))
    add("clear_dkv_accum-d96", lambda: _prepost_clear_dkv_accum(96))
    add("clear_dkv_accum-d256", lambda: _prepost_clear_dkv_accum(256))
    return c


# ------------------------------------------------------- memory-efficient attention bwd

LSE_ALIGN = 32  # torch pads logsumexp's query dim to this


def _dense_forward(q, k, v, mask, window, max_q):
    """(out, logsumexp) of masked softmax attention in fp32 torch ops, logsumexp padded as
    torch's forward pads it ([B, H, round_up(Mq, 32)], +inf past Mq, 0 on rows without keys)."""
    from ops.reference import attention_mask_ref

    s = torch.einsum("bnhk,bmhk->bhnm", q.float(), k.float()) * q.shape[-1] ** -0.5
    keep = attention_mask_ref(q.shape[1], k.shape[1], mask, window, device=q.device)
    drop = torch.logical_not(keep)  # (~ on a fake CUDA tensor fails in CPU-only torch)
    s = s.masked_fill(drop, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(drop, 0.0)
    out = torch.einsum("bhnm,bmhd->bnhd", p, v.float()).to(q.dtype)
    pad = -(-max_q // LSE_ALIGN) * LSE_ALIGN - lse.shape[-1]
    return out, torch.cat([lse, torch.full(lse.shape[:-1] + (pad,), float("inf"), device=q.device)], dim=-1)


def _mea(dtype, b, mq, mk, h, kd, kv, *, mask=0, window=0, lengths=None, splits=1, layout="bmhk", math_forward=False):
    """One ``ops.efficient_attention_backward`` on the out / logsumexp of torch's forward
    (``aten._efficient_attention_forward``), or of a torch-math forward (``math_forward``)
    where torch 2.11's kernel masks wrongly (bottom-right causal with more queries than keys)."""
    import ops

    if lengths is not None:
        b, mq, mk = 1, sum(lengths[0]), sum(lengths[1])
    if layout == "packed":
        q, k, v = _randn(b, mq, 3, h, kd, dtype=dtype).unbind(2)
    elif layout == "bhmk":
        q, k, v = (_randn(b, h, m, d, dtype=dtype).transpose(1, 2) for m, d in ((mq, kd), (mk, kd), (mk, kv)))
    else:
        q, k, v = (
            _randn(b, mq, h, kd, dtype=dtype),
            _randn(b, mk, h, kd, dtype=dtype),
            _randn(b, mk, h, kv, dtype=dtype),
        )
    do = _randn(b, mq, h, kv, dtype=dtype)
    cq = ck = None
    max_q, max_k = mq, mk
    if lengths is not None:
        cq, ck = _cu_seqlens(lengths[0]), _cu_seqlens(lengths[1])
        max_q, max_k = max(max(lengths[0]), 1), max(max(lengths[1]), 1)
    win = window or None
    if math_forward:
        out, lse = _dense_forward(q, k, v, mask, window, max_q)
        seed = offset = torch.empty((), dtype=torch.int64)
    else:
        varlen = cq is not None
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q,
            k,
            v,
            None,
            cq,
            ck,
            max_q if varlen else None,
            max_k if varlen else None,
            0.0,
            mask,
            True,
            window_size=win,
        )
    ops.efficient_attention_backward(
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
        seed,
        offset,
        mask,
        False,
        num_splits_key=splits,
        window_size=win,
        backend="mem_eff",
    )


def _mea_configs():
    c = []

    def add(group, variant, fn):
        c.append(Config(f"mem_eff_attention/{variant}", f"mem_eff_attention_{group}", fn))

    varlen_a = ([77, 0, 130, 1], [77, 5, 120, 1])  # an empty query sequence, single rows
    varlen_b = ([1, 130, 3], [0, 130, 64])  # an empty key sequence: its query row sees nothing
    # head dims and dtypes (a: d64 / d128 / Dqk != Dv)
    add("a", "bf16-d64-2x100x257-nomask", lambda: _mea(BF16, 2, 100, 257, 2, 64, 64))
    add("a", "fp16-d64-1x150x150-causal_tl", lambda: _mea(F16, 1, 150, 150, 2, 64, 64, mask=1))
    add("a", "bf16-d128-1x77x200-causal_br", lambda: _mea(BF16, 1, 77, 200, 2, 128, 128, mask=2))
    add("a", "bf16-k128v64-1x100x257", lambda: _mea(BF16, 1, 100, 257, 2, 128, 64))
    add("a", "fp16-k32v96-1x77x130-causal_tl", lambda: _mea(F16, 1, 77, 130, 2, 32, 96, mask=1))
    # d256, masks past the keys, windows, layouts (b)
    add("b", "fp16-d256-1x130x130-causal_tl", lambda: _mea(F16, 1, 130, 130, 2, 256, 256, mask=1))
    add("b", "bf16-d256-1x70x100-nomask", lambda: _mea(BF16, 1, 70, 100, 2, 256, 256))
    add(
        "b", "fp16-d64-1x200x130-causal_br-q_gt_k", lambda: _mea(F16, 1, 200, 130, 2, 64, 64, mask=2, math_forward=True)
    )
    add("b", "bf16-d64-1x257x257-window16_tl", lambda: _mea(BF16, 1, 257, 257, 2, 64, 64, mask=1, window=16))
    add("b", "fp16-d64-1x100x300-window16_br", lambda: _mea(F16, 1, 100, 300, 2, 64, 64, mask=2, window=16))
    add("b", "bf16-d64-2x130x130-packed-qkv", lambda: _mea(BF16, 2, 130, 130, 2, 64, 64, mask=1, layout="packed"))
    add("b", "fp16-k64v32-1x50x130-bhmk-causal_br", lambda: _mea(F16, 1, 50, 130, 2, 64, 32, mask=2, layout="bhmk"))
    # variable lengths and split keys (c)
    add("c", "fp16-d64-varlen-causal_tl", lambda: _mea(F16, 1, 0, 0, 2, 64, 64, mask=1, lengths=varlen_a))
    add(
        "c", "bf16-d128-varlen-window8_br", lambda: _mea(BF16, 1, 0, 0, 2, 128, 128, mask=2, window=8, lengths=varlen_b)
    )
    varlen_c = ([77, 0, 150, 1], [77, 5, 300, 1])  # a sequence of 3 key blocks: room for 2 splits
    add(
        "c",
        "bf16-d64-varlen-causal_tl-splits2",
        lambda: _mea(BF16, 1, 0, 0, 2, 64, 64, mask=1, lengths=varlen_c, splits=2),
    )
    add("c", "bf16-d64-2x300x300-causal_tl-splits2", lambda: _mea(BF16, 2, 300, 300, 2, 64, 64, mask=1, splits=2))
    add("c", "bf16-d128-1x200x300-nomask-splits2", lambda: _mea(BF16, 1, 200, 300, 2, 128, 128, splits=2))
    add("c", "fp16-d64-1x130x257-auto-splits", lambda: _mea(F16, 1, 130, 257, 2, 64, 64, mask=1, splits=None))
    # fp32: the SIMT path (d)
    add("d", "fp32-d64-1x100x257-causal_tl", lambda: _mea(F32, 1, 100, 257, 2, 64, 64, mask=1))
    add("d", "fp32-k128v96-1x130x77-nomask-splits2", lambda: _mea(F32, 1, 130, 77, 2, 128, 96, splits=2))
    add("d", "fp32-d256-1x70x100-window16_br", lambda: _mea(F32, 1, 70, 100, 2, 256, 256, mask=2, window=16))
    add("d", "fp32-d64-varlen-causal_tl", lambda: _mea(F32, 1, 0, 0, 2, 64, 64, mask=1, lengths=varlen_a))
    return c


# --------------------------------------------------------- Hopper attention backward (sm90)


def _sm90(
    dtype, b, mq, mk, h, hk, kd, kv, *, mask=0, window=0, lengths=None, deterministic=False, bias=False, dropout=0.0
):
    """One ``ops.efficient_attention_backward(backend="sm90")`` on the out / logsumexp (and
    Philox state) of torch's forward; ``hk`` key / value heads (the forward sees them repeated),
    ``bias``: a [B, H, Mq, Mk] bias whose gradient is asked for."""
    import ops

    if lengths is not None:
        b, mq, mk = 1, sum(lengths[0]), sum(lengths[1])
    q, do = _randn(b, mq, h, kd, dtype=dtype), _randn(b, mq, h, kv, dtype=dtype)
    k, v = _randn(b, mk, hk, kd, dtype=dtype), _randn(b, mk, hk, kv, dtype=dtype)
    cq = ck = None
    max_q, max_k = mq, mk
    if lengths is not None:
        cq, ck = _cu_seqlens(lengths[0]), _cu_seqlens(lengths[1])
        max_q, max_k = max(max(lengths[0]), 1), max(max(lengths[1]), 1)
    attn_bias = _randn(b, h, mq, mk, dtype=dtype) if bias else None
    varlen = cq is not None
    group = h // hk
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q,
        k.repeat_interleave(group, 2),
        v.repeat_interleave(group, 2),
        attn_bias,
        cq,
        ck,
        max_q if varlen else None,
        max_k if varlen else None,
        dropout,
        mask,
        True,
        window_size=window or None,
    )
    ops.efficient_attention_backward(
        do,
        q,
        k,
        v,
        attn_bias,
        out,
        cq,
        ck,
        max_q,
        max_k,
        lse,
        dropout,
        seed,
        offset,
        mask,
        bias,
        window_size=window or None,
        deterministic=deterministic,
        backend="sm90",
    )


def _sm90_configs():
    c = []

    def add(group, variant, fn):
        c.append(Config(f"attention_sm90/{variant}", f"attention_sm90_{group}", fn, arch="sm_90a"))

    # the schedules: persistent d64 (with and without carried dQ), the heavy-first counter, a CTA
    # per tile with convert_dq overlapped (d128 / d96 / d192), deterministic turns (a)
    add("a", "bf16-d64-2x100x257-nomask-carry", lambda: _sm90(BF16, 2, 100, 257, 2, 2, 64, 64))
    add("a", "fp16-d64-1x300x300-causal_tl", lambda: _sm90(F16, 1, 300, 300, 2, 2, 64, 64, mask=1))
    add("a", "bf16-d128-1x300x400-nomask-overlap", lambda: _sm90(BF16, 1, 300, 400, 2, 2, 128, 128))
    add("a", "bf16-d96-2x130x257-gqa-overlap", lambda: _sm90(BF16, 2, 130, 257, 4, 2, 96, 96))
    add(
        "a",
        "bf16-d128-1x200x260-causal_tl-deterministic",
        lambda: _sm90(BF16, 1, 200, 260, 2, 1, 128, 128, mask=1, deterministic=True),
    )
    # d128's partial last query block on narrower products (81 rows: one past a block; 300 and
    # 200 rows above take 64 and 48)
    add("a", "bf16-d128-2x81x300-gqa-tail16", lambda: _sm90(BF16, 2, 81, 300, 4, 2, 128, 128))
    # wide tiles, Dqk != Dv, windows, variable lengths, bias + gradient + dropout (b)
    add("b", "bf16-d192-1x100x130-nomask-overlap", lambda: _sm90(BF16, 1, 100, 130, 2, 2, 192, 192))
    add("b", "fp16-d256-1x130x257-causal_br", lambda: _sm90(F16, 1, 130, 257, 2, 2, 256, 256, mask=2))
    add("b", "bf16-k128v64-1x100x257-causal_br", lambda: _sm90(BF16, 1, 100, 257, 2, 2, 128, 64, mask=2))
    add("b", "bf16-d64-1x257x257-window16_tl", lambda: _sm90(BF16, 1, 257, 257, 2, 2, 64, 64, mask=1, window=16))
    add(
        "b",
        "fp16-d128-varlen-causal_tl",
        lambda: _sm90(F16, 1, 0, 0, 2, 2, 128, 128, mask=1, lengths=([77, 0, 130, 1], [77, 5, 120, 1])),
    )
    add(
        "b",
        "bf16-d128-1x130x200-bias_grad-dropout",
        lambda: _sm90(BF16, 1, 130, 200, 2, 2, 128, 128, bias=True, dropout=0.1),
    )
    return c


# ------------------------------------------------------------ Hopper attention forward (sm90)


def _sm90_fwd(dtype, b, mq, mk, h, hk, d, dv, *, mask=0, window=0, lengths=None, bias=None, dropout=0.0, face=False):
    """One forward of ``ops.memory_efficient_attention`` (no grad), whose forward is ours
    (``ops.attention_fwd_sm90``; asserted on real tensors, so the tool never sanitizes torch's
    instead). ``hk`` key / value heads; ``bias`` = (shape, "dense" | "padded"): broadcastable to
    [B, H, Mq, Mk], "padded" rows of a wider buffer (strides not multiples of 8; the op would pad
    them, which FakeTensorMode cannot on a CPU-only build: op workloads keep Mk a multiple of 16).
    ``face``: the kernel's torch face itself (``attention_forward_sm90``), which reads the bias with
    the strides it is given."""
    import ops
    from ops import _compile as cc
    from ops import attention_fwd_sm90 as fwd

    if lengths is not None:
        b, mq, mk = 1, sum(lengths[0]), sum(lengths[1])
    q = _randn(b, mq, h, d, dtype=dtype)
    k, v = _randn(b, mk, hk, d, dtype=dtype), _randn(b, mk, hk, dv, dtype=dtype)
    cq = ck = max_q = max_k = None
    if lengths is not None:
        cq, ck = _cu_seqlens(lengths[0]), _cu_seqlens(lengths[1])
        max_q, max_k = max(max(lengths[0]), 1), max(max(lengths[1]), 1)
    attn_bias = None
    if bias is not None:
        shape, layout = bias
        if layout == "padded":
            attn_bias = _randn(*shape[:-1], shape[-1] + 3, dtype=dtype).narrow(-1, 0, shape[-1])
        else:
            attn_bias = _randn(*shape, dtype=dtype)
    real = not cc.is_fake_tensor(q)
    why = fwd.unsupported(q, k, v, mask_type=mask, bias=attn_bias, dropout_p=dropout, arch=None if real else "sm_90a")
    assert why is None, f"the Hopper forward does not take this workload: {why}"
    if face:  # (fake tensors: the check above is the call's validation; the face compiles for a device)
        if not real:
            return
        seed = offset = None
        if dropout > 0.0:
            seed, offset = fwd.philox_state(q.device, fwd.dropout_words(q, k, cq, max_q, max_k))
        fwd.attention_forward_sm90(q, k, v, None, mask, window, cq, ck, max_q, max_k, attn_bias, dropout, seed, offset)
        return
    with torch.no_grad():
        ops.memory_efficient_attention(
            q,
            k,
            v,
            causal={0: False, 1: True, 2: "bottom_right"}[mask],
            window_size=window or None,
            cu_seqlens_q=cq,
            cu_seqlens_k=ck,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            attn_bias=attn_bias,
            dropout_p=dropout,
            return_lse=True,
        )


def _sm90_fwd_configs():
    c = []

    def add(group, variant, fn):
        c.append(Config(f"attention_sm90/fwd-{variant}", f"attention_sm90_fwd_{group}", fn, arch="sm_90a"))

    # every head-dim pair once, the masks, grouped- / multi-query heads, windows (a)
    add("a", "bf16-d64-2x100x257-nomask", lambda: _sm90_fwd(BF16, 2, 100, 257, 2, 2, 64, 64))
    add("a", "fp16-d96-1x130x200-causal_tl-gqa", lambda: _sm90_fwd(F16, 1, 130, 200, 4, 2, 96, 96, mask=1))
    add("a", "bf16-d128-2x81x300-causal_br-mqa", lambda: _sm90_fwd(BF16, 2, 81, 300, 4, 1, 128, 128, mask=2))
    add("a", "fp16-d192-1x130x100-nomask", lambda: _sm90_fwd(F16, 1, 130, 100, 2, 2, 192, 192))
    add(
        "a",
        "bf16-k192v128-1x100x257-causal_br-gqa",
        lambda: _sm90_fwd(BF16, 1, 100, 257, 4, 2, 192, 128, mask=2),
    )
    add("a", "fp16-d256-1x70x130-causal_tl", lambda: _sm90_fwd(F16, 1, 70, 130, 2, 2, 256, 256, mask=1))
    add(
        "a",
        "bf16-d192-1x200x200-window16_tl",
        lambda: _sm90_fwd(BF16, 1, 200, 200, 2, 2, 192, 192, mask=1, window=16),
    )
    add(
        "a",
        "fp16-d256-1x130x257-window32_br-gqa",
        lambda: _sm90_fwd(F16, 1, 130, 257, 4, 2, 256, 256, mask=2, window=32),
    )
    # bias (broadcast, odd strides), dropout, variable lengths with empty and one-row sequences (b)
    add(
        "b",
        "bf16-d64-2x100x160-causal_tl-bias-bcast",
        lambda: _sm90_fwd(BF16, 2, 100, 160, 2, 2, 64, 64, mask=1, bias=((1, 2, 100, 160), "dense")),
    )
    add(
        "b",
        "fp16-d128-1x130x200-bias-padded-face",
        lambda: _sm90_fwd(F16, 1, 130, 200, 2, 1, 128, 128, bias=((130, 200), "padded"), face=True),
    )
    add(
        "b",
        "bf16-d128-1x130x257-causal_tl-dropout",
        lambda: _sm90_fwd(BF16, 1, 130, 257, 2, 2, 128, 128, mask=1, dropout=0.2),
    )
    add("b", "fp16-d256-1x70x130-dropout", lambda: _sm90_fwd(F16, 1, 70, 130, 2, 2, 256, 256, dropout=0.3))
    add(
        "b",
        "bf16-d64-2x100x160-causal_br-bias-dropout",
        lambda: _sm90_fwd(BF16, 2, 100, 160, 2, 2, 64, 64, mask=2, bias=((2, 1, 100, 160), "dense"), dropout=0.2),
    )
    add(
        "b",
        "fp16-d128-varlen-causal_tl-gqa",
        lambda: _sm90_fwd(F16, 1, 0, 0, 4, 2, 128, 128, mask=1, lengths=([77, 0, 130, 1], [77, 5, 120, 1])),
    )
    add(
        "b",
        "bf16-d96-varlen-empty_keys-dropout",
        lambda: _sm90_fwd(BF16, 1, 0, 0, 2, 2, 96, 96, lengths=([1, 130, 3], [0, 130, 64]), dropout=0.2),
    )
    add(
        "b",
        "fp16-k192v128-varlen-window8_br-mqa-dropout",
        lambda: _sm90_fwd(
            F16, 1, 0, 0, 4, 1, 192, 128, mask=2, window=8, lengths=([50, 0, 129, 1], [64, 3, 200, 1]), dropout=0.1
        ),
    )
    return c


# ------------------------------------------------------------------ positive controls


def _canary(kind: str):
    """A tiny kernel with a planted bug: 'oob' writes just past a 1 KiB allocation
    (memcheck must report it), 'race' reads a shared-memory slot another warp writes
    with no barrier between (racecheck must report it). Proves that the kernel filter
    matches DSL kernels and that the tool sees them."""
    import cutlass
    import cutlass.cute as cute

    from ops import _compile as cc

    from .sanitize_canary import Canary

    fn = cc.compile_kernel(
        Canary(kind),
        cc.fake_tensor(cutlass.Float32, (cute.sym_int(),), 1),
        cc.fake_stream(),
        arch=cc.device_arch(torch.cuda.current_device()),
    )
    buf = torch.zeros(256, device=DEV)  # 1 KiB, its own cudaMalloc without the caching allocator
    fn(buf)


def _canary_configs():
    return [
        Config("canary/memcheck-oob-write", CANARY, lambda: _canary("oob"), ("memcheck",), True, True),
        Config("canary/racecheck-smem-race", CANARY, lambda: _canary("race"), ("racecheck",), True, True),
    ]


def all_configs():
    configs = (
        _dropout_configs()
        + _norm_configs()
        + _prepost_configs()
        + _mea_configs()
        + _sm90_configs()
        + _sm90_fwd_configs()
        + _canary_configs()
    )
    for cfg in configs:
        assert "," not in cfg.name and " " not in cfg.name, cfg.name
    return configs


def seed_for(cfg: Config) -> None:
    _seed(cfg.name)
