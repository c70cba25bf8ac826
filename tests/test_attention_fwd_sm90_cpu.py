"""CPU: the Hopper attention forward (``ops.attention_fwd_sm90``) compiles for every configuration it
serves, its tiles fit, its compile key is stable, and ``unsupported()`` names what it does not take
(no CUDA call for CPU, meta or fake tensors)."""

import dataclasses

import cutlass
import pytest
import torch

from cute_kernels.attention_sm90 import forward_config as F
from layouts.attention_fwd_sm90 import SMEM_LIMIT, AttentionFwdSm90Tiles
from ops import _disk_cache
from ops import attention_fwd_sm90 as A

BF16, F16 = cutlass.BFloat16, cutlass.Float16
CONFIGS = [
    A.ForwardConfig(dt, d, d, mask, window, varlen, "sm_90a")
    for dt in (BF16, F16)
    for d in (64, 128)
    for mask, window, varlen in (
        (0, False, False),
        (1, False, False),
        (2, True, False),
        (1, False, True),
        (2, True, True),
    )
]
# the other head dims: each tile (a window's own at d192 / d256), variable lengths' row stores, both
# dtypes for two of them
CONFIGS += [
    A.ForwardConfig(dt, d, dv, mask, window, varlen, "sm_90a")
    for dt, d, dv, mask, window, varlen in (
        (BF16, 96, 96, 0, False, False),
        (BF16, 96, 96, 2, True, True),
        (BF16, 192, 192, 1, False, False),
        (BF16, 192, 192, 2, True, True),
        (BF16, 256, 256, 0, False, False),
        (BF16, 256, 256, 2, True, True),
        (F16, 256, 256, 1, False, False),
        (BF16, 192, 128, 1, False, True),
        (BF16, 192, 128, 2, True, False),
        (F16, 192, 128, 0, False, False),
    )
]


# bias / dropout: a few, the compile is the same for grouped-query heads (a runtime ratio)
FEATURE_CONFIGS = [
    A.ForwardConfig(BF16, 64, 64, 0, False, False, "sm_90a", bias=True),
    A.ForwardConfig(F16, 128, 128, 1, False, False, "sm_90a", dropout=True),
    A.ForwardConfig(BF16, 128, 128, 2, True, False, "sm_90a", bias=True, dropout=True),
    A.ForwardConfig(F16, 64, 64, 1, False, True, "sm_90a", dropout=True),
    A.ForwardConfig(BF16, 256, 256, 1, False, False, "sm_90a", dropout=True),
    A.ForwardConfig(BF16, 192, 128, 2, True, False, "sm_90a", bias=True),
    A.ForwardConfig(BF16, 128, 128, 1, False, True, "sm_90a", short_causal=True),
]


def _config_id(c):
    dv = "" if c.head_dim_v == c.head_dim else f"v{c.head_dim_v}"
    features = "-bias" * c.bias + "-dropout" * c.dropout + "-short" * c.short_causal
    return f"{c.dtype.__name__}-d{c.head_dim}{dv}-m{c.mask_type}-w{int(c.window)}-v{int(c.varlen)}{features}"


@pytest.mark.compile
@pytest.mark.parametrize("config", CONFIGS + FEATURE_CONFIGS, ids=_config_id)
def test_compiles(config):
    assert callable(A._build(config))


def test_every_head_dim_pair_compiles_in_a_test():
    assert {(c.head_dim, c.head_dim_v) for c in CONFIGS} == set(F.HEAD_DIMS)
    assert {(c.head_dim, c.head_dim_v) for c in CONFIGS if c.window} == set(F.HEAD_DIMS)


