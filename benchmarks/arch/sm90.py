"""H100 / H200 (sm_90): which peers exist here and the problem sizes of each suite."""

NAME = "sm90"
PEERS = ("torch", "torch.compile", "quack", "fa4", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")

DROPOUT_BIAS_BWD = {
    # (rows, N), dtype name, activation
    "full": [
        ((16384, 4096), "float32", None),
        ((16384, 4096), "bfloat16", None),
        ((65536, 1024), "float32", None),
        ((65536, 1024), "bfloat16", None),
        ((8192, 1024), "float32", None),
        ((8192, 1024), "bfloat16", None),
        ((16384, 4096), "bfloat16", "gelu"),
        ((16384, 4096), "bfloat16", "relu"),
        ((8192, 1000), "bfloat16", None),
    ],
    "quick": [
        ((16384, 4096), "float32", None),
        ((16384, 4096), "bfloat16", None),
        ((8192, 1024), "bfloat16", None),
    ],
}

# the forward at the backward's sizes: a training step runs both on one tensor
DROPOUT_BIAS_FWD = DROPOUT_BIAS_BWD

LAYER_NORM_BWD = {
    # (rows, N), dtype name of x and dz (weight and bias fp32, as quack takes them)
    "full": [
        ((16384, 4096), "bfloat16"),
        ((8192, 8192), "bfloat16"),
        ((32768, 1024), "bfloat16"),
        ((4096, 16384), "bfloat16"),
        ((16384, 4096), "float32"),
    ],
    "quick": [
        ((16384, 4096), "bfloat16"),
        ((32768, 1024), "bfloat16"),
    ],
}

LAYER_NORM_FWD = {
    # (rows, N), dtype name of x, "layer" (fp32 weight and bias) or "rms" (fp32 weight)
    "full": [
        ((16384, 4096), "bfloat16", "layer"),
        ((8192, 8192), "bfloat16", "layer"),
        ((32768, 1024), "bfloat16", "layer"),
        ((4096, 16384), "bfloat16", "layer"),
        ((1024, 65536), "bfloat16", "layer"),
        ((16384, 4096), "float32", "layer"),
        ((16384, 4096), "bfloat16", "rms"),
        ((32768, 1024), "bfloat16", "rms"),
        ((4096, 16384), "bfloat16", "rms"),
    ],
    "quick": [
        ((16384, 4096), "bfloat16", "layer"),
        ((32768, 1024), "bfloat16", "rms"),
    ],
}

NORM_TRAIN = LAYER_NORM_FWD  # the same cases, forward + backward

DROPOUT_ADD_LAYER_NORM = {
    # (rows, N), dtype name of x and the residual, "layer" (fp32 weight and bias) or "rms" (fp32 weight)
    "full": [
        ((16384, 4096), "bfloat16", "layer"),
        ((32768, 1024), "bfloat16", "layer"),
        ((8192, 8192), "bfloat16", "layer"),
        ((16384, 4096), "bfloat16", "rms"),
    ],
    "quick": [
        ((16384, 4096), "bfloat16", "layer"),
    ],
}

ATTN_BWD_PREPROCESS = {
    # (batch, heads, seqlen, head_dim), dtype name; O and dO [B, S, H, D] contiguous
    "full": [
        ((4, 16, 4096, 128), "bfloat16"),
        ((8, 16, 2048, 64), "bfloat16"),
        ((1, 32, 16384, 128), "bfloat16"),
    ],
    "quick": [
        ((4, 16, 4096, 128), "bfloat16"),
    ],
}

ATTN_BWD_POSTPROCESS = {
    # (batch, heads, seqlen, head_dim), dtype name, dQ accumulator split counts
    # (each shape also gets one convert_dkv case)
    "full": [
        ((4, 16, 4096, 128), "bfloat16", (1, 4)),
        ((8, 16, 2048, 64), "bfloat16", (1, 4)),
        ((1, 32, 16384, 128), "bfloat16", (1, 4)),
    ],
    "quick": [
        ((4, 16, 4096, 128), "bfloat16", (1, 4)),
    ],
}

ATTENTION_BWD = {
    # (batch, heads, seqlen, head_dim), dtype name, causal; Q, K, V, O, dO [B, S, H, D]
    # contiguous, seqlen_q = seqlen_k; no dropout or bias unless a feature is named. These are what
    # benchmark_configurations(cases, arch) of ops.mem_eff_attention and of
    # ops.attention_sm90 receive on CPU.
    "full": [
        ((8, 16, 1024, 64), "bfloat16", False),
        ((4, 16, 2048, 128), "bfloat16", False),
        ((2, 16, 4096, 128), "bfloat16", False),
        ((1, 16, 8192, 128), "bfloat16", False),
        ((2, 16, 4096, 128), "bfloat16", True),
        ((2, 16, 4096, 64), "bfloat16", True),
        # an optional fourth entry names a feature ("bias", "bias_grad", "dropout")
        ((2, 16, 4096, 128), "bfloat16", False, "bias"),
        ((2, 16, 4096, 128), "bfloat16", False, "bias_grad"),
        ((2, 16, 4096, 128), "bfloat16", False, "dropout"),
    ],
    "quick": [
        ((4, 16, 2048, 128), "bfloat16", False),
        ((2, 16, 4096, 64), "bfloat16", True),
        ((2, 16, 4096, 128), "bfloat16", False, "dropout"),
    ],
}

# (batch, heads, seqlen, head_dim), dtype name, causal[, features]: Q [B, S, H, D], K / V
# [B, S, Hk, D / Dv], seqlen_q = seqlen_k; features ":"-joined (benchmarks/suites/attention_cases.py):
# kv<N> key / value heads, dv<N> the value head dim, window<N> a causal sliding window of N keys,
# varlen (B = 1, the S tokens packed as a fixed, seeded mix of sequence lengths)
_PLAIN = [spec for spec in ATTENTION_BWD["full"] if len(spec) == 3]  # attention_bwd's cases without a feature
ATTENTION_FWD = {
    "full": _PLAIN
    + [
        ((4, 32, 2048, 128), "bfloat16", False, "kv8"),
        ((2, 16, 4096, 192), "bfloat16", True),
        ((2, 16, 4096, 256), "bfloat16", False),
        ((2, 16, 4096, 192), "bfloat16", True, "dv128"),
        ((1, 16, 32768, 128), "bfloat16", True, "varlen"),
        ((4, 16, 4096, 128), "bfloat16", True, "window512"),
    ],
    "quick": [spec for spec in ATTENTION_BWD["quick"] if len(spec) == 3]
    + [
        ((4, 32, 2048, 128), "bfloat16", False, "kv8"),
        ((1, 16, 32768, 128), "bfloat16", True, "varlen"),
        ((4, 16, 4096, 128), "bfloat16", True, "window512"),
    ],
}

# the attention features of a training step, each case beside its twin without the feature
# (features of benchmarks/suites/attention_cases.py: softcap<N> the logits capped at N tanh(s / N),
# sink a learnable sink per query head, dlse a loss on the returned logsumexp too)
FEATURE_CASES = [
    ((2, 16, 4096, 128), "bfloat16", True, "softcap30"),  # twin: 2x16x4096x128 causal, above
    ((2, 64, 4096, 64), "bfloat16", True, "kv8:window128"),  # gpt-oss: 8 key heads, a 128-key window
    ((2, 64, 4096, 64), "bfloat16", True, "kv8:window128:sink"),  # and its learnable sinks
    ((4, 32, 2048, 128), "bfloat16", False),
    ((4, 32, 2048, 128), "bfloat16", False, "dlse"),
]
ATTENTION_TRAIN = {  # the forward's cases and the feature cases, forward + backward
    "full": ATTENTION_FWD["full"] + FEATURE_CASES,
    "quick": ATTENTION_FWD["quick"] + [((2, 64, 4096, 64), "bfloat16", True, "kv8:window128:sink")],
}

# the same feature cases in attention_bwd, the backward timed alone through autograd ("autograd":
# the backward ops' arguments have no softcap, sink or dLSE), with their twins timed the same way
AUTOGRAD_CASES = [
    (shape, dtype, causal, ":".join(["autograd", *features]))
    for shape, dtype, causal, *features in [((2, 16, 4096, 128), "bfloat16", True)] + FEATURE_CASES
]
ATTENTION_BWD = {
    "full": ATTENTION_BWD["full"] + AUTOGRAD_CASES,
    "quick": ATTENTION_BWD["quick"] + [((2, 16, 4096, 128), "bfloat16", True, "autograd:softcap30")],
}
