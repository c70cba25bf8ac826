"""CPU: the Hopper-native attention backward (``ops.attention_sm90``) compiles for every
configuration it serves, its tiles agree with the table of ``cute_kernels/attention_sm90/backward_config.py``,
``unsupported()`` names each feature it does not take (without CUDA calls for CPU, meta
or fake tensors), and the ``backend=`` dispatch of ``efficient_attention_backward`` /
``memory_efficient_attention`` picks the kernel the rules say, stopping before any launch
(both backends' implementations are replaced by recorders)."""

import dataclasses
import logging
import math
import re

import cutlass
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from cute_kernels.attention_sm90 import backward_config as bwd_config
from layouts import attention_sm90 as tiling
from ops import _compile as cc
from ops._disk_cache import stable_key
from ops import attention as A
from ops import attention_checks as AC
from ops import attention_sm90 as S
from ops import attention_common as C
from ops import mem_eff_attention as M
from ops.attention_common import AttentionBackwardArgs

from .helpers import trace_custom_ops

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CONFIGS = [
    (dt, d, mask) for dt in (cutlass.BFloat16, cutlass.Float16) for d in bwd_config.HEAD_DIMS for mask in (0, 1, 2)
]
# a sliding window comes with a causal mask only
WINDOW_CONFIGS = [
    (dt, d, mask) for dt in (cutlass.BFloat16, cutlass.Float16) for d in bwd_config.HEAD_DIMS for mask in (1, 2)
]


# ------------------------------------------------------------------------- compile


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [cutlass.BFloat16, cutlass.Float16], ids=["bf16", "fp16"])
def test_compiles_carry_dq(dtype):
    """Persistent d64 CTAs over short tiles: a tile's last dQ in the next tile's step 0."""
    assert callable(S._build(S.Sm90Config(dtype, 64, 64, 0, "sm_90a", carry_dq=True)))


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


@pytest.mark.compile
@pytest.mark.parametrize(
    "dtype,head_dim,mask_type", CONFIGS, ids=[f"{dt.__name__}-d{d}-mask{m}" for dt, d, m in CONFIGS]
)
def test_compiles(dtype, head_dim, mask_type):
    assert callable(S._build(S.Sm90Config(dtype, head_dim, head_dim, mask_type, "sm_90a")))


@pytest.mark.compile
@pytest.mark.parametrize(
    "dtype,head_dim,mask_type", WINDOW_CONFIGS, ids=[f"{dt.__name__}-d{d}-mask{m}" for dt, d, m in WINDOW_CONFIGS]
)
def test_compiles_with_window(dtype, head_dim, mask_type):
    assert callable(S._build(S.Sm90Config(dtype, head_dim, head_dim, mask_type, "sm_90a", window=True)))


# (mask, window, deterministic, tail_m): d128's partial last query block on narrower products
TAIL_CONFIGS = [
    (0, False, False, 16),
    (0, False, False, 32),
    (1, False, False, 48),
    (2, False, False, 64),
    (1, True, False, 16),
    (1, False, True, 32),
]


@pytest.mark.compile
@pytest.mark.parametrize("mask_type,window,deterministic,tail_m", TAIL_CONFIGS)
def test_compiles_partial_last_block(mask_type, window, deterministic, tail_m):
    first = not deterministic and not window
    assert callable(
        S._build(
            S.Sm90Config(
                cutlass.BFloat16,
                128,
                128,
                mask_type,
                "sm_90a",
                window=window,
                deterministic=deterministic,
                dq_ready=mask_type == 0 and not deterministic,
                store_first=first,
                tail_m=tail_m,
            )
        )
    )


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


DETERMINISTIC_CONFIGS = [
    (64, 0, False),
    (96, 0, False),
    (128, 1, False),
    (64, 2, True),
    (128, 1, True),
    (192, 0, False),
    (192, 2, True),
    (256, 0, False),
    (256, 1, True),
]


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,mask_type,window", DETERMINISTIC_CONFIGS)
def test_compiles_deterministic(head_dim, mask_type, window):
    """dQ added in key-block order: the store warp's semaphore wait / release."""
    assert callable(
        S._build(
            S.Sm90Config(cutlass.BFloat16, head_dim, head_dim, mask_type, "sm_90a", window=window, deterministic=True)
        )
    )


VARLEN_CONFIGS = [
    (64, 0, False, False),
    (96, 2, False, False),
    (128, 1, False, False),
    (64, 1, True, False),
    (128, 2, True, True),
    (96, 0, False, True),
    (192, 1, False, False),
    (192, 2, True, True),
    (256, 0, False, True),
    (256, 2, True, False),
]  # (head dim, mask, window, deterministic)


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,mask_type,window,deterministic", VARLEN_CONFIGS)
def test_compiles_varlen(head_dim, mask_type, window, deterministic):
    """Packed sequences (cu_seqlens): per-sequence row offsets of every TMA view and store."""
    assert callable(
        S._build(
            S.Sm90Config(
                cutlass.BFloat16,
                head_dim,
                head_dim,
                mask_type,
                "sm_90a",
                window=window,
                deterministic=deterministic,
                varlen=True,
            )
        )
    )


# ------------------------------------------------------------- Dqk != Dv


PAIRS = bwd_config.HEAD_DIM_PAIRS  # every supported (Dqk, Dv) with Dqk != Dv
# each pair: bf16 without a mask and causal, fp16 bottom-right
PAIR_CONFIGS = [
    (dt, dqk, dv, mask)
    for dqk, dv in PAIRS
    for dt, mask in ((cutlass.BFloat16, 0), (cutlass.BFloat16, 1), (cutlass.Float16, 2))
]


@pytest.mark.compile
@pytest.mark.parametrize(
    "dtype,head_dim,head_dim_v,mask_type",
    PAIR_CONFIGS,
    ids=[f"{dt.__name__}-d{a}-dv{b}-mask{m}" for dt, a, b, m in PAIR_CONFIGS],
)
def test_compiles_unequal_head_dims(dtype, head_dim, head_dim_v, mask_type):
    assert callable(S._build(S.Sm90Config(dtype, head_dim, head_dim_v, mask_type, "sm_90a")))


# (Dqk, Dv, mask, window, deterministic, varlen): the other features on a base and a wide pair
PAIR_FEATURE_CONFIGS = [
    (dqk, dv, mask, window, det, varlen)
    for dqk, dv in ((128, 64), (192, 128))
    for mask, window, det, varlen in (
        (1, True, False, False),
        (2, True, False, False),
        (1, False, True, False),
        (0, False, False, True),
        (2, True, True, True),
    )
]


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,head_dim_v,mask_type,window,deterministic,varlen", PAIR_FEATURE_CONFIGS)
def test_compiles_unequal_head_dims_with_features(head_dim, head_dim_v, mask_type, window, deterministic, varlen):
    """Sliding window, deterministic dQ order and packed sequences with Dqk != Dv."""
    assert callable(
        S._build(
            S.Sm90Config(
                cutlass.BFloat16,
                head_dim,
                head_dim_v,
                mask_type,
                "sm_90a",
                window=window,
                deterministic=deterministic,
                varlen=varlen,
            )
        )
    )


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


