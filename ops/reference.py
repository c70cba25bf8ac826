"""Plain torch references: the ground truth of the tests and the 'torch' peer of the benchmarks."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from layouts.attention_bwd_prepost import VARLEN_ACCUM_PAD, seqlen_rounded


def activation_grad_ref(z: Tensor, activation: Optional[str]) -> Tensor:
    """act'(z) in z's dtype (pass fp64 for a reference)."""
    if activation is None:
        return torch.ones_like(z)
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)
    if activation == "gelu_erf":
        return 0.5 * (1 + torch.erf(z / math.sqrt(2.0))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    raise ValueError(f"unknown activation {activation!r}")


def dropout_bias_backward_ref(
    grad_out: Tensor,
    mask: Tensor,
    p: float,
    x: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[Tensor, Tensor]:
    """(dX, dBias) computed in ``compute_dtype``, returned in that dtype."""
    g = grad_out.to(compute_dtype) * mask.to(compute_dtype) * (1.0 / (1.0 - p))
    if activation is not None:
        g = g * activation_grad_ref(x.to(compute_dtype) + bias.to(compute_dtype), activation)
    return g, g.reshape(-1, g.shape[-1]).sum(0)


def dropout_bias_backward_torch(grad_out, mask, p, x=None, bias=None, activation=None):
    """What a torch user writes (the eager / torch.compile peer): fp32 math, outputs in dY's dtype."""
    g = grad_out.float() * mask * (1.0 / (1.0 - p))
    if activation is not None:
        g = g * activation_grad_ref(x.float() + bias.float(), activation)
    return g.to(grad_out.dtype), g.reshape(-1, g.shape[-1]).sum(0).to(grad_out.dtype)


# ------------------------------------------------------- attention backward pre/post


def _seq_bounds(cu_seqlens: Tensor):
    """[(start, length)] of each packed sequence."""
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]


def attention_delta_ref(
    out: Tensor,
    grad_out: Tensor,
    scale: float = 1.0,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rounded: bool = True,
) -> Tensor:
    """Δ = scale * rowsum(out * grad_out) in fp64, [batch, heads, seqlen], zero past each sequence.

    ``rounded``: seqlen is round_up(max seqlen, 128) (attention_bwd_preprocess's Δ), else the
    max seqlen itself (attention_bwd_compute_delta's). Inputs [B, S, H, D], or packed
    [total, H, D] with ``cu_seqlens_q`` and ``max_seqlen_q``.
    """
    rows = scale * (out.double() * grad_out.double()).sum(-1)  # [B, S, H] or [total, H]
    if cu_seqlens_q is None:
        seqs = [r.t() for r in rows]  # [H, S] each
        s = out.shape[1]
    else:
        seqs = [rows[start : start + n].t() for start, n in _seq_bounds(cu_seqlens_q)]
        s = int(max_seqlen_q)
    delta = rows.new_zeros((len(seqs), out.shape[-2], seqlen_rounded(s) if rounded else s))
    for b, d in enumerate(seqs):
        delta[b, :, : d.shape[1]] = d
    return delta


def attention_delta_torch(out: Tensor, grad_out: Tensor) -> Tensor:
    """What a torch user writes (the eager / torch.compile peer): fp32 rowsum, [B, S, H]."""
    return (out.float() * grad_out.float()).sum(-1)


def convert_dq_ref(
    dq_accum: Tensor,
    softmax_scale: float,
    *,
    head_dim: int,
    seqlen_q: Optional[int] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    p_dropout: float = 0.0,
) -> Tensor:
    """dQ in fp64: the split partials summed, scaled by softmax_scale / (1 - p_dropout).

    ``dq_accum``: [(nsplits,) B, S_r, H, D_r] -> [B, seqlen_q, H, head_dim]; with
    ``cu_seqlens_q`` [(nsplits,) total_q + 128 B, H, D_r] -> [total_q, H, head_dim], sequence
    b's rows starting at cu_seqlens_q[b] + 128 b.
    """
    acc = dq_accum.double()
    if acc.dim() == (3 if cu_seqlens_q is not None else 4):
        acc = acc.unsqueeze(0)
    acc = acc.sum(0) * (softmax_scale / (1.0 - p_dropout))
    if cu_seqlens_q is None:
        return acc[:, :seqlen_q, :, :head_dim]
    parts = [
        acc[start + VARLEN_ACCUM_PAD * b : start + VARLEN_ACCUM_PAD * b + n]
        for b, (start, n) in enumerate(_seq_bounds(cu_seqlens_q))
    ]
    return torch.cat(parts)[..., :head_dim]


