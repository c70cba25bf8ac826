"""Argument checks shared by the ops: clear errors, naming the argument, before any launch."""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import Tensor


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


def rows_view(name: str, t: Tensor) -> Tensor:
    """``t`` as [rows, N] without a copy, its last dim contiguous.

    Size-1 dims get canonical strides so that alignment reasoning sees real steps only.
    """
    n = t.shape[-1]
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
