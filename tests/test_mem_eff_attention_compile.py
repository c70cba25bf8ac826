"""CPU: the memory-efficient attention backward compiles for every configuration class
(sm_90a and sm_80), its tiles and shared storage are consistent, host Params follow the
C++ (workspace, check_supported), and the op refuses what it does not implement."""

import cutlass
import pytest
import torch

from cute_kernels.mem_eff_attention import config as mem_eff_config
from cute_kernels.mem_eff_attention.params import Params, choose_num_splits_key
from cute_kernels.mem_eff_attention.shared_storage import make_shared_storage, print_size
from layouts import mem_eff_attention as tiling
from ops import attention as A
from ops import mem_eff_attention as M

# (head_dim, head_dim_value, aligned): every max_k class, Dqk != Dv, the unaligned path;
# above 256 (dK / dV accumulated in the workspace, column loops of 128 and of 64)
CONFIGS = [
    (32, 32, True),
    (64, 64, True),
    (96, 64, True),
    (128, 128, True),
    (160, 160, True),
    (256, 256, True),
    (72, 40, False),
    (512, 512, True),
    (320, 288, True),
    (512, 320, True),
    (300, 270, False),
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("d,dv,aligned", CONFIGS)
def test_compiles(arch, d, dv, aligned):
    dtype = cutlass.BFloat16 if d % 64 == 0 else cutlass.Float16
    if arch == "sm_80" and mem_eff_config.max_k_for(d, dv) > 384:  # Q_i, dO_i, K_j, V_j do not fit 163 KB
        with pytest.raises(NotImplementedError, match="sm_80 serves head dims up to 384"):
            mem_eff_config.attention_backward_config(16, d, dv, aligned, arch)
        return
    cfg = mem_eff_config.attention_backward_config(16, d, dv, aligned, arch)
    assert cfg.smem_bytes() <= tiling.SMEM_CAPACITY[arch]
    if arch == "sm_80" and cfg.max_k == 256:
        assert cfg.stages_q == 1  # no room to prefetch on an A100
    # Δ in the kernel or passed in, with and without cu_seqlens (one of each per config keeps CI short)
    varlen, computes_delta = (d + dv) % 3 == 0, d % 64 == 0
    assert callable(M.compiled(M.MemEffConfig(dtype, cfg, varlen, computes_delta, arch)))


# fp32 (SIMT): both tile classes, Dqk != Dv, the unaligned path
CONFIGS_FP32 = [(64, 64, True), (128, 96, True), (256, 256, True), (40, 72, False)]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("d,dv,aligned", CONFIGS_FP32)
def test_compiles_fp32(arch, d, dv, aligned):
    cfg = mem_eff_config.attention_backward_config(32, d, dv, aligned, arch)
    assert cfg.smem_bytes() <= tiling.SMEM_CAPACITY[arch]
    varlen, computes_delta = d % 128 == 0, d != 256
    assert callable(M.compiled(M.MemEffConfig(cutlass.Float32, cfg, varlen, computes_delta, arch)))


@pytest.mark.compile
def test_compiles_all_variants_of_one_config():
    cfg = mem_eff_config.attention_backward_config(16, 128, 128, True, "sm_90a")
    for varlen in (False, True):
        for computes_delta in (False, True):
            assert callable(M.compiled(M.MemEffConfig(cutlass.Float16, cfg, varlen, computes_delta, "sm_90a")))


@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 224, 256])
def test_config_table(d):
    cfg = mem_eff_config.attention_backward_config(16, d, d, True, "sm_90a")
    assert cfg.max_k == d and cfg.output_in_rf and cfg.kernel_computes_delta
    assert cfg.block_size_i == 64 and cfg.block_size_j == (128 if d <= 128 else 64)
    assert cfg.num_threads == 256 and cfg.min_blocks_per_sm == 1
    # the accumulators fit the register budget the table promises
    assert 2 * cfg.block_size_j * cfg.max_k // cfg.num_threads <= mem_eff_config.MAX_OUTPUT_RF_FLOATS
    assert cfg.smem_bytes() <= tiling.SMEM_CAPACITY["sm_90a"]
    assert cfg.stages_q == 2


