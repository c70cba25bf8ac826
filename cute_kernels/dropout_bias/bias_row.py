"""The bias vector of a thread's columns, shared by the dropout + bias forward and backward:
both kernels walk rows with one vector of columns a thread, so the bias (broadcast over
rows) is loaded once into registers."""

import cutlass.cute as cute


@cute.jit
def load_bias_row(copy: cute.TiledCopy, thr, mBias: cute.Tensor, rows, n, tile, col_tile, col_ok):
    """The thread's vector of ``mBias`` [N] for column tile ``col_tile`` (zeros past N): a
    [rows, N] view with row stride 0 partitioned as the rows are."""
    mBiasRows = cute.make_tensor(mBias.iterator, cute.make_layout((rows, n), stride=(0, 1)))
    tBg = thr.partition_S(cute.local_tile(mBiasRows, tile, (0, col_tile)))
    rBias = cute.make_rmem_tensor_like(tBg[None, 0, 0])
    rBias.fill(0.0)
    if col_ok:
        cute.copy(copy, tBg[None, 0, 0], rBias)
    return rBias
