"""CPU: the Hopper-native attention backward (``ops.attention_sm90``) compiles, with fake
tensors, for every configuration it serves: each dtype, head dim and mask, windows,
deterministic mode, packed sequences, Dqk != Dv, bias / its gradient / dropout, the partial
last query block, carry_dq, dq_ready, store_first and zero_ahead."""

import cutlass
import pytest

from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops import attention_sm90 as S

from .attention_sm90_common import PAIRS

CONFIGS = [
    (dt, d, mask) for dt in (cutlass.BFloat16, cutlass.Float16) for d in bwd_config.HEAD_DIMS for mask in (0, 1, 2)
]
# a sliding window comes with a causal mask only
WINDOW_CONFIGS = [
    (dt, d, mask) for dt in (cutlass.BFloat16, cutlass.Float16) for d in bwd_config.HEAD_DIMS for mask in (1, 2)
]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [cutlass.BFloat16, cutlass.Float16], ids=["bf16", "fp16"])
def test_compiles_carry_dq(dtype):
    """Persistent d64 CTAs over short tiles: a tile's last dQ in the next tile's step 0."""
    assert callable(S._build(S.Sm90Config(dtype, 64, 64, 0, "sm_90a", carry_dq=True)))


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


@pytest.mark.compile
def test_d96_compiles_without_dq_per_wg(monkeypatch):
    """The dQ staging atom follows the warpgroups' 48-column slices, not the reduce-add box:
    one joint handoff of the whole tile compiles too (32-column atoms could not be partitioned)."""
    tiles = bwd_config.attention_sm90_tiles
    monkeypatch.setattr(bwd_config, "attention_sm90_tiles", lambda d, *a, **kw: tiles(d, *a, dq_per_wg=False, **kw))
    assert callable(S._build(S.Sm90Config(cutlass.BFloat16, 96, 96, 1, "sm_90a")))


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


@pytest.mark.compile
@pytest.mark.parametrize("mask,carry", [(0, False), (0, True), (1, False), (2, False)])
def test_compiles_zero_ahead(mask, carry):
    """zero_ahead where the op takes it: d64 persistent CTAs without a mask (with and without
    carry_dq) and causal ones (tiles and zeroing jobs from counters), both corners."""
    assert callable(S._build(S.Sm90Config(cutlass.BFloat16, 64, 64, mask, "sm_90a", carry_dq=carry, zero_ahead=True)))