@pytest.mark.parametrize("d", [32, 64, 128, 160, 256])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_config_table_fp32(d, arch):
    """fp32: SIMT FMA over 16 x 16 threads, 64 x 64 tiles (32 x 32 above a head dim of 128)."""
    cfg = mem_eff_config.attention_backward_config(32, d, d, True, arch)
    assert not cfg.is_half and cfg.output_in_rf and cfg.kernel_computes_delta
    assert (cfg.block_size_i, cfg.block_size_j) == ((64, 64) if d <= 128 else (32, 32))
    assert cfg.mma_qk().op == cfg.mma_grad_kv().op == cfg.mma_grad_q().op == "fma"
    assert cfg.mma_qk().num_threads == cfg.num_threads == 256
    assert cfg.smem_store_bits() == 32  # a SIMT thread's accumulator columns are not adjacent
    assert cfg.smem_bytes() <= tiling.SMEM_CAPACITY[arch]
    assert cfg.grad_q_red_floats == (4 if arch == "sm_90a" else 1)


@pytest.mark.parametrize("d,dv", [(288, 288), (320, 320), (384, 384), (448, 448), (512, 512), (512, 320), (64, 300)])
def test_config_table_gmem_accum(d, dv):
    """Above 256: max_k a multiple of 64, 64 x 32 tiles, 2 x 4 warps, dK / dV in the workspace."""
    cfg = mem_eff_config.attention_backward_config(16, d, dv, True, "sm_90a")
    assert cfg.max_k == tiling.round_up(max(d, dv), 64) and not cfg.output_in_rf
    assert cfg.needs_accum_grad_k and cfg.needs_accum_grad_v
    assert (cfg.block_size_i, cfg.block_size_j) == (64, 32)
    assert cfg.warps_sdp == cfg.warps_dkv == cfg.warps_dq == (2, 4)
    assert cfg.grad_col_tile == (128 if cfg.max_k % 128 == 0 else 64)
    assert cfg.num_col_blocks * cfg.grad_col_tile == cfg.max_k
    assert cfg.grad_q_elements_stored == 64 * cfg.max_k and cfg.grad_kv_accum_words == 32 * cfg.max_k
    assert cfg.smem_bytes() <= tiling.SMEM_CAPACITY["sm_90a"]
    assert cfg.stages_q == (2 if cfg.max_k <= 320 else 1)
    sizes = cfg.shared_storage_sizes()
    assert sizes["persistent"]["mm_qk_k"] == 32 * cfg.max_k * 2
    p = Params(cfg, 2, 3, 300, 200, d, dv, num_splits_key=2)
    assert p.workspace_elements_gk() == p.workspace_elements_gv() == 2 * 32 * cfg.max_k
    p.check_supported()


def test_config_refuses():
    with pytest.raises(NotImplementedError, match="512"):
        mem_eff_config.attention_backward_config(16, 544, 512, True)
    with pytest.raises(NotImplementedError, match="fp32 head dims above 256"):
        mem_eff_config.attention_backward_config(32, 288, 64, True)
    with pytest.raises(NotImplementedError, match="sm_80 serves head dims up to 384"):
        mem_eff_config.attention_backward_config(16, 512, 64, True, "sm_80")
    with pytest.raises(ValueError, match="warp tile"):
        mem_eff_config.AttentionBackwardConfig(16, True, False, 64, 128, 96, warps_dq=(2, 4))
    with pytest.raises(ValueError, match="warps"):
        mem_eff_config.AttentionBackwardConfig(16, True, False, 64, 128, 128, warps_sdp=(2, 2))


@pytest.mark.parametrize("d", [64, 128, 256, 320, 512])
def test_shared_storage_matches_layouts(d):
    cfg = mem_eff_config.attention_backward_config(16, d, d, True, "sm_90a")
    storage = make_shared_storage(cfg, cutlass.BFloat16)
    sizes = cfg.shared_storage_sizes()
    # the struct is the table plus alignment padding, and the parts overlap (a union)
    assert sizes["total"] <= storage.__sizeof__() <= cfg.smem_bytes()
    assert sizes["total"] < sum(sizes["persistent"].values()) + sum(sizes["part1"].values()) + sum(
        sizes["part2"].values()
    )
    text = print_size(cfg, cutlass.BFloat16)
    assert "part1" in text and "tmp_shared_storage" in text and str(storage.__sizeof__()) in text


def _params(**kw):
    cfg = mem_eff_config.attention_backward_config(16, 128, 128, True, **kw.pop("cfg", {}))
    base = dict(cfg=cfg, num_batches=2, num_heads=3, num_queries=1000, num_keys=700, head_dim=128, head_dim_value=128)
    base.update(kw)
    return Params(**base)


