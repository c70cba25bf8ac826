"""What the LayerNorm / RMSNorm forward and backward row kernels share (Apex's kernel traits).

Rows are grid-strided over a persistent grid of ``ctas_per_col`` CTAs (times ``ctas_per_row``
along a row, one cluster).
"""

from layouts.layer_norm import SMEM_CARVEOUT, RowTiles


def launch(kernel, tiles: RowTiles, ctas_per_col, stream):
    """Launch a row kernel on its persistent grid of ``ctas_per_col`` CTAs (times
    ``ctas_per_row`` where a row spans a cluster)."""
    cpr = tiles.ctas_per_row
    shape = {"grid": [ctas_per_col, 1, 1]}
    if cpr > 1:
        shape = {"grid": [ctas_per_col * cpr, 1, 1], "cluster": [cpr, 1, 1]}
    kernel.launch(
        **shape,
        block=[tiles.num_threads, 1, 1],
        min_blocks_per_mp=tiles.ctas_per_sm,
        preferred_smem_carveout=SMEM_CARVEOUT,
        stream=stream,
    )
