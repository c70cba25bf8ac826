"""Benchmark suites: each module has ``NAME``, ``run(settings, quick) -> rows`` (on the GPU) and
``compile_configs(arch, quick) -> [Config]`` (without one: benchmarks.compile_check)."""

SUITES = (
    "dropout_bias_fwd",
    "dropout_bias_bwd",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "norm_train",
    "dropout_add_layer_norm",
    "attn_bwd_preprocess",
    "attn_bwd_postprocess",
    "attention_bwd",
    "attention_fwd",
    "attention_train",
)
