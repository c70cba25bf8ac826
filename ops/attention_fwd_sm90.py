"""Torch face of the Hopper-native attention forward (``cute_kernels.attention_sm90.attention_forward_sm90``).

``attention_forward_sm90(query, key, value, ...)`` returns O and the LSE in the layouts of
``aten._efficient_attention_forward`` ([B, Mq, H, Dv] and fp32 [B, H, round_up(Mq, 32)], +inf
on the padded rows), which the backwards read. ``unsupported`` says why the kernel cannot take a
problem (None: it can); the attention ops then run torch's forward and log the reason.

Dropout draws torch's keep mask from a philox seed and offset: ``philox_state`` takes them from
the default CUDA generator as torch's forward does (attention.cu: ``gen->philox_cuda_state(B *
num_heads * M * N)``), so ``torch.manual_seed`` reproduces the mask of torch's forward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
import torch
from torch import Tensor

from cute_kernels.attention_sm90.attention_forward_sm90 import AttentionForwardSm90
from cute_kernels.attention_sm90.forward_config import (
    forward_tiles,
    forward_unsupported,
    lpt_heads_per_chunk,
    short_causal,
)
from layouts.attention_fwd_sm90 import SMEM_LIMIT, tma_align_elems

from . import _compile as cc
from ._memo import Memo
from .philox import philox_state  # noqa: F401 (the attention ops take it from here)
from .attention_common import lse_rows, remembered_verdict, softmax_scale, tma_misaligned

DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """One compiled forward: element type, head dims, mask (0 none, 1 causal top-left, 2
    bottom-right), whether a sliding window applies, variable lengths, the DSL target, an
    additive bias, dropout, softcapped scores (the cap itself is a runtime argument), used
    lengths (``seqused_q / _k``, int32 per sequence), a learnable sink per query head (its values
    are a runtime argument), a causal mask over few keys (``forward_config.short_causal``: its own
    tiles)."""

    dtype: type
    head_dim: int
    head_dim_v: int
    mask_type: int
    window: bool
    varlen: bool
    arch: str
    bias: bool = False
    dropout: bool = False
    softcap: bool = False
    seqused: bool = False
    sink: bool = False
    short_causal: bool = False


def _build(config: ForwardConfig):
    c = config
    tiles = forward_tiles(c.head_dim, c.head_dim_v, c.window, c.bias, c.dropout, c.short_causal)
    kernel = AttentionForwardSm90(
        c.dtype, tiles, c.mask_type, c.window, c.varlen, c.bias, c.dropout, c.softcap, seqused=c.seqused, sink=c.sink
    )
    b, h, hk, mq, mk, lse_rows = (cute.sym_int() for _ in range(6))
    seqs = cute.sym_int() if c.varlen else b  # the LSE's rows: per sequence
    vec = tma_align_elems(c.dtype.width)
    q = cc.fake_tensor(c.dtype, (b, mq, h, c.head_dim), vec)
    k = cc.fake_tensor(c.dtype, (b, mk, hk, c.head_dim), vec)
    v = cc.fake_tensor(c.dtype, (b, mk, hk, c.head_dim_v), vec)
    o = cc.fake_tensor(c.dtype, (b, mq, h, c.head_dim_v), vec)
    lse = cc.fake_tensor(cutlass.Float32, (seqs, h, lse_rows), 1)
    cu_q, cu_k = (cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if c.varlen else None for _ in range(2))
    # the bias: any strides (0 for broadcast dims; read element by element), as the backward's
    bias = cc.fake_tensor(c.dtype, (b, h, mq, mk), 1, leading_dim=None) if c.bias else None
    rng = cc.fake_rng_args(False) if c.dropout else (None,) * 5
    used = (cc.fake_tensor(cutlass.Int32, (seqs,), 1) if c.seqused else None for _ in range(2))
    sink = cc.fake_tensor(cutlass.Float32, (h,), 1) if c.sink else None
    return cc.compile_kernel(
        kernel,
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k,
        cutlass.Int32(0),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        bias,
        *rng,
        cutlass.Float32(1.0),
        *used,
        sink,
        cc.fake_stream(),
        arch=c.arch,
    )


compiled = cc.CompileCache("attention_fwd_sm90", _build)


_verdicts = Memo()  # unsupported's answers for plain CUDA tensors at TMA-aligned addresses, by metadata


def unsupported(query, key, value, *, mask_type=0, bias=None, dropout_p=0.0, arch=None) -> Optional[str]:
    """Why the forward kernel cannot take this problem (None: it can); no CUDA call for CPU,
    meta or fake tensors (they get the reason of their missing arch unless ``arch`` is given).
    Remembered per metadata for plain CUDA tensors (``attention_common.remembered_verdict``),
    except dropout under CUDA-graph capture (asked on every call)."""
    if dropout_p > 0.0 and cc.capturing():
        # the generator's offset cannot be read or advanced from Python during capture
        return "dropout under CUDA-graph capture (the philox offset is not graph-safe from Python)"
    bias_meta = None if bias is None else (bias.dtype, tuple(bias.shape))
    return remembered_verdict(
        _verdicts,
        (query, key, value),
        (arch, mask_type, bias_meta, dropout_p > 0.0),
        lambda: _unsupported(query, key, value, mask_type, bias, dropout_p, arch),
    )


def _unsupported(query, key, value, mask_type, bias, dropout_p, arch) -> Optional[str]:
    """unsupported's checks, all of them."""
    arch = arch or cc.tensor_arch(query)
    if arch != "sm_90a":
        return f"needs sm_90a, the device is {arch or f'{query.device} (no CUDA arch known)'}"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (fp16 / bf16 only)"
    why = forward_unsupported(query.shape[-1], value.shape[-1])
    if why is not None:
        return f"head dims {query.shape[-1]} / {value.shape[-1]} ({why})"
    why = _bias_unsupported(query, key, bias)
    if why is not None:
        return why
    if dropout_p > 0.0:
        tiles = forward_tiles(query.shape[-1], value.shape[-1], bias=bias is not None, dropout=True)
        if tiles.smem_bytes(query.element_size(), dropout=True) > SMEM_LIMIT:
            return f"dropout with head dims {query.shape[-1]} / {value.shape[-1]} (its keep flags do not fit)"
    if key.shape[2] == 0 or query.shape[2] % key.shape[2]:
        return f"query heads {query.shape[2]} not a multiple of key heads {key.shape[2]}"
    if mask_type not in (0, 1, 2):
        return f"mask type {mask_type}"
    return tma_misaligned((("query", query), ("key", key), ("value", value)))


