"""Suite attention_fwd: the attention forward alone, through each implementation's public entry.

Cases (``ATTENTION_FWD`` in ``benchmarks/arch/*.py``; syntax, features and peers in
``attention_cases``): ``BxHxSxD:bf16[:causal][:features]``.

- ``ours``: ``ops.memory_efficient_attention(q, k, v, causal=..., window_size=..., cu_seqlens_*=...)``
  under ``torch.no_grad()``: the public op, whatever forward it runs (the Hopper kernel of
  ``ops.attention_fwd_sm90`` where it applies, torch's memory-efficient forward elsewhere), so
  the row is what users get;
- ``fa4``: ``flash_attn.cute.flash_attn_func`` (``flash_attn_varlen_func`` with varlen) under
  ``torch.no_grad()``;
- ``sdpa_efficient`` / ``sdpa_flash`` / ``sdpa_cudnn``: ``F.scaled_dot_product_attention`` under
  that ``sdpa_kernel`` backend, no_grad;
- ``matmul``: the bf16 matmul ceiling at the case's FLOPs (as in attention_bwd).

Each output is checked against an fp32 reference first (max |O - ref| / max |ref| < TOL; ours
is timed only when right). FLOPs: 4 B H Sq Sk D (2 (D + Dv) with Dv != D), halved when causal;
with a window the visited (query, key) pairs; with varlen the sum over the sequences. Timing,
rows and the board's columns as attention_bwd's: ROUNDS interleaved rounds after WARMUP_MS of
warm-up each, ``ms`` the median, ``ours_over_peer`` on every other row.
"""

from __future__ import annotations

import functools

import torch

from .attention_cases import as_tuple, first_call, import_fa4, keyed_configs, run_case, suite_cases
from .attention_common import run_cases

NAME = "attention_fwd"
FLOPS_SCALE = 1.0  # a call's FLOPs over the forward's
# the case features ops.attention_fwd_sm90.benchmark_configurations keys faithfully (all of them)
KEYED = {"attention_fwd_sm90": "all"}


def _step(fwd, x):
    """The timed call (the forward under no_grad) and its outputs (O[, LSE]), run once."""

    def fn():
        with torch.no_grad():
            return fwd(*x.leaves())

    return fn, as_tuple(first_call(fn))


def run(settings, quick: bool):
    case = functools.partial(run_case, NAME, _step, False, FLOPS_SCALE)
    return run_cases(settings.ATTENTION_FWD["quick" if quick else "full"], import_fa4, case)


def compile_configs(arch: str, quick: bool):
    """Our forward's keys (``ops.attention_fwd_sm90.benchmark_configurations``: none off sm_90a)
    for the cases it keys faithfully (KEYED)."""
    from ..arch import settings

    return keyed_configs(suite_cases(settings(arch).ATTENTION_FWD, quick), KEYED, arch)


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
