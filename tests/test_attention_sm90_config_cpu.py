"""CPU: the Hopper-native attention backward's kernel options (carry_dq, tail_m, the
heavy-first order and its chunks, persistent CTAs, dq_defer, dq_ready, store_first,
zero_ahead, the kernel class per head dims) are asked for where they apply, refused by
the kernel elsewhere, and keyed by one spelling of ``Sm90Config``."""

import dataclasses

import cutlass
import pytest

from cute_kernels.attention_sm90 import backward_config as bwd_config
from layouts import attention_sm90 as tiling
from ops import _compile as cc
from ops import attention_sm90 as S
from ops._disk_cache import stable_key

from .attention_sm90_common import PAIRS


def test_carry_dq_only_for_short_equal_tiles(monkeypatch):
    """The op asks for carry_dq where persistent CTAs walk equal tiles of at most
    CARRY_DQ_MAX_STEPS steps (query blocks x the query heads of a key head; 0: never)."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    t = bwd_config.attention_sm90_tiles(64)
    most = 8
    monkeypatch.setattr(bwd_config, "CARRY_DQ_MAX_STEPS", most)

    def carries(tiles, mask, rows_q, group, window=False, deterministic=False, varlen=False, bias=False, dropout=False):
        schedule = AttentionBackwardSm90.tile_schedule(tiles, mask, window, deterministic, varlen, bias, dropout)
        return S._carries_dq(tiles, schedule, rows_q, group)

    rows = lambda steps: steps * t.tile_m  # noqa: E731
    assert carries(t, 0, rows_q=rows(most), group=1)
    assert carries(t, 0, rows_q=rows(most) - t.tile_m + 1, group=1)
    assert not carries(t, 0, rows_q=rows(most) + 1, group=1)
    assert not carries(t, 0, rows_q=rows(most // 2) + 1, group=2)  # 2 heads x (most / 2 + 1) blocks
    assert carries(t, 0, rows_q=1, group=1)
    for mask, kw in (
        (1, {}),
        (0, dict(varlen=True)),
        (0, dict(deterministic=True)),
        (0, dict(bias=True)),
        (0, dict(dropout=True)),
    ):
        assert not carries(t, mask, rows_q=1, group=1, **kw), (mask, kw)
    for d in (96, 128, 192):
        assert not carries(bwd_config.attention_sm90_tiles(d), 0, rows_q=1, group=1)
    monkeypatch.setattr(bwd_config, "CARRY_DQ_MAX_STEPS", 0)
    assert not carries(t, 0, rows_q=1, group=1)


@pytest.mark.parametrize(
    "rows_q,tail",
    [(4096, 16), (2048, 48), (8192, 32), (81, 16), (129, 64), (1, 16), (4080, 0), (230, 0), (79, 0), (65, 0), (64, 64)],
)
def test_tail_rows(rows_q, tail):
    """The partial block's rows rounded up to 16, none where they would round to the whole 80."""
    t = bwd_config.attention_sm90_tiles(128)
    assert t.tile_m == 80 and t.tail_block and t.tail_rows(rows_q) == tail
    assert (
        not bwd_config.attention_sm90_tiles(64).tail_block and bwd_config.attention_sm90_tiles(64).tail_rows(100) == 0
    )
    assert not bwd_config.attention_sm90_tiles(128, bias_or_dropout=True).tail_block