def _bias_unsupported(query, key, bias) -> Optional[str]:
    """Why the kernel cannot read this bias (None: it can, or there is none): any strides do."""
    if bias is None:
        return None
    if bias.dtype != query.dtype:
        return f"attention bias of dtype {bias.dtype} (query's {query.dtype} only)"
    b, mq, h, _ = query.shape
    full = (b, h, mq, key.shape[1])
    if bias.dim() > 4 or any(n not in (1, f) for n, f in zip(reversed(bias.shape), reversed(full))):
        return f"attention bias of shape {tuple(bias.shape)} (broadcastable to {full} only)"
    return None


def dropout_words(query, key, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None) -> int:
    """How far a dropout forward advances the philox offset: torch's B * num_heads * M * N of the
    tensors' shapes (the packed lengths with ``cu_seqlens``), and with variable lengths at least
    the words the kernels draw (sequence i's (i, head) stream at (i H + head) max_q max_k)."""
    b, mq, h, _ = query.shape
    words = b * h * mq * key.shape[1]
    if cu_seqlens_q is not None:
        words = max(words, (cu_seqlens_q.shape[0] - 1) * h * int(max_seqlen_q) * int(max_seqlen_k))
    return words


def attention_forward_sm90(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: Optional[float] = None,
    mask_type: int = 0,
    window_size: int = 0,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    bias: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    philox_seed: Optional[Tensor] = None,
    philox_offset: Optional[Tensor] = None,
    softcap: float = 0.0,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """O [B, Mq, H, Dv] and LSE [B, H, round_up(Mq, 32)] (natural log, fp32) of q [B, Mq, H, D],
    k [B, Mk, Hk, D], v [B, Mk, Hk, Dv] (``unsupported`` first). ``window_size`` > 0 (with a
    causal mask): key k also needs k > q + offset - window_size. Variable lengths: B = 1,
    int32 ``cu_seqlens_q / _k`` [sequences + 1], the LSE [sequences, H, round_up(max_seqlen_q, 32)].

    ``bias``: broadcastable to [B, H, Mq, Mk], query's dtype, added to the scaled scores (not with
    variable lengths). ``dropout_p`` > 0: P V takes the keep mask of torch's forward for
    ``philox_seed / philox_offset`` (int64 CPU scalars, ``philox_state``; with variable lengths
    sequence i's (i, head) stream starts at (i H + head) max_seqlen_q max_seqlen_k, as the
    backwards draw it); the LSE is the undropped softmax's. ``softcap`` c > 0: the scores
    scale q kᵀ become c tanh(scale q kᵀ / c) before the bias and the mask (0: none).

    ``seqused_q / _k``: int32 [sequences] (both or neither; ``full_seqused`` makes the one not
    given): only the first seqused[b] query / key rows of sequence b are used, the masks align to
    those lengths; O is 0 past them and the LSE +inf (the padded rows' value). Not with a bias
    or dropout. ``sink`` [H] (any float dtype, natural-log units): a logit per query head in every
    row's softmax denominator, with no value row (a row that sees no key: O = 0, LSE = the sink)."""
    b, mq, h, d = query.shape
    varlen = cu_seqlens_q is not None
    if bias is not None and varlen:
        raise NotImplementedError("attention bias with cu_seqlens is not supported (torch's forward refuses it too)")
    seqs, rows_q = (cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)) if varlen else (b, mq)
    seqused = seqused_q is not None
    if seqused and (bias is not None or dropout_p > 0.0):
        raise NotImplementedError("used lengths (seqused_q / seqused_k) with an attention bias or dropout")
    # used lengths: query blocks past them do not run, so their O and LSE are written here
    out = (torch.zeros if seqused else torch.empty)((b, mq, h, value.shape[3]), dtype=query.dtype, device=query.device)
    lse = torch.empty((seqs, h, lse_rows(rows_q)), dtype=torch.float32, device=query.device)
    if seqused:
        lse.fill_(math.inf)
    if out.numel() == 0 or key.shape[1] == 0 or seqs == 0:  # no launch: nothing to compute, or no key to see
        return out.zero_(), _empty_lse(lse, mq, cu_seqlens_q, seqused_q, sink)
    dropout = dropout_p > 0.0
    # the longest sequence's keys (packed keys bound it where the caller gives no max_seqlen_k)
    keys = int(max_seqlen_k) if varlen and max_seqlen_k is not None else key.shape[1]
    dv, causal = value.shape[3], mask_type != 0
    config = ForwardConfig(
        cc.cute_dtype(query.dtype),
        d,
        dv,
        int(mask_type),
        window_size > 0,
        varlen,
        cc.tensor_arch(query),
        bias is not None,
        dropout,
        softcap > 0.0,
        seqused,
        sink is not None,
        short_causal(d, dv, causal, keys, window_size > 0, bias is not None, dropout),
    )
    scale = softmax_scale(scale, d)
    if bias is not None:
        bias = bias.expand(b, h, mq, key.shape[1])  # a view: broadcast dims get stride 0
    rng = (None,) * 5
    if dropout:
        rows_k = int(max_seqlen_k) if varlen else key.shape[1]
        rng = cc.dropout_args(dropout_p, philox_seed, philox_offset, rows_q, rows_k)
    # (only the causal grid's heavy-first order reads the chunk)
    chunk = lpt_heads_per_chunk(keys, d, dv, h // key.shape[2], query.element_size(), seqs * h) if causal else 1
    if sink is not None:  # the kernel reads fp32 (a no-op for a contiguous fp32 sink)
        sink = sink.to(torch.float32).contiguous()
    fn = compiled(config)
    args = (
        cu_seqlens_q,
        cu_seqlens_k,
        rows_q,
        scale,
        int(window_size),
        chunk,
        bias,
        *rng,
        softcap,
        seqused_q,
        seqused_k,
        sink,
    )
    fn(query, key, value, out, lse, *args)
    return out, lse


def _empty_lse(
    lse: Tensor,
    mq: int,
    cu_seqlens_q: Optional[Tensor],
    seqused_q: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
) -> Tensor:
    """The LSE of queries that see no key: 0 (with a sink: the head's sink) on each sequence's
    (used) rows, +inf on the padding."""
    rows = torch.arange(lse.shape[-1], device=lse.device)
    if cu_seqlens_q is None:
        lengths = torch.full((lse.shape[0], 1), mq, device=lse.device)
    else:
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).view(-1, 1)
    if seqused_q is not None:
        lengths = torch.minimum(lengths, seqused_q.view(-1, 1))
    inside = (rows.view(1, -1) < lengths).unsqueeze(1).expand(lse.shape)
    if sink is not None:
        return lse.copy_(torch.where(inside, sink.to(lse.dtype).view(1, -1, 1), math.inf))
    return lse.fill_(math.inf).masked_fill_(inside, 0.0)


