"""Every tile layout, swizzle, tiled copy and tiled MMA our kernels use, per architecture."""

from .spec import TiledCopySpec

__all__ = ["TiledCopySpec"]
