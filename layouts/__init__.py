"""Every tile layout, swizzle, tiled copy and tiled MMA our kernels use, per architecture."""

from .catalogue import get, names
from .spec import TiledCopySpec

__all__ = ["TiledCopySpec", "get", "names"]
