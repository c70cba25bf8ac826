"""What the CPU tests of the attention ops (tests/test_mem_eff_attention_*_cpu.py) share: an
independent naive autograd implementation of attention (masks, windows, variable lengths,
empty rows, bias and dropout), cu_seqlens, and a reference-backed stand-in for the CUDA
backward."""

import torch

from ops import attention as A
from ops.attention_sink import sink_grad
from ops.reference import attention_backward_ref, attention_forward_ref, mem_eff_dropout_keep_mask

F64 = torch.float64
FORWARD_SEED, FORWARD_OFFSET = (
    0x9234_5678_9ABC_DEF0 - (1 << 64),
    37,
)  # a seed with both key halves set (int64 as torch keeps it)


# ------------------------------------------------------------- naive implementation


def naive_keep(nq, nk, mask_type, window):
    """The mask, element by element, written from the kernel's comments."""
    keep = torch.zeros(nq, nk, dtype=torch.bool)
    shift = nk - nq if mask_type == 2 else 0
    for n in range(nq):
        for m in range(nk):
            ok = True
            if mask_type in (1, 2):
                ok = m <= n + shift  # mask if key > query + shift
                if window > 0:
                    ok = ok and not (m <= n + shift - window)
            keep[n, m] = ok
    return keep


def naive_segment(q, k, v, scale, keep):
    """One sequence [M, H, D]: masked softmax without -inf (autograd-safe on empty rows)."""
    nq, h = q.shape[0], q.shape[1]
    if k.shape[0] == 0:
        return q.new_zeros(nq, h, v.shape[-1]) + 0 * q.sum(), q.new_zeros(h, nq)
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    w = keep.to(q.dtype)
    m = s.detach().masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * w
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    lse = torch.where(den > 0, m + torch.log(torch.where(den > 0, den, torch.ones_like(den))), torch.zeros_like(den))
    return torch.einsum("hnm,mhd->nhd", p, v), lse.squeeze(-1)


def naive_attention(q, k, v, mask_type=0, window=0, scale=None, cu_q=None, cu_k=None):
    """(out, per-sequence lse list) in fp64 with autograd; [B, M, H, D] or packed (B == 1)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_q is None:
        parts = [
            naive_segment(q[b], k[b], v[b], scale, naive_keep(q.shape[1], k.shape[1], mask_type, window))
            for b in range(q.shape[0])
        ]
        return torch.stack([p[0] for p in parts]), [p[1] for p in parts]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks, vs = q[0, cq[i] : cq[i + 1]], k[0, ck[i] : ck[i + 1]], v[0, ck[i] : ck[i + 1]]
        o, lse = naive_segment(qs, ks, vs, scale, naive_keep(qs.shape[0], ks.shape[0], mask_type, window))
        outs.append(o)
        lses.append(lse)
    rest = q.shape[1] - cq[-1]
    outs.append(q.new_zeros(rest, q.shape[2], v.shape[-1]))
    return torch.cat(outs).unsqueeze(0), lses


def naive_grads(q, k, v, do, **kw):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lses = naive_attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do.double(), allow_unused=True)
    return out.detach(), lses, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def rand(*shape, gen):
    return torch.randn(*shape, dtype=F64, generator=gen)


# ------------------------------------ the backward's stand-in (autograd wiring on the CPU)


def _lse_padded(lse_ref, max_q):
    """The reference lse in torch's layout: fp32, rows padded with +inf to a multiple of 32."""
    rows, h, n = lse_ref.shape
    lse = torch.full((rows, h, A.lse_rows(max_q)), float("inf"), dtype=torch.float32)
    lse[..., :n] = lse_ref
    return lse


