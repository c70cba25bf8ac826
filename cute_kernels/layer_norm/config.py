"""Choices of the LayerNorm / RMSNorm forward and backward that are not layouts: the rules
that pick their tiles (``ln_fwd_tiles``, ``ln_bwd_tiles``, ``finalize_tiles``) with the
measured constants they use, and the persistent grid the ops launch (``ctas_per_col``). The
tiles themselves (``LnFwdTiles``, ``LnBwdTiles``, ``LnBwdFinalizeTiles``) are
``layouts/layer_norm.py``.

Apex fixes one kernel-traits instance per hidden size. We keep its decomposition as
named configuration and derive it from (N, dtypes, arch) with one rule:

* ``vec`` (Apex ``ELTS_PER_LDG``): elements per access, 128 bits of the widest of x, dz,
  dx; the host narrows it when N, a stride or an address does not allow it.
* ``ldgs`` (``LDGS``): vectors per thread per row, at most ``ELEMS_PER_THREAD // vec``
  so that a thread's fp32 dgamma/dbeta accumulators stay in registers.
* ``threads_per_row`` (``THREADS_PER_ROW`` = 32 * ``WARPS_N``): the power of two that
  covers the row with that many vectors per thread; rows shorter than a warp share a
  warp (the all-reduce then runs over the row's lanes only).
* ``ctas_per_row`` (``CTAS_PER_ROW``): a row needing more than ``MAX_THREADS_PER_ROW``
  threads is split over a thread-block cluster (sm_90), whose CTAs exchange their row
  sums through distributed shared memory. Its CTAs then have ``CLUSTER_THREADS_PER_ROW``
  threads holding ``MAX_ELEMS_PER_THREAD`` elements each, one CTA per SM and
  ``CLUSTER_STAGES`` ring stages (512 threads only for rows too long for that).
* ``cluster_exchange`` (clusters only): ``"mbarrier"`` sends each warp's sums with
  ``st.async`` and waits on a per-buffer transaction-count mbarrier; ``"barrier"``
  stores them and waits at a full ``barrier.cluster`` per row (the original path).
* ``rows_per_cta`` (``ROWS_PER_CTA``, ``WARPS_M`` rows of warps): a CTA has at least
  ``MIN_THREADS_PER_CTA`` threads; short rows stack.
* ``stages``: depth of the shared-memory ring that cp.async fills ahead of the
  compute (memory-level parallelism without registers): each thread copies and later
  reads back only its own vectors, so the ring needs no barrier, only
  ``cp.async.wait_group``. Enough stages for ``BYTES_IN_FLIGHT`` per SM.
* ``ctas_per_sm``: persistent grid size from an estimate of registers per thread.

| N (bf16)      | vec | ldgs | threads/row | CTAs/row | rows/CTA |
|---------------|-----|------|-------------|----------|----------|
| 1             | 1   | 1    | 1           | 1        | 128      |
| 7             | 1   | 7    | 1           | 1        | 128      |
| 64            | 8   | 2    | 4           | 1        | 32       |
| 1000          | 8   | 2    | 64          | 1        | 2        |
| 4096          | 8   | 2    | 256         | 1        | 1        |
| 8192          | 8   | 2    | 512         | 1        | 1        |
| 16384         | 8   | 4    | 256         | 2        | 1        |
| 65536         | 8   | 4    | 256         | 8        | 1        |
| 131072        | 8   | 4    | 512         | 8        | 1        |

(tests/test_layer_norm_cpu.py checks this table against the rule.) fp32 halves
``vec`` and doubles ``ldgs``. sm_80 has no clusters: rows needing more than one CTA raise
``NotImplementedError`` there.

The forward (``ln_fwd_tiles``) splits a row by the same rule, so the table is its too: its
16 elements a thread are the row's x in fp32 plus gamma and beta kept in registers for the
whole persistent loop (Apex's forward keeps them there too). Only its CTAs per SM (its
register estimate: no accumulators, the parameters' own widths) and its ring (x alone)
differ; the x bytes in flight per SM are the backward's ``BYTES_IN_FLIGHT``.
"""