# (head dim, mask, window, deterministic, varlen, bias, bias gradient, dropout)
FEATURE_CONFIGS = [
    (64, 0, False, False, False, True, True, True),
    (64, 1, False, False, False, False, False, True),
    (64, 2, True, False, False, True, False, False),
    (96, 2, True, False, False, True, True, False),
    (96, 0, False, False, True, False, False, True),
    (128, 1, False, False, False, True, True, True),
    (128, 0, False, False, False, True, False, False),
    (128, 1, True, True, False, True, True, True),
    (128, 2, False, False, True, False, False, True),
    (192, 1, False, False, False, True, True, True),
    (192, 0, False, True, True, False, False, True),
    (256, 2, True, False, False, False, False, True),
    (256, 0, False, False, False, True, True, False),
]


def _feature_id(c):
    d, mask, window, det, varlen, bias, grad_bias, dropout = c
    flags = [
        n
        for n, on in (
            ("window", window),
            ("det", det),
            ("varlen", varlen),
            ("bias", bias),
            ("dbias", grad_bias),
            ("dropout", dropout),
        )
        if on
    ]
    return f"d{d}-mask{mask}-" + "-".join(flags)


@pytest.mark.compile
@pytest.mark.parametrize("config", FEATURE_CONFIGS, ids=[_feature_id(c) for c in FEATURE_CONFIGS])
def test_compiles_with_bias_and_dropout(config):
    """Bias (any strides), its gradient and dropout's keep flags, alone and with the other features."""
    d, mask, window, det, varlen, bias, grad_bias, dropout = config
    assert callable(
        S._build(
            S.Sm90Config(
                cutlass.Float16,
                d,
                d,
                mask,
                "sm_90a",
                window=window,
                deterministic=det,
                varlen=varlen,
                bias=bias,
                grad_bias=grad_bias,
                dropout=dropout,
            )
        )
    )


@pytest.mark.compile
@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (64, 128), (192, 128), (256, 96)])
def test_compiles_unequal_head_dims_with_bias_and_dropout(head_dim, head_dim_v):
    assert callable(
        S._build(
            S.Sm90Config(cutlass.BFloat16, head_dim, head_dim_v, 1, "sm_90a", bias=True, grad_bias=True, dropout=True)
        )
    )


def test_feature_flags_are_checked():
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    tiles = bwd_config.attention_sm90_tiles(64, bias_or_dropout=True)
    with pytest.raises(ValueError, match="grad_bias needs has_bias"):
        AttentionBackwardSm90(cutlass.BFloat16, tiles, 0, grad_bias=True)
    with pytest.raises(NotImplementedError, match="variable lengths"):
        AttentionBackwardSm90(cutlass.BFloat16, tiles, 0, varlen=True, has_bias=True)


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


@pytest.mark.compile
def test_d96_compiles_without_dq_per_wg(monkeypatch):
    """The dQ staging atom follows the warpgroups' 48-column slices, not the reduce-add box:
    one joint handoff of the whole tile compiles too (32-column atoms could not be partitioned)."""
    tiles = bwd_config.attention_sm90_tiles
    monkeypatch.setattr(bwd_config, "attention_sm90_tiles", lambda d, *a, **kw: tiles(d, *a, dq_per_wg=False, **kw))
    assert callable(S._build(S.Sm90Config(cutlass.BFloat16, 96, 96, 1, "sm_90a")))


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


def test_dq_defer_without_bias_or_dropout():
    """The deferred dQ's barriers do not order the bias gradient's stores or the keep flags."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    t = bwd_config.attention_sm90_tiles(64)
    for kw in (dict(has_bias=True), dict(dropout=True)):
        with pytest.raises(ValueError, match="without a bias or dropout"):
            AttentionBackwardSm90(cutlass.BFloat16, t, 0, **kw)
    AttentionBackwardSm90(cutlass.BFloat16, t, 1, has_window=True, deterministic=True, varlen=True)


# --------------------------------------------------------------------- unsupported()


def _problem(b=2, sq=100, sk=130, h=3, d=64, dv=None, hk=None, dtype=BF16, device="cpu"):
    """(query, key, value, grad_out, out) [B, S, H, D] tensors of one problem."""
    dv = d if dv is None else dv
    hk = h if hk is None else hk
    e = lambda *s: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
    return e(b, sq, h, d), e(b, sk, hk, d), e(b, sk, hk, dv), e(b, sq, h, dv), e(b, sq, h, dv)


def _sm90(grad_out, query, key, value, out, logsumexp, scale, mask_type=0, **kw):
    """attention_backward_sm90 of these arguments."""
    args = AttentionBackwardArgs(
        grad_out=grad_out,
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        scale=scale,
        custom_mask_type=mask_type,
        **kw,
    )
    return S.attention_backward_sm90(args)


def _misaligned_query():
    q, k, v, do, o = _problem()
    shifted = torch.zeros(q.numel() + 1, dtype=BF16)[1:].view(q.shape)  # 2 bytes past the allocation
    return shifted, k, v, do, o


def _row_strided_query():
    q, k, v, do, o = _problem()
    return torch.zeros(2, 100, 3, 68, dtype=BF16)[..., :64], k, v, do, o  # head stride 68: not 16 bytes


UNSUPPORTED = [
    # (id, problem, keyword arguments, fragment of the reason)
    ("fp32", lambda: _problem(dtype=F32), {}, "dtype torch.float32"),
    ("head-dim-80", lambda: _problem(d=80), {}, "head dims 80 / 80"),
    ("head-dim-320", lambda: _problem(d=320), {}, "head dims 320 / 320"),
    ("dqk-96-dv-192", lambda: _problem(d=96, dv=192), {}, "head dims 96 / 192 (Dqk 96 with Dv 192"),
    ("dqk-96-dv-256", lambda: _problem(d=96, dv=256), {}, "24-column quarters"),
    ("dv-80", lambda: _problem(d=128, dv=80), {}, "head dims 128 / 80"),
    ("dv-320", lambda: _problem(d=192, dv=320), {}, "head dims 192 / 320"),
    ("heads-not-grouped", lambda: _problem(h=4, hk=3), {}, "query heads 4 not a multiple of key heads 3"),
    ("mask-3", _problem, dict(mask_type=3), "mask type 3"),
    ("misaligned", _misaligned_query, {}, "query is not TMA-aligned"),
    ("row-stride", _row_strided_query, {}, "query is not TMA-aligned"),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_names_the_feature(case):
    _, problem, kw, fragment = case
    reason = S.unsupported(*problem(), arch="sm_90a", **kw)
    assert reason is not None and fragment in reason, reason


@pytest.mark.parametrize("mask_type", [0, 1, 2])
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F16, 96), (F16, 128), (BF16, 192), (F16, 256)])
def test_supported_problems(dtype, d, mask_type):
    assert S.unsupported(*_problem(d=d, dtype=dtype), mask_type=mask_type, arch="sm_90a") is None
    # [B, H, S, D] tensors seen as [B, S, H, D] (SDPA's layout), more queries than keys
    q, k, v, do, o = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _problem(sq=200, sk=70, d=d, dtype=dtype))
    assert S.unsupported(q, k, v, do, o, mask_type=mask_type, window_size=0, dropout_p=0.0, arch="sm_90a") is None
    if mask_type:  # with a sliding window too
        assert S.unsupported(q, k, v, do, o, mask_type=mask_type, window_size=16, arch="sm_90a") is None
    for hk in (1, 3):  # multi-query, grouped-query (H 6)
        assert S.unsupported(*_problem(h=6, hk=hk, d=d, dtype=dtype), mask_type=mask_type, arch="sm_90a") is None


@pytest.mark.parametrize("head_dim,head_dim_v", PAIRS)
def test_supported_problems_with_unequal_head_dims(head_dim, head_dim_v):
    for mask_type in (0, 1, 2):
        assert S.unsupported(*_problem(d=head_dim, dv=head_dim_v), mask_type=mask_type, arch="sm_90a") is None
    assert (
        S.unsupported(*_problem(d=head_dim, dv=head_dim_v, dtype=F16), mask_type=1, window_size=16, arch="sm_90a")
        is None
    )
    assert S.unsupported(*_problem(h=6, hk=2, d=head_dim, dv=head_dim_v), mask_type=2, arch="sm_90a") is None


@pytest.mark.parametrize("remembered", [False, True])
def test_unsupported_checks_addresses_on_every_call(monkeypatch, remembered):
    """Addresses are checked on every call (the same metadata at another address gets its own
    verdict), and the first tensor in argument order with a bad address or bad strides is named.
    ``remembered``: as for CUDA tensors, whose verdicts at aligned addresses are remembered by
    metadata (here CPU tensors that say they are on CUDA)."""
    if remembered:
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(S, "_verdicts", S.Memo())
    q, k, v, do, o = _problem(sq=64, sk=64)
    assert S.unsupported(q, k, v, do, o, arch="sm_90a") is None
    shifted = torch.zeros(k.numel() + 8, dtype=BF16)[8:].view(k.shape)  # 16 bytes in: aligned
    assert S.unsupported(q, shifted, v, do, o, arch="sm_90a") is None
    shifted = torch.zeros(k.numel() + 1, dtype=BF16)[1:].view(k.shape)  # same metadata, 2 bytes in
    assert "key is not TMA-aligned" in S.unsupported(q, shifted, v, do, o, arch="sm_90a")
    assert S.unsupported(q, k, v, do, o, arch="sm_90a") is None
    strided = torch.zeros(*o.shape[:-1], 68, dtype=BF16)[..., :64]  # out: head stride not 16 bytes
    assert "out is not TMA-aligned" in S.unsupported(q, k, v, do, strided, arch="sm_90a")
    assert "key is not TMA-aligned" in S.unsupported(q, shifted, v, do, strided, arch="sm_90a")
    # only aligned calls were remembered: one verdict per metadata (and arch) seen
    assert len(S._verdicts) == (2 if remembered else 0)


def test_unsupported_remembers_the_verdict_not_the_addresses(monkeypatch):
    """A remembered verdict is keyed by what it depends on: metadata, the mask type and the arch."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(S, "_verdicts", S.Memo())
    problem = _problem(h=4, hk=3)
    for _ in range(2):
        assert "not a multiple" in S.unsupported(*problem, arch="sm_90a")
        assert S.unsupported(*problem, arch="sm_80") == "needs sm_90a, the device is sm_80"
        assert S.unsupported(*_problem(d=64), arch="sm_90a") is None
        assert "mask type 3" in S.unsupported(*_problem(d=64), mask_type=3, arch="sm_90a")
    assert len(S._verdicts) == 4


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_100a"])
def test_other_archs_get_a_reason(arch):
    assert S.unsupported(*_problem(), arch=arch) == f"needs sm_90a, the device is {arch}"


