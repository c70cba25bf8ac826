"""Suite attention_train: attention forward + backward as a training step calls them, through
each implementation's public autograd entry.

Cases (``ATTENTION_TRAIN`` in ``benchmarks/arch/*.py``; syntax, features and peers in
``attention_cases``): ``BxHxSxD:bf16[:causal][:features]``. A timed call sets the leaves'
``.grad`` to None (``zero_grad(set_to_none=True)``), runs the forward on Q, K, V (and the sink)
that require gradients and ``torch.autograd.backward`` of its outputs: O with dO, and with
``dlse`` the LSE with dLSE too (one backward call, as a loss on both gives it):

- ``ours``: ``ops.memory_efficient_attention`` (its forward where it applies, our backward:
  ``backend="auto"``, the Hopper kernel where it applies);
- ``fa4``: ``flash_attn.cute.flash_attn_func`` / ``flash_attn_varlen_func`` (FA4's autograd
  Function: its forward and ``_flash_attn_bwd``);
- ``sdpa_efficient`` / ``sdpa_flash`` / ``sdpa_cudnn``: ``F.scaled_dot_product_attention`` under
  that ``sdpa_kernel`` backend, on [B, H, S, D] views of the [B, S, H, D] leaves;
- ``matmul``: the bf16 matmul ceiling at the case's FLOPs (as in attention_bwd).

Checked first against an fp32 reference: O, dQ, dK, dV (the LSE with ``dlse``, d sink with
``sink``) each within TOL (max |x - ref| / max |ref|; ours timed only when right). FLOPs: 3.5 x
the forward's (forward 1 + backward 2.5; the forward's as in attention_fwd). Timing and rows as
attention_bwd's. Each feature case (softcap, sink, dlse) has its twin without the feature in the
table: a feature's cost is the ratio of the two.
"""

from __future__ import annotations

import functools

import torch

from .attention_cases import KEYED, as_tuple, first_call, import_fa4, keyed_configs, run_case, suite_cases
from .attention_common import run_cases

NAME = "attention_train"
FLOPS_SCALE = 3.5  # forward 1 + backward 2.5 (five S x S x D products against the forward's two)


def _step(fwd, x):
    """The timed call (a training step's forward and backward) and its results (O[, LSE], dQ, dK,
    dV[, d sink]), run once."""
    leaves = [t.detach().requires_grad_() for t in x.leaves()]
    grads = x.output_grads()

    def fn():
        for t in leaves:
            t.grad = None
        outs = as_tuple(fwd(*leaves))
        torch.autograd.backward(outs, grads)
        return outs

    outs = first_call(fn)
    results = (*(t.detach() for t in outs), *(t.grad for t in leaves))
    for t in leaves:
        t.grad = None
    return fn, results


def run(settings, quick: bool):
    case = functools.partial(run_case, NAME, _step, True, FLOPS_SCALE)
    return run_cases(settings.ATTENTION_TRAIN["quick" if quick else "full"], import_fa4, case)


def compile_configs(arch: str, quick: bool):
    """The forward's keys (``ops.attention_fwd_sm90``, sm_90a only) and the backwards'
    (``ops.mem_eff_attention``; ``ops.attention_sm90``, sm_90a only) of the cases each keys
    faithfully (KEYED)."""
    from ..arch import settings

    return keyed_configs(suite_cases(settings(arch).ATTENTION_TRAIN, quick), KEYED, arch)


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