from __future__ import annotations

from dataclasses import replace

from layouts.layer_norm import (
    MAX_CLUSTER,
    MAX_CTAS_PER_SM,
    MAX_THREADS_PER_SM,
    MAX_VECTOR_BITS,
    REG_FILE,
    LnBwdFinalizeTiles,
    LnBwdTiles,
    LnFwdTiles,
    RowTiles,
)

ELEMS_PER_THREAD = 16  # elements of a row per thread: 2x16 fp32 accumulators + data in registers
MAX_ELEMS_PER_THREAD = 32  # beyond the largest cluster, threads take more of the row
MAX_THREADS_PER_ROW = 512  # per CTA; more threads per row go to more CTAs of a cluster
# A row split over a cluster: 256 threads per CTA holding 32 elements each, one CTA per SM,
# 3 ring stages (4096x16384 bf16 with the mbarrier exchange: 161 us; 512 threads x 16: 189 us)
CLUSTER_THREADS_PER_ROW = 256
CLUSTER_STAGES = 3
MIN_THREADS_PER_CTA = 128
# The forward stacks rows of 256 threads or more up to 512 threads a CTA: one all-reduce
# barrier serves them all (16384x4096 bf16 LayerNorm: 2 rows of 256 threads, 72 us, 94% of a
# copy; 1 row: 79 us, 86%). Rows of 64 threads stacked 8 high ran 2-5% slower than 2 high.
FWD_STACK_MIN_THREADS_PER_ROW = 256
FWD_MIN_THREADS_PER_CTA = 512
# Rows over a cluster of 4 or 8 CTAs of 256 threads: two CTAs per SM, so one cluster's exchange
# waits under another's work, though ptxas then spills 64 bytes (bf16 LayerNorm, against one
# CTA per SM: 2048x32768 113 us against 173, 1024x65536 165 against 210; a cluster of 2 at
# 4096x16384 ran slower, 108 against 83)
FWD_CLUSTER_CTAS_PER_SM = 2
FWD_CLUSTER_SHARED_MIN_CTAS = 4
# LayerNorm rows over 8 CTAs or more exchange once a row (each warp's sum and its centred squares
# about its own mean, merged as Chan's parallel variance), fewer twice (the sum, then the squares
# about the row's mean). bf16, H200, one / two exchanges (us): 1024x65536 112 / 167, 512x131072
# 161 / 266; 2048x32768 (4 CTAs) 118 / 115, 4096x16384 86 / 83, 16384x4096 82 / 72.
FWD_ONE_EXCHANGE_MIN_CTAS = 8
BYTES_IN_FLIGHT = (
    64 * 1024
)  # per SM: x and dz bytes the cp.async ring keeps loading (96 KiB: 3 stages at N=4096 bf16, 9% slower)
MAX_STAGES = 8
SMEM_PER_SM = 200 * 1024  # of the 227 KiB an H100 SM offers, what the rings may take
BASE_REGS = 24  # addresses, indices, row statistics
FWD_BASE_REGS = 32  # the forward's: with 24, ptxas spilled at N=64 (8 CTAs of 128) and N=4096 (3 of 256)
# finalize: (row threads, column threads) per CTA, fp32 vector per thread
FINALIZE_THREADS = (64, 8)  # 32 columns per CTA: N=4096 spreads over 128 CTAs (64 were 2x slower)
FINALIZE_VEC = 4
FINALIZE_ROWS_UNROLL = 4  # partial rows each thread loads before adding them


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def register_estimate(t: LnBwdTiles, in_bits: int, out_bits: int, w_bits: int, num_partials: int) -> int:
    """Accumulators, gamma (fp32), one row's raw data and its fp32 y and dy."""
    elems = t.ldgs * t.vec
    return BASE_REGS + (num_partials + 1 + 2) * elems + elems * (in_bits + out_bits) // 32


def fwd_register_estimate(t: LnFwdTiles, in_bits: int, param_bits: int) -> int:
    """One row's x in fp32, as loaded and as y stored; gamma and beta (``param_bits``: their widths added)."""
    elems = t.ldgs * t.vec
    return FWD_BASE_REGS + elems * (32 + 2 * in_bits + param_bits) // 32