def test_tail_m_only_where_the_kernel_takes_it(monkeypatch):
    """_plan asks for tail_m at d128 without varlen, bias or dropout; the kernel refuses it elsewhere."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    def key(**kw):
        args = dict(
            window=False,
            deterministic=False,
            varlen=False,
            bias=False,
            grad_bias=False,
            dropout=False,
            rows_q=4096,
            group=1,
            rows_k=4096,
            ctas=132,
        )
        args.update(kw)
        return S._plan(cutlass.BFloat16, 128, 128, args.pop("mask_type", 0), "sm_90a", **args)[2]

    assert key().tail_m == 16 and key(mask_type=1, window=True).tail_m == 16 and key(deterministic=True).tail_m == 16
    assert key(varlen=True).tail_m == 0 and key(bias=True).tail_m == 0 and key(dropout=True).tail_m == 0
    assert key(rows_q=4080).tail_m == 0
    monkeypatch.setattr(S, "TAIL_BLOCK", False)
    assert key().tail_m == 0
    t = bwd_config.attention_sm90_tiles(128)
    with pytest.raises(ValueError, match="tail_m 24"):
        AttentionBackwardSm90(cutlass.BFloat16, t, 0, tail_m=24)
    with pytest.raises(ValueError, match="tail_m 16"):
        AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(64), 0, tail_m=16)
    with pytest.raises(ValueError, match="without varlen"):
        AttentionBackwardSm90(cutlass.BFloat16, t, 0, varlen=True, tail_m=16)
    assert AttentionBackwardSm90(cutlass.BFloat16, t, 1, tail_m=64).tail_m == 64


def test_pairs_are_every_accepted_combination():
    """HEAD_DIM_PAIRS lists what head_dims_unsupported() accepts; Dqk 96 with a wide Dv is the
    one combination the tiles cannot take (its dQ quarters have no swizzle atom)."""
    dims = bwd_config.HEAD_DIMS
    accepted = {(a, b) for a in dims for b in dims if a != b and bwd_config.head_dims_unsupported(a, b) is None}
    assert set(PAIRS) == accepted and len(PAIRS) == len(set(PAIRS))
    assert {(128, 64), (64, 128), (192, 128)} <= accepted
    assert accepted.isdisjoint({(96, 192), (96, 256)})


@pytest.mark.parametrize("head_dim,head_dim_v", PAIRS)
def test_build_picks_the_kernel_class_for_pairs(monkeypatch, head_dim, head_dim_v):
    """The wider of the two head dims picks the decomposition; the tiles carry both."""
    from cute_kernels.attention_sm90.attention_backward_sm90_wide import AttentionBackwardSm90Wide

    built = []
    monkeypatch.setattr(cc, "compile_kernel", lambda kernel, *a, arch: built.append((kernel, a)))
    S._build(S.Sm90Config(cutlass.BFloat16, head_dim, head_dim_v, 1, "sm_90a"))
    ((kernel, args),) = built
    wide = max(head_dim, head_dim_v) > bwd_config.WIDE_FROM
    assert isinstance(kernel, AttentionBackwardSm90Wide) == wide
    assert (kernel.tiles.head_dim, kernel.tiles.head_dim_v) == (head_dim, head_dim_v)
    # q, k, v, do, lse, delta, dq_accum, dk, dv: Q / K / dQ / dK Dqk wide, V / dO / dV Dv wide
    widths = [a.shape[-1] for a in args[:9]]
    assert widths[:4] == [head_dim, head_dim, head_dim_v, head_dim_v] and widths[6:] == [head_dim, head_dim, head_dim_v]


def test_feature_flags_are_checked():
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    tiles = bwd_config.attention_sm90_tiles(64, bias_or_dropout=True)
    with pytest.raises(ValueError, match="grad_bias needs has_bias"):
        AttentionBackwardSm90(cutlass.BFloat16, tiles, 0, grad_bias=True)
    with pytest.raises(NotImplementedError, match="variable lengths"):
        AttentionBackwardSm90(cutlass.BFloat16, tiles, 0, varlen=True, has_bias=True)


@pytest.mark.parametrize(
    "mask_type,deterministic,lpt", [(0, False, False), (1, False, True), (2, False, True), (1, True, False)]
)
def test_heavy_first_order_only_where_it_applies(mask_type, deterministic, lpt):
    """Causal masks walk key blocks heavy-first; deterministic mode keeps the launch order
    its dQ turns rely on (a CTA must not wait for one that cannot launch)."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    kernel = AttentionBackwardSm90(
        cutlass.BFloat16, bwd_config.attention_sm90_tiles(64), mask_type, deterministic=deterministic
    )
    assert kernel.lpt is lpt


