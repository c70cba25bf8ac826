"""What the CPU tests of the Hopper-native attention backward (tests/test_attention_sm90_*_cpu.py)
share: the supported (Dqk, Dv) pairs, one problem's CPU / meta / fake tensors, a guard
against device queries."""

import torch

from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops import _compile as cc

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


PAIRS = bwd_config.HEAD_DIM_PAIRS  # every supported (Dqk, Dv) with Dqk != Dv


def _problem(b=2, sq=100, sk=130, h=3, d=64, dv=None, hk=None, dtype=BF16, device="cpu"):
    """(query, key, value, grad_out, out) [B, S, H, D] tensors of one problem."""
    dv = d if dv is None else dv
    hk = h if hk is None else hk
    e = lambda *s: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
    return e(b, sq, h, d), e(b, sk, hk, d), e(b, sk, hk, dv), e(b, sq, h, dv), e(b, sq, h, dv)


def _no_cuda_calls(monkeypatch):
    def refuse(*a):
        raise AssertionError("a CUDA device was queried")

    monkeypatch.setattr(cc, "device_arch", refuse)
