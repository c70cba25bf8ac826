"""A100 (sm_80) and the default for other archs: the same sizes, the peers that run there."""

NAME = "sm80"
PEERS = ("torch", "torch.compile", "quack", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")

from .sm90 import (
    ATTENTION_BWD,
    ATTENTION_FWD,
    ATTN_BWD_POSTPROCESS,
    ATTN_BWD_PREPROCESS,
    AUTOGRAD_CASES,
    DROPOUT_ADD_LAYER_NORM,
    DROPOUT_BIAS_BWD,
    DROPOUT_BIAS_FWD,
    LAYER_NORM_BWD,
    LAYER_NORM_FWD,
    NORM_TRAIN,
)  # noqa: E402,F401  same problem sizes


def _runs_here(case) -> bool:
    """Rows that need more than one CTA use sm_90 clusters: the A100 runs the others."""
    from cute_kernels.layer_norm.config import ln_bwd_tiles
    from layouts.layer_norm import widest_vec

    (_, n), dtype = case[:2]
    bits = 32 if dtype == "float32" else 16
    try:
        ln_bwd_tiles(n, bits, bits, 32, widest_vec(n, bits), arch="sm_80")
    except NotImplementedError:
        return False
    return True


LAYER_NORM_BWD = {k: [c for c in v if _runs_here(c)] for k, v in LAYER_NORM_BWD.items()}  # noqa: F811
# the forward splits rows as the backward does: the same rows need clusters
LAYER_NORM_FWD = {k: [c for c in v if _runs_here(c)] for k, v in LAYER_NORM_FWD.items()}  # noqa: F811
NORM_TRAIN = {k: [c for c in v if _runs_here(c)] for k, v in NORM_TRAIN.items()}  # noqa: F811
# the attention feature cases compare Hopper kernels (our forward takes the softcap and the sink on
# sm_90a only; FA4's kernels): the forward's cases alone, attention_bwd's without its autograd ones
ATTENTION_TRAIN = ATTENTION_FWD
ATTENTION_BWD = {k: [c for c in v if c not in AUTOGRAD_CASES] for k, v in ATTENTION_BWD.items()}
DROPOUT_ADD_LAYER_NORM = {k: [c for c in v if _runs_here(c)] for k, v in DROPOUT_ADD_LAYER_NORM.items()}  # noqa: F811