class BackwardStandIn:
    """Stands in for ops.attention.efficient_attention_backward (``on_args``: for the op's
    backward, ops.attention._backward, which takes ``AttentionBackwardArgs`` and the logsumexp's
    gradient too): checks the call's conventions and answers with the fp64 reference (cast to the
    inputs' dtype). ``sink``: the forward's learnable sinks where the CPU forward stands in too
    (the backward is not given them: the stand-in checks that the LSE it gets includes them)."""

    def __init__(self):
        self.calls = []
        self.sink = None

    def on_args(self, a, checked=False):
        """``_backward``'s five results: with ``a.sink`` (the sink's gradient asked of the backward)
        its d sink from the op's own ``sink_grad`` (torch ops on CPU tensors), the reference's
        four before it. ``checked``: the op's backward says its forward checked the inputs."""
        assert checked, "the op's backward passes checked=True (its forward checked the inputs)"
        grads = self._on_args(a)
        if a.sink is None:
            return (*grads, None)
        dsink = sink_grad(a.sink, a.out, a.grad_out, a.logsumexp, a.grad_lse, a.cu_seqlens_q, a.max_seqlen_q)
        return (*grads, dsink)

    def _on_args(self, a):
        return self(
            a.grad_out,
            a.query,
            a.key,
            a.value,
            a.bias,
            a.out,
            a.cu_seqlens_q,
            a.cu_seqlens_k,
            a.max_seqlen_q,
            a.max_seqlen_k,
            a.logsumexp,
            a.dropout_p,
            a.philox_seed,
            a.philox_offset,
            a.custom_mask_type,
            a.bias_requires_grad,
            scale=a.scale,
            window_size=a.window_size,
            backend=a.backend,
            deterministic=a.deterministic,
            grad_lse=a.grad_lse,
            softcap=a.softcap,
            seqused_q=a.seqused_q,
            seqused_k=a.seqused_k,
            sink=self.sink,
        )

    def __call__(
        self,
        grad_out_,
        query,
        key,
        value,
        bias,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        logsumexp,
        dropout_p,
        philox_seed,
        philox_offset,
        custom_mask_type,
        bias_requires_grad,
        *,
        scale=None,
        num_splits_key=None,
        window_size=None,
        shared_storage_dqdkdv=False,
        backend="auto",
        deterministic=None,
        grad_lse=None,
        softcap=0.0,
        seqused_q=None,
        seqused_k=None,
        sink=None,
    ):
        self.calls.append(
            dict(
                grad_lse=grad_lse,
                softcap=softcap,
                seqused=(seqused_q, seqused_k),
                grad_out=grad_out_,
                mask=custom_mask_type,
                window=window_size,
                scale=scale,
                max=(max_seqlen_q, max_seqlen_k),
                bias=bias,
                dropout_p=dropout_p,
                bias_requires_grad=bias_requires_grad,
                backend=backend,
                deterministic=deterministic,
            )
        )
        assert philox_seed.dtype == philox_offset.dtype == torch.int64
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        b, mq, h, kv = out.shape
        rows = b if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
        assert logsumexp.dtype == torch.float32 and logsumexp.shape == (rows, h, A.lse_rows(max_seqlen_q))
        assert grad_out_.shape == out.shape and query.shape[:3] == (b, mq, h)
        mask = None
        if dropout_p > 0.0:  # the forward's bits, from the seed / offset it returned
            mask = mem_eff_dropout_keep_mask(int(philox_seed), int(philox_offset), b, h, mq, key.shape[1], dropout_p)
        if bias is not None:
            assert bias.shape == (b, h, mq, key.shape[1])
        if grad_lse is not None:
            assert grad_lse.shape == logsumexp.shape and grad_lse.dtype == torch.float32
        options = dict(custom_mask_type=custom_mask_type, window_size=window_size or 0, scale=scale, softcap=softcap)
        if sink is not None:  # the kernels take P from the LSE: it must be the sink's
            _check_sink_lse(query, key, value, logsumexp, cu_seqlens_q, cu_seqlens_k, bias, sink, options)
        dq, dk, dv, db, *_ = attention_backward_ref(
            query,
            key,
            value,
            grad_out_,
            custom_mask_type=custom_mask_type,
            window_size=window_size or 0,
            scale=scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            bias=bias,
            dropout_mask=mask,
            dropout_p=dropout_p,
            return_grad_bias=True,
            grad_lse=grad_lse,
            softcap=softcap,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            sink=sink,
        )
        # fresh [B, M, H, K] tensors, as torch's at::empty(query.sizes())
        grads = tuple(g.to(t.dtype).contiguous() for g, t in ((dq, query), (dk, key), (dv, value)))
        return grads + (db.to(bias.dtype) if bias_requires_grad else None,)


def _check_sink_lse(query, key, value, logsumexp, cu_q, cu_k, bias, sink, options):
    """The backward's LSE is the reference's with the sink on every row of every sequence."""
    _, want = attention_forward_ref(
        query, key, value, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, bias=bias, sink=sink, **options
    )
    rows = torch.isfinite(want)
    assert torch.allclose(logsumexp[..., : want.shape[-1]][rows].double(), want[rows], atol=1e-5)


# ------------------------------------------ naive implementation with bias and dropout


def naive_attention_bias_dropout(q, k, v, bias, z, mask_type=0, window=0, scale=None):
    """[B, M, H, D] fp64 with autograd through q, k, v and bias [B, H, Mq, Mk]; z multiplies
    the probabilities (the dropout's 0 or 1 / (1 - p))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = naive_keep(q.shape[1], k.shape[1], mask_type, window)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale + bias
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhnm,bmhd->bnhd", p * z, v)
