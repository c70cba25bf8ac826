"""Fused bias + activation + dropout, forward and backward."""

from .dropout_bias_bwd import DropoutBiasBwd
from .dropout_bias_fwd import DropoutBiasFwd

__all__ = ["DropoutBiasBwd", "DropoutBiasFwd"]
