"""Which tile (key block, key head, batch) each CTA of an attention kernel runs.

Three schedulers, one ``Params`` (the grid's extent in tiles and the heavy-first order's L2
chunk):

- ``GridTileScheduler``: a CTA a tile, placed by the hardware (``cta_coords``); with ``lpt``
  (causal masks) the 1-D grid walks the tiles heavy-first (``coords_of``).
- ``PersistentTileScheduler``: a CTA per multiprocessor walking tiles c, c + grid, ...
- ``DynamicTileScheduler``: persistent, each CTA's next tile taken from a zeroed counter by its
  producer warp (``fetch_tile``), in the heavy-first order, and handed to the CTA's other warps
  through a ring in shared memory (``publish_tile`` / ``take_tile``): list scheduling, as the
  hardware does it for a CTA per tile, for tiles that differ in work.

The backward's tiles are key blocks (each walks the query blocks that see it); a forward's
would be query blocks: the order is the same with the roles of the blocks swapped.
"""

from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class TileSchedulerParams:
    """Tiles per head (``n_blocks``), key heads, batches (sequences), and the heavy-first order's
    chunk of (batch, head) pairs that run side by side (``heads_per_chunk``)."""

    n_blocks: Any
    heads_kv: Any
    batches: Any
    heads_per_chunk: Any

    @property
    def total(self):
        return self.n_blocks * self.heads_kv * self.batches


@dataclass(frozen=True)
class TileRing:
    """``DynamicTileScheduler``: the ring's pipeline (one producer thread, every other warp
    consuming), its slots in shared memory (int32 tile indices) and the global tile counter."""

    pipe: Any
    slots: Any
    counter: Any


@dataclass(frozen=True)
class GridTileScheduler:
    """A CTA a tile. ``lpt``: the heavy-first order (causal masks)."""

    lpt: bool = False

    @cute.jit
    def cta_coords(self, params: TileSchedulerParams):
        """(key block, key head, batch) of this CTA. With ``lpt`` (causal masks) the 1-D grid
        is walked heavy-first: key block n sees the query blocks from its diagonal on, so
        block 0 carries the most work; all (batch, head) pairs of a chunk of
        ``heads_per_chunk`` take block 0, then block 1, ... (the light blocks fill the last
        wave instead of a head's block 0 starting late). The chunk keeps the Q / dO / dQ
        rows the running CTAs share within L2."""
        if const_expr(not self.lpt):
            return cute.arch.block_idx()
        cta, _, _ = cute.arch.block_idx()
        return self.coords_of(params, cta)

    @cute.jit
    def coords_of(self, params: TileSchedulerParams, cta):
        """(key block, key head, batch) of the CTA (or persistent tile) of linear index ``cta``:
        ``cta_coords``'s heavy-first order with ``lpt``, else the grid's (key blocks fastest)."""
        n_blocks, heads_kv, heads_per_chunk = params.n_blocks, params.heads_kv, params.heads_per_chunk
        if const_expr(not self.lpt):
            bh = cta // n_blocks
            batch = bh // heads_kv
            return cta - bh * n_blocks, bh - batch * heads_kv, batch
        per_chunk = heads_per_chunk * n_blocks
        chunk = cta // per_chunk
        r = cta - chunk * per_chunk
        first = chunk * heads_per_chunk
        width = heads_kv * params.batches - first  # the last chunk may hold fewer heads
        if width > heads_per_chunk:
            width = heads_per_chunk
        n_block = r // width
        bh = first + r - n_block * width
        batch = bh // heads_kv
        return n_block, bh - batch * heads_kv, batch


@dataclass(frozen=True)
class PersistentTileScheduler(GridTileScheduler):
    """CTA c runs tiles c, c + grid, ... (``step``: the grid's size)."""

    @cute.jit
    def publish_tile(self, ring_args, tile, ring):
        """The producer warp hands ``tile`` to the other warps (each computes it itself here)."""
        return ring

    @cute.jit
    def fetch_tile(self, ring_args, tile, step):
        """The producer warp's next tile."""
        return tile + step

    @cute.jit
    def take_tile(self, ring_args, tile, step, ring):
        """Every other warp's next tile."""
        return tile + step, ring


@dataclass(frozen=True)
class DynamicTileScheduler(PersistentTileScheduler):
    """CTA c runs tile c, then whichever the counter hands out next (grid + k). ``ring_args``:
    ``TileRing``; ``ring``: this warp's state in it."""

    @cute.jit
    def publish_tile(self, ring_args: TileRing, tile, ring):
        """The producer warp hands ``tile`` to the other warps through the ring."""
        ring_args.pipe.producer_acquire(ring)
        with cute.arch.elect_one():
            ring_args.slots[ring.index] = tile
            ring_args.pipe.producer_commit(ring)
        ring.advance()
        return ring

    @cute.jit
    def fetch_tile(self, ring_args: TileRing, tile, step):
        """The producer warp's next tile: the counter's next (the first ``step`` tiles are the
        CTAs' own)."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(ring_args.counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(taken, 0) + step

    @cute.jit
    def take_tile(self, ring_args: TileRing, tile, step, ring):
        """Every other warp's next tile: the ring's next."""
        ring_args.pipe.consumer_wait(ring)
        tile = ring_args.slots[ring.index]
        ring_args.pipe.consumer_release(ring)
        ring.advance()
        return tile, ring


def tile_scheduler(schedule: str, lpt: bool) -> GridTileScheduler:
    """The scheduler of ``schedule`` ("grid", "persistent" or "dynamic")."""
    kind = {"grid": GridTileScheduler, "persistent": PersistentTileScheduler, "dynamic": DynamicTileScheduler}
    return kind[schedule](lpt)
