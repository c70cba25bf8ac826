"""LayerNorm / RMSNorm: the forward row kernel; the backward's row kernel and the finalize
reduction of dgamma/dbeta."""

from .ln_bwd import LnBwd
from .ln_bwd_finalize import LnBwdFinalize
from .ln_fwd import LnFwd

__all__ = ["LnBwd", "LnBwdFinalize", "LnFwd"]