def benchmark_configurations(cases, arch: str) -> list:
    """The ``compiled`` keys of a suite's cases ((B, H, S, D), dtype name, causal[, features]):
    features ``kv<N>`` (grouped-query heads: compiled alike), ``dv<N>``, ``window<N>``,
    ``varlen``, ``softcap<N>`` (the cap a runtime argument), ``sink``, ``dlse`` (the forward
    writes the LSE either way), joined by ':'; none off sm_90a or for head dims the forward
    does not compile."""
    if arch != "sm_90a":
        return []
    keys = set()
    for (_, _, s, d), dtype, causal, *features in cases:
        tokens = features[0].split(":") if features and features[0] else []
        dv = next((int(t[2:]) for t in tokens if t.startswith("dv")), d)
        if forward_unsupported(d, dv) is not None:
            continue
        window = any(t.startswith("window") for t in tokens)
        varlen = "varlen" in tokens
        softcap, sink = any(t.startswith("softcap") for t in tokens), "sink" in tokens
        dt = cc.cute_dtype(getattr(torch, dtype))
        # packed sequences: their longest is not in the case, so the tiles of either
        for short in {short_causal(d, dv, causal, n, window, False, False) for n in ((s, 0) if varlen else (s,))}:
            config = ForwardConfig(dt, d, dv, int(causal), window, varlen, arch, softcap=softcap, sink=sink)
            keys.add(dataclasses.replace(config, short_causal=short))
    return sorted(keys, key=repr)
