"""CPU: the Hopper-native attention backward's tiles agree with the tables of
``cute_kernels/attention_sm90/backward_config.py`` (every head dim and (Dqk, Dv) pair), fit
shared memory with dropout's keep flags, take whole swizzle atoms, refuse bad overrides, and
the layouts catalogue's forms of them match the kernel's DSL layouts."""

import dataclasses
import re

import cutlass
import pytest

from cute_kernels.attention_sm90 import backward_config as bwd_config
from layouts import attention_sm90 as tiling

from .attention_sm90_common import PAIRS


@pytest.mark.parametrize("head_dim", bwd_config.HEAD_DIMS)
def test_keep_flags_fit(head_dim):
    """Dropout's two keep-flag buffers (a bit per element of the block) fit beside every tile
    set dropout runs on, and each consumer thread draws whole 16-key half-words of one query row."""
    t = bwd_config.attention_sm90_tiles(head_dim, bias_or_dropout=True)
    keys, queries = t.sdp_wg_tile
    assert keys * queries * tiling.NUM_CONSUMER_WG == t.tile_m * t.tile_n  # the warpgroups cover the block
    assert t.keep_flag_keys % 16 == 0 and keys % t.keep_flag_keys == 0
    assert t.smem_bytes(dropout=True) - t.smem_bytes() >= tiling.KEEP_FLAG_BUFFERS * t.keep_flag_bytes
    assert t.smem_bytes(dropout=True) <= tiling.SMEM_LIMIT


def test_smem_bytes_is_the_structs_size():
    """SharedStorage's size is a multiple of its 1 KiB alignment, and without dropout it has
    no keep-flag member: d64 with two dQ staging buffers (tile_m 128) then needs exactly the
    limit, and launched on the H100 (with a one-byte placeholder member the DSL sized it
    233472 bytes and refused the launch)."""
    for d in bwd_config.HEAD_DIMS:
        for bias_or_dropout in (False, True):
            t = bwd_config.attention_sm90_tiles(d, bias_or_dropout=bias_or_dropout)
            assert t.smem_bytes() % tiling.SMEM_ALIGN == 0 == t.smem_bytes(dropout=True) % tiling.SMEM_ALIGN
    t = dataclasses.replace(bwd_config.attention_sm90_tiles(64), dq_stages=2, kv_buffers=1)
    assert t.tile_m == 128 and t.smem_bytes() == tiling.SMEM_LIMIT == 232448
    # the default d64 tiles spend the same 32 KiB on a second K / V buffer instead
    t = bwd_config.attention_sm90_tiles(64)
    assert t.kv_buffers == 2 and t.smem_bytes() == tiling.SMEM_LIMIT
    assert t.smem_bytes() - dataclasses.replace(t, kv_buffers=1).smem_bytes() == 2 * 128 * 64 * 2


def test_query_tiles_follow_bias_and_dropout():
    """d64 steps 128 queries (the warpgroups split dQ's rows, each hands its own 64 rows to the
    store warp: the staging atoms tile columns first, so those rows are one TMA box) and d128
    80 (dQ^T = K^T dS^T, one dS barrier), with or without a causal mask; a bias or dropout
    (registers, dropout's flags) keeps 64."""
    t = bwd_config.attention_sm90_tiles(64)
    assert (t.tile_m, t.dq_order, t.dq_swapab) == (128, (1, 0), False)
    # each block's dQ a step late (its own dS barriers), both dQ buffers freed first
    assert (t.dq_defer, t.pds_split, t.dq_empty_early) == (True, False, True)
    t = bwd_config.attention_sm90_tiles(64, bias_or_dropout=True)
    assert (t.tile_m, t.dq_order, t.dq_defer) == (64, (0, 1), False)
    assert not bwd_config.attention_sm90_tiles(128).dq_defer
    t = bwd_config.attention_sm90_tiles(128)
    assert (t.tile_m, t.dq_swapab, t.pds_split, t.stats_stage_stride) == (80, True, False, 96)
    assert not t.dq_empty_early and bwd_config.attention_sm90_tiles(96).dq_empty_early  # (measured per tile)
    t = bwd_config.attention_sm90_tiles(128, bias_or_dropout=True)
    assert (t.tile_m, t.dq_swapab, t.pds_split, t.stats_stage_stride) == (64, False, True, 64)
    # dropout's flags fit beside every tile set it runs on, not beside tile_m 80
    assert bwd_config.attention_sm90_tiles(128).smem_bytes(dropout=True) > tiling.SMEM_LIMIT


