"""``use_for_sdpa()``: torch's efficient SDPA backend (``F.scaled_dot_product_attention``) on our
attention forward and backward.

Opt-in and reversible: while on, ``aten::_scaled_dot_product_efficient_attention`` (CUDA) runs our
Hopper forward (``ops.attention_fwd_sm90``) where it applies, and
``aten::_scaled_dot_product_efficient_attention_backward`` runs
``ops.attention.efficient_attention_backward`` for the configurations it supports (attention
bias with its gradient and dropout included); torch's own kernels run the rest, with the reason
logged (logger ``cute_kernels``, level DEBUG).
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import List, Optional

import torch

from layouts.attention_sm90 import TMA_ALIGN_BYTES  # the kernels' widest access: gradients are made dense otherwise

from . import attention_fwd_sm90 as fwd_sm90
from ._validate import kernel_ready
from .attention import efficient_attention_backward
from .attention_common import DTYPES

logger = logging.getLogger("cute_kernels")


# ------------------------------------------------------------------- SDPA integration

SDPA_BACKWARD = "aten::_scaled_dot_product_efficient_attention_backward"
SDPA_FORWARD = "aten::_scaled_dot_product_efficient_attention"
_SDPA_OP_NAME = "_scaled_dot_product_efficient_attention_backward"
_SDPA_FORWARD_OP_NAME = "_scaled_dot_product_efficient_attention"
_MAX_BATCH = (1 << 16) - 1  # torch's wrapper runs larger batches in chunks of this size


def _aten_efficient_attention_backward(*args, **kwargs):
    """The untouched inner op (a module attribute so that tests can stand in for it)."""
    return torch.ops.aten._efficient_attention_backward.default(*args, **kwargs)


def _torch_sdpa_backward(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal,
    scale,
):
    """What torch's ``_scaled_dot_product_efficient_attention_backward_cuda`` does: [B, H, M, K]
    inputs transposed to [B, M, H, K], ``aten._efficient_attention_backward``, grads
    transposed back (views of [B, M, H, K] memory); batches over 65535 in chunks."""
    batch = query.shape[0]
    if batch > _MAX_BATCH and dropout_p != 0.0:
        raise RuntimeError(
            f"Efficient attention backward cannot handle dropout when the batch size exceeds ({_MAX_BATCH})."
        )
    mask_type = 1 if is_causal else 0
    bias_requires_grad = bool(grad_input_mask[3])

    def chunk(g, q, k, v, bias, o, lse):
        dq, dk, dv, db = _aten_efficient_attention_backward(
            g,
            q,
            k,
            v,
            bias,
            o,
            None,
            None,
            q.shape[1],
            k.shape[1],
            lse,
            dropout_p,
            philox_seed,
            philox_offset,
            mask_type,
            bias_requires_grad,
            scale=scale,
            num_splits_key=None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), db

    t = lambda x: x.transpose(1, 2)  # noqa: E731
    g_t, q_t, k_t, v_t, o_t = t(grad_out), t(query), t(key), t(value), t(out)
    if batch <= _MAX_BATCH:
        return chunk(g_t, q_t, k_t, v_t, attn_bias, o_t, logsumexp)
    like = lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)  # noqa: E731
    dq = like(query) if grad_input_mask[0] else None
    dk = like(key) if grad_input_mask[1] else None
    dv = like(value) if grad_input_mask[2] else None
    db = torch.zeros_like(attn_bias) if grad_input_mask[3] and attn_bias is not None else None
    for start in range(0, batch, _MAX_BATCH):
        s = slice(start, min(start + _MAX_BATCH, batch))
        lse = logsumexp[s] if logsumexp.numel() > 0 else logsumexp
        cq, ck, cv, cb = chunk(g_t[s], q_t[s], k_t[s], v_t[s], None if attn_bias is None else attn_bias[s], o_t[s], lse)
        for full, part in ((dq, cq), (dk, ck), (dv, cv)):
            if full is not None and part is not None:
                full[s].copy_(part)
        if db is not None and cb is not None:
            db.add_(cb)
    return dq, dk, dv, db


def _sdpa_unsupported(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p) -> Optional[str]:
    """Why our kernel cannot take this SDPA backward, or None when it can."""
    if attn_bias is not None and attn_bias.dtype != query.dtype:
        return f"attn_bias dtype {attn_bias.dtype}"
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout_p = {dropout_p}"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype}"
    if any(t.dtype != query.dtype for t in (key, value, out, grad_out)):
        return "mixed dtypes"
    if query.dim() != 4:
        return f"{query.dim()}-D inputs"
    if query.shape[0] > _MAX_BATCH:
        return f"batch {query.shape[0]} > {_MAX_BATCH}"
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (query, key, value)):
        return "an input is not contiguous in its last dim"
    if logsumexp.dtype != torch.float32 or logsumexp.dim() != 3 or logsumexp.shape[-1] < query.shape[2]:
        return f"logsumexp {logsumexp.dtype} {tuple(logsumexp.shape)}"
    return None


def _sdpa_backward_override(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    """Our ``aten::_scaled_dot_product_efficient_attention_backward`` (inputs [B, H, M, K])."""
    if grad_out is None:  # undefined: torch returns four undefined tensors
        return None, None, None, None
    reason = _sdpa_unsupported(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p)
    if reason is None:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        q_t, k_t = t(query), t(key)
        grad_out = kernel_ready(grad_out, TMA_ALIGN_BYTES // grad_out.element_size())
        try:
            bias_grad = attn_bias is not None and bool(grad_input_mask[3])
            dq, dk, dv, db = efficient_attention_backward(
                t(grad_out),
                q_t,
                k_t,
                t(value),
                attn_bias,
                t(out),
                None,
                None,
                q_t.shape[1],
                k_t.shape[1],
                logsumexp,
                float(dropout_p),
                philox_seed,
                philox_offset,
                1 if is_causal else 0,
                bias_grad,
                scale=scale,
            )
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), db
        except NotImplementedError as e:
            reason = f"NotImplementedError: {e}"
    logger.debug("SDPA efficient backward falls back to torch's kernel: %s", reason)
    return _torch_sdpa_backward(
        grad_out,
        query,
        key,
        value,
        attn_bias,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        dropout_p,
        grad_input_mask,
        is_causal,
        scale,
    )


def _sdpa_forward_override(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
):
    """Our ``aten::_scaled_dot_product_efficient_attention`` (inputs [B, H, M, K]): our forward on
    the [B, M, H, K] views where it applies, else what torch's CUDA kernel does
    (``aten._efficient_attention_forward`` on the same views); (out [B, H, M, Kv] view, logsumexp,
    philox seed, philox offset)."""
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (query, key, value))
    reason = f"{query.dim()}-D inputs" if query.dim() != 4 else None
    if reason is None:
        mask_type = 1 if is_causal else 0
        reason = fwd_sm90.unsupported(q_t, k_t, v_t, mask_type=mask_type, bias=attn_bias, dropout_p=dropout_p)
    if reason is None:
        if dropout_p > 0.0:  # torch's CPU scalars, from the generator as torch's forward takes them
            seed, offset = fwd_sm90.philox_state(query.device, fwd_sm90.dropout_words(q_t, k_t))
        else:
            seed, offset = (torch.empty((), dtype=torch.int64, device=query.device) for _ in range(2))
        out, lse = fwd_sm90.attention_forward_sm90(
            q_t,
            k_t,
            v_t,
            scale,
            1 if is_causal else 0,
            bias=attn_bias,
            dropout_p=dropout_p,
            philox_seed=seed,
            philox_offset=offset,
        )
        if not compute_log_sumexp:
            lse = lse.new_empty((*lse.shape[:-1], 0))
        return out.transpose(1, 2), lse, seed, offset
    logger.debug("SDPA efficient forward falls back to torch's kernel: %s", reason)
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q_t,
        k_t,
        v_t,
        attn_bias,
        None,
        None,
        None,
        None,
        dropout_p,
        1 if is_causal else 0,
        compute_log_sumexp,
        scale=scale,
    )
    return out.transpose(1, 2), lse, seed, offset


_sdpa_lock = threading.Lock()
_sdpa_libs: dict = {}  # dispatch key -> the torch.library.Library holding our kernel


def _check_dispatch_key(dispatch_key) -> None:
    if not isinstance(dispatch_key, str) or not hasattr(torch._C.DispatchKey, dispatch_key):
        raise ValueError(f"dispatch_key must be the name of a torch dispatch key such as 'CUDA', got {dispatch_key!r}")


def _enable_sdpa(dispatch_key: str = "CUDA") -> None:
    _check_dispatch_key(dispatch_key)
    with _sdpa_lock:
        if dispatch_key in _sdpa_libs:
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns when a kernel overrides a built-in one
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            lib.impl(_SDPA_OP_NAME, _sdpa_backward_override, dispatch_key)
            lib.impl(_SDPA_FORWARD_OP_NAME, _sdpa_forward_override, dispatch_key)
        _sdpa_libs[dispatch_key] = lib


def _disable_sdpa(dispatch_key: str = "CUDA") -> None:
    _check_dispatch_key(dispatch_key)
    with _sdpa_lock:
        lib = _sdpa_libs.pop(dispatch_key, None)
        if lib is not None:
            lib._destroy()  # deregisters: torch's own kernel is the one dispatched again


def _sdpa_enabled(dispatch_key: str = "CUDA") -> bool:
    return dispatch_key in _sdpa_libs


class use_for_sdpa:
    """Make torch's efficient SDPA backend run our forward and backward (opt-in, reversible).

    As a context manager, ``with ops.use_for_sdpa(): ...`` turns it on (``enabled=False``:
    off) for the block and restores the previous state on exit; ``use_for_sdpa.enable()``,
    ``use_for_sdpa.disable()`` and ``use_for_sdpa.is_enabled()`` switch it for good.

    It registers CUDA kernels for ``aten::_scaled_dot_product_efficient_attention`` (our Hopper
    forward where ``ops.attention_fwd_sm90.unsupported`` finds no reason against it, else what
    torch's kernel does) and ``aten::_scaled_dot_product_efficient_attention_backward``; the
    latter transposes the [B, H, M, K] inputs and calls ``efficient_attention_backward`` when
    the dtype is fp16 / bf16 / fp32 (attention bias, its gradient and dropout included) and
    our op does not raise NotImplementedError; anything else goes to
    ``aten._efficient_attention_backward`` exactly as torch's wrapper calls it (one DEBUG
    line on logger ``cute_kernels`` says why). Disabling removes the registration, so torch's
    kernel is dispatched again. Process-wide (all threads), not nestable per thread.
    """

    enable = staticmethod(_enable_sdpa)
    disable = staticmethod(_disable_sdpa)
    is_enabled = staticmethod(_sdpa_enabled)

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self.enabled = enabled
        self._previous: List[bool] = []

    def __enter__(self):
        self._previous.append(_sdpa_enabled())
        (_enable_sdpa if self.enabled else _disable_sdpa)()
        return self

    def __exit__(self, *exc):
        (_enable_sdpa if self._previous.pop() else _disable_sdpa)()
        return False
