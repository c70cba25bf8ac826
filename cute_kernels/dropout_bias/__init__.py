"""Fused dropout + bias (+ activation) backward."""

from .dropout_bias_bwd import DropoutBiasBwd

__all__ = ["DropoutBiasBwd"]