def test_params_workspace():
    p = _params()
    cfg = p.cfg
    assert p.num_query_blocks() == 16
    assert p.workspace_elements_gk() == p.workspace_elements_gv() == 0  # output in registers
    assert p.workspace_elements_gq() == 16 * (4 + cfg.block_size_i * cfg.max_k)
    assert p.workspace_strideBH() % 4 == 0
    assert p.workspace_size() == 2 * 3 * p.workspace_strideBH() * 4
    assert not p.should_zero_workspace()
    assert _params(num_splits_key=2).should_zero_workspace()
    assert _params(custom_mask_type=1, window_size=8).should_zero_workspace()


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        (dict(custom_mask_type=3), ValueError, "custom_mask_type"),
        (dict(window_size=4), ValueError, "causal"),
        (dict(window_size=-1, custom_mask_type=1), ValueError, "window_size"),
        (dict(num_splits_key=0), ValueError, "num_splits_key"),
        (dict(num_splits_key=7), ValueError, "too large"),
        (dict(head_dim=0), ValueError, "head_dim"),
        (dict(head_dim_value=130), ValueError, "kMaxK"),
        (dict(num_heads=0), ValueError, "num_heads"),
        (dict(dropout_prob=0.1), ValueError, "kApplyDropout"),
        (dict(dropout_prob=1.5), ValueError, "dropout"),
        (dict(has_bias=True), ValueError, "has_bias"),
        (dict(has_bias=True, varlen=True, cfg=dict(has_bias=True)), NotImplementedError, "CuSeqlen \\+ bias"),
    ],
)
def test_check_supported(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        _params(**kw).check_supported()


def test_num_splits_heuristic():
    # 2 x 3 heads cannot fill 132 SMs: split the keys (at most one split per key block)
    p = _params()
    s = choose_num_splits_key(p, 132)
    assert 1 < s <= p.max_splits_key()
    # plenty of (batch, head) pairs: one split
    assert choose_num_splits_key(_params(num_batches=64, num_heads=32, num_keys=128), 132) == 1


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_op_refuses_before_launch():
    q = _meta(1, 8, 2, 64)
    lse = _meta(1, 2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="bias_requires_grad needs a bias"):
        A.efficient_attention_backward(q, q, q, q, None, q, None, None, 8, 8, lse, 0.0, None, None, 0, True)
    with pytest.raises(ValueError, match="philox_seed"):
        A.efficient_attention_backward(q, q, q, q, None, q, None, None, 8, 8, lse, 0.1, None, None, 0, False)
    with pytest.raises(ValueError, match="custom_mask_type"):
        A.efficient_attention_backward(q, q, q, q, None, q, None, None, 8, 8, lse, 0.0, None, None, 5, False)
    with pytest.raises(ValueError, match="window_size"):
        A.efficient_attention_backward(
            q, q, q, q, None, q, None, None, 8, 8, lse, 0.0, None, None, 0, False, window_size=3
        )
    with pytest.raises(ValueError, match="CUDA"):  # meta tensors are no CUDA tensors
        A.efficient_attention_backward(q, q, q, q, None, q, None, None, 8, 8, lse, 0.0, None, None, 0, False)


@pytest.mark.compile
def test_compiles_tmp_own_buffer_variant():
    """The measured alternative (tmp_T not aliasing attn_T) stays compilable."""
    cfg = mem_eff_config.attention_backward_config(16, 128, 128, True, "sm_90a", tmp_own_buffer=True)
    assert cfg.shared_storage_sizes()["part1"]["tmp_shared_storage"] > 0
    assert callable(M.compiled(M.MemEffConfig(cutlass.BFloat16, cfg, False, True, "sm_90a")))


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True])
def test_delta_for_head_dims_above_256_compiles(varlen):
    """With split keys Δ comes from compute_delta (the preprocess kernel), which serves the
    backward's head dims up to 512 (its public op keeps the flash limit of 256)."""
    from layouts import attention_bwd_prepost as prepost_tiling
    from ops.attention_bwd_prepost import compiled_compute_delta

    assert prepost_tiling.compute_delta_tiles(16, 500, 4).max_k == 512
    with pytest.raises(ValueError, match="512"):
        prepost_tiling.delta_head_dim_rounded(513)
    assert callable(compiled_compute_delta(cutlass.BFloat16, 512, 8, varlen, "sm_90a"))


