"""Plain torch references: the ground truth of the tests and the 'torch' peer of the benchmarks."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor


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