def test_dkv_tma_store_on_the_base_tiles_only():
    """dK / dV leave through shared memory and a TMA store on the base tiles (every mask, bias
    or dropout); the wide tiles split dK / dV's head dim between the warpgroups and store
    from registers."""
    for d, kw in ((64, {}), (96, {}), (128, {}), (128, dict(bias_or_dropout=True)), (64, dict(head_dim_v=128))):
        assert bwd_config.attention_sm90_tiles(d, **kw).dkv_tma_store, (d, kw)
    assert not bwd_config.attention_sm90_tiles(192).dkv_tma_store
    with pytest.raises(ValueError, match="dkv_tma_store False"):
        bwd_config.attention_sm90_tiles(256, dkv_tma_store=True)


# --------------------------------------------------------------------------- tiles


def _table():
    """{head_dim: row} from the markdown table in the module docstring of cute_kernels/attention_sm90/backward_config.py."""
    rows = {}
    for line in bwd_config.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells[0].isdigit():
            d, tile_m, tile_n, stages, ds_stages, consumers, smem = cells
            wgs, threads = (int(x) for x in consumers.split("x"))
            rows[int(d)] = dict(
                tile_m=int(tile_m),
                tile_n=int(tile_n),
                stages=int(stages),
                ds_stages=int(ds_stages),
                consumers=(wgs, threads),
                smem_kib=int(smem.split()[0]),
            )
    return rows


def test_table_covers_the_head_dims():
    assert sorted(_table()) == sorted(bwd_config.HEAD_DIMS)