def _no_cuda_calls(monkeypatch):
    def refuse(*a):
        raise AssertionError("a CUDA device was queried")

    monkeypatch.setattr(cc, "device_arch", refuse)


def test_no_arch_without_a_real_cuda_tensor(monkeypatch):
    """CPU, meta and fake CUDA tensors: no device query, a reason instead of a guess."""
    _no_cuda_calls(monkeypatch)
    assert "the device is cpu" in S.unsupported(*_problem())
    meta = _problem(device="meta")
    assert cc.tensor_arch(meta[0]) is None and "the device is meta" in S.unsupported(*meta)
    with FakeTensorMode():
        fake = _problem(device="cuda")
        assert cc.tensor_arch(fake[0]) is None
        assert "no CUDA arch known" in S.unsupported(*fake)
        # with the arch given, fake tensors are judged on their metadata (no data_ptr)
        assert S.unsupported(*fake, mask_type=2, arch="sm_90a") is None
        assert "not a multiple" in S.unsupported(*_problem(h=4, hk=3, device="cuda"), arch="sm_90a")
    assert S.unsupported(*meta, arch="sm_90a") is None


# ------------------------------------------------------------ host: dQ / dK / dV sizes


@pytest.mark.parametrize("dq_head_dim,fused", [(None, True), (64, True), (128, False), (192, False)])
def test_preprocess_sizes_dq_accum_by_the_query_head_dim(monkeypatch, dq_head_dim, fused):
    """out / dO are Dv wide, the dQ accumulator Dqk wide: the fused clear walks out's width,
    so with another width the accumulator is zeroed apart and the launch computes Δ only."""
    from ops import attention_bwd_prepost as P

    launches = []
    monkeypatch.setattr(P, "launch_preprocess", lambda out, do, delta, acc, *a: launches.append(acc))
    out = torch.zeros(2, 100, 3, 64, dtype=BF16)
    delta, acc = P._preprocess_impl(out, out, 1.0, None, None, True, dq_head_dim=dq_head_dim)
    assert acc.shape == (2, 128, 3, dq_head_dim or 64) and acc.dtype == F32 and delta.shape == (2, 3, 128)
    (launched,) = launches
    assert (launched is acc) if fused else (launched is None and (acc == 0).all())
    # packed sequences: the slack rows of each sequence too
    launches.clear()
    cu = torch.tensor([0, 30, 100], dtype=torch.int32)
    _, acc = P._preprocess_impl(out[0], out[0], 1.0, cu, 70, True, dq_head_dim=dq_head_dim)
    assert acc.shape == P.dq_accum_shape(2, 100, 3, dq_head_dim or 64, varlen=True)


@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (128, 64), (64, 96), (192, 128), (256, 192)])
def test_host_sizes_gradients_by_their_head_dims(monkeypatch, head_dim, head_dim_v):
    """attention_backward_sm90 on CPU tensors with the launches recorded: the kernel is
    compiled for (Dqk, Dv), the dQ accumulator it gets is Dqk wide, dK Dqk and dV Dv wide,
    and convert_dq turns the accumulator into a Dqk-wide dQ."""
    from ops import attention_bwd_prepost as P

    keys, launches = [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: None)
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))
    converted = []

    def convert(acc, scale, d, sq, *rest, ready=None):
        converted.append((acc.shape, d))
        return torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16)

    monkeypatch.setattr(P, "convert_dq", convert)
    q, k, v, do, o = _problem(h=4, hk=2, d=head_dim, dv=head_dim_v)
    dq, dk, dv, db = _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 1)
    # (only d128's own tiles store each block's first dQ: none of these pairs; d64's persistent
    # causal CTAs zero the accumulator themselves)
    assert keys == [
        S.Sm90Config(cutlass.BFloat16, head_dim, head_dim_v, 1, "sm_90a", zero_ahead=head_dim == head_dim_v == 64)
    ]
    assert db is None
    ((q_, k_, v_, do_, lse, delta, acc, dk_, dv_, *_),) = launches
    # the LSE in log2 units from the preprocess launch, shaped as Δ
    assert acc.shape == (2, 128, 4, head_dim) and delta.shape == lse.shape == (2, 4, 128)
    assert dk_ is dk and dv_ is dv and dk.shape == (2, 130, 2, head_dim) and dv.shape == (2, 130, 2, head_dim_v)
    assert converted == [((2, 128, 4, head_dim), head_dim)] and dq.shape == q.shape


