"""LayerNorm / RMSNorm backward: the row kernel and the finalize reduction of dgamma/dbeta."""

from .ln_bwd import LnBwd
from .ln_bwd_finalize import LnBwdFinalize

__all__ = ["LnBwd", "LnBwdFinalize"]
