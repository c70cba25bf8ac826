"""clear_dkv_accum, after PyTorch's ``clear_dKVaccum``: zero the fp32 dK and dV
accumulators ([B, H_k, seqlen_k_rounded, kHeadDim]) before a backward that adds into
them, with GmemTiledCopydQaccum's 128-bit stores.
"""

import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32

from layouts.attention_bwd_prepost import PrepostTiles

from .seqlen import block_coords
from .tile_io import clear_tile


class ClearDKVAccum:
    def __init__(self, tiles: PrepostTiles):
        self.tiles = tiles

    @cute.jit
    def __call__(self, mdKaccum: cute.Tensor, mdVaccum: cute.Tensor, stream: cuda.CUstream):
        copy = self.tiles.gmem_tiled_copy_dq_accum().build(Float32)
        self.kernel(mdKaccum, mdVaccum, copy).launch(
            grid=self.tiles.grid(
                cute.ceil_div(mdKaccum.shape[2], self.tiles.block_m), mdKaccum.shape[0], mdKaccum.shape[1]
            ),
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mdKaccum: cute.Tensor, mdVaccum: cute.Tensor, copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, bidb, bidh = block_coords(self.tiles, mdKaccum.shape[1])
        tile = self.tiles.tile
        rows_left = mdKaccum.shape[2] - n_block * tile[0]
        thr = copy.get_slice(tidx)
        tc = thr.partition_D(cute.make_identity_tensor(tile))
        for mAcc in (mdKaccum, mdVaccum):
            tg = thr.partition_D(cute.local_tile(mAcc[bidb, bidh, None, None], tile, (n_block, 0)))
            clear_tile(copy, tg, tc, rows_left)