@pytest.mark.parametrize(
    "mask_type,deterministic,overlaps",
    [(0, False, True), (0, True, True), (1, False, False), (1, True, True), (2, False, False)],
)
def test_convert_overlaps_where_the_grid_has_an_idle_tail(monkeypatch, mask_type, deterministic, overlaps):
    """A CTA per tile in launch order (d128: schedule "grid"; causal only with determinism's
    launch order) counts each key block's dQ into a zeroed [sequences, Hk] int32, and
    ConvertDQReady gets the counts, their tile counter, the query heads per key head and the
    count that completes a head: the grid's key blocks, ceil(Sk / tile_n). Persistent CTAs
    (d64) and the heavy-first order do not."""
    from ops import attention_bwd_prepost as P

    keys, launches, readies = [], [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: None)
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))

    def convert(acc, scale, d, sq, *rest, ready=None):
        readies.append(ready)
        return torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16)

    monkeypatch.setattr(P, "convert_dq", convert)
    q, k, v, do, o = _problem(h=4, hk=2, d=128, dv=128)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, mask_type, deterministic=deterministic)
    assert keys[-1].dq_ready is overlaps
    counts = launches[-1][11]
    if not overlaps:
        assert counts is None and readies == [None]
        return
    ((tiles, counts_, group, expected),) = readies
    assert counts_ is counts and counts.shape == (2, 2) and counts.dtype == torch.int32 and not counts.any()
    assert tiles.shape == (1,) and not tiles.any() and tiles.data_ptr() + 4 == counts.data_ptr()
    assert group == 2 and expected == -(-130 // bwd_config.attention_sm90_tiles(128).tile_n)
    # nor where a head has more key blocks than DQ_READY_MAX_KEY_BLOCKS
    blocks = bwd_config.DQ_READY_MAX_KEY_BLOCKS
    assert S._overlaps_convert("grid", mask_type, deterministic, blocks)
    assert not S._overlaps_convert("grid", mask_type, deterministic, blocks + 1)
    # d64's persistent CTAs never count
    keys.clear()
    q, k, v, do, o = _problem(h=4, hk=2, d=64, dv=64)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, mask_type, deterministic=deterministic)
    assert keys[-1].dq_ready is (deterministic and overlaps)


def test_call_plans_follow_the_signature_and_the_settings(monkeypatch):
    """attention_backward_sm90 makes its choices (tiles, flags, grids, the compile key) once
    per call signature (``_call_plan``): a repeated call reuses them; another module setting,
    mask or shape makes a new plan, and the compile key follows the setting."""
    from ops import attention_bwd_prepost as P

    keys, plans = [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: None)
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: None))
    monkeypatch.setattr(
        P,
        "convert_dq",
        lambda acc, scale, d, sq, *rest, ready=None: torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16),
    )
    monkeypatch.setattr(S, "_call_plans", S.Memo())
    plan = S._plan
    monkeypatch.setattr(S, "_plan", lambda *a, **kw: plans.append(1) or plan(*a, **kw))
    lse = torch.zeros(2, 4, 128)

    def call(mask_type=0, sq=100):
        q, k, v, do, o = _problem(sq=sq, h=4, hk=2, d=128, dv=128)
        dq, dk, dv, _ = _sm90(do, q, k, v, o, lse, 0.1, mask_type)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    call()
    call()
    assert len(plans) == 1 and len(keys) == 2 and keys[0] == keys[1] and keys[0].store_first
    monkeypatch.setattr(S, "STORE_FIRST", False)
    call()
    assert len(plans) == 2 and not keys[-1].store_first
    call(mask_type=1)
    assert len(plans) == 3 and keys[-1].mask_type == 1
    call(sq=60)
    call(sq=60)
    assert len(plans) == 4 and len(S._call_plans) == 4


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 128), (64, 64), (64, 128)])
def test_one_scratch_allocation_holds_the_launches_buffers(monkeypatch, deterministic, head_dim, head_dim_v):
    """Δ, the LSE in log2 units, the zeroed int32s (counters, counts, flags, semaphores) and the
    dQ accumulator are parts of one fp32 allocation (host time): disjoint, 128-byte aligned,
    the int32s zeroed; the accumulator is zeroed by the preprocess where Dqk and Dv round alike,
    apart where they do not, and not at all where the kernel stores first or zeroes it."""
    from ops import attention_bwd_prepost as P

    keys, launches, pre = [], [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(
        P,
        "launch_preprocess",
        lambda out, do, delta, acc, scale, cu, mq, lse, lse2, dlse: pre.append((delta, acc, lse2)),
    )
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))
    monkeypatch.setattr(
        P,
        "convert_dq",
        lambda acc, scale, d, sq, *r, ready=None: torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16),
    )
    empty = torch.empty  # the scratch (the one 1-D fp32 allocation) filled with 7s
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *a, **kw: (lambda t: t.fill_(7.0) if t.dtype == F32 and t.dim() == 1 else t)(empty(*a, **kw)),
    )
    q, k, v, do, o = _problem(h=4, hk=2, d=head_dim, dv=head_dim_v)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0, deterministic=deterministic)
    (key,), (launch,), ((delta, fused, lse2),) = keys, launches, pre
    _, _, _, _, lse, delta_, acc, _, _, semaphore, counter, counts, first = launch[:13]
    assert lse is lse2 and delta_ is delta and delta.shape == lse.shape == (2, 4, 128)
    parts = [t for t in (delta, lse, acc, semaphore, counter, counts, first) if t is not None]
    base = delta.untyped_storage().data_ptr()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts)
    assert all(t.untyped_storage().data_ptr() == base for t in parts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # disjoint
    assert all((t.data_ptr() - base) % 128 == 0 for t in (delta, lse, acc))
    for t in parts[3:]:
        assert t.dtype == torch.int32 and not t.any()
    assert (semaphore is not None) is deterministic
    if deterministic:
        assert semaphore.shape == (2, 4, -(-100 // S._tiles(head_dim, head_dim_v, False, False, False).tile_m))
    unzeroed = key.store_first or key.zero_ahead
    same_width = P.head_dim_rounded(head_dim) == P.head_dim_rounded(head_dim_v)
    assert (fused is acc) is (not unzeroed and same_width) and (fused is None) is (unzeroed or not same_width)
    # zeroed apart (host-side here: the allocation was filled with 7s) or left as allocated
    assert (acc == 0).all() if not unzeroed and not same_width else (acc == 7).all()


def test_dq_ready_needs_a_cta_per_tile():
    """The kernel counts a CTA's key block at its end: persistent CTAs refuse dq_ready."""
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    with pytest.raises(ValueError, match="dq_ready"):
        AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(64), 0, dq_ready=True)
    assert AttentionBackwardSm90(cutlass.BFloat16, bwd_config.attention_sm90_tiles(128), 0, dq_ready=True).dq_ready


@pytest.mark.compile
@pytest.mark.parametrize(
    "config",
    [
        (128, 128, 0, False, False, False),
        (96, 96, 0, True, True, False),
        (192, 128, 0, False, False, True),
        (64, 64, 0, False, False, True),
        (128, 128, 1, True, False, False),
    ],
)
def test_compiles_dq_ready(config):
    """The counting kernel where the op takes it (schedule "grid"): d128 / d96 with determinism
    and varlen, a wide head dim, d64 with dropout (a CTA per tile), causal with determinism."""
    d, dv, mask, det, varlen, dropout = config
    assert callable(
        S._build(
            S.Sm90Config(
                cutlass.BFloat16,
                d,
                dv,
                mask,
                "sm_90a",
                deterministic=det,
                varlen=varlen,
                dropout=dropout,
                dq_ready=True,
            )
        )
    )


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


def _record_unzeroed_calls(monkeypatch):
    """attention_backward_sm90 on CPU tensors with the kernel launch recorded: (compile keys,
    launch arguments, whether each preprocess launch zeroes an accumulator) lists the calls fill."""
    from ops import attention_bwd_prepost as P

    keys, launches, zeroing = [], [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda out, do, delta, acc, *a: zeroing.append(acc is not None))
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))
    monkeypatch.setattr(
        P,
        "convert_dq",
        lambda acc, scale, d, sq, *r, ready=None: torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16),
    )
    return keys, launches, zeroing