@pytest.mark.parametrize(
    "features",
    [(), ("window",), ("bias",), ("dropout",), ("short_causal",), ("window", "bias", "dropout", "short_causal")],
    ids=lambda f: "-".join(f) or "plain",
)
@pytest.mark.parametrize("dims", F.HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_tiles_fit(dims, features):
    tiles = F.forward_tiles(*dims, **{f: True for f in features})
    assert (tiles.head_dim, tiles.head_dim_v) == dims
    assert tiles.o_in_q == (dims[1] <= dims[0])
    assert tiles.smem_bytes(2, dropout="dropout" in features) <= SMEM_LIMIT
    assert tiles.consumer_wgs in F.CONSUMER_REGS and tiles.num_threads == 128 * (tiles.consumer_wgs + 1)
    # the register budgets of one CTA fit the multiprocessor's 64K
    regs = 128 * F.PRODUCER_REGS[tiles.consumer_wgs] + tiles.num_mma_threads * F.CONSUMER_REGS[tiles.consumer_wgs]
    assert regs <= 64 * 1024


def test_tiles_refuse_shapes_wgmma_cannot_take():
    with pytest.raises(ValueError, match="tile_m"):
        AttentionFwdSm90Tiles(128, 128, 96, 128, 2)
    with pytest.raises(ValueError, match="tile_n"):
        AttentionFwdSm90Tiles(128, 128, 128, 120, 2)


def test_config_key_is_stable_text():
    """The disk cache keys by repr: no object address in it, equal configs equal text."""
    a, b = CONFIGS[0], dataclasses.replace(CONFIGS[0])
    assert _disk_cache.stable_key(a) == _disk_cache.stable_key(b) is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.head_dim = 1
    keys = {
        _disk_cache.stable_key(dataclasses.replace(a, bias=x, dropout=y)) for x in (False, True) for y in (False, True)
    }
    assert len(keys) == 4  # bias and dropout are compiled apart


def _meta(b, s, h, d, dtype=torch.bfloat16, hk=None, dv=None):
    q = torch.empty(b, s, h, d, dtype=dtype, device="meta")
    k = torch.empty(b, s, hk or h, d, dtype=dtype, device="meta")
    v = torch.empty(b, s, hk or h, dv or d, dtype=dtype, device="meta")
    return q, k, v


@pytest.mark.parametrize(
    "kw,tensors,reason",
    [
        ({}, _meta(1, 128, 2, 128), "needs sm_90a"),
        ({"arch": "sm_80"}, _meta(1, 128, 2, 128), "needs sm_90a"),
        ({"arch": "sm_90a"}, _meta(1, 128, 2, 128, torch.float32), "dtype"),
        ({"arch": "sm_90a"}, _meta(1, 128, 2, 80), "head dims"),
        ({"arch": "sm_90a"}, _meta(1, 128, 2, 128, dv=64), "head dims"),
        ({"arch": "sm_90a"}, _meta(1, 128, 2, 128, dv=192), "head dims"),
        ({"arch": "sm_90a"}, _meta(1, 128, 3, 128, hk=2), "multiple of key heads"),
        ({"arch": "sm_90a", "mask_type": 3}, _meta(1, 128, 2, 128), "mask type"),
        ({"arch": "sm_90a", "bias": torch.empty(2, 128, 128, device="meta")}, _meta(1, 128, 2, 128), "dtype"),
        (
            {"arch": "sm_90a", "bias": torch.empty(3, 128, 128, dtype=torch.bfloat16, device="meta")},
            _meta(1, 128, 2, 128),
            "broadcastable",
        ),
    ],
)
def test_unsupported_names_the_reason(kw, tensors, reason):
    assert reason in A.unsupported(*tensors, **kw)


def test_unsupported_names_a_misaligned_tensor():
    q, k, v = _meta(1, 128, 2, 128)
    q = torch.empty(1, 128, 2, 130, dtype=torch.bfloat16, device="meta")[..., :128]
    assert "query is not TMA-aligned" in A.unsupported(q, k, v, arch="sm_90a")


@pytest.mark.parametrize("dims", F.HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
def test_supported_problem(dims):
    d, dv = dims
    assert A.unsupported(*_meta(2, 1000, 8, d, hk=2, dv=dv), arch="sm_90a", mask_type=2) is None


def test_supported_bias_and_dropout():
    q, k, v = _meta(2, 1000, 8, 64, hk=2)
    bias = torch.empty(1, 8, 1000, 1000, dtype=torch.bfloat16, device="meta").expand(2, 8, 1000, 1000)
    assert A.unsupported(q, k, v, arch="sm_90a", mask_type=1, bias=bias, dropout_p=0.1) is None
    assert A.unsupported(q, k, v, arch="sm_90a", bias=bias[0, 0, :1]) is None  # [1, Mk]: broadcast


def test_dropout_under_graph_capture_is_refused_on_every_call(monkeypatch):
    """The philox offset is not graph-safe from Python: under capture dropout runs torch's forward;
    the verdict is not remembered (outside capture the same problem is ours again)."""
    from ops import _compile as cc

    q, k, v = _meta(1, 256, 2, 64)
    monkeypatch.setattr(cc, "capturing", lambda: True)
    assert "CUDA-graph capture" in A.unsupported(q, k, v, arch="sm_90a", dropout_p=0.1)
    assert A.unsupported(q, k, v, arch="sm_90a") is None  # no dropout: capture is fine
    monkeypatch.setattr(cc, "capturing", lambda: False)
    assert A.unsupported(q, k, v, arch="sm_90a", dropout_p=0.1) is None


def test_kernel_refuses_bias_with_varlen():
    from cute_kernels.attention_sm90.attention_forward_sm90 import AttentionForwardSm90

    with pytest.raises(NotImplementedError, match="variable lengths"):
        AttentionForwardSm90(BF16, F.forward_tiles(64, 64), 0, varlen=True, has_bias=True)


def test_dropout_words_and_philox_state(monkeypatch):
    """The offset advances as torch's forward advances it: B * H * M * N rounded up to 4 (with
    variable lengths at least the (sequence, head) streams of max_q * max_k words); the seed is
    torch's int64 view of the generator's uint64 seed."""

    class Generator:  # the default CUDA generator's face: seed, offset and its setter
        def __init__(self, seed, offset):
            self.seed, self.offset = seed, offset

        def initial_seed(self):
            return self.seed

        def get_offset(self):
            return self.offset

        def set_offset(self, offset):
            assert offset % 4 == 0
            self.offset = offset

    q, k, _ = _meta(2, 7, 3, 64)
    k = torch.empty(2, 9, 1, 64, device="meta")  # grouped-query heads: torch's forward gets them repeated
    assert A.dropout_words(q, k) == 2 * 3 * 7 * 9
    qv, kv = torch.empty(1, 101, 3, 64, device="meta"), torch.empty(1, 101, 3, 64, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")  # two sequences of at most 100 rows
    assert A.dropout_words(qv, kv, cu, 100, 100) == 2 * 3 * 100 * 100
    assert A.dropout_words(qv, kv, cu, 60, 60) == 3 * 101 * 101
    gen = Generator(2**64 - 5, 8)
    monkeypatch.setattr(torch.cuda, "default_generators", (gen,))
    seed, offset = A.philox_state(torch.device("cuda", 0), 2 * 3 * 7 * 9)
    assert (seed.item(), offset.item(), gen.offset) == (-5, 8, 8 + 380)
    assert seed.dtype == offset.dtype == torch.int64 and seed.device.type == "cpu" and seed.dim() == 0


def test_benchmark_configurations_follow_the_cases():
    cases = [
        ((4, 16, 2048, 128), "bfloat16", False),
        ((2, 16, 4096, 64), "bfloat16", True),
        ((2, 16, 4096, 80), "bfloat16", False),
        ((2, 16, 4096, 192), "bfloat16", True, "dv128:window256"),
        ((2, 16, 4096, 192), "bfloat16", False, "dv64"),
    ]
    keys = A.benchmark_configurations(cases, "sm_90a")
    assert {(k.head_dim, k.head_dim_v, k.mask_type, k.window) for k in keys} == {
        (128, 128, 0, False),
        (64, 64, 1, False),
        (192, 128, 1, True),
    }
    assert A.benchmark_configurations(cases, "sm_80") == []
    # causal d128: its own tiles over few keys; packed sequences (longest unknown) get both
    short = [((2, 16, 4096, 128), "bfloat16", True), ((1, 16, 16384, 128), "bfloat16", True)]
    keys = A.benchmark_configurations(short + [((1, 16, 32768, 128), "bfloat16", True, "varlen")], "sm_90a")
    assert {(k.varlen, k.short_causal) for k in keys} == {(False, True), (False, False), (True, True), (True, False)}


def test_short_causal_tiles_only_where_they_differ():
    assert F.short_causal(128, 128, True, 4096, False, False, False)
    assert F.short_causal(128, 128, True, F.SHORT_CAUSAL_KEYS, False, False, False)
    assert not F.short_causal(128, 128, True, F.SHORT_CAUSAL_KEYS + 1, False, False, False)
    assert not F.short_causal(128, 128, False, 4096, False, False, False)  # no mask
    assert not F.short_causal(128, 128, True, 4096, True, False, False)  # a window's tiles are these already
    assert not F.short_causal(128, 128, True, 4096, False, True, False)  # and a bias's
    assert not F.short_causal(64, 64, True, 4096, False, False, False)
    short, long = (F.forward_tiles(128, 128, short_causal=x) for x in (True, False))
    assert (short.tile_m, short.tile_n) == (128, 128) and (long.tile_m, long.tile_n) == F.TILES[(128, 128)]


def test_lpt_chunk_keeps_the_chunks_keys_and_values_in_l2():
    mib = 1 << 20
    # 2 MiB of K / V a head at 4096 keys, d128 bf16: the power of two of heads that fit
    fit = F.LPT_L2_BYTES // (2 * mib)
    want = 1 << (fit.bit_length() - 1)
    assert F.lpt_heads_per_chunk(4096, 128, 128, 1, 2, 1000) == want
    assert F.lpt_heads_per_chunk(4096, 128, 128, 4, 2, 1000) == 4 * want  # four query heads a key head
    assert F.lpt_heads_per_chunk(4096, 128, 128, 1, 2, 3) == 3  # no more than the pairs
    assert F.lpt_heads_per_chunk(1 << 22, 256, 256, 2, 2, 64) == 2  # one key head's group, even past L2
    assert F.lpt_heads_per_chunk(0, 128, 128, 1, 2, 7) == 7


@pytest.mark.parametrize("mask_type,want", [(0, 1), (1, 2 * 16), (2, 2 * 16)])
def test_forward_launch_passes_the_chunk(monkeypatch, mask_type, want):
    """The causal grid's chunk is the model's (8 key heads of 8192 keys, d128 bf16, fit
    40 MiB: 8, times the group of 4), capped by the pairs; without a mask 1."""
    seen = {}
    monkeypatch.setattr(A, "compiled", lambda config: lambda *a: seen.update(config=config, args=a))
    monkeypatch.setattr(F, "LPT_L2_BYTES", 40 << 20)
    q = torch.zeros(2, 8192, 16, 128, dtype=torch.bfloat16)
    k, v = (torch.zeros(2, 8192, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    A.attention_forward_sm90(q, k, v, mask_type=mask_type)
    assert seen["args"][10] == want and seen["config"].short_causal == (mask_type != 0)


def test_the_op_takes_our_forward_where_it_applies():
    from ops import attention

    q, k, v = _meta(2, 256, 8, 128, hk=2)
    assert attention.forward_unsupported(q, k, v, 1, None, 0.0, "auto", arch="sm_90a") is None
    assert attention.forward_unsupported(q, k, v, 1, None, 0.0, "sm90", arch="sm_90a") is None
    assert attention.forward_unsupported(q, k, v, 1, None, 0.0, "mem_eff", arch="sm_90a") == "backend='mem_eff'"
    assert attention.forward_unsupported(q, k, v, 1, None, 0.1, "auto", arch="sm_90a") is None
    bias = torch.empty(2, 8, 256, 256, dtype=torch.bfloat16, device="meta")
    assert attention.forward_unsupported(q, k, v, 1, bias, 0.1, "auto", arch="sm_90a") is None
    assert "needs sm_90a" in attention.forward_unsupported(q, k, v, 1, None, 0.0, "auto", arch="sm_80")


def test_use_for_sdpa_registers_and_restores_the_forward():
    import ops
    from ops import attention_sdpa as SD

    def kernel_line():
        lines = torch._C._dispatch_dump(SD.SDPA_FORWARD).splitlines()
        return next((ln for ln in lines if ln.startswith("CUDA:")), None)

    before = kernel_line()
    with ops.use_for_sdpa():
        assert "attention_sdpa.py" in kernel_line()
    assert kernel_line() == before


def test_varlen_grid_covers_every_real_block():
    """The packed-sequence grid, (rows + sequences (tile_m - 1)) // tile_m a head, is at least
    the real query blocks, sum ceil(len / tile_m), for any lengths within the packed rows."""
    from cute_kernels.attention.varlen_scheduler import varlen_grid_ctas

    gen = torch.Generator().manual_seed(3)
    for tile_m in (128, 192):
        for _ in range(200):
            lens = torch.randint(0, 700, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
            rows = sum(lens) + int(torch.randint(0, 300, (1,), generator=gen))
            blocks = sum(-(-n // tile_m) for n in lens)
            assert blocks * 3 <= varlen_grid_ctas(rows, len(lens), 3, tile_m)