@pytest.mark.parametrize("head_dim", bwd_config.HEAD_DIMS)
def test_tiles_match_the_table(head_dim):
    row = _table()[head_dim]
    t = bwd_config.attention_sm90_tiles(head_dim)
    assert (t.tile_m, t.tile_n, t.stages, t.ds_stages) == (
        row["tile_m"],
        row["tile_n"],
        row["stages"],
        row["ds_stages"],
    )
    assert row["consumers"] == (tiling.NUM_CONSUMER_WG, 128)
    assert t.num_threads == 128 * (tiling.NUM_CONSUMER_WG + 1) and t.num_mma_threads == 128 * tiling.NUM_CONSUMER_WG
    assert t.smem_bytes() <= tiling.SMEM_LIMIT and -(-t.smem_bytes() // 1024) == row["smem_kib"]
    if head_dim > bwd_config.WIDE_FROM:
        # both warpgroups own all 64 keys and split the head dim of dK / dV (P^T and dS^T in shared memory)
        assert isinstance(t, bwd_config.AttentionSm90WideTiles) and t.tile_n == 64 and t.ds_buffers == 2 * t.ds_stages
        assert t.q_slice_cols == head_dim // 2 and t.dq_slice_cols == t.k_slice_cols == head_dim // 4
        assert not t.dq_per_wg  # a warpgroup's dQ columns are two quarters of d: one joint handoff
        # a thread's dK + dV accumulators (fp32) and one dQ quarter fit the consumers' registers with room
        assert 2 * t.tile_n * head_dim // t.num_mma_threads + t.tile_m * t.dq_slice_cols // 128 <= 160
    else:
        assert not isinstance(t, bwd_config.AttentionSm90WideTiles)
        assert t.tile_n == 64 * tiling.NUM_CONSUMER_WG  # each consumer warpgroup owns 64 keys
        assert t.ds_buffers == t.ds_stages
    # the dQ product covers the tile with the warpgroups it has
    am, an = t.dq_atoms
    assert am * an == tiling.NUM_CONSUMER_WG
    if t.dq_swapab:  # dQ^T: the head dim on wgmma's M, the queries on N
        assert am == 1 and (head_dim // an) % 64 == 0 and t.tile_m % 8 == 0
    else:
        assert (t.tile_m // am) % 64 == 0 and (head_dim // an) % 8 == 0


@pytest.mark.parametrize("head_dim", [32, 80, 160, 224, 320])
def test_other_head_dims_are_not_implemented(head_dim):
    with pytest.raises(NotImplementedError, match=re.escape(str(bwd_config.HEAD_DIMS))):
        bwd_config.attention_sm90_tiles(head_dim)


# (Q / dO, K / V, fp32 dQ staging) swizzle-atom columns: the module docstring's paragraph
ATOM_COLS = {64: (64, 64, 32), 96: (32, 16, 16), 128: (64, 64, 32), 192: (32, 16, 16), 256: (64, 64, 32)}


@pytest.mark.parametrize("head_dim", bwd_config.HEAD_DIMS)
def test_swizzle_atoms(head_dim):
    """Every column slice a wgmma or a dQ reduce-add takes of a tile starts on a whole
    atom; d96's 192-byte rows get narrower atoms than the 128-byte ones."""
    t = bwd_config.attention_sm90_tiles(head_dim)
    q, k, dq = (
        tiling.atom_cols(t.q_slice_cols, 16),
        tiling.atom_cols(t.k_slice_cols, 16),
        tiling.atom_cols(t.dq_slice_cols, 32),
    )
    assert (q, k, dq) == ATOM_COLS[head_dim]
    assert t.q_slice_cols % q == 0 and t.k_slice_cols % k == 0 and t.dq_slice_cols % dq == 0
    # one warpgroup's dQ columns (wide tiles: of each of the two halves computed in turn)
    assert t.k_slice_cols == head_dim // t.dq_atoms[1] // (2 if head_dim > bwd_config.WIDE_FROM else 1)


def _pair_table():
    """{(Dqk, Dv): row} from the Dqk != Dv table of cute_kernels/attention_sm90/backward_config.py."""
    rows = {}
    for line in bwd_config.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and re.fullmatch(r"\d+ / \d+", cells[0]):
            dqk, dv = (int(x) for x in cells[0].split(" / "))
            kernel, tile_m, tile_n, stages, regs, smem = cells[1:]
            rows[dqk, dv] = dict(
                wide=kernel == "wide",
                tile_m=int(tile_m),
                tile_n=int(tile_n),
                stages=int(stages),
                regs=int(regs),
                smem_kib=int(smem.split()[0]),
            )
    return rows


def test_pair_table_covers_the_pairs():
    assert sorted(_pair_table()) == sorted(PAIRS)


@pytest.mark.parametrize("head_dim,head_dim_v", PAIRS)
def test_pair_tiles_match_the_table(head_dim, head_dim_v):
    """The wider head dim picks the tiles; Q / K / dQ are Dqk wide, dO / V Dv wide, and a
    thread's dK + dV accumulators stay within the equal head dims' largest (128 fp32)."""
    row = _pair_table()[head_dim, head_dim_v]
    t = bwd_config.attention_sm90_tiles(head_dim, head_dim_v=head_dim_v)
    assert (t.head_dim, t.head_dim_v) == (head_dim, head_dim_v)
    wide = max(head_dim, head_dim_v) > bwd_config.WIDE_FROM
    assert isinstance(t, bwd_config.AttentionSm90WideTiles) == wide == row["wide"]
    assert (t.tile_m, t.tile_n, t.stages) == (row["tile_m"], row["tile_n"], row["stages"])
    assert t.smem_bytes() <= tiling.SMEM_LIMIT and -(-t.smem_bytes() // 1024) == row["smem_kib"]
    # base: 64 keys x (Dqk + Dv) per warpgroup; wide: 64 keys x (Dqk + Dv) / 2: tile_n (Dqk + Dv) / 256 either way
    assert t.tile_n * (head_dim + head_dim_v) // t.num_mma_threads == row["regs"] <= 128
    # one stage fewer only where two do not fit (d256's rule)
    assert t.stages == 2 or dataclasses.replace(t, stages=2).smem_bytes() > tiling.SMEM_LIMIT
    # the smem sum, member by member: Q / dO stages, K / V, dS (and P), fp32 dQ staging
    elems = (t.stages * t.tile_m + t.tile_n) * (head_dim + head_dim_v) + t.ds_buffers * t.tile_m * t.tile_n
    assert t.smem_bytes() >= 2 * elems + 4 * t.tile_m * head_dim


@pytest.mark.parametrize("head_dim,head_dim_v", PAIRS)
def test_swizzle_atoms_of_pairs(head_dim, head_dim_v):
    """dO's MN-major slices (dV's N) follow Dv, Q's and K's Dqk; V (read K-major only) takes
    the widest atom for its Dv columns. Every slice is whole atoms."""
    t = bwd_config.attention_sm90_tiles(head_dim, head_dim_v=head_dim_v)
    halves = 2 if isinstance(t, bwd_config.AttentionSm90WideTiles) else 1
    assert (t.q_slice_cols, t.do_slice_cols, t.v_slice_cols) == (head_dim // halves, head_dim_v // halves, head_dim_v)
    for cols, bits in (
        (t.q_slice_cols, 16),
        (t.do_slice_cols, 16),
        (t.k_slice_cols, 16),
        (t.v_slice_cols, 16),
        (t.dq_slice_cols, 32),
    ):
        assert cols % tiling.atom_cols(cols, bits) == 0
    assert tiling.atom_cols(t.v_slice_cols, 16) == max(c for c in (64, 32, 16) if head_dim_v % c == 0)


def test_equal_head_dims_keep_their_layouts():
    """head_dim_v defaults to head_dim, and then V shares K's layout (its atoms follow K's
    dQ slices), as before Dqk != Dv."""
    for d in bwd_config.HEAD_DIMS:
        t = bwd_config.attention_sm90_tiles(d)
        assert t.head_dim_v == d and t == bwd_config.attention_sm90_tiles(d, head_dim_v=d)
        assert t.v_slice_cols == t.k_slice_cols and t.do_slice_cols == t.q_slice_cols


def test_tile_overrides_are_checked():
    with pytest.raises(ValueError, match="tile_m must be 64 or 128"):
        bwd_config.attention_sm90_tiles(64, tile_m=32)
    with pytest.raises(ValueError, match="tile_n"):
        bwd_config.attention_sm90_tiles(128, tile_n=64)
    with pytest.raises(ValueError, match="need tile_m 64 and tile_n 64"):
        bwd_config.attention_sm90_tiles(256, tile_n=128)
    with pytest.raises(ValueError, match="ds_stages 2"):
        bwd_config.attention_sm90_tiles(192, ds_stages=1)
    with pytest.raises(ValueError, match="dq_per_wg False"):
        bwd_config.attention_sm90_tiles(256, dq_per_wg=True)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        bwd_config.attention_sm90_tiles(256, stages=2)  # two Q / dO stages of d256: 257 KiB
    # dq_defer: two dS buffers at least, every wgmma of a step in the step, its own barriers
    with pytest.raises(ValueError, match="ds_stages >= 2"):
        bwd_config.attention_sm90_tiles(64, ds_stages=1)
    with pytest.raises(ValueError, match="overlap 'none'"):
        bwd_config.attention_sm90_tiles(64, overlap="s")
    with pytest.raises(ValueError, match="pds_split False"):
        bwd_config.attention_sm90_tiles(64, pds_split=True)
    with pytest.raises(ValueError, match="dq_defer False"):
        bwd_config.attention_sm90_tiles(192, dq_defer=True)
    bwd_config.attention_sm90_tiles(128, dq_defer=True)  # d128 may take it (measured slower: it spills)
    # dK / dV by every consumer thread's 16-byte stores: staged in shared memory, whole rows a pass
    with pytest.raises(ValueError, match="dkv_vector_store stores the dK / dV that dkv_tma_store stages"):
        bwd_config.attention_sm90_tiles(64, dkv_tma_store=False)
    with pytest.raises(ValueError, match="do not split evenly"):
        bwd_config.attention_sm90_tiles(96, dkv_vector_store=True)
    assert [
        bwd_config.attention_sm90_tiles(d, head_dim_v=dv).dkv_vector_store
        for d, dv in ((64, 64), (128, 128), (128, 64), (96, 96), (96, 128), (192, 192))
    ] == [True] * 3 + [False] * 3


# ------------------------------------------------------------------ catalogue


CATALOGUE_DIMS = [(d, d) for d in bwd_config.HEAD_DIMS] + [(128, 64), (64, 96), (192, 128), (256, 96)]
# with a bias or dropout d64 / d128 take other tiles; the bias gradient a keys-contiguous dS
CATALOGUE_OPTIONS = [(d, d, dict(bias_or_dropout=True)) for d in (64, 128)] + [
    (64, 64, dict(bias_or_dropout=True, ds_keys_contiguous=True))
]


@pytest.mark.compile
@pytest.mark.parametrize("d,dv,options", [(d, dv, {}) for d, dv in CATALOGUE_DIMS] + CATALOGUE_OPTIONS)
def test_catalogue_forms_match_the_kernel_layouts(d, dv, options):
    """The catalogue's algebra forms of the shared-memory tiles give the offsets of the DSL
    layouts the kernel allocates (their swizzles act on byte addresses), atoms included;
    with Dqk != Dv also dO's and V's."""
    import cutlass.cute as cute

    from layouts.algebra import Swizzle, parse_layout
    from layouts.attention_sm90_smem import smem_layouts_algebra

    t = bwd_config.attention_sm90_tiles(d, head_dim_v=dv, **options)
    printed = {}
    bf16 = cutlass.BFloat16
    layouts = {  # made while tracing
        "smem_q": lambda: cute.select(t.smem_layout_q(bf16), mode=[0, 1]),
        "smem_k": lambda: cute.select(t.smem_layout_k(bf16), mode=[0, 1]),  # one buffer (d64 holds two)
        "smem_ds": lambda: cute.select(t.smem_layout_ds(bf16), mode=[0, 1]),
        "smem_dq": lambda: cute.select(t.smem_layout_dq(), mode=[0, 1]),
    }
    if dv != d:
        layouts.update(
            smem_do=lambda: cute.select(t.smem_layout_do(bf16), mode=[0, 1]),
            smem_v=lambda: cute.select(t.smem_layout_v(bf16), mode=[0, 1]),
        )

    @cute.jit
    def trace():
        for name, make in layouts.items():
            lay = make()
            printed[name] = (str(lay.inner), str(lay.outer))

    cute.compile(trace)
    forms = smem_layouts_algebra(t)
    assert sorted(forms) == sorted(printed)
    for name, (layout, dtype, _) in forms.items():
        inner, outer = printed[name]
        bits = layout.swizzle.bits
        assert inner == f"S<{bits},4,3>", (name, inner)  # the same atom, on bytes
        dsl, byte_swizzle, elem = parse_layout(outer), Swizzle(bits, 4, 3), 2 if dtype == "bf16" else 4
        assert dsl.size() == layout.size(), name
        for i in range(layout.size()):
            assert layout(i) == byte_swizzle(dsl(i) * elem) // elem, (name, i)
