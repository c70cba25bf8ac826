"""Benchmark suites: each module has ``NAME``, ``run(settings, quick) -> rows`` and ``compile_only()``."""

SUITES = ("dropout_bias_bwd", "layer_norm_bwd", "attn_bwd_preprocess", "attn_bwd_postprocess", "attention_bwd")