# Bias (aligned: cp.async; unaligned: element by element), its gradient, dropout, and all
# together, over the tile classes, dtypes, both archs, with varlen / Δ passed in (split keys).
# (dtype bits, head dim, arch, features, varlen, computes_delta)
FEATURES = [
    (16, 128, "sm_90a", dict(apply_dropout=True), False, True),
    (16, 128, "sm_90a", dict(has_bias=True, bias_aligned=True), False, True),
    (16, 128, "sm_90a", dict(has_bias=True, bias_aligned=True, grad_bias=True), False, False),
    (16, 64, "sm_90a", dict(has_bias=True, bias_aligned=False, grad_bias=True), False, True),
    (16, 128, "sm_90a", dict(has_bias=True, bias_aligned=True, grad_bias=True, apply_dropout=True), False, False),
    (16, 64, "sm_90a", dict(apply_dropout=True), True, False),  # varlen + dropout, split keys
    (16, 256, "sm_90a", dict(has_bias=True, bias_aligned=True, grad_bias=True, apply_dropout=True), False, True),
    (16, 512, "sm_90a", dict(has_bias=True, bias_aligned=True, grad_bias=True, apply_dropout=True), False, False),
    (16, 96, "sm_80", dict(has_bias=True, bias_aligned=True, grad_bias=True, apply_dropout=True), False, True),
    (16, 256, "sm_80", dict(has_bias=True, bias_aligned=False, apply_dropout=True), False, True),
    (16, 384, "sm_80", dict(apply_dropout=True), True, True),
    (32, 64, "sm_90a", dict(has_bias=True, bias_aligned=True, grad_bias=True, apply_dropout=True), False, True),
    (32, 256, "sm_90a", dict(has_bias=True, bias_aligned=False, grad_bias=True, apply_dropout=True), False, False),
    (32, 128, "sm_80", dict(apply_dropout=True), True, True),
]


@pytest.mark.compile
@pytest.mark.parametrize("bits,d,arch,features,varlen,computes_delta", FEATURES)
def test_compiles_bias_and_dropout(bits, d, arch, features, varlen, computes_delta):
    dtype = {32: cutlass.Float32, 16: cutlass.BFloat16 if d % 64 == 0 else cutlass.Float16}[bits]
    cfg = mem_eff_config.attention_backward_config(bits, d, d, True, arch, **features)
    assert cfg.smem_bytes() <= tiling.SMEM_CAPACITY[arch]
    sizes = cfg.shared_storage_sizes()["part1"]
    assert (sizes["bias"] > 0) == cfg.has_bias and (sizes["zij"] > 0) == cfg.apply_dropout
    assert callable(M.compiled(M.MemEffConfig(dtype, cfg, varlen, computes_delta, arch)))


def test_bias_and_dropout_refused_where_unsupported():
    cfg = mem_eff_config.attention_backward_config(16, 64, 64, True, "sm_90a", has_bias=True)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        M.AttentionBackwardKernel(cutlass.BFloat16, cfg, True, True)
    with pytest.raises(ValueError, match="grad_bias needs has_bias"):
        mem_eff_config.attention_backward_config(16, 64, 64, True, "sm_90a", grad_bias=True)


@pytest.mark.parametrize("bits,d", [(16, 64), (16, 128), (16, 256), (16, 512), (32, 64), (32, 256)])
def test_zij_draw_covers_the_tile(bits, d):
    """Every (query, key) of a block gets its flag from exactly one thread's quads, in the
    C++'s split (threads per row = threads / queries, contiguous runs of keys)."""
    cfg = mem_eff_config.attention_backward_config(bits, d, d, True, "sm_90a", apply_dropout=True)
    tpr, quads = cfg.zij_threads_per_row, cfg.zij_quads_per_thread
    seen = set()
    for t in range(cfg.num_threads):
        row, col = t // tpr, (t % tpr) * 4 * quads
        for c in range(4 * quads):
            seen.add((row, col + c))
    assert len(seen) == cfg.num_threads * 4 * quads == cfg.block_size_i * cfg.block_size_j
    assert seen == {(i, j) for i in range(cfg.block_size_i) for j in range(cfg.block_size_j)}
    # flag rows stay 32-bit aligned (one Uint32 store per quad)
    assert (cfg.smem_layout_zij().shape[1] + cfg.smem_layout_zij().pad) % 4 == 0


def test_no_feature_config_is_unchanged():
    """The flags are off by default: the plain kernel's storage has no bias / Zij bytes."""
    cfg = mem_eff_config.attention_backward_config(16, 128, 128, True, "sm_90a")
    assert not (cfg.has_bias or cfg.grad_bias or cfg.apply_dropout)
    sizes = cfg.shared_storage_sizes()["part1"]
    assert sizes["bias"] == 0 and sizes["zij"] == 0


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_dropout_mask_kernel_compiles(arch):
    assert callable(M.compiled_dropout_mask(arch))
