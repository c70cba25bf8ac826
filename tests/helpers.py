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


UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def delta_rounding_floors(q, k, do, out, dtype, scale=None):
    """(dq floor, dk floor): attention-backward rounding that does not shrink with the gradient.

    dS = P (dP - Δ) with Δ from the rounded O: a query row that sees one key has dq ~ 0 plus
    that rounding, eps |dO ∘ O|_2 (statistical) scale max|K| per row; dk = scale dS^T Q sums
    it over dim 1 (the queries of dense [B, M, H, D] tensors)."""
    import math

    eps = UNIT_ROUNDOFF[dtype]
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # rows that see no key (O NaN there: tests poison what a forward leaves unwritten) carry none
    row = (do.double() * out.double().nan_to_num(0.0)).norm(dim=-1, keepdim=True)
    dq_floor = 4 * eps * sm_scale * row * k.double().abs().max().item()
    # dK sums over the queries and, with grouped-query heads, over each key head's query heads
    b, _, h, _ = row.shape
    per_key_head = row.square().sum(1, keepdim=True).view(b, 1, k.shape[2], h // k.shape[2], 1).sum(3)
    dk_floor = 4 * eps * sm_scale * q.double().abs().max().item() * per_key_head.sqrt()
    return dq_floor, dk_floor


TILE_ROWS = 64  # the smallest block a kernel computes at once (a query / key block)


def _tile_norms(x: torch.Tensor, row_dim: int) -> torch.Tensor:
    """Norms of TILE_ROWS-row tiles along ``row_dim``, every other dim but the last a separate
    tile sequence: [sequences, tiles]."""
    x = x.movedim(row_dim, -2)
    m, d = x.shape[-2], x.shape[-1]
    x = torch.nn.functional.pad(x.reshape(-1, m, d), (0, 0, 0, (-m) % TILE_ROWS))
    return x.reshape(x.shape[0], -1, TILE_ROWS * d).norm(dim=-1)


def tile_error(got: torch.Tensor, ref: torch.Tensor, row_dim: int = 1, floor=None) -> float:
    """The largest error of a tile of rows relative to that tile's reference norm.

    Tiles whose reference is under half the root-mean-square tile are judged against half of
    it. A block of the kernel that is off by a few percent, missing, or computed for the
    wrong rows shows here even when the tensor's largest element hides it. A gradient that
    is 0 by construction has no scale to be relative to: 0 is returned, and the element-wise
    check judges it. That is a reference exactly 0, or one whose typical tile is 1e-4
    of the terms it cancels from (``floor`` / (4 eps): ``check_grad``'s rounding floor is
    4 eps times those terms)."""
    ref = ref.double()
    norms = _tile_norms(ref, row_dim)
    typical = norms.square().mean().sqrt().item()
    if floor is not None:
        floor_tiles = _tile_norms(torch.as_tensor(floor, dtype=torch.float64).expand_as(ref), row_dim)
        terms = floor_tiles.square().mean().sqrt().item() / (4 * UNIT_ROUNDOFF[got.dtype])
        if typical <= 1e-4 * terms:
            return 0.0
    if typical == 0.0:
        return 0.0
    err = _tile_norms((got.double() - ref).nan_to_num(float("inf")), row_dim)
    return (err / norms.clamp_min(0.5 * typical)).max().item()


def named_call(name: str):
    """A callable tagged ``.name`` for fake timers (the benchmark timing tests); ``"bad"`` raises."""

    def run():
        if name == "bad":
            raise RuntimeError("boom")

    run.name = name
    return run
