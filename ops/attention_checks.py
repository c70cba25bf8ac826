"""The checks of ``memory_efficient_attention``'s arguments (``ops.attention``): shapes,
dtypes, devices, ``cu_seqlens``, the causal mask's and the window's forms, the softcap, the used
lengths, the sink."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _compile as cc
from ._validate import check_cuda, check_float, check_int, check_same_device, check_tensor, validate_once
from .attention_common import DTYPES

MASK_TYPES = {"top_left": 1, "bottom_right": 2}


def mask_type_of(causal) -> int:
    if isinstance(causal, bool):
        return int(causal)
    if isinstance(causal, str) and causal in MASK_TYPES:
        return MASK_TYPES[causal]
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def check_qkv(query, key, value):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
    check_cuda("query", query)
    for name, t in (("key", key), ("value", value)):
        check_same_device(name, t, query)
    if query.dtype not in DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise TypeError(f"query must have dtype in ({names}), got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
    b, mq, h, d = query.shape
    if d < 1:
        raise ValueError(f"query must have head_dim >= 1, got shape {tuple(query.shape)}")
    if value.shape[3] < 1:
        raise ValueError(f"value must have head_dim >= 1, got shape {tuple(value.shape)}")
    hk = key.shape[2]
    if tuple(key.shape) != (b, key.shape[1], hk, d) or hk < 1 or h % hk:
        raise ValueError(
            f"key must have shape ({b}, Mk, Hk, {d}) (query's batch and head_dim, Hk heads dividing query's {h}), "
            f"got {tuple(key.shape)}"
        )
    if tuple(value.shape[:3]) != tuple(key.shape[:3]):
        raise ValueError(
            f"value must have key's batch, seqlen and heads {tuple(key.shape[:3])}, got shape {tuple(value.shape)}"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim (stride {t.stride(-1)}); pass {name}.contiguous()"
            )


def check_cu_meta(name, cu, query):
    check_tensor(name, cu)
    check_same_device(name, cu, query)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D tensor [num_seqs + 1] with at least 2 entries, got shape {tuple(cu.shape)}"
        )
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def check_meta(query, key, value, cu_seqlens_q, cu_seqlens_k):
    check_qkv(query, key, value)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{missing} is required: cu_seqlens_q and cu_seqlens_k go together")
    if cu_seqlens_q is not None:
        check_cu_meta("cu_seqlens_q", cu_seqlens_q, query)
        check_cu_meta("cu_seqlens_k", cu_seqlens_k, query)
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(
                f"cu_seqlens_k must have cu_seqlens_q's shape {tuple(cu_seqlens_q.shape)} (one entry per sequence + 1), "
                f"got {tuple(cu_seqlens_k.shape)}"
            )
        if query.shape[0] != 1:
            raise ValueError(
                f"query must have batch 1 with cu_seqlens_q (sequences packed along M), got batch {query.shape[0]}"
            )


def check_cu_values(name, cu, total, max_seqlen, max_name):
    """cu_seqlens must start at 0, not decrease, end within the packed length and respect
    max_seqlen; returns the longest sequence. One device read (a synchronisation)."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    lengths = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] > total:
        raise ValueError(f"{name} ends at {vals[-1]}, past the packed length {total}")
    longest = max(lengths)
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is shorter than the longest sequence in {name} ({longest})")
    return longest, lengths


_cu_checked = WeakIdKeyDictionary()  # a cu_seqlens tensor -> ((its version, total, max_seqlen), result)


def cu_values_once(name, cu, total, max_seqlen, max_name):
    """``check_cu_values``, read from the device once per tensor and version: the same tensor
    passed again unchanged (the layers of one step share theirs, forward and backward) costs no
    synchronisation; an in-place change bumps the version and is checked again."""
    if cu.is_inference():  # (no version counter to tell a change)
        return check_cu_values(name, cu, total, max_seqlen, max_name)
    key = (cu._version, total, max_seqlen)
    known = _cu_checked.get(cu)
    if known is not None and known[0] == key:
        return known[1]
    result = check_cu_values(name, cu, total, max_seqlen, max_name)
    _cu_checked[cu] = (key, result)
    return result


def validate_call(
    query, key, value, causal, window_size, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
):
    """Checks everything, returns (custom_mask_type, window_size, max_seqlen_q, max_seqlen_k, scale)."""
    check_tensor("query", query)
    validate_once(
        ("mea", query, key, value, cu_seqlens_q, cu_seqlens_k),
        lambda: check_meta(query, key, value, cu_seqlens_q, cu_seqlens_k),
    )
    mask_type, window_size = window_of(mask_type_of(causal), window_size)
    if scale is not None:
        check_float("scale", scale)
        scale = float(scale)
    varlen = cu_seqlens_q is not None
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is None:
            continue
        if not varlen:
            raise ValueError(f"{name} is only used with cu_seqlens_q / cu_seqlens_k (variable lengths)")
        check_int(name, m, low=1)
    if not varlen:
        mq, mk = query.shape[1], key.shape[1]
        if mask_type == 2 and mq > mk:
            raise NotImplementedError(BOTTOM_RIGHT_MSG.format(mq=mq, mk=mk))
        return mask_type, window_size, mq, mk, scale
    if max_seqlen_q is not None and max_seqlen_q > query.shape[1]:
        raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is longer than query's packed length {query.shape[1]}")
    if max_seqlen_k is not None and max_seqlen_k > key.shape[1]:
        raise ValueError(f"max_seqlen_k ({max_seqlen_k}) is longer than key's packed length {key.shape[1]}")
    if cc.eager(cu_seqlens_q) and not cc.capturing():  # values may be read here
        longest_q, lq = cu_values_once("cu_seqlens_q", cu_seqlens_q, query.shape[1], max_seqlen_q, "max_seqlen_q")
        longest_k, lk = cu_values_once("cu_seqlens_k", cu_seqlens_k, key.shape[1], max_seqlen_k, "max_seqlen_k")
        if mask_type == 2 and any(a > b for a, b in zip(lq, lk)):
            raise NotImplementedError(BOTTOM_RIGHT_MSG.format(mq="a sequence's Mq", mk="its Mk"))
        max_seqlen_q = max(1, longest_q) if max_seqlen_q is None else int(max_seqlen_q)
        max_seqlen_k = max(1, longest_k) if max_seqlen_k is None else int(max_seqlen_k)
    elif max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError(
            "max_seqlen_q and max_seqlen_k are required with cu_seqlens under torch.compile, tracing or "
            "CUDA-graph capture (reading them from cu_seqlens needs the values on the host)"
        )
    return mask_type, window_size, int(max_seqlen_q), int(max_seqlen_k), scale