def test_store_first_call_hands_over_flags_not_zeros(monkeypatch):
    """A store_first call: the accumulator is the op's unzeroed buffer, the preprocess is asked
    for no zeroing, and the kernel gets a zeroed int32 flag per (batch, query head, query
    block) beside ConvertDQReady's counts in one buffer."""
    keys, launches, zeroing = _record_unzeroed_calls(monkeypatch)
    q, k, v, do, o = _problem(h=4, hk=2, d=128, dv=128)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].store_first is True and zeroing == [False]
    acc, counts, flags = launches[-1][6], launches[-1][11], launches[-1][12]
    blocks = -(-q.shape[1] // bwd_config.attention_sm90_tiles(128).tile_m)
    assert acc.shape[1] >= q.shape[1] and acc.dtype == torch.float32  # (TMA clips a block past its rows)
    assert flags.shape == (2, 4, blocks) and flags.dtype == torch.int32 and not flags.any()
    assert flags.data_ptr() == counts.data_ptr() + 4 * counts.numel()
    monkeypatch.setattr(S, "STORE_FIRST", False)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].store_first is False and zeroing == [False, True] and launches[-1][12] is None


@pytest.mark.compile
@pytest.mark.parametrize(
    "config",
    [
        (64, 64, 0, False, True, False),
        (128, 128, 0, True, False, False),
        (96, 96, 1, False, False, False),
        (64, 64, 2, False, False, False),
        (192, 128, 0, True, False, False),
        (256, 256, 1, False, False, False),
        (128, 128, 0, True, False, True),
        (64, 128, 1, False, False, False),
    ],
)
def test_compiles_store_first(config):
    """store_first where the op takes it: d64 persistent (with carry_dq), d128 with the counts,
    causal corners (dynamic tiles at d64), wide tiles, with bias and its gradient, Dqk != Dv."""
    d, dv, mask, ready, carry, bias = config
    assert callable(
        S._build(
            S.Sm90Config(
                cutlass.BFloat16,
                d,
                dv,
                mask,
                "sm_90a",
                bias=bias,
                grad_bias=bias,
                carry_dq=carry,
                dq_ready=ready,
                store_first=True,
            )
        )
    )


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