@pytest.mark.parametrize("seqlen_q,group,d", [(4096, 1, 128), (8192, 4, 64), (1, 1, 96), (10**7, 8, 128)])
def test_lpt_chunk_fits_the_l2_budget(seqlen_q, group, d):
    t = bwd_config.attention_sm90_tiles(d)
    per_head = group * seqlen_q * d * (2 * 2 + 4)  # Q, dO (bf16) and the fp32 dQ accumulator
    chunk = t.lpt_heads_per_chunk(seqlen_q, group)
    assert chunk >= 1 and (chunk == 1 or chunk * per_head <= bwd_config.LPT_L2_BYTES < (chunk + 1) * per_head)


def test_kv_buffers_choose_the_persistent_kernel():
    """Two K / V buffers: d64 without a bias or dropout; the kernel runs persistent CTAs on
    them only where every tile has the same work (no mask, no varlen) and nothing else keeps
    per-CTA state (determinism's turns, bias, dropout); otherwise it uses the first buffer."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    t = bwd_config.attention_sm90_tiles(64)
    assert t.kv_buffers == 2 and t.kv_barriers == 4
    for d in (96, 128):
        assert bwd_config.attention_sm90_tiles(d).kv_buffers == 1
    assert bwd_config.attention_sm90_tiles(64, bias_or_dropout=True).kv_buffers == 1
    k = AttentionBackwardSm90(cutlass.BFloat16, t, 0)
    assert k.persistent and not k.dynamic_tiles
    for mask in (1, 2):  # causal tiles differ in work: taken from a counter, heavy-first
        k = AttentionBackwardSm90(cutlass.BFloat16, t, mask)
        assert k.persistent and k.dynamic_tiles
        assert AttentionBackwardSm90.tile_schedule(t, mask) == "dynamic"
    assert AttentionBackwardSm90.tile_schedule(t, 0) == "persistent"
    assert AttentionBackwardSm90.tile_schedule(t, 1, has_window=True) == "dynamic"
    for kw in (dict(varlen=True), dict(deterministic=True)):
        assert not AttentionBackwardSm90(cutlass.BFloat16, t, 1, **kw).persistent, kw
        assert AttentionBackwardSm90.tile_schedule(t, 1, **kw) == "grid", kw
    assert not AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(128), 0).persistent
    assert bwd_config.attention_sm90_tiles(128).tile_ring == 0 < t.tile_ring
    # setmaxnreg.inc waits for registers the producer freed: the three warpgroups' counts must
    # fit the launch's 168 a thread slot (384 threads, 64 K registers), or the consumers hang
    launch_regs = 65536 // t.num_threads // 8 * 8
    for producer, consumer in (
        (bwd_config.PRODUCER_REGS, bwd_config.CONSUMER_REGS),
        (bwd_config.PRODUCER_REGS_PERSISTENT, bwd_config.CONSUMER_REGS_PERSISTENT),
    ):
        assert producer + tiling.NUM_CONSUMER_WG * consumer <= (1 + tiling.NUM_CONSUMER_WG) * launch_regs
        assert producer % 8 == 0 == consumer % 8 and 24 <= producer <= consumer <= 256
    with pytest.raises(ValueError, match="kv_buffers"):
        bwd_config.attention_sm90_tiles(64, kv_buffers=3)
    with pytest.raises(ValueError, match="carry_dq"):  # only over equal tiles
        AttentionBackwardSm90(cutlass.BFloat16, t, 1, carry_dq=True)
    with pytest.raises(ValueError, match="dq_defer"):
        bwd_config.attention_sm90_tiles(128, kv_buffers=2)


def test_heavy_first_order_walks_every_tile_once():
    """cute_kernels/attention_sm90/lpt_order.heavy_first_order: chunks of pairs, key blocks outer inside each,
    the last chunk narrower; every (key block, pair) exactly once."""
    from cute_kernels.attention_sm90.lpt_order import heavy_first_order

    order = heavy_first_order(3, 5, 2)
    assert sorted(order) == [(n, p) for n in range(3) for p in range(5)]
    assert order[:6] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert order[-3:] == [(0, 4), (1, 4), (2, 4)]  # the last chunk holds one pair


def test_makespan_is_list_scheduling():
    """Each CTA, in order, takes the SM that frees up first."""
    from cute_kernels.attention_sm90.lpt_order import makespan

    assert makespan([3, 3, 2, 2, 2], 2) == 7  # 3 | 3, then 2 + 2 on one and 2 on the other
    assert makespan([5, 1, 1, 1, 1, 1], 2) == 5
    assert makespan([], 4) == 0.0


@pytest.mark.parametrize(
    "b,h,s,d,fit,chosen", [(2, 16, 4096, 128, 6, 4), (1, 16, 8192, 128, 3, 2), (4, 16, 2048, 128, 12, 8)]
)
def test_lpt_chunk_by_the_model(b, h, s, d, fit, chosen):
    """The suite's causal d128 shapes on 132 SMs: the chunk that fits the L2 budget leaves the
    modelled makespan 13-15% over the ideal; the model's chunk (measured faster on the H100,
    docs/attention_sm90.md) comes within 3%; never more heads than fit."""
    from benchmarks.sm90_schedule import model_ratio

    t = bwd_config.attention_sm90_tiles(d)
    assert t.lpt_heads_per_chunk(s, 1, 2) == fit
    got = t.lpt_heads_per_chunk(s, 1, 2, seqlen_k=s, pairs=b * h, mask_type=1, num_sms=132)
    assert got == chosen <= fit
    assert model_ratio(t, b, h, s, fit, 132) > 1.13 and model_ratio(t, b, h, s, got, 132) < 1.03


def test_grad_bias_needs_a_keys_contiguous_ds_tile():
    """The bias gradient's TMA stores read dS rows of keys; the keys-contiguous tile alone is fine."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    with pytest.raises(ValueError, match="grad_bias needs tiles.ds_keys_contiguous"):
        AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(128), 0, has_bias=True, grad_bias=True)
    AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(128, ds_keys_contiguous=True), 0)