def window_of(mask_type: int, window_size) -> Tuple[int, int]:
    """(mask type, w) from ``window_size``: None / 0 (no window), an int w (query n sees the
    w keys up to its diagonal: n + shift - w < m <= n + shift; causal masks only), or
    FlashAttention's (left, right), -1 meaning unbounded: (-1, -1) no window, (left, 0) is
    w = left + 1 (with causal=False FlashAttention aligns it bottom-right, and so do we)."""
    if isinstance(window_size, (tuple, list)):
        if len(window_size) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in window_size):
            raise TypeError(f"window_size as (left, right) must be two ints, got {window_size!r}")
        left, right = window_size
        if left < -1 or right < -1:
            raise ValueError(f"window_size (left, right) takes ints >= 0, or -1 for unbounded, got {window_size!r}")
        if right == -1 and mask_type:  # FlashAttention ignores right under causal
            right = 0
        if left == -1 and right in (-1, 0):
            return (mask_type or (2 if right == 0 else 0)), 0
        if right != 0:
            raise NotImplementedError(
                f"window_size {window_size!r} reaches {'past' if right > 0 else 'any key after'} the diagonal: "
                "only causal windows (right = 0) are implemented"
            )
        return mask_type or 2, left + 1
    if window_size is None:
        return mask_type, 0
    check_int("window_size", window_size, low=0)
    if int(window_size) > 0 and mask_type == 0:
        raise ValueError(
            "window_size needs causal=True / 'top_left' / 'bottom_right' when it is an int w (query n sees the w "
            "keys up to its diagonal); FlashAttention's (left, right) form is taken too: (w - 1, 0)"
        )
    return mask_type, int(window_size)


BOTTOM_RIGHT_MSG = (
    "causal='bottom_right' with more queries than keys ({mq} > {mk}) is not supported: torch's "
    "_efficient_attention_forward leaves the first query blocks unmasked there (torch 2.11)"
)


def check_softcap(softcap) -> float:
    """``softcap=`` as a float: c > 0 caps the scores at c tanh(s / c); None or 0 is none (0.0).
    A bool, a string or a tensor is a TypeError; a negative, NaN or infinite cap a ValueError."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float > 0, or None / 0 for none, got {type(softcap).__name__}")
    c = float(softcap)
    if not math.isfinite(c) or c < 0.0:
        raise ValueError(f"softcap must be a finite float > 0, or None / 0 for none, got {softcap!r}")
    return c


def check_seqused(seqused_q, seqused_k, query, key, cu_seqlens_q, cu_seqlens_k):
    """``seqused_q / _k`` as the kernels take them: (None, None), or both int32 [sequences] on
    query's device (the one not given: every sequence's full length). Their values are not read
    here (no synchronisation): the kernels clamp them to [0, the sequence's length]."""
    if seqused_q is None and seqused_k is None:
        return None, None
    varlen = cu_seqlens_q is not None
    seqs = cu_seqlens_q.shape[0] - 1 if varlen else query.shape[0]
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            check = functools.partial(_check_seqused_meta, name, t, query, seqs, varlen)
            validate_once(("seqused", name, t, query, seqs), check)
    lengths = {"q": (cu_seqlens_q, query.shape[1]), "k": (cu_seqlens_k, key.shape[1])}

    def full(side):  # every sequence's whole length
        cu, rows = lengths[side]
        return cu.diff() if varlen else torch.full((seqs,), rows, dtype=torch.int32, device=query.device)

    return (full("q") if seqused_q is None else seqused_q), (full("k") if seqused_k is None else seqused_k)


def _check_seqused_meta(name, t, query, seqs, varlen) -> None:
    check_tensor(name, t)
    check_same_device(name, t, query)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != (seqs,) or (seqs > 1 and t.stride(0) != 1):
        per = "one entry per sequence of cu_seqlens" if varlen else "one entry per batch entry"
        raise ValueError(f"{name} must be a contiguous 1-D tensor [{seqs}] ({per}), got shape {tuple(t.shape)}")


SINK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_sink(sink, query) -> None:
    """``sink=``: None, or a [H] float tensor (one logit per query head) on query's device."""
    if sink is None:
        return
    check_tensor("sink", sink)
    check_same_device("sink", sink, query)
    if sink.dtype not in SINK_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SINK_DTYPES)
        raise TypeError(f"sink must have dtype in ({names}), got {sink.dtype}")
    if sink.dim() != 1 or sink.shape[0] != query.shape[2]:
        raise ValueError(
            f"sink must have shape ({query.shape[2]},) (one logit per query head), got {tuple(sink.shape)}"
        )