def test_zero_ahead_call_hands_over_flags_not_zeros(monkeypatch):
    """A d64 call without a mask on a GPU of 132 multiprocessors: an unzeroed accumulator, no
    zeroing asked of the preprocess, a zeroed flag per (batch, query head, query block); with
    fewer CTAs than a head's key blocks the preprocess zeroes it as before."""
    keys, launches, zeroing = _record_unzeroed_calls(monkeypatch)
    monkeypatch.setattr(S, "PERSISTENT_CTAS", 132)
    q, k, v, do, o = _problem(h=4, hk=2, d=64, dv=64)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].zero_ahead is True and keys[-1].store_first is False and zeroing == [False]
    acc, flags = launches[-1][6], launches[-1][12]
    blocks = -(-q.shape[1] // bwd_config.attention_sm90_tiles(64).tile_m)
    assert acc.shape[1] >= q.shape[1] and acc.dtype == torch.float32
    assert flags.shape == (2, 4, blocks) and flags.dtype == torch.int32 and not flags.any()
    monkeypatch.setattr(S, "PERSISTENT_CTAS", 1)  # 2 key blocks a head (130 keys)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].zero_ahead is False and zeroing == [False, True] and launches[-1][12] is None


@pytest.mark.compile
@pytest.mark.parametrize("mask,carry", [(0, False), (0, True), (1, False), (2, False)])
def test_compiles_zero_ahead(mask, carry):
    """zero_ahead where the op takes it: d64 persistent CTAs without a mask (with and without
    carry_dq) and causal ones (tiles and zeroing jobs from counters), both corners."""
    assert callable(S._build(S.Sm90Config(cutlass.BFloat16, 64, 64, mask, "sm_90a", carry_dq=carry, zero_ahead=True)))


# ------------------------------------------------------------------------ dispatch


class Recorder:
    """Stands in for one backend: records the call, returns zero gradients (no launch)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, args):
        self.calls.append((self.name, args))
        query, key = args.query, args.key
        zeros = (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(args.value))
        full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])  # [B, H, Mq, Mk], as the kernel's
        return zeros + (query.new_zeros(full) if args.bias is not None and args.bias_requires_grad else None,)


@pytest.fixture
def backends(monkeypatch):
    """CPU tensors through ``efficient_attention_backward``: CUDA checks off, the device's arch
    sm_90a (set ``cc.tensor_arch`` again to change it), both backends recorded. Yields the calls."""
    calls = []
    monkeypatch.setattr(C, "check_cuda", lambda *a: None)
    monkeypatch.setattr(cc, "tensor_arch", lambda t: "sm_90a")
    monkeypatch.setattr(S, "attention_backward_sm90", Recorder("sm90", calls))
    monkeypatch.setattr(M, "_backward", Recorder("mem_eff", calls))  # behind the deterministic and grouped-head steps
    return calls


def _eab(b=2, sq=100, sk=130, h=3, d=64, dv=None, hk=None, dtype=BF16, mask_type=0, **kw):
    """One efficient_attention_backward on CPU tensors (a problem the sm90 path takes by default)."""
    q, k, v, do, o = _problem(b=b, sq=sq, sk=sk, h=h, d=d, dv=dv, hk=hk, dtype=dtype)
    args = dict(
        bias=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=sq,
        max_seqlen_k=sk,
        dropout_p=0.0,
        philox_seed=None,
        philox_offset=None,
        bias_requires_grad=False,
        logsumexp=torch.zeros(b, h, (sq + 31) // 32 * 32),
    )
    args.update(kw)
    return A.efficient_attention_backward(do, q, k, v, out=o, custom_mask_type=mask_type, **args)


def _seed():
    return torch.tensor(1, dtype=torch.int64)


FALLS_BACK = [
    # (id, keyword arguments of _eab, fragment of the logged reason)
    ("num-splits-key", dict(num_splits_key=2), "num_splits_key=2"),
    ("num-splits-key-1", dict(num_splits_key=1), "num_splits_key=1"),
    ("shared-storage", dict(sq=100, sk=100, shared_storage_dqdkdv=True), "shared_storage_dqdkdv"),
    ("fp32", dict(dtype=F32), "dtype torch.float32"),
    ("head-dim-80", dict(d=80), "head dims 80"),
    ("dqk-96-dv-256", dict(d=96, dv=256), "head dims 96 / 256"),
]


def test_auto_takes_sm90_with_bias_and_dropout(backends):
    """Bias (broadcast), its gradient and dropout go to the sm90 kernel with the forward's
    philox state; a broadcast bias's gradient comes back in the bias's shape."""
    bias = torch.zeros(3, 100, 130, dtype=BF16)
    seed, offset = torch.tensor(7, dtype=torch.int64), torch.tensor(12, dtype=torch.int64)
    _, _, _, db = _eab(
        mask_type=1, bias=bias, bias_requires_grad=True, dropout_p=0.2, philox_seed=seed, philox_offset=offset
    )
    ((name, a),) = backends
    assert name == "sm90" and a.bias is bias and a.bias_requires_grad is True
    assert a.dropout_p == 0.2 and a.philox_seed is seed and a.philox_offset is offset
    assert db.shape == bias.shape


def test_bias_with_varlen_is_refused(backends):
    cu = torch.tensor([0, 100], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="bias with cu_seqlens"):
        _eab(
            b=1,
            bias=torch.zeros(1, 3, 100, 130, dtype=BF16),
            cu_seqlens_q=cu,
            cu_seqlens_k=torch.tensor([0, 130], dtype=torch.int32),
        )
    assert backends == []


@pytest.mark.parametrize("hk", [1, 2])
def test_auto_takes_sm90_with_grouped_heads(backends, hk):
    dq, dk, dv, _ = _eab(h=4, hk=hk, mask_type=1)
    ((name, _),) = backends
    assert (
        name == "sm90" and dk.shape == (2, 130, hk, 64) and dv.shape == (2, 130, hk, 64) and dq.shape == (2, 100, 4, 64)
    )


@pytest.mark.parametrize("hk", [1, 3])
def test_auto_takes_sm90_with_varlen(backends, hk):
    """Packed sequences go to the sm90 path with their offsets and bounds."""
    cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 30, 130], dtype=torch.int32)
    dq, dk, dv, _ = _eab(
        b=1,
        hk=hk,
        mask_type=2,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=60,
        max_seqlen_k=100,
        logsumexp=torch.zeros(2, 3, 64),
    )
    ((name, a),) = backends
    assert name == "sm90" and dq.shape == (1, 100, 3, 64) and dk.shape == (1, 130, hk, 64)
    assert a.cu_seqlens_q is cu_q and a.cu_seqlens_k is cu_k and (a.max_seqlen_q, a.max_seqlen_k) == (60, 100)


@pytest.mark.parametrize("hk", [0, 3])
def test_key_heads_must_divide_query_heads(backends, hk):
    with pytest.raises(ValueError, match="divides query's 4"):
        _eab(h=4, hk=hk)
    assert backends == []


def test_mem_eff_sums_grouped_heads(monkeypatch):
    """The memory-efficient kernel has one key head per query head: it runs on key / value
    repeated per query head, and dK / dV are summed back over each group (in fp32)."""
    seen = []

    def kernel(args):
        query, key, value = args.query, args.key, args.value
        seen.append((key.shape, value.shape, torch.equal(key[:, :, 0], key[:, :, 1])))
        # gradients that tell the query heads apart: head j's entries are j
        heads = torch.arange(query.shape[2], dtype=torch.float32).view(1, 1, -1, 1)
        return (torch.zeros_like(query), (key * 0 + heads).to(key.dtype), (value * 0 + 2 * heads).to(value.dtype), None)

    monkeypatch.setattr(M, "_backward", kernel)
    q, k, v, do, o = _problem(h=6, hk=2, dtype=F16)
    k.normal_()
    args = AttentionBackwardArgs(
        grad_out=do, query=q, key=k, value=v, out=o, logsumexp=torch.zeros(2, 6, 128), scale=0.1
    )
    dq, dk, dv, db = M.attention_backward_mem_eff(args)
    assert seen == [((2, 130, 6, 64), (2, 130, 6, 64), True)]
    # key head 0 serves query heads 0, 1, 2 (sum 3), key head 1 heads 3, 4, 5 (sum 12)
    assert dk.shape == k.shape and dk.dtype == F16 and (dk[:, :, 0] == 3).all() and (dk[:, :, 1] == 12).all()
    assert (dv[:, :, 0] == 6).all() and (dv[:, :, 1] == 24).all() and db is None
    with pytest.raises(ValueError, match="shared_storage_dqdkdv"):
        M.attention_backward_mem_eff(dataclasses.replace(args, shared_storage_dqdkdv=True))


@pytest.mark.parametrize("flag", [False, True])
def test_deterministic_reaches_either_backend(backends, flag):
    """deterministic=None follows torch.are_deterministic_algorithms_enabled(); the sm90
    kernel gets the flag, the memory-efficient one a single key split."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(flag)
    try:
        _eab(mask_type=1)
        _eab(mask_type=1, backend="mem_eff")
    finally:
        torch.use_deterministic_algorithms(before)
    (sm90_call, mem_eff_call) = backends
    assert sm90_call[0] == "sm90" and sm90_call[1].deterministic is flag
    assert mem_eff_call[0] == "mem_eff" and mem_eff_call[1].num_splits_key == (1 if flag else None)


def test_deterministic_refuses_key_splits(backends):
    with pytest.raises(ValueError, match="deterministic needs num_splits_key None or 1"):
        _eab(deterministic=True, num_splits_key=2)
    _eab(deterministic=True, num_splits_key=1, backend="mem_eff")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        _eab(deterministic="yes")
    assert [c[0] for c in backends] == ["mem_eff"]


def test_auto_takes_sm90_with_a_window(backends):
    _eab(mask_type=1, window_size=8)
    ((name, a),) = backends
    assert (name, a.custom_mask_type, a.window, a.deterministic, a.cu_seqlens_q) == ("sm90", 1, 8, False, None)


@pytest.mark.parametrize("mask_type,sq,sk", [(0, 100, 130), (1, 130, 100), (2, 100, 130), (2, 130, 100)])
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (BF16, 96), (F16, 128), (F16, 192), (BF16, 256)])
def test_auto_takes_sm90_where_it_applies(backends, caplog, dtype, d, mask_type, sq, sk):
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        dq, dk, dv, db = _eab(sq=sq, sk=sk, d=d, dtype=dtype, mask_type=mask_type, scale=0.3)
    # the drop-in's logsumexp, scale, mask type, window, deterministic
    ((name, a),) = backends
    assert name == "sm90" and a.logsumexp.shape == (2, 3, (sq + 31) // 32 * 32)
    assert (a.scale, a.custom_mask_type, a.window, a.deterministic) == (0.3, mask_type, 0, False)
    assert db is None and dq.shape == (2, sq, 3, d) and dk.shape == dv.shape == (2, sk, 3, d)
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "cute_kernels.attention"]
    assert msg.startswith("attention backward: sm90 (backend='auto', supported") and f"mask {mask_type}" in msg


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (64, 128), (192, 128), (256, 64)])
def test_auto_takes_sm90_with_unequal_head_dims(backends, head_dim, head_dim_v):
    dq, dk, dv, db = _eab(h=4, hk=2, d=head_dim, dv=head_dim_v, mask_type=1)
    ((name, _),) = backends
    assert name == "sm90" and db is None
    assert (
        dq.shape == (2, 100, 4, head_dim) and dk.shape == (2, 130, 2, head_dim) and dv.shape == (2, 130, 2, head_dim_v)
    )


