"""Argument checks shared by the ops: clear errors, naming the argument, before any launch."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch
from torch import Tensor

from ._memo import Memo


def check_tensor(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_cuda(name: str, t) -> None:
    check_tensor(name, t)
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")


def check_same_device(name: str, t, ref: Tensor) -> None:
    check_tensor(name, t)
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {ref.device}")


def check_dtype(name: str, t: Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_shape(name: str, t: Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_probability(name: str, p) -> None:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(p).__name__}")
    if not (0.0 <= float(p) < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {p}")


def check_float(name: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise TypeError(f"{name} must be a finite float, got {x!r}")


def check_int(name: str, x, low: int = 0) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if int(x) < low:
        raise ValueError(f"{name} must be >= {low}, got {x}")


_validated = Memo()  # metadata keys whose checks passed


def validate_once(parts, check) -> None:
    """Run ``check`` once per metadata signature of ``parts`` (host time matters).

    Tensors enter the key by type, shape, strides, dtype and device, everything else by
    type and value; unhashable arguments always get the full check, and so does a
    trace (torch.compile runs the checks once per graph anyway; Dynamo cannot hash).
    Checks of per-call values (scales, probabilities) belong outside ``check``.
    """
    if torch.compiler.is_compiling():
        check()
        return
    key = tuple(
        [(type(p), p.shape, p.stride(), p.dtype, p.device) if isinstance(p, Tensor) else (type(p), p) for p in parts]
    )
    try:
        known = key in _validated
    except TypeError:  # an unhashable argument: let the full check name it
        check()
        return
    if not known:
        check()
        _validated.put(key, True)


def kernel_ready(t: Tensor, vec: int = 1) -> Tensor:
    """``t`` as it is where a kernel can read it, else a dense copy.

    For the gradients autograd hands to a backward, whose layout the caller does not
    choose: ``.sum()`` gives an expanded tensor (every stride 0), a transposed or sliced
    view any strides. Readable as it is: last dim contiguous, no broadcast (stride-0)
    dim, every other stride and the address multiples of ``vec`` elements (the kernels'
    vector and TMA accesses).
    """
    if t.numel() == 0:
        return t
    # the usual case first: dense, rows a multiple of vec (so every stride is), aligned
    if (
        t.is_contiguous()
        and t.shape[-1] % vec == 0
        and (type(t) is not Tensor or t.data_ptr() % (vec * t.element_size()) == 0)
    ):
        return t
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    outer = [st for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1]
    if any(st == 0 or st % vec for st in outer):
        return t.contiguous()
    # a traced (fake) tensor has no address: the launch checks it on the real one; a misaligned
    # one may be contiguous already (``contiguous()`` would hand it back): a fresh copy then
    if type(t) is Tensor and t.data_ptr() % (vec * t.element_size()):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def rows_view(name: str, t: Tensor) -> Tensor:
    """``t`` as [rows, N] without a copy, its last dim contiguous.

    Size-1 dims get canonical strides so that alignment reasoning sees real steps only.
    """
    n = t.shape[-1]
    if n > 0 and t.is_contiguous():  # the common case, cheap on the per-call path
        return t if t.dim() == 2 else t.view(-1, n)
    try:
        v = t.view(-1, n)
    except RuntimeError as e:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
            f"[rows, {n}] without a copy; pass {name}.contiguous()"
        ) from e
    rows = v.shape[0]
    row_stride = v.stride(0) if rows > 1 else n
    col_stride = v.stride(1) if n > 1 else 1
    if col_stride != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {v.stride(1)}); pass {name}.contiguous()")
    if (row_stride, col_stride) != v.stride():
        v = v.as_strided((rows, n), (row_stride, col_stride))
    return v
