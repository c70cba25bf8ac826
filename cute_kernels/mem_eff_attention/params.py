"""Host side of ``AttentionBackwardKernel::Params``: sizes, workspace, ``check_supported``.

The device side of ``Params`` (pointer advancing) is ``advance_to_block`` in
``attention_backward_kernel.py``: there the tensors carry their own strides.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import AttentionBackwardConfig

NO_CUSTOM_MASK, CAUSAL_FROM_TOP_LEFT, CAUSAL_FROM_BOTTOM_RIGHT = 0, 1, 2
NUM_CUSTOM_MASK_TYPES = 3


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Params:
    cfg: AttentionBackwardConfig
    num_batches: int  # sequences when varlen
    num_heads: int
    num_queries: int  # the longest sequence when varlen
    num_keys: int
    head_dim: int
    head_dim_value: int
    custom_mask_type: int = NO_CUSTOM_MASK
    window_size: int = 0
    num_splits_key: int = 1
    dropout_prob: float = 0.0
    has_bias: bool = False
    varlen: bool = False

    # -- workspace (the C++'s workspace_elements_gk / gv / gq, workspace_strideBH) ----
    # dK_j / dV_j accumulators (not output_in_rf): one block_size_j x max_k fp32 tile per
    # split (a split walks its key blocks one after the other), in GmemTile order per
    # column chunk. The op allocates them beside the dQ workspace ([B * H, splits, gk + gv]).
    def workspace_elements_gk(self) -> int:
        if not self.cfg.needs_accum_grad_k:
            return 0
        return self.num_splits_key * self.cfg.grad_kv_accum_words

    def workspace_elements_gv(self) -> int:
        if not self.cfg.needs_accum_grad_v:
            return 0
        return self.num_splits_key * self.cfg.grad_kv_accum_words

    def num_query_blocks(self) -> int:
        return ceil_div(self.num_queries, self.cfg.block_size_i)

    def workspace_elements_gq(self) -> int:
        """One ``GradQTempStorage`` (lock, counter, pad, fp32 tile) per query block."""
        return self.num_query_blocks() * self.cfg.grad_q_temp_storage_words

    def workspace_strideBH(self) -> int:  # noqa: N802 (the C++ name)
        total = self.workspace_elements_gk() + self.workspace_elements_gv() + self.workspace_elements_gq()
        return ceil_div(total, 4) * 4  # 128-bit aligned

    def workspace_size(self) -> int:
        """Bytes of fp32 workspace the kernel needs."""
        return self.num_batches * self.num_heads * self.workspace_strideBH() * 4

    def should_zero_workspace(self) -> bool:
        # Several splits meet in the dQ partials (and locks / counters start at 0); a
        # window makes the first key block of a query block something other than 0.
        return self.num_splits_key > 1 or self.window_size > 0

    def max_splits_key(self) -> int:
        return max(1, ceil_div(self.num_keys, self.cfg.block_size_j))

    # -- check_supported ----------------------------------------------------------------
    def check_supported(self) -> None:
        """The C++'s ``check_supported`` as Python errors (alignment is handled by config)."""
        if not 0 <= self.custom_mask_type < NUM_CUSTOM_MASK_TYPES:
            raise ValueError(f"custom_mask_type must be 0, 1 or 2, got {self.custom_mask_type}")
        if not 0.0 <= self.dropout_prob <= 1.0:
            raise ValueError(f"dropout_p must be in [0, 1], got {self.dropout_prob}")
        if self.dropout_prob > 0.0 and not self.cfg.apply_dropout:
            raise ValueError("Set `kApplyDropout`=True to support `dropout_prob > 0` (the config's apply_dropout)")
        if self.has_bias != self.cfg.has_bias:
            raise ValueError("the config's has_bias must match whether a bias is given")
        if self.has_bias and self.varlen:
            raise NotImplementedError(
                "CuSeqlen + bias not implemented yet (as the C++: torch's forward refuses it too)"
            )
        for name, v in (("head_dim", self.head_dim), ("head_dim_value", self.head_dim_value)):
            if v <= 0:
                raise ValueError(f"Invalid value for `{name}`: {v}")
            if v > self.cfg.max_k:
                raise ValueError(f"kMaxK: expected `{name}` <= {self.cfg.max_k}, got {v}")
        for name, v in (("num_heads", self.num_heads), ("num_batches", self.num_batches)):
            if v <= 0:
                raise ValueError(f"Invalid value for `{name}`: {v}")
        if self.cfg.keys_queries_aligned_to_block_size:
            if self.varlen:
                raise ValueError("this kernel configuration does not support cu_seqlens")
            if self.num_queries % self.cfg.block_size_i or self.num_keys % self.cfg.block_size_j:
                raise ValueError("kKeysQueriesAlignedToBlockSize condition not respected")
        if self.num_splits_key <= 0:
            raise ValueError(f"Invalid `num_splits_key` (expected > 0), got {self.num_splits_key}")
        if self.num_splits_key > self.max_splits_key():
            raise ValueError(
                f"Invalid `num_splits_key` ({self.num_splits_key}) - too large for `num_keys` = {self.num_keys}"
            )
        if self.window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {self.window_size}")
        if self.window_size != 0 and self.custom_mask_type == NO_CUSTOM_MASK:
            raise ValueError("LocalAttention (window_size) only supported in causal mode (custom_mask_type 1 or 2)")


def choose_num_splits_key(params: Params, num_sms: int) -> int:
    """Split the keys until the CTAs fill the GPU: fewest waves x key blocks per CTA.

    Ties go to fewer splits (no lock traffic on the dQ partials). The C++'s launcher
    splits when batch x heads alone cannot fill the device, to the same end.
    """
    bh = params.num_batches * params.num_heads
    nkb = params.max_splits_key()
    ctas_per_wave = max(1, num_sms * params.cfg.min_blocks_per_sm)
    best, best_cost = 1, None
    for s in range(1, nkb + 1):
        cost = ceil_div(bh * s, ctas_per_wave) * ceil_div(nkb, s)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best
