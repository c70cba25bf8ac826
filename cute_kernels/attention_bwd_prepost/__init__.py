"""Attention-backward pre/post-processing: Δ = rowsum(dO∘O), accumulator clears and
fp32 -> fp16/bf16 conversions (PyTorch's flash_bwd_preprocess_kernel.h and the mem-eff
kernel's computeDelta)."""

from .clear_dkv_accum import ClearDKVAccum
from .compute_delta import ComputeDelta, compute_delta
from .compute_dot_do_o import ComputeDotDoO
from .convert_dkv import ConvertDKV
from .convert_dq import ConvertDQ
from .convert_dq_ready import ConvertDQReady

__all__ = [
    "ClearDKVAccum",
    "ComputeDelta",
    "ComputeDotDoO",
    "ConvertDKV",
    "ConvertDQ",
    "ConvertDQReady",
    "compute_delta",
]
