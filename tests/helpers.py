"""Helpers shared by the tests."""

import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (floats) or 0xFF bytes so unwritten elements show."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1 if t.dtype.is_signed else 255)
    return t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


class _Traced(Exception):
    """Raised instead of running the captured graph (the ops cannot launch on a CPU)."""


def trace_custom_ops(fn, *args):
    """The cute_kernels ops that one ``torch.compile(fullgraph=True)`` capture of ``fn`` holds.

    Compiling fails if the capture breaks the graph; the graph itself is never run.
    """
    import pytest

    def backend(gm, example_inputs):
        found = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "cute_kernels" in str(n.target)]

        def run(*a):
            raise _Traced(found)

        return run

    torch._dynamo.reset()
    with pytest.raises(_Traced) as info:
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return info.value.args[0]