def test_config_key_is_one_spelling_and_the_benchmark_precompiles_it(monkeypatch):
    """``Sm90Config`` keeps one spelling per value (its repr names the disk-cache entry, and
    holds no address) and no device-side seed without dropout; the suite's precompile asks for
    the keys the op's calls will (causal top-left, features as flags, carry_dq by the steps a tile)."""
    monkeypatch.setattr(bwd_config, "CARRY_DQ_MAX_STEPS", 8)
    bf16 = cutlass.BFloat16
    loose = S.Sm90Config(bf16, 128.0, 64, 2, "sm_90a", window=1, dropout=1, rng_on_device=1, tail_m=32.0)
    key = S.Sm90Config(bf16, 128, 64, 2, "sm_90a", window=True, dropout=True, rng_on_device=True, tail_m=32)
    assert loose == key and repr(loose) == repr(key) and hash(loose) == hash(key)
    assert key.window is True and key.rng_on_device is True and key.tail_m == 32 and key.head_dim == 128
    assert " at 0x" not in repr(key) and stable_key((key,)) == f"({key!r},)"
    # the seed on the device only means something with dropout
    assert S.Sm90Config(bf16, 128, 64, 2, "sm_90a", rng_on_device=True).rng_on_device is False
    seen = []
    monkeypatch.setattr(S, "compiled", lambda config: seen.append(config))
    cases = [
        ((2, 16, 4096, 128), "bfloat16", True),
        ((2, 16, 4096, 128), "bfloat16", False, "bias_grad"),
        ((2, 16, 4096, 64), "float16", False, "dropout"),
        ((2, 16, 4096, 80), "bfloat16", False),
        ((8, 16, 1024, 64), "bfloat16", False),
        ((2, 16, 4096, 64), "bfloat16", False),
    ]
    assert S.compile_for_benchmark_cases(cases, "sm_90a") == 5 and S.compile_for_benchmark_cases(cases, "sm_80") == 0
    assert sorted(seen, key=str) == sorted(
        [
            S.Sm90Config(cutlass.BFloat16, 128, 128, 1, "sm_90a", store_first=True, tail_m=16),  # 4096 = 51 x 80 + 16
            S.Sm90Config(cutlass.BFloat16, 128, 128, 0, "sm_90a", bias=True, grad_bias=True, dq_ready=True),
            S.Sm90Config(cutlass.Float16, 64, 64, 0, "sm_90a", dropout=True, dq_ready=True),
            S.Sm90Config(cutlass.BFloat16, 64, 64, 0, "sm_90a", carry_dq=True, zero_ahead=True),  # 8 steps a tile
            S.Sm90Config(cutlass.BFloat16, 64, 64, 0, "sm_90a"),  # 32 (over ZERO_AHEAD_MAX_STEPS)
        ],
        key=str,
    )


def test_window_needs_a_causal_mask():
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90
    from cute_kernels.attention_sm90.attention_backward_sm90_wide import AttentionBackwardSm90Wide

    with pytest.raises(ValueError, match="causal"):
        AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(64), 0, has_window=True)
    with pytest.raises(ValueError, match="causal"):
        AttentionBackwardSm90Wide(cutlass.BFloat16, bwd_config.attention_sm90_tiles(256), 0, has_window=True)


@pytest.mark.parametrize("head_dim", bwd_config.HEAD_DIMS)
def test_build_picks_the_kernel_class(monkeypatch, head_dim):
    """d192 / d256 take the wide decomposition (its own tiles and kernel class), the others the base."""
    from cute_kernels.attention_sm90.attention_backward_sm90_wide import AttentionBackwardSm90Wide

    built = []
    monkeypatch.setattr(cc, "compile_kernel", lambda kernel, *a, arch: built.append(kernel))
    S._build(S.Sm90Config(cutlass.BFloat16, head_dim, head_dim, 1, "sm_90a"))
    (kernel,) = built
    wide = head_dim > bwd_config.WIDE_FROM
    assert isinstance(kernel, AttentionBackwardSm90Wide) == wide
    assert isinstance(kernel.tiles, bwd_config.AttentionSm90WideTiles) == wide


def test_dq_defer_without_bias_or_dropout():
    """The deferred dQ's barriers do not order the bias gradient's stores or the keep flags."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    t = bwd_config.attention_sm90_tiles(64)
    for kw in (dict(has_bias=True), dict(dropout=True)):
        with pytest.raises(ValueError, match="without a bias or dropout"):
            AttentionBackwardSm90(cutlass.BFloat16, t, 0, **kw)
    AttentionBackwardSm90(cutlass.BFloat16, t, 1, has_window=True, deterministic=True, varlen=True)


def test_dq_ready_needs_a_cta_per_tile():
    """The kernel counts a CTA's key block at its end: persistent CTAs refuse dq_ready."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    with pytest.raises(ValueError, match="dq_ready"):
        AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(64), 0, dq_ready=True)
    assert AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(128), 0, dq_ready=True).dq_ready


def test_store_first_where_every_query_block_is_seen():
    """The op stores each query block's first dQ (no zeroed accumulator) only where some key
    block sees every query block and the adds are not ordered or per sequence."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    t = bwd_config.attention_sm90_tiles(128)
    assert t.store_first and not bwd_config.attention_sm90_tiles(64).store_first
    assert not bwd_config.attention_sm90_tiles(128, bias_or_dropout=True).store_first
    first = lambda mask, sq, sk, **kw: S._stores_first(
        kw.get("tiles", t),
        mask,
        kw.get("window", False),  # noqa: E731
        kw.get("det", False),
        kw.get("varlen", False),
        sq,
        sk,
    )
    assert first(0, 700, 300) and first(1, 900, 100) and first(1, 100, 900) and first(2, 500, 500)
    assert first(2, 400, 900)
    assert not first(2, 900, 400)  # bottom-right, Sq > Sk: the first query blocks see no key
    assert not first(1, 500, 500, window=True) and not first(0, 500, 500, det=True)
    assert not first(0, 500, 500, varlen=True) and not first(0, 500, 0)
    assert not first(0, 500, 500, tiles=bwd_config.attention_sm90_tiles(64))  # (measured slower there)
    for kw in (dict(deterministic=True), dict(varlen=True)):
        with pytest.raises(ValueError, match="store_first"):
            AttentionBackwardSm90(cutlass.BFloat16, t, 0, store_first=True, **kw)
    assert AttentionBackwardSm90(cutlass.BFloat16, t, 0, store_first=True).rotates
    assert not AttentionBackwardSm90(cutlass.BFloat16, t, 1, store_first=True).rotates


def test_zero_ahead_where_persistent_ctas_know_their_next_tile():
    """The kernel zeroes the accumulator itself only on persistent CTAs where every query block
    is reached by some key block, never beside store_first: over equal tiles (no mask: every
    query block has an owner, a CTA's next tile is c + grid) while a head's key blocks fit the
    grid and tiles are short; with tiles from the counter (causal) from a counter of zeroing
    jobs. Without a mask the key blocks share a head's query blocks, each owned once."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    most = bwd_config.ZERO_AHEAD_MAX_STEPS
    assert S._zeroes_ahead("persistent", False, 8, 132, 8) and S._zeroes_ahead("persistent", False, 132, 132, most)
    assert not S._zeroes_ahead("persistent", False, 133, 132, 8)  # 16896+ keys a head on an H100
    assert not S._zeroes_ahead("persistent", False, 8, 132, most + 1)  # long tiles: the per-step cost wins
    assert S._zeroes_ahead("dynamic", False, 8, 132, 8) and S._zeroes_ahead("dynamic", False, 200, 132, 200)
    assert not S._zeroes_ahead("dynamic", False, 8, 132, 8, reached=False)  # a window, bottom-right Sq > Sk
    assert not S._zeroes_ahead("grid", False, 8, 132, 8) and not S._zeroes_ahead("persistent", True, 8, 132, 8)
    t64, t128 = bwd_config.attention_sm90_tiles(64), bwd_config.attention_sm90_tiles(128)
    assert AttentionBackwardSm90(cutlass.BFloat16, t64, 0, zero_ahead=True).zero_ahead
    assert AttentionBackwardSm90(cutlass.BFloat16, t64, 1, zero_ahead=True).dynamic_tiles
    for args, kw in (
        ((t128, 0), {}),
        ((t64, 0), dict(store_first=True)),
        ((t64, 1), dict(has_window=True)),
        ((t64, 0), dict(varlen=True)),
        ((t64, 0), dict(deterministic=True)),
    ):
        with pytest.raises(ValueError, match="zero_ahead"):
            AttentionBackwardSm90(cutlass.BFloat16, *args, zero_ahead=True, **kw)
    # whole blocks of rows zeroed: a tile_m that does not divide the accumulator's row rounding is refused
    t80 = dataclasses.replace(t64, tile_m=80, dq_swapab=True)
    with pytest.raises(ValueError, match="rounded to"):
        AttentionBackwardSm90(cutlass.BFloat16, t80, 0, zero_ahead=True)
    # the shares (owned_blocks' arithmetic): contiguous, every query block once
    for m_blocks in range(1, 20):
        for n_blocks in range(1, 20):
            owned = []
            for n in range(n_blocks):
                lo = (n * m_blocks + n_blocks - 1) // n_blocks
                hi = ((n + 1) * m_blocks + n_blocks - 1) // n_blocks
                owned += range(lo, hi)
            assert owned == list(range(m_blocks))