@pytest.mark.parametrize("case", FALLS_BACK, ids=[c[0] for c in FALLS_BACK])
def test_auto_falls_back_to_mem_eff(backends, caplog, case):
    _, kw, fragment = case
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        _eab(**kw)
    assert [name for name, *_ in backends] == ["mem_eff"]
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "cute_kernels.attention"]
    assert msg.startswith("attention backward: mem_eff (backend='auto', not on sm90:") and fragment in msg, msg


@pytest.mark.parametrize("case", FALLS_BACK, ids=[c[0] for c in FALLS_BACK])
def test_sm90_refuses_what_it_cannot_take(backends, case):
    _, kw, fragment = case
    with pytest.raises(
        NotImplementedError, match=r"backend='sm90' cannot take this attention backward: .*" + re.escape(fragment)
    ):
        _eab(backend="sm90", **kw)
    assert backends == []  # refused before either backend


@pytest.mark.parametrize("arch", ["sm_80", "sm_100a", None])
def test_auto_on_other_devices_takes_mem_eff(backends, monkeypatch, arch):
    monkeypatch.setattr(cc, "tensor_arch", lambda t: arch)
    _eab()
    assert [name for name, *_ in backends] == ["mem_eff"]
    with pytest.raises(NotImplementedError, match="needs sm_90a"):
        _eab(backend="sm90")


def test_explicit_backends(backends):
    _eab(backend="sm90", mask_type=1)
    _eab(backend="mem_eff", mask_type=1)
    _eab(backend="mem_eff", num_splits_key=3)
    assert [name for name, *_ in backends] == ["sm90", "mem_eff", "mem_eff"]


def test_unsupported_is_the_rule(backends, monkeypatch):
    """auto asks attention_sm90.unsupported() (with its features) and follows its answer."""
    seen = []

    def verdict(*args, **kw):
        seen.append(kw)
        return "a reason of its own"

    monkeypatch.setattr(S, "unsupported", verdict)
    _eab(mask_type=2, window_size=None)
    assert [name for name, *_ in backends] == ["mem_eff"]
    assert seen == [
        dict(mask_type=2, window_size=None, bias=None, dropout_p=0.0, arch=None, softcap=0.0, grad_bias=False)
    ]
    with pytest.raises(NotImplementedError, match="a reason of its own"):
        _eab(backend="sm90")


@pytest.mark.parametrize("bad", ["hopper", "SM90", "", None, 90])
def test_bad_backend_is_a_value_error(backends, bad):
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'sm90', 'mem_eff'"):
        _eab(backend=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        with FakeTensorMode():
            q = torch.empty(1, 8, 2, 64, device="cuda", dtype=BF16)
            ops.memory_efficient_attention(q, q, q, backend=bad)
    assert backends == []


def test_the_choice_is_made_at_run_time_under_fake_tensors(monkeypatch):
    """FakeTensorMode (torch.compile's tracing): the fake implementation answers, for every
    backend value, without asking a device; the real one decides when it runs."""
    _no_cuda_calls(monkeypatch)
    with FakeTensorMode():
        q, k, v, do, o = _problem(d=96, dv=256, device="cuda")  # not an sm90 problem: decided later
        lse = torch.empty(2, 3, 128, device="cuda")
        for backend in ("auto", "sm90", "mem_eff"):
            dq, dk, dv, db = A.efficient_attention_backward(
                do, q, k, v, None, o, None, None, 100, 130, lse, 0.0, None, None, 1, False, backend=backend
            )
            assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and db is None
            assert dk.is_contiguous() and dv.is_contiguous()


def test_the_backward_op_takes_the_arguments_object_flat():
    """The op's schema lists AttentionBackwardArgs' fields in their order: the op builds the
    object from its parameters and the fake from its positional arguments."""
    schema = torch.ops.cute_kernels.efficient_attention_backward.default._schema
    assert tuple(a.name for a in schema.arguments) == C.OP_FIELDS


def test_schemas_carry_the_backend():
    for op in (torch.ops.cute_kernels.efficient_attention_backward, torch.ops.cute_kernels.memory_efficient_attention):
        assert "str backend" in str(op.default._schema), op.default._schema
        assert "bool deterministic" in str(op.default._schema), op.default._schema


class _Captured(Exception):
    """Raised instead of running the captured graph."""


@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_keeps_the_backend(monkeypatch, deterministic):
    """torch.compile(fullgraph=True) captures the op with the backend and the deterministic
    flag among its arguments."""
    monkeypatch.setattr(C, "check_cuda", lambda *a: None)

    def backend(gm, example_inputs):
        args = [
            n.args
            for n in gm.graph.nodes
            if n.op == "call_function" and "efficient_attention_backward" in str(n.target)
        ]

        def run(*a):
            raise _Captured(args)

        return run

    q, k, v, do, o = _problem(sq=64, sk=64)
    lse = torch.zeros(2, 3, 64)

    def fn(q, k, v, do, o, lse):
        return A.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            o,
            None,
            None,
            64,
            64,
            lse,
            0.0,
            None,
            None,
            1,
            False,
            backend="sm90",
            deterministic=deterministic,
        )[0]

    torch._dynamo.reset()
    with pytest.raises(_Captured) as info:
        torch.compile(fn, fullgraph=True, backend=backend)(q, k, v, do, o, lse)
    torch._dynamo.reset()
    (args,) = info.value.args[0]
    at = C.OP_FIELDS.index("backend")  # (fields past deterministic are the op's own backward's)
    assert args[at : at + 2] == ("sm90", deterministic), args


