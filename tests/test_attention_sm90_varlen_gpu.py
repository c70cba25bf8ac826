"""The Hopper-native attention backward on an H100 (sm_90a) with variable lengths (packed
sequences, empty ones included) with every mask, windows, grouped heads, deterministic mode
and Dqk != Dv, against fp64 and the memory-efficient kernel."""

import logging

import pytest
import torch

import ops
from ops.reference import attention_backward_ref, attention_forward_ref

from .attention_sm90_gpu_common import (
    BF16,
    DEV,
    F16,
    LOGGER,
    blind_rows,
    check,
    chosen,
    dims_id,
    head_dims,
    make_inputs,
    poison,
    rounding_floors,
)
from .attention_sm90_gpu_common import _needs_sm90  # noqa: F401 (autouse: an sm_90a device)

pytestmark = pytest.mark.gpu


# (dtype, H, Hk, D, mask, window, query lengths, key lengths, deterministic): sequences
# packed along the rows of batch-1 tensors; tiles run past a sequence into the next one
VARLEN_CASES = [
    (BF16, 2, 2, 64, 0, 0, [1, 130, 3], [0, 130, 64], False),  # an empty key sequence
    (F16, 2, 2, 128, 1, 0, [300], [257], False),
    (BF16, 4, 2, 64, 2, 0, [5, 64, 65, 33], [70, 64, 1, 100], False),  # bottom-right, Sq > Sk in one
    (F16, 2, 1, 96, 2, 16, [200, 129, 7], [250, 129, 300], False),  # multi-query, a window
    (BF16, 2, 2, 128, 1, 50, [257, 0, 100], [300, 40, 100], True),  # an empty query sequence
    (F16, 3, 3, 64, 0, 0, [700, 300], [500, 900], True),
    # d192 / d256: 64 x 64 tiles (a tile past a sequence's end reads the next one's rows)
    (BF16, 2, 2, 192, 1, 0, [1, 130, 65], [0, 130, 64], False),
    (F16, 4, 2, 256, 2, 0, [5, 64, 65, 33], [70, 64, 1, 100], False),
    (BF16, 2, 1, 256, 1, 40, [257, 0, 100], [300, 40, 100], True),
    # Dqk != Dv: the dQ accumulator (Dqk wide) is zeroed apart from Δ's launch
    (F16, 4, 2, (128, 64), 2, 0, [5, 64, 65, 33], [70, 64, 1, 100], False),
    (BF16, 2, 1, (192, 128), 1, 40, [257, 0, 100], [300, 40, 100], True),
]


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def _varlen_id(c):
    return (
        f"{str(c[0])[6:]}-H{c[1]}Hk{c[2]}d{dims_id(c[3])}m{c[4]}w{c[5]}-q{'_'.join(map(str, c[6]))}-k{'_'.join(map(str, c[7]))}"
        + ("-det" if c[8] else "")
    )


def _varlen_floors(q, k, do, out, dtype, lengths_q, lengths_k):
    """rounding_floors per packed sequence (dk's floor sums only its own sequence's queries)."""
    dq_floor = torch.zeros(q.shape[:3] + (1,), dtype=torch.float64, device=DEV)
    dk_floor = torch.zeros(k.shape[:3] + (1,), dtype=torch.float64, device=DEV)
    for (q0, nq), (k0, nk) in zip(_bounds(lengths_q), _bounds(lengths_k)):
        if nq and nk:
            fq, fk, _ = rounding_floors(
                *(t[:, a : a + n] for t, a, n in ((q, q0, nq), (k, k0, nk), (do, q0, nq), (out, q0, nq))), dtype
            )
            dq_floor[:, q0 : q0 + nq] = fq
            dk_floor[:, k0 : k0 + nk] = fk
    return dq_floor, dk_floor, None


def _bounds(lengths):
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    return list(zip(starts, lengths))


@pytest.mark.parametrize("case", VARLEN_CASES, ids=[_varlen_id(c) for c in VARLEN_CASES])
def test_varlen(case, caplog):
    """Packed sequences through the sm90 path: against fp64 and the memory-efficient kernel
    (rows past a sequence's end belong to the next one, so any leak shows), and bitwise
    repeatable in deterministic mode."""
    dtype, h, hk, d, mask_type, window, lengths_q, lengths_k, deterministic = case
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, _, _, do = make_inputs(1, h, total_q, total_k, d, dtype, seed=total_q + sum(head_dims(d)))
    _, k, v, _ = make_inputs(1, hk, total_q, total_k, d, dtype, seed=total_k + h)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse = attention_forward_ref(
        q, k, v, custom_mask_type=mask_type, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    padded = torch.full((lse.shape[0], h, (max_q + 31) // 32 * 32), float("inf"), device=DEV)
    padded[..., : lse.shape[2]] = lse.float()
    out = out.to(dtype)
    for i, ((q0, nq), nk) in enumerate(zip(_bounds(lengths_q), lengths_k)):  # each sequence's rows without keys
        poison(out[:, q0 : q0 + nq], padded[i : i + 1], blind_rows(nq, nk, mask_type, window))
    empty = torch.empty((), dtype=torch.int64)

    def run(backend):
        dq, dk, dv, _ = ops.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            out,
            cu_q,
            cu_k,
            max_q,
            max_k,
            padded,
            0.0,
            empty,
            empty,
            mask_type,
            False,
            window_size=window or None,
            backend=backend,
            deterministic=deterministic,
        )
        return dq, dk, dv

    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = run("auto")
        theirs = run("mem_eff")
    assert chosen(caplog) == ["sm90", "mem_eff"]
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    floors = _varlen_floors(q, k, do, out, dtype, lengths_q, lengths_k)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, ref, (q, k, v), floors):
        check(f"{name} [{_varlen_id(case)}]", g, r, like, dtype, floor)
    floors = [None if f is None else 2 * f for f in floors]
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v), floors):
        check(f"{name} [{_varlen_id(case)}] vs mem_eff", g, r, like, dtype, floor)
    if deterministic:
        for _ in range(2):
            for name, g0, g in zip(("dq", "dk", "dv"), ours, run("sm90")):
                assert torch.equal(g0, g), f"{name}: deterministic runs differ"
