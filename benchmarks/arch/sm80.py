"""A100 (sm_80) and the default for other archs: the same sizes, the peers that run there."""

NAME = "sm80"
PEERS = ("torch", "torch.compile", "quack", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")

from .sm90 import ATTN_BWD_POSTPROCESS, ATTN_BWD_PREPROCESS, DROPOUT_BIAS_BWD, LAYER_NORM_BWD  # noqa: E402,F401  same problem sizes

# rows that need more than one CTA use sm_90 clusters: the A100 runs the others
LAYER_NORM_BWD = {k: [c for c in v if c[0][1] <= 8192] for k, v in LAYER_NORM_BWD.items()}  # noqa: F811