def test_memory_efficient_attention_traces_with_backend(monkeypatch):
    monkeypatch.setattr(AC, "check_cuda", lambda *a: None)
    q, k, v = torch.randn(1, 12, 2, 64), torch.randn(1, 12, 2, 64), torch.randn(1, 12, 2, 64)
    found = trace_custom_ops(
        lambda q, k, v: ops.memory_efficient_attention(q, k, v, causal=True, backend="sm90") * 2, q, k, v
    )
    assert any("memory_efficient_attention" in f for f in found)


# ------------------------------------------------------------ the attention_bwd suite


def test_suite_compile_only_covers_ours_sm90(monkeypatch):
    """``python -m benchmarks`` without a GPU compiles the sm90 configurations of the
    suite's cases too, features included (sm_90a only), besides the memory-efficient ones."""
    from benchmarks.suites import attention_bwd

    seen = {"mem_eff": [], "sm90": []}
    monkeypatch.setattr(M, "compiled", lambda config: seen["mem_eff"].append(config))
    monkeypatch.setattr(S, "compiled", lambda config: seen["sm90"].append(config))
    assert attention_bwd.compile_only("sm_90a") == len(seen["mem_eff"]) + len(seen["sm90"])
    bf16 = cutlass.BFloat16
    # the one d64 case without a mask (8x16x1024x64) has 8 steps a tile: it carries dQ where 8
    # steps do; d64's persistent CTAs zero the accumulator themselves (without a mask: 8 key blocks
    # a head, 132 CTAs; causal: from the counter of zeroing jobs); d128 without a mask (a CTA per tile in launch order)
    # overlaps convert_dq up to 32 key blocks a head (not 1x16x8192x128's 64); d128's tiles without a bias or dropout
    # store each query block's first dQ (tiles.store_first; Sq == Sk) and run the partial last query block on
    # narrower products, per Sq (2048 = 25 x 80 + 48, 4096 = 51 x 80 + 16, 8192 = 102 x 80 + 32)
    carry, first = (
        bwd_config.CARRY_DQ_MAX_STEPS >= 8,
        S.STORE_FIRST and bwd_config.attention_sm90_tiles(128).store_first,
    )
    tail = bwd_config.attention_sm90_tiles(128).tail_rows if S.TAIL_BLOCK else (lambda rows: 0)
    zero_ahead = lambda m: S.ZERO_AHEAD and (m == 0 or S.ZERO_AHEAD_CAUSAL)  # noqa: E731
    plain = {
        S.Sm90Config(bf16, 64, 64, m, "sm_90a", carry_dq=carry and m == 0, zero_ahead=zero_ahead(m)) for m in (0, 1)
    }
    plain |= {
        S.Sm90Config(bf16, 128, 128, m, "sm_90a", dq_ready=m == 0 and s <= 4096, store_first=first, tail_m=tail(s))
        for m, s in ((0, 2048), (0, 4096), (0, 8192), (1, 4096))
    }
    features = {
        S.Sm90Config(bf16, 128, 128, 0, "sm_90a", bias=bias, grad_bias=grad_bias, dropout=dropout, dq_ready=True)
        for bias, grad_bias, dropout in ((True, False, False), (True, True, False), (False, False, True))
    }
    assert set(seen["sm90"]) == plain | features
    seen["sm90"].clear()
    attention_bwd.compile_only("sm_80")
    assert seen["sm90"] == []


def test_suite_ratios():
    from benchmarks.suites import attention_bwd as suite

    nan = float("nan")
    tf = {
        "ours": 200.0,
        "ours_sm90": 400.0,
        "sdpa_efficient": 100.0,
        "sdpa_flash": 250.0,
        "sdpa_cudnn": 500.0,
        "fa4": nan,
        "matmul": 800.0,
    }
    rows = [{"impl": impl, "tflops": t} for impl, t in tf.items()]
    suite._add_ratios(rows)
    by = {r["impl"]: r for r in rows}
    assert "ours_over_peer" not in by["ours"] and by["ours_sm90"]["ours_over_peer"] == 0.5
    assert by["sdpa_efficient"]["ours_over_peer"] == 2.0 and "sm90_over_peer" not in by["sdpa_efficient"]
    assert by["sdpa_flash"]["sm90_over_peer"] == 1.6 and by["sdpa_cudnn"]["sm90_over_peer"] == 0.8
    assert math.isnan(by["fa4"]["sm90_over_peer"]) and math.isnan(by["fa4"]["ours_over_peer"])  # not timed
    assert {r["impl"] for r in rows if "sm90_over_peer" in r} == set(suite.PEERS)
    # a case without the sm90 row (or with it untimed): no ratio, or NaN
    rows = [{"impl": "ours", "tflops": 1.0}, {"impl": "fa4", "tflops": 2.0}]
    suite._add_ratios(rows)
    assert "sm90_over_peer" not in rows[1] and rows[1]["ours_over_peer"] == 0.5


def test_suite_times_in_interleaved_rounds():
    """Every queued implementation is timed once a round, in an order rotated from round to
    round; fwd's time is subtracted; a failing one drops out with its error, the rest go on."""
    from benchmarks.timing import bench_rounds

    calls = []
    clock = {"a": [3.0, 1.0, 2.0], "b": [5.0, 5.0, 6.0], "fwd": [1.0, 1.0, 1.0]}

    def fn(name):
        def run():
            if name == "bad":
                raise RuntimeError("boom")

        run.name = name
        return run

    def bench(f):
        calls.append(f.name)
        if f.name == "bad":
            f()
        return clock[f.name][sum(c == f.name for c in calls) - 1]

    got = bench_rounds([(fn("a"), None), (fn("b"), fn("fwd")), (fn("bad"), None)], 3, bench)
    assert calls == ["a", "b", "fwd", "bad", "b", "fwd", "a", "a", "b", "fwd"]
    assert got[0] == ([3.0, 1.0, 2.0], None)
    assert got[1] == ([4.0, 4.0, 5.0], None)
    assert got[2][0] == [] and isinstance(got[2][1], RuntimeError) and str(got[2][1]) == "boom"


@pytest.mark.parametrize("feature", ["bias", "bias_grad", "dropout"])
def test_suite_sm90_row_runs_features(monkeypatch, feature):
    """The sm90 row passes the case's feature and bias on, with its backend pinned."""
    from benchmarks.suites import attention_bwd as suite

    calls = []
    monkeypatch.setattr(suite, "_setup_ours", lambda *a, **kw: calls.append((a, kw)))
    suite._setup_ours_sm90("q", "k", "v", "do", False, feature, "bias")
    assert calls == [(("q", "k", "v", "do", False), dict(feature=feature, bias="bias", backend="sm90"))]


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


def test_is_fake_tensor_fast_path_agrees_with_torch():
    """cc.is_fake_tensor answers plain tensors at once and otherwise as torch's is_fake:
    fake tensors (FakeTensorMode) and functional wrappers of real or fake ones."""
    from torch._subclasses.fake_tensor import is_fake

    plain = torch.zeros(2, 3)
    with FakeTensorMode():
        fake = torch.zeros(2, 3)
    cases = [plain, plain[:, 1:], fake, torch._to_functional_tensor(plain), torch._to_functional_tensor(fake)]
    got = [cc.is_fake_tensor(t) for t in cases]
    assert got == [is_fake(t) for t in cases] == [False, False, True, False, True]
