"""The torch face: validated, torch.library-registered ops and autograd modules."""

from .attention import efficient_attention_backward, efficient_attention_forward, memory_efficient_attention
from .attention_sdpa import use_for_sdpa
from .context_parallel import context_parallel_attention
from .attention_bwd_prepost import (
    attention_bwd_clear_dkv_accum,
    attention_bwd_compute_delta,
    attention_bwd_convert_dkv,
    attention_bwd_convert_dq,
    attention_bwd_preprocess,
)
from .dropout_add_norm import DropoutAddLayerNorm, DropoutAddRMSNorm, dropout_add_layer_norm, dropout_add_rms_norm
from .dropout_bias import BiasDropout, bias_dropout, dropout_bias_backward, dropout_bias_forward
from .norm import LayerNorm, RMSNorm, layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

__all__ = [
    "BiasDropout",
    "DropoutAddLayerNorm",
    "DropoutAddRMSNorm",
    "LayerNorm",
    "RMSNorm",
    "attention_bwd_clear_dkv_accum",
    "attention_bwd_compute_delta",
    "attention_bwd_convert_dkv",
    "attention_bwd_convert_dq",
    "attention_bwd_preprocess",
    "bias_dropout",
    "context_parallel_attention",
    "dropout_add_layer_norm",
    "dropout_add_rms_norm",
    "dropout_bias_backward",
    "dropout_bias_forward",
    "efficient_attention_backward",
    "efficient_attention_forward",
    "layer_norm",
    "layer_norm_backward",
    "memory_efficient_attention",
    "rms_norm",
    "rms_norm_backward",
    "use_for_sdpa",
]