def convert_dq_torch(
    dq_accum: Tensor, softmax_scale: float, seqlen_q: int, head_dim: int, dtype=torch.bfloat16
) -> Tensor:
    """What a torch user writes for convert_dq ([nsplits, B, S_r, H, D_r] in): the benchmark peer."""
    return (dq_accum.sum(0)[:, :seqlen_q, :, :head_dim] * softmax_scale).to(dtype)


def convert_dkv_ref(
    dk_accum: Tensor,
    dv_accum: Tensor,
    softmax_scale: float,
    *,
    head_dim: int,
    seqlen_k: int,
    cu_seqlens_k: Optional[Tensor] = None,
    p_dropout: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """(dK, dV) in fp64 from [B, H_k, S_k_r, D_r] accumulators.

    dK = dk_accum * softmax_scale / (1 - p), dV = dv_accum / (1 - p); [B, seqlen_k, H_k,
    head_dim], or with ``cu_seqlens_k`` packed [seqlen_k (= total_k), H_k, head_dim] where
    sequence b's row j is accumulator row (b, :, j).
    """
    rp = 1.0 / (1.0 - p_dropout)

    def convert(acc, scale):
        acc = acc.double()[..., :head_dim] * scale
        if cu_seqlens_k is None:
            return acc[:, :, :seqlen_k].transpose(1, 2)
        parts = [acc[b, :, :n].transpose(0, 1) for b, (_, n) in enumerate(_seq_bounds(cu_seqlens_k))]
        return torch.cat(parts)

    return convert(dk_accum, softmax_scale * rp), convert(dv_accum, rp)


def convert_dkv_torch(
    dk_accum: Tensor, dv_accum: Tensor, softmax_scale: float, seqlen_k: int, head_dim: int, dtype=torch.bfloat16
):
    """What a torch user writes for convert_dkv (the benchmark peer)."""
    fmt = torch.contiguous_format  # [B, S, H, D] in memory, as ours
    dk = (dk_accum[:, :, :seqlen_k, :head_dim] * softmax_scale).transpose(1, 2).to(dtype, memory_format=fmt)
    dv = dv_accum[:, :, :seqlen_k, :head_dim].transpose(1, 2).to(dtype, memory_format=fmt)
    return dk, dv


def norm_backward_ref(
    grad_out: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    has_bias: bool,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """LayerNorm (mean given) / RMSNorm (mean None) backward in fp64 from the saved statistics."""
    n = x.shape[-1]
    x64, dz = x.double().reshape(-1, n), grad_out.double().reshape(-1, n)
    rs = rstd.double().reshape(-1, 1)
    y = (x64 if mean is None else x64 - mean.double().reshape(-1, 1)) * rs
    dy = dz * weight.double() if weight is not None else dz
    dx = dy - (dy * y).mean(-1, keepdim=True) * y
    if mean is not None:
        dx = dx - dy.mean(-1, keepdim=True)
    dx = (dx * rs).reshape(x.shape)
    dw = (dz * y).sum(0) if weight is not None else None
    db = dz.sum(0) if has_bias else None
    return dx, dw, db


# ------------------------------------------------------- memory-efficient attention
#
# Layouts as torch's ``_efficient_attention_forward`` / ``_backward``: q [B, Mq, H, K],
# k [B, Mk, H, K], v [B, Mk, H, Kv], out / grad_out [B, Mq, H, Kv]; variable lengths pack
# the sequences along M with B == 1 and int32 cu_seqlens [num_seqs + 1].
#
# Mask (kernel_backward.h, key index m, query index n, per sequence): shift = 0 for
# custom_mask_type 1 (causal from the top left) or num_keys - num_queries for 2 (from the
# bottom right); causal masks key > query + shift; window_size > 0 (causal only)
# additionally masks key <= query + shift - window_size. A query row with no key left
# has output 0 and zero gradients (its probabilities are 0, never NaN).


def attention_mask_ref(
    num_queries: int, num_keys: int, custom_mask_type: int = 0, window_size: int = 0, device=None
) -> Tensor:
    """[num_queries, num_keys] bool, True where query n may attend key m."""
    if custom_mask_type not in (0, 1, 2):
        raise ValueError(f"custom_mask_type must be 0, 1 or 2, got {custom_mask_type}")
    if window_size and window_size > 0 and custom_mask_type == 0:
        raise ValueError("window_size needs a causal mask (custom_mask_type 1 or 2), as the kernel")
    n = torch.arange(num_queries, device=device).view(-1, 1)
    m = torch.arange(num_keys, device=device).view(1, -1)
    keep = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if custom_mask_type == 0:
        return keep
    shift = num_keys - num_queries if custom_mask_type == 2 else 0
    keep &= m <= n + shift
    if window_size and window_size > 0:
        keep &= m > n + shift - window_size
    return keep


def _attention_segments(query, key, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None):
    """[(b, q rows, k rows)]: one dense problem per batch entry or packed sequence, each cut to
    its first ``seqused_q[i]`` / ``seqused_k[i]`` rows where given (the rest is padding)."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together")
    if cu_seqlens_q is None:
        segments = [(b, slice(0, query.shape[1]), slice(0, key.shape[1])) for b in range(query.shape[0])]
    else:
        if query.shape[0] != 1:
            raise ValueError(f"variable lengths need batch 1, got {query.shape[0]}")
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        if len(cq) != len(ck):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
        segments = [(0, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]
    return [(b, _used(rq, seqused_q, i), _used(rk, seqused_k, i)) for i, (b, rq, rk) in enumerate(segments)]


def _used(rows: slice, seqused: Optional[Tensor], i: int) -> slice:
    """The first ``seqused[i]`` of ``rows`` (all of them without ``seqused``)."""
    if seqused is None:
        return rows
    n = min(max(int(seqused[i]), 0), rows.stop - rows.start)
    return slice(rows.start, rows.start + n)


def _attention_scores(q, k, scale, softcap=0.0):
    """(scores [H, Mq, Mk], d scores / d (scale q kᵀ) or None): scale q kᵀ, with a ``softcap``
    c > 0 capped at c tanh(scale q kᵀ / c) (FlashAttention's order: before bias and mask),
    whose derivative is 1 - tanh²."""
    s = torch.einsum("nhk,mhk->hnm", q, k) * scale
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, 1.0 - t * t


def _attention_probs(q, k, scale, keep, bias=None, softcap=0.0, sink=None):
    """Masked softmax in fp64: (P [H, Mq, Mk], lse [H, Mq]); P = 0 and lse = -inf on empty rows.
    ``sink`` [H]: one more logit per row in the denominator (no value row): lse = log(e^sink +
    sum e^s), the sink on empty rows."""
    s, _ = _attention_scores(q, k, scale, softcap)
    if bias is not None:  # [H, Mq, Mk]: added to the scaled (capped) logits, before the mask
        s = s + bias
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf where a row keeps nothing
    if sink is not None:
        lse = torch.logaddexp(lse, sink.double().view(-1, 1).expand_as(lse))
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    p = torch.where(keep.unsqueeze(0) & finite.unsqueeze(-1), p, torch.zeros_like(p))
    return p, lse


def _query_heads_per_key_head(query, key) -> int:
    """Grouped-query heads: key / value have Hk heads, Hk dividing query's H."""
    h, hk = query.shape[2], key.shape[2]
    if hk < 1 or h % hk:
        raise ValueError(f"key heads ({hk}) must divide query heads ({h})")
    return h // hk


def _attention_scale(scale, head_dim):
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def attention_forward_ref(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    custom_mask_type: int = 0,
    window_size: int = 0,
    scale: Optional[float] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    empty_row_lse: float = 0.0,
    bias: Optional[Tensor] = None,
    dropout_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out [B, Mq, H, Kv], lse) in fp64: softmax(scale q kᵀ + mask) v and its natural-log
    log-sum-exp; with ``softcap`` c > 0 the scores are c tanh(scale q kᵀ / c) (before bias and mask).
    ``sink`` [H] (a learnable sink per query head): e^sink joins every row's softmax denominator
    without a value row; a row with no key then has out 0 and lse = the sink. Differentiable
    (autograd) in every input, the sink included.

    lse is [B, H, Mq] (dense) or [num_seqs, H, max sequence length] (variable lengths,
    sequence i's query j at [i, :, j], +inf past its end, as torch pads). A query row with
    no key has out 0 and lse ``empty_row_lse`` (torch's kernel writes 0 there: mi and the
    sum are reset before the log). ``bias`` (broadcastable to [B, H, Mq, Mk], dense only)
    is added to the scaled logits; ``dropout_mask`` ([B, H, Mq, Mk] bool, True = kept)
    drops probabilities after the softmax (kept ones scaled by 1 / (1 - dropout_p); lse
    is the undropped softmax's). ``seqused_q / _k`` ([B], or [num_seqs] with variable lengths):
    each sequence is its first seqused rows, the masks align to them; out is 0 and lse +inf on
    the padding rows.
    """
    group = _query_heads_per_key_head(query, key)
    key, value = (t.repeat_interleave(group, dim=2) for t in (key, value))
    out, lse, _ = _attention_forward_parts(
        query,
        key,
        value,
        custom_mask_type,
        window_size,
        scale,
        cu_seqlens_q,
        cu_seqlens_k,
        bias,
        dropout_mask,
        dropout_p,
        softcap,
        seqused_q,
        seqused_k,
        sink,
    )
    return out, _lse_layout(lse, query, cu_seqlens_q, empty_row_lse, seqused_q is not None)


def _bias_and_dropout(query, key, cu_seqlens_q, bias, dropout_mask, dropout_p):
    """(bias [B, H, Mq, Mk] fp64 or None, Z [B, H, Mq, Mk] fp64 (0 or 1 / (1 - p)) or None)."""
    b, mq, h, _ = query.shape
    full = (b, h, mq, key.shape[1])
    if (bias is not None or dropout_mask is not None) and cu_seqlens_q is not None:
        raise ValueError("the reference takes bias / dropout_mask for dense problems only")
    bias64 = None if bias is None else bias.double().expand(full)
    z = None
    if dropout_mask is not None:
        z = dropout_mask.expand(full).double() / (1.0 - dropout_p)
    return bias64, z


def _attention_forward_parts(
    query,
    key,
    value,
    custom_mask_type,
    window_size,
    scale,
    cu_seqlens_q,
    cu_seqlens_k,
    bias=None,
    dropout_mask=None,
    dropout_p=0.0,
    softcap=0.0,
    seqused_q=None,
    seqused_k=None,
    sink=None,
):
    q, k, v = query.double(), key.double(), value.double()
    sc = _attention_scale(scale, query.shape[-1])
    bias64, z = _bias_and_dropout(query, key, cu_seqlens_q, bias, dropout_mask, dropout_p)
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    lses, probs = [], []
    for b, rq, rk in _attention_segments(query, key, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        qs, ks, vs = q[b, rq], k[b, rk], v[b, rk]
        keep = attention_mask_ref(qs.shape[0], ks.shape[0], custom_mask_type, window_size, device=q.device)
        p, lse = _attention_probs(qs, ks, sc, keep, None if bias64 is None else bias64[b], softcap, sink)
        pd = p if z is None else p * z[b]
        out[b, rq] = torch.einsum("hnm,mhd->nhd", pd, vs)
        lses.append(lse)
        probs.append(p)
    return out, lses, probs


def _lse_layout(lses, query, cu_seqlens_q, empty_row_lse, seqused=False):
    """[B, H, Mq] dense (each entry's used rows, +inf past them), [num_seqs, H, longest] packed."""
    lses = [torch.where(torch.isfinite(x), x, torch.full_like(x, empty_row_lse)) for x in lses]
    if cu_seqlens_q is None and not seqused:
        return torch.stack(lses) if lses else query.new_zeros((0, query.shape[2], query.shape[1]), dtype=torch.float64)
    width = query.shape[1] if cu_seqlens_q is None else max([x.shape[-1] for x in lses], default=0)
    lse = torch.full((len(lses), query.shape[2], width), float("inf"), dtype=torch.float64, device=query.device)
    for i, x in enumerate(lses):
        lse[i, :, : x.shape[-1]] = x
    return lse


def attention_backward_ref(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    *,
    custom_mask_type: int = 0,
    window_size: int = 0,
    scale: Optional[float] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    dropout_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    return_grad_bias: bool = False,
    out: Optional[Tensor] = None,
    softcap: float = 0.0,
    grad_lse: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
):
    """(dq, dk, dv) in fp64, the shapes of query, key, value, from the closed form

    P = masked softmax(scale q kᵀ + bias), Z = dropout_mask / (1 - p) (or 1),
    dV = (P∘Z)ᵀ dO, dP = Z∘(dO vᵀ), dS = P ∘ (dP - rowsum(dO ∘ O)), dQ = scale dS k,
    dK = scale dSᵀ q. Rows without keys contribute nothing (P = 0), keys no query sees
    get zero dK / dV, and rows outside every packed sequence stay 0. With
    ``return_grad_bias`` a fourth entry: dBias = dS, [B, H, Mq, Mk] (before any
    reduction over broadcast dims). Grouped-query heads (key / value with Hk heads, Hk
    dividing H): dK / dV summed over the query heads of each group.

    ``out``: the forward output Δ = rowsum(dO ∘ O) is taken from, as a backward kernel takes
    it; by default the exact output rounded to query's dtype, as a forward hands it over.
    The reference and a kernel then agree on Δ, and their difference is the kernel's own
    arithmetic (Δ's rounding would otherwise dominate rows whose dS nearly cancels).

    ``grad_lse``: the gradient of the forward's logsumexp, in its layout ([B, H, >= Mq], or
    [num_seqs, H, >= max length] with variable lengths): d lse_n / d s_nm = P_nm, so
    dS = P ∘ (dP - (Δ - dlse)). ``softcap`` c > 0: the scores were c tanh(x / c), x = scale q kᵀ
    (``_attention_scores``); dBias is the gradient of the capped scores, dQ / dK take it times
    1 - tanh²(x / c). ``seqused_q / _k``: as ``attention_forward_ref``'s (the padding rows get
    zero gradients).

    ``sink`` [H]: the forward's learnable sinks (P takes them in its denominator); a last entry
    d sink [H] = sum over rows of P_sink (dlse - Δ), P_sink = e^(sink - lse) the sink's
    probability (rows without keys included: there P_sink = 1).
    """
    group = _query_heads_per_key_head(query, key)
    if group > 1:
        grads = attention_backward_ref(
            query,
            key.repeat_interleave(group, dim=2),
            value.repeat_interleave(group, dim=2),
            grad_out,
            custom_mask_type=custom_mask_type,
            window_size=window_size,
            scale=scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            bias=bias,
            dropout_mask=dropout_mask,
            dropout_p=dropout_p,
            return_grad_bias=return_grad_bias,
            out=out,
            softcap=softcap,
            grad_lse=grad_lse,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            sink=sink,
        )
        dk, dv = (g.unflatten(2, (key.shape[2], group)).sum(3) for g in grads[1:3])
        return (grads[0], dk, dv) + tuple(grads[3:])
    q, k, v, do = query.double(), key.double(), value.double(), grad_out.double()
    sc = _attention_scale(scale, query.shape[-1])
    bias64, z = _bias_and_dropout(query, key, cu_seqlens_q, bias, dropout_mask, dropout_p)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    db = q.new_zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1])) if cu_seqlens_q is None else None
    segments = _attention_segments(query, key, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    dsink = None if sink is None else q.new_zeros(q.shape[2])
    for i, (b, rq, rk) in enumerate(segments):
        qs, ks, vs, dos = q[b, rq], k[b, rk], v[b, rk], do[b, rq]
        keep = attention_mask_ref(qs.shape[0], ks.shape[0], custom_mask_type, window_size, device=q.device)
        p, lse = _attention_probs(qs, ks, sc, keep, None if bias64 is None else bias64[b], softcap, sink)  # [H, Mq, Mk]
        zb = 1.0 if z is None else z[b]
        if out is None:
            o = torch.einsum("hnm,mhd->nhd", p * zb, vs).to(query.dtype).double()
        else:
            o = out[b, rq].double().nan_to_num(0.0)
        dv[b, rk] = torch.einsum("hnm,nhd->mhd", p * zb, dos)
        dp = torch.einsum("nhd,mhd->hnm", dos, vs) * zb
        delta = (dos * o).sum(-1).t().unsqueeze(-1)  # [H, Mq, 1]
        if grad_lse is not None:  # sequence i's rows (b == i when dense)
            delta = delta - grad_lse[i, :, : qs.shape[0]].double().unsqueeze(-1)
        ds = p * (dp - delta)
        if dsink is not None:
            dsink -= (torch.exp(sink.double().view(-1, 1) - lse) * delta[..., 0]).sum(-1)
        if db is not None:
            db[b, :, rq, rk] = ds
        _, dtanh = _attention_scores(qs, ks, sc, softcap)
        if dtanh is not None:
            ds = ds * dtanh
        dq[b, rq] = sc * torch.einsum("hnm,mhk->nhk", ds, ks)
        dk[b, rk] = sc * torch.einsum("hnm,nhk->mhk", ds, qs)
    grads = (dq, dk, dv, db) if return_grad_bias else (dq, dk, dv)
    return grads if dsink is None else grads + (dsink,)


def attention_op_ref(query: Tensor, key: Tensor, value: Tensor, *, custom_mask_type=0, window_size=0, scale=None):
    """(out in query's dtype, lse fp32 [B, H, Mq]): ``attention_forward_ref`` handed over as the
    attention op returns them (``memory_efficient_attention(..., return_lse=True)``, its LSE rows
    without the padding to 32). The math is fp64 whatever the inputs' dtype."""
    out, lse = attention_forward_ref(
        query, key, value, custom_mask_type=custom_mask_type, window_size=window_size, scale=scale
    )
    return out.to(query.dtype), lse.float()


def attention_op_backward_ref(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    *,
    custom_mask_type=0,
    window_size=0,
    scale=None,
):
    """(dq, dk, dv) in the inputs' dtypes: ``attention_backward_ref`` with Δ from the forward's
    ``out``, as the op's backward takes it (the logsumexp a kernel reads is recomputed here)."""
    grads = attention_backward_ref(
        query,
        key,
        value,
        grad_out,
        custom_mask_type=custom_mask_type,
        window_size=window_size,
        scale=scale,
        out=out,
    )
    return tuple(g.to(t.dtype) for g, t in zip(grads, (query, key, value)))


# ------------------------------------------------------------- Philox4x32-10 (curand)
# The CPU twin of cute_kernels/common/philox.py, vectorised over numpy uint32 arrays.

_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)


def philox4x32_10(counter, key):
    """Philox4x32-10 of counters ``counter`` (4 uint32 arrays or ints) under ``key`` (2):
    the four output words as uint32 arrays (Random123 / curand ``curand_Philox4x32_10``)."""
    import numpy as np

    mask = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & mask for x in counter]
    k = [np.uint64(int(x) & 0xFFFFFFFF) for x in key]
    for r in range(10):
        if r > 0:
            k = [(k[0] + np.uint64(_PHILOX_W[0])) & mask, (k[1] + np.uint64(_PHILOX_W[1])) & mask]
        p0 = c[0] * np.uint64(_PHILOX_M[0])  # < 2^64: exact in uint64
        p1 = c[2] * np.uint64(_PHILOX_M[1])
        hi0, lo0 = p0 >> np.uint64(32), p0 & mask
        hi1, lo1 = p1 >> np.uint64(32), p1 & mask
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
    return tuple(x.astype(np.uint32) for x in c)


def curand_philox_words(seed: int, word_index):
    """Word ``word_index`` (uint64 array) of curand's Philox stream under ``seed``: what
    ``curand_init(seed, 0, o)`` + ``skipahead(n)`` reads first for o + n = word_index."""
    import numpy as np

    idx = np.asarray(word_index, dtype=np.uint64)
    ctr = idx >> np.uint64(2)
    zero = np.zeros_like(ctr)
    words = philox4x32_10(
        (ctr & np.uint64(0xFFFFFFFF), ctr >> np.uint64(32), zero, zero), (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    )
    stacked = np.stack(words, axis=-1)
    return np.take_along_axis(stacked, (idx & np.uint64(3)).astype(np.int64)[..., None], axis=-1)[..., 0]


def curand_uniform(words):
    """``_curand_uniform``: float32(u32) * 2^-32 + 2^-33 in float32 (the product is exact)."""
    import numpy as np

    inv = np.float32(2.3283064e-10)
    return np.asarray(words, dtype=np.uint32).astype(np.float32) * inv + inv / np.float32(2.0)


def mem_eff_dropout_keep_mask(
    seed: int, offset: int, batches: int, heads: int, num_queries: int, num_keys: int, p: float
):
    """The keep mask [B, H, Mq, Mk] (bool) of torch's memory-efficient attention for
    philox (seed, offset): element (b, h, n, m) is word offset + (b H + h) Mq Mk + n Mk + m,
    kept when its uniform is > p (float32 compare, as the kernels)."""
    import numpy as np

    b = np.arange(batches, dtype=np.uint64).reshape(-1, 1, 1, 1)
    h = np.arange(heads, dtype=np.uint64).reshape(1, -1, 1, 1)
    n = np.arange(num_queries, dtype=np.uint64).reshape(1, 1, -1, 1)
    m = np.arange(num_keys, dtype=np.uint64).reshape(1, 1, 1, -1)
    mq_mk = np.uint64(num_queries * num_keys)
    idx = np.uint64(offset) + (b * np.uint64(heads) + h) * mq_mk + n * np.uint64(num_keys) + m
    u = curand_uniform(curand_philox_words(int(seed), idx))
    return torch.from_numpy(u > np.float32(p))


def dropout_keep_mask(seed: int, offset: int, rows: int, n: int, p: float) -> Tensor:
    """The keep mask [rows, N] (bool) that ``ops.dropout_bias_forward`` draws for philox (seed,
    offset): byte b = r ceil(N / 8) + c // 8 of the bit mask is counter (offset / 4, b) of
    Philox4x32-10 under key (lo32(seed), hi32(seed)); column c takes 16-bit half c % 8 of its
    four words (low half first) and is kept where that half is >= round(p 2^16)."""
    import numpy as np

    from cute_kernels.common.philox import keep_threshold

    nbytes = (n + 7) // 8
    b = np.arange(rows * nbytes, dtype=np.uint64)
    ctr = np.full_like(b, np.uint64((offset >> 2) & (2**64 - 1)))
    m32 = np.uint64(0xFFFFFFFF)
    words = philox4x32_10((ctr & m32, ctr >> np.uint64(32), b & m32, b >> np.uint64(32)), (seed, seed >> 32))
    halves = np.stack([(w >> np.uint32(s)) & np.uint32(0xFFFF) for w in words for s in (0, 16)], axis=-1)
    keep = halves >= np.uint32(keep_threshold(p))  # [rows * nbytes, 8]
    return torch.from_numpy(keep.reshape(rows, nbytes * 8)[:, :n].copy())


def pack_mask(keep: Tensor) -> Tensor:
    """A bool keep mask [..., N] as the kernels' bit mask: uint8 [..., ceil(N / 8)], bit j of
    byte b for column 8 b + j, bits past N zero."""
    n = keep.shape[-1]
    pad = (-n) % 8
    flags = torch.nn.functional.pad(keep.to(torch.uint8), (0, pad)).reshape(*keep.shape[:-1], -1, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=keep.device)
    return (flags * weights).sum(-1, dtype=torch.uint8)


def bias_dropout_forward_ref(x: Tensor, bias: Tensor, keep: Tensor, p: float, activation=None) -> Tensor:
    """act(x + bias) * keep / (1 - p) in fp64."""
    z = x.double() + bias.double()
    if activation == "relu":
        z = torch.relu(z)
    elif activation == "gelu":
        z = torch.nn.functional.gelu(z, approximate="tanh")
    elif activation == "gelu_erf":
        z = torch.nn.functional.gelu(z)
    return z * keep.to(z.device) / (1.0 - p)
