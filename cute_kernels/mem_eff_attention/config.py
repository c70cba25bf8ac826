"""Choices of the memory-efficient attention backward that are not layouts: the algorithm
switches (the C++'s kPreload, kKeysQueriesAlignedToBlockSize, our dQ reductions), the
register budget that keeps dK_j / dV_j in registers (kOutputInRF), kMinBlocksPerSm, and the
measured tile table per (dtype, head dim, arch) with its head-dim thresholds
(``attention_backward_config``). The tiles' geometry, shared-memory layouts, swizzles and
tiled MMAs / copies are ``layouts/mem_eff_attention.py`` (``AttentionBackwardLayouts``, which
``AttentionBackwardConfig`` extends: the kernel reads this one object). The table:

| max_k (padded head dim) | block_size_i (queries) | block_size_j (keys) | warps | QK/DOIVJ warps | GradV/GradK warps | GradQ warps |
|-------------------------|------------------------|---------------------|-------|----------------|-------------------|-------------|
| 32 .. 128               | 64                     | 128                 | 8     | 4 x 2          | 4 x 2             | 2 x 4 (4 x 2 when max_k % 64) |
| 160 .. 256              | 64                     | 64                  | 8     | 4 x 2          | 4 x 2             | 2 x 4 (4 x 2 when max_k % 64) |
| 320 .. 512 (x 64)       | 64                     | 32                  | 8     | 2 x 4          | 2 x 4             | 2 x 4                         |

fp32 (SIMT): 64 x 64 up to max_k 128, 32 x 32 above, up to MAX_K_FP32. Above MAX_K_IN_RF
(fp16 / bf16) dK / dV accumulate in the fp32 workspace (layouts/mem_eff_attention.py's
module docstring: the column loops); shared memory decides stages_q per arch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from layouts.mem_eff_attention import HEAD_DIM_ROUND, SMEM_CAPACITY, AttentionBackwardLayouts, round_up

MAX_K_IN_RF = 256  # largest padded head dim whose dK/dV accumulators stay in registers
MAX_K = 512  # largest head dim (fp16 / bf16): above MAX_K_IN_RF, dK/dV accumulate in the workspace
MAX_K_FP32 = 256  # largest head dim of the fp32 (SIMT) path
GMEM_ACCUM_K_ROUND = 64  # above MAX_K_IN_RF, max_k is a multiple of the 2 x 4 warps' N tile
MAX_OUTPUT_RF_FLOATS = 128  # dK + dV accumulator floats per thread (the C++: kMaxK <= kBlockSizeI)


@dataclass(frozen=True)
class AttentionBackwardConfig(AttentionBackwardLayouts):
    """What the kernel reads: the layouts' geometry (``AttentionBackwardLayouts``) and the
    switches below; ``attention_backward_config`` picks both per (dtype, head dims, arch)."""

    preload: bool = False  # kPreload: prefetch the next matmul's operands (Q/dO of the next block)
    keys_queries_aligned_to_block_size: bool = False  # kKeysQueriesAlignedToBlockSize
    # dQ partials added into GradQTempStorage with fire-and-forget reductions (red.add,
    # 128-bit on sm_90) instead of the lock-ordered load / add / store: the round trip
    # leaves the critical path of every step; the counter still elects the writer of dQ.
    grad_q_atomic: bool = True
    grad_q_red_floats: int = 4  # floats per reduction: 4 (red.global.add.v4.f32) needs sm_90

    def __post_init__(self):
        super().__post_init__()
        if self.grad_q_red_floats not in (1, 2, 4):
            raise ValueError(f"grad_q_red_floats must be 1, 2 or 4, got {self.grad_q_red_floats}")

    # ---- the C++'s derived constants that are choices, not tiles ---------------------
    @property
    def output_in_rf(self) -> bool:
        """kOutputInRF: dK_j / dV_j accumulate in registers across the query blocks."""
        floats = 2 * self.block_size_j * self.max_k // self.num_threads
        return self.max_k <= MAX_K_IN_RF and floats <= MAX_OUTPUT_RF_FLOATS

    @property
    def kernel_computes_delta(self) -> bool:  # kKernelComputesDelta (sm80+)
        return True

    @property
    def min_blocks_per_sm(self) -> int:  # kMinBlocksPerSm = warps per SM / warps per block
        return max(1, (12 if self.is_half else 8) // self.num_warps)

    @property
    def needs_accum_grad_q(self) -> bool:  # kNeedsAccumGradQ (split keys are on for sm70+)
        return True


def _sm_major(arch: str) -> int:
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return int(digits[:-1] or 0)


def max_k_for(head_dim: int, head_dim_value: int) -> int:
    return round_up(max(head_dim, head_dim_value, 1), HEAD_DIM_ROUND)


def _max_head_dim_for(cap: int) -> int:
    """The largest half-precision head dim above MAX_K_IN_RF whose tiles fit ``cap`` bytes."""
    best = MAX_K_IN_RF
    for k in range(MAX_K_IN_RF + GMEM_ACCUM_K_ROUND, MAX_K + 1, GMEM_ACCUM_K_ROUND):
        cfg = AttentionBackwardConfig(16, True, False, 64, 32, k, warps_sdp=(2, 4), warps_dkv=(2, 4), stages_q=1)
        if cfg.smem_bytes() <= cap:
            best = k
    return best


def attention_backward_config(
    elem_bits: int, head_dim: int, head_dim_value: int, is_aligned: bool, arch: str = "sm_90a", **overrides
) -> AttentionBackwardConfig:
    """The tiles for (dtype, head dims, alignment, arch); see the module table."""
    max_k = max_k_for(head_dim, head_dim_value)
    biggest = max(head_dim, head_dim_value)
    if elem_bits == 32 and max_k > MAX_K_FP32:
        raise NotImplementedError(
            f"fp32 head dims above {MAX_K_FP32} (got {biggest}) are not implemented: the SIMT path has no "
            "column loop (use fp16 / bf16, which go to 512)"
        )
    if max_k > MAX_K:
        raise NotImplementedError(f"head dims above {MAX_K} are not implemented (got {biggest})")
    warps = {}
    if elem_bits == 32:  # SIMT: smaller tiles (fp32 operands take twice the bytes)
        block_i = block_j = 64 if max_k <= 128 else 32
    elif max_k <= MAX_K_IN_RF:
        block_i, block_j = 64, (128 if max_k <= 128 else 64)
    else:  # dK / dV accumulated in the workspace, column loops of 128 (or 64)
        max_k = round_up(max_k, GMEM_ACCUM_K_ROUND)
        block_i, block_j = 64, 32
        warps = dict(warps_sdp=(2, 4), warps_dkv=(2, 4))
    fields = dict(
        elem_bits=elem_bits,
        is_aligned=is_aligned,
        apply_dropout=False,
        preload=False,
        block_size_i=block_i,
        block_size_j=block_j,
        max_k=max_k,
        # MatmulGradQ's N tile is 16 x warps: 4 warps along the head dim need it % 64
        warps_dq=(2, 4) if max_k % 64 == 0 else (4, 2),
        grad_q_red_floats=4 if _sm_major(arch) >= 9 else 1,
        **warps,
    )
    fields.update(overrides)
    cfg = AttentionBackwardConfig(**fields)
    cap = SMEM_CAPACITY.get(arch, SMEM_CAPACITY["sm_80"])
    if cfg.smem_bytes() > cap and "stages_q" not in overrides:
        cfg = replace(cfg, stages_q=1)  # no room to prefetch the next query block
    if cfg.smem_bytes() > cap:
        hint = ""
        if max_k > MAX_K_IN_RF:
            hint = (
                f" (head dim {biggest}: {arch} serves head dims up to {_max_head_dim_for(cap)}; sm_90 serves {MAX_K})"
            )
        raise NotImplementedError(f"{cfg} needs {cfg.smem_bytes()} bytes of shared memory, {arch} has {cap}{hint}")
    return cfg
