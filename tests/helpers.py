"""Helpers shared by the tests."""

import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (floats) or 0xFF bytes so unwritten elements show."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1 if t.dtype.is_signed else 255)
    return t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff
