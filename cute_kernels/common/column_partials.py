"""Column sums across CTAs, deterministic and in one launch.

A streaming kernel that reduces over rows cannot finish its column sums inside one
CTA. Each CTA folds its row-threads into one fp32 partial per column of its tile
(``store``); then it takes a ticket (an integer atomic on its column tile's counter)
and the CTA that arrives last folds all partials of that tile (``finish``) in a fixed
order: lane l adds chunks l, l + L, l + 2L, ..., then the L lanes are added in order.
Which CTA comes last changes nothing in the result, so it repeats bit for bit, with
no float atomics and no second kernel. The last CTA resets the counter to zero, so the
counters are reusable by the next launch on the same stream.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


class ColumnPartials:
    """Folding of a CTA's [tile_m, tile_n] fp32 column sums, then of the tile's partials.

    ``lanes`` threads share a column in ``finish`` (each with its own subset of
    chunks), so the last CTA keeps ``lanes`` loads in flight per column.
    """

    def __init__(self, tile_m: int, tile_n: int, num_threads: int):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_threads = num_threads
        # threads per column in `finish` (at least one; at most the CTA's threads)
        self.lanes = max(1, num_threads // tile_n)

    def smem_size_bytes(self) -> int:
        return 4 * (self.tile_m * self.tile_n + self.lanes * self.tile_n + 4)

    @cute.jit
    def store(self, sAcc: cute.Tensor, mPartial: cute.Tensor, chunk: Int32, col_tile: Int32, tidx: Int32):
        """sAcc [tile_m, tile_n] (already written, barrier done) -> mPartial[chunk, tile cols]."""
        n = mPartial.shape[1]
        for j in cutlass.range_constexpr(cute.ceil_div(self.tile_n, self.num_threads)):
            c = tidx + j * self.num_threads
            if c < self.tile_n:
                total = sAcc[0, c]
                for r in cutlass.range(1, self.tile_m, unroll=8):  # rows in order
                    total = total + sAcc[r, c]
                gcol = col_tile * self.tile_n + c
                if gcol < n:
                    mPartial[chunk, gcol] = total

    @cute.jit
    def finish(
        self,
        mPartial: cute.Tensor,
        mCounter: cute.Tensor,
        mOut: cute.Tensor,
        col_tile: Int32,
        tidx: Int32,
        sFold: cute.Tensor,  # [lanes, tile_n] fp32
        sFlag: cute.Tensor,  # [1] Int32
    ):
        """Call after ``store`` by every thread: the last CTA of the column tile writes mOut."""
        num_chunks, n = mPartial.shape
        # Release this CTA's partials to the GPU before taking the ticket.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            ticket = cute.arch.atomic_add(mCounter.iterator + col_tile, Int32(1), sem="acq_rel", scope="gpu")
            sFlag[0] = Int32(0)
            if ticket == num_chunks - 1:
                sFlag[0] = Int32(1)
                mCounter[col_tile] = Int32(0)  # every CTA of this tile has arrived
        cute.arch.sync_threads()
        if sFlag[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            for j in cutlass.range_constexpr(cute.ceil_div(self.tile_n * self.lanes, self.num_threads)):
                t = tidx + j * self.num_threads
                c = t % self.tile_n
                lane = t // self.tile_n
                if lane < self.lanes:
                    gcol = col_tile * self.tile_n + c
                    acc = Float32(0.0)
                    if gcol < n:
                        for k in cutlass.range(lane, num_chunks, self.lanes, unroll=8):
                            acc = acc + mPartial[k, gcol]
                    sFold[lane, c] = acc
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(cute.ceil_div(self.tile_n, self.num_threads)):
                c = tidx + j * self.num_threads
                gcol = col_tile * self.tile_n + c
                if c < self.tile_n and gcol < n:
                    total = sFold[0, c]
                    for lane in cutlass.range_constexpr(1, self.lanes):
                        total = total + sFold[lane, c]
                    mOut[gcol] = total.to(mOut.element_type)