def _row_split(n: int, vec: int, arch: str) -> tuple:
    """(ldgs, threads_per_row, ctas_per_row) for a row of ``n`` in ``vec``-element vectors
    (the rule of the module's doc)."""
    vectors = -(-n // vec)
    ldgs = max(1, ELEMS_PER_THREAD // vec)
    tpr = _pow2_at_least(-(-vectors // ldgs))
    cpr = 1
    if tpr > MAX_THREADS_PER_ROW:
        full = MAX_ELEMS_PER_THREAD // vec  # vectors per thread when threads hold the most
        cpr = _pow2_at_least(-(-vectors // (CLUSTER_THREADS_PER_ROW * full)))
        if cpr <= MAX_CLUSTER:
            tpr = CLUSTER_THREADS_PER_ROW
        else:  # the longest rows: more threads per CTA
            cpr = min(MAX_CLUSTER, tpr // MAX_THREADS_PER_ROW)
            tpr = MAX_THREADS_PER_ROW
        if cpr > 1 and not arch.startswith("sm_9"):
            raise NotImplementedError(
                f"N={n} needs {cpr} CTAs per row, which uses sm_90 thread-block clusters; "
                f"on {arch} rows up to {MAX_THREADS_PER_ROW * ldgs * vec} elements are supported"
            )
    ldgs = -(-vectors // (tpr * cpr))
    if ldgs * vec > MAX_ELEMS_PER_THREAD:
        raise NotImplementedError(
            f"N={n} is longer than the largest supported row "
            f"({MAX_CLUSTER * MAX_THREADS_PER_ROW * MAX_ELEMS_PER_THREAD} elements)"
        )
    return ldgs, tpr, cpr


def _check_row(n: int, vec: int, widest: int) -> None:
    if vec < 1 or vec & (vec - 1) or vec * widest > MAX_VECTOR_BITS:
        raise ValueError(f"vector of {vec} x {widest} bits is not a legal access")
    if n < 1:
        raise ValueError(f"row length must be >= 1, got {n}")


def ln_bwd_tiles(
    n: int,
    in_bits: int,
    out_bits: int,
    w_bits: int,
    vec: int,
    arch: str = "sm_90a",
    num_partials: int = 2,
    extra_bits: int = 0,
    **overrides,
) -> LnBwdTiles:
    """The tiles for a row of ``n`` elements (x/dx ``in_bits``, dz ``out_bits``, weight ``w_bits``).

    ``vec`` is the widest legal vector the host found; ``num_partials`` is how many
    fp32 column sums the kernel keeps (dgamma, dbeta and / or the fused dx_bias);
    ``extra_bits`` the element widths of further ring inputs (the fused gradient of r),
    added. ``overrides`` replace fields (measurement sweeps).
    """
    _check_row(n, vec, max(in_bits, out_bits))
    ldgs, tpr, cpr = _row_split(n, vec, arch)
    num_threads = max(tpr, MIN_THREADS_PER_CTA)
    rows_per_cta = num_threads // tpr
    t = LnBwdTiles(vec, ldgs, tpr, cpr, rows_per_cta, 2, 1)
    t = replace(t, **{k: v for k, v in overrides.items() if k not in ("ctas_per_sm", "stages")})
    out_bits += extra_bits  # the ring and the registers hold the extra inputs beside dz
    ctas_per_sm = overrides.get(
        "ctas_per_sm", _ctas_per_sm(t, register_estimate(t, in_bits, out_bits, w_bits, num_partials))
    )
    stage = t.stage_bytes(in_bits, out_bits)
    stages = max(2, min(MAX_STAGES, -(-BYTES_IN_FLIGHT // (stage * ctas_per_sm))))
    if t.ctas_per_row > 1:
        stages = max(stages, CLUSTER_STAGES)
    while (
        stages > 1 and ctas_per_sm * t.replace_stages(stages).smem_bytes(in_bits, out_bits, num_partials) > SMEM_PER_SM
    ):
        stages -= 1
    t = replace(t, ctas_per_sm=ctas_per_sm, stages=overrides.get("stages", stages))
    if t.max_n < n:
        raise ValueError(f"tiles cover {t.max_n} columns, fewer than N={n}")
    return t


def _ctas_per_sm(t: RowTiles, regs: int) -> int:
    """Resident CTAs per SM (ptxas's launch bound) for ``regs`` registers a thread."""
    regs = -(-regs // 8) * 8
    ctas = max(1, min(REG_FILE // (regs * t.num_threads), MAX_THREADS_PER_SM // t.num_threads, MAX_CTAS_PER_SM))
    if t.num_threads <= MAX_THREADS_PER_SM // 8 and t.ctas_per_row == 1:
        # ptxas fits two CTAs (min blocks per SM) with few spills; measured faster than one (backward)
        ctas = max(ctas, 2)
    return ctas


def ln_fwd_tiles(
    n: int, in_bits: int, param_bits: int, vec: int, arch: str = "sm_90a", extra_bits: int = 0, **overrides
) -> LnFwdTiles:
    """The forward's tiles for a row of ``n`` elements (x and y ``in_bits``; ``param_bits``:
    the widths of gamma and beta (and the fused x_bias) added, 0 without any). ``extra_bits``:
    the widths of further ring inputs (the fused residual) added, or, where wider, of r held
    in registers. ``vec`` is the widest legal vector the host found; ``overrides`` replace
    fields (measurement sweeps)."""
    _check_row(n, vec, max(in_bits, extra_bits))
    in_bits += extra_bits
    ldgs, tpr, cpr = _row_split(n, vec, arch)
    min_threads = FWD_MIN_THREADS_PER_CTA if tpr >= FWD_STACK_MIN_THREADS_PER_ROW and cpr == 1 else MIN_THREADS_PER_CTA
    rows_per_cta = max(tpr, min_threads) // tpr
    t = LnFwdTiles(vec, ldgs, tpr, cpr, rows_per_cta, 2, 1, one_exchange=cpr >= FWD_ONE_EXCHANGE_MIN_CTAS)
    t = replace(t, **{k: v for k, v in overrides.items() if k not in ("ctas_per_sm", "stages")})
    ctas_per_sm = _ctas_per_sm(t, fwd_register_estimate(t, in_bits, param_bits))
    if (
        t.ctas_per_row >= FWD_CLUSTER_SHARED_MIN_CTAS
        and t.num_threads * FWD_CLUSTER_CTAS_PER_SM <= MAX_THREADS_PER_SM // 4
    ):
        ctas_per_sm = max(ctas_per_sm, FWD_CLUSTER_CTAS_PER_SM)
    ctas_per_sm = overrides.get("ctas_per_sm", ctas_per_sm)
    stages = max(2, min(MAX_STAGES, -(-BYTES_IN_FLIGHT // (t.stage_bytes(in_bits) * ctas_per_sm))))
    if t.ctas_per_row > 1:
        stages = max(stages, CLUSTER_STAGES)
    while stages > 1 and ctas_per_sm * t.replace_stages(stages).smem_bytes(in_bits) > SMEM_PER_SM:
        stages -= 1
    t = replace(t, ctas_per_sm=ctas_per_sm, stages=overrides.get("stages", stages))
    if t.max_n < n:
        raise ValueError(f"tiles cover {t.max_n} columns, fewer than N={n}")
    return t


def finalize_tiles(n: int) -> LnBwdFinalizeTiles:
    vec = FINALIZE_VEC
    while n % vec:
        vec //= 2
    return LnBwdFinalizeTiles(vec, FINALIZE_THREADS, FINALIZE_ROWS_UNROLL)


def ctas_per_col(rows: int, t: RowTiles, num_sms: int) -> int:
    """Persistent grid: CTAs along the rows (Apex ``ctas_per_col``), also the partials' count."""
    row_blocks = max(1, -(-rows // t.rows_per_cta))
    resident = max(1, num_sms * t.ctas_per_sm // t.ctas_per_row)
    return min(row_blocks, resident)
