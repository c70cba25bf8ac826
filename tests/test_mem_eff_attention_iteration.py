"""CPU: the mem-eff attention backward's iteration order (cute_kernels/mem_eff_attention/
iteration.py) against a brute-force mask, and the same functions traced by the DSL."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kernels.mem_eff_attention import iteration as it
from cute_kernels.mem_eff_attention.iteration import (
    CAUSAL_FROM_BOTTOM_RIGHT,
    NO_CUSTOM_MASK,
    IterationParams,
    get_num_parallel_blocks_for_query,
    get_query_end,
    get_query_start,
    get_query_start_shift,
    incr_iteration,
    is_last_key_for_query,
    visited_blocks,
)

SIZES = [1, 5, 63, 64, 65, 128, 200, 257]
BLOCKS = [(64, 64), (64, 128), (128, 64), (32, 32)]
MASKS = [(NO_CUSTOM_MASK, 0)] + [(c, w) for c in (1, 2) for w in (0, 1, 3, 64, 100)]


def _ceil_div(a, b):
    return -(-a // b)


def needed_blocks(nq, nk, cmt, window, bi, bj):
    """(query_start, key_start) of every block with at least one unmasked element.

    Causal masks key > query + shift; the window masks key <= query + shift - window
    (shift = num_keys - num_queries from bottom-right, else 0)."""
    q = np.arange(nq)[:, None]
    k = np.arange(nk)[None, :]
    shift = nk - nq if cmt == CAUSAL_FROM_BOTTOM_RIGHT else 0
    m = np.ones((nq, nk), bool)
    if cmt != NO_CUSTOM_MASK:
        m &= k <= q + shift
    if window:
        m &= k > q + shift - window
    qb, kb = _ceil_div(nq, bi), _ceil_div(nk, bj)
    pad = np.zeros((qb * bi, kb * bj), bool)
    pad[:nq, :nk] = m
    blk = pad.reshape(qb, bi, kb, bj).any(axis=(1, 3))
    return {(int(a) * bi, int(b) * bj) for a, b in zip(*np.nonzero(blk))}


def check_config(nq, nk, cmt, window, ns, bi, bj):
    cfg = (nq, nk, cmt, window, ns, bi, bj)
    visits = list(visited_blocks(nq, nk, cmt, window, ns, bi, bj))
    pairs = [(q, k) for _, q, k in visits]

    # Every block is visited at most once over all splits ...
    assert len(set(pairs)) == len(pairs), cfg
    # ... every block with an unmasked element is visited, and (stronger than the
    # kernel needs) no fully masked block is.
    assert set(pairs) == needed_blocks(nq, nk, cmt, window, bi, bj), cfg
    if cmt == NO_CUSTOM_MASK:
        assert len(pairs) == _ceil_div(nq, bi) * _ceil_div(nk, bj), cfg

    by_split = {s: [(q, k) for s2, q, k in visits if s2 == s] for s in range(ns)}
    for s, seq in by_split.items():
        p = IterationParams(nq, nk, cmt, window, ns, s, bi, bj)
        # A split owns key blocks s, s + ns, ...; each key block is one contiguous run
        # that starts at get_query_start.
        keys = [k for _, k in seq]
        runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
        assert len(runs) == len(set(runs)) and runs == sorted(runs), cfg
        for k in runs:
            assert (k // bj) % ns == s, cfg
            first = next(q for q, k2 in seq if k2 == k)
            assert first == get_query_start(p, k), cfg
            qs = [q for q, k2 in seq if k2 == k]
            if cmt == NO_CUSTOM_MASK and ns > 1:
                # Rotation of all query blocks, starting at the split's shift.
                shift = get_query_start_shift(p)
                assert shift == (s * bi) % get_query_end(p), cfg
                allq = list(range(0, nq, bi))
                i0 = allq.index(shift)
                assert qs == allq[i0:] + allq[:i0], cfg
            else:
                assert qs == sorted(qs), cfg
        # isLast: true exactly on this split's last visit of each query block (the
        # dQ counter takes one ticket per split and query block).
        last_visit = {q: i for i, (q, _) in enumerate(seq)}
        for i, (q, k) in enumerate(seq):
            assert is_last_key_for_query(p, q, k) == (last_visit[q] == i), (cfg, s, q, k)

    # get_num_parallel_blocks_for_query == number of splits that visit (and so
    # ticket) the query block, 0 for a block no split visits.
    p0 = IterationParams(nq, nk, cmt, window, ns, 0, bi, bj)
    for q in range(0, get_query_end(p0), bi):
        splits = {s for s, q2, _ in visits if q2 == q}
        assert get_num_parallel_blocks_for_query(p0, q) == len(splits), (cfg, q)
    if ns == 1:
        # With one split, isLast marks the globally last visit of each query block.
        last = {q: (q, k) for _, q, k in visits}
        for q, k in pairs:
            assert is_last_key_for_query(p0, q, k) == (last[q] == (q, k)), (cfg, q, k)
    return visits


@pytest.mark.parametrize("bi,bj", BLOCKS)
@pytest.mark.parametrize("cmt,window", MASKS)
def test_grid(cmt, window, bi, bj):
    for nq, nk in itertools.product(SIZES, SIZES):
        for ns in range(1, min(4, _ceil_div(nk, bj)) + 1):
            check_config(nq, nk, cmt, window, ns, bi, bj)


@settings(max_examples=200, deadline=None)
@given(
    nq=st.integers(1, 700),
    nk=st.integers(1, 700),
    mask=st.sampled_from([(0, False), (1, False), (2, False), (1, True), (2, True)]),
    window=st.integers(1, 400),
    bi=st.sampled_from([16, 32, 64, 128]),
    bj=st.sampled_from([16, 32, 64, 128]),
    ns_frac=st.floats(0, 1),
)
def test_random(nq, nk, mask, window, bi, bj, ns_frac):
    cmt, windowed = mask
    ns = 1 + int(ns_frac * (min(8, _ceil_div(nk, bj)) - 1))
    check_config(nq, nk, cmt, window if windowed else 0, ns, bi, bj)


def test_splits_rotate_without_mask():
    # 4 query blocks, 3 splits: split s starts at query block s, wraps, moves on.
    v = list(visited_blocks(256, 3 * 64, 0, 0, 3, 64, 64))
    assert [(q, k) for s, q, k in v if s == 2] == [(128, 128), (192, 128), (0, 128), (64, 128)]


def test_cdiv_trunc_and_helpers():
    for a in range(-200, 201):
        for b in (1, 7, 64):
            assert it._cdiv_trunc(a, b) == int(a / b)  # C++ truncation
    assert it._select(True, 1, 2) == 1 and it._select(False, 1, 2) == 2
    assert it._and(True, False) is False and it._or(False, True) is True and it._not(False) is True
    assert it._min(3, -1) == -1 and it._max(3, -1) == 3 and type(it._min(3, 4)) is int


# ----------------------------------------------------------------------------- DSL

FIELDS = 8  # nq, nk, cmt, window, ns, split, q, k
OUTS = 9


def _reference_row(row, bi, bj):
    nq, nk, cmt, window, ns, split, q, k = (int(x) for x in row)
    p = IterationParams(nq, nk, cmt, window, ns, split, bi, bj)
    nxt_q, nxt_k = incr_iteration(p, q, k)
    return [
        nxt_q,
        nxt_k,
        get_query_start(p, k),
        it.get_smallest_query_for_key(p, k),
        get_num_parallel_blocks_for_query(p, q),
        int(is_last_key_for_query(p, q, k)),
        get_query_start_shift(p),
        get_query_end(p),
        it._cdiv_trunc(q - k, bj),
    ]


def _dsl_inputs(bi, bj, rng):
    rows = []
    for nq, nk in itertools.product([1, 5, 64, 65, 200, 257], [1, 63, 128, 257]):
        for cmt, window in MASKS:
            for ns in range(1, min(4, _ceil_div(nk, bj)) + 1):
                for split in range(ns):
                    for q in range(0, nq + bi, bi):
                        for k in range(-bj, nk + 2 * bj, bj):
                            rows.append((nq, nk, cmt, window, ns, split, q, k))
    rows = np.array(rows, dtype=np.int32)
    return rows[rng.choice(len(rows), size=min(len(rows), 6000), replace=False)]


@pytest.mark.compile
@pytest.mark.parametrize("bi,bj", [(64, 128), (32, 32)])
def test_dsl_matches_python(bi, bj):
    """Host @cute.jit (LLVM-JIT on the CPU) with dynamic Int32 parameters gives the
    Python results: the _select/_and/... path, floordivsi/remsi and select typing."""
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack

    @cute.jit
    def run(mIn: cute.Tensor, mOut: cute.Tensor):
        for r in cutlass.range(mIn.shape[0]):
            p = IterationParams(mIn[r, 0], mIn[r, 1], mIn[r, 2], mIn[r, 3], mIn[r, 4], mIn[r, 5], bi, bj)
            q = mIn[r, 6]
            k = mIn[r, 7]
            nxt_q, nxt_k = incr_iteration(p, q, k)
            mOut[r, 0] = nxt_q
            mOut[r, 1] = nxt_k
            mOut[r, 2] = get_query_start(p, k)
            mOut[r, 3] = it.get_smallest_query_for_key(p, k)
            mOut[r, 4] = get_num_parallel_blocks_for_query(p, q)
            mOut[r, 5] = Int32(is_last_key_for_query(p, q, k))
            mOut[r, 6] = get_query_start_shift(p)
            mOut[r, 7] = get_query_end(p)
            mOut[r, 8] = it._cdiv_trunc(q - k, bj)

    rows = _dsl_inputs(bi, bj, np.random.default_rng(bi * 1000 + bj))
    t_in = torch.from_numpy(rows)
    t_out = torch.full((len(rows), OUTS), -12345, dtype=torch.int32)
    run(from_dlpack(t_in), from_dlpack(t_out))
    expect = np.array([_reference_row(r, bi, bj) for r in rows], dtype=np.int32)
    bad = np.nonzero((t_out.numpy() != expect).any(axis=1))[0]
    assert len(bad) == 0, [(rows[i].tolist(), t_out[i].tolist(), expect[i].tolist()) for i in bad[:5]]


@pytest.mark.compile
def test_dsl_kernel_compiles():
    """Traced into a @cute.kernel for sm_90a (compile only), with runtime Int32
    parameters and with static Python-int mask type / window."""
    import cutlass.cute as cute
    from cutlass import Int32

    bi, bj = 64, 128

    @cute.kernel
    def kernel(mOut: cute.Tensor, nq: Int32, nk: Int32, cmt: Int32, window: Int32):
        split, _, _ = cute.arch.block_idx()
        ns, _, _ = cute.arch.grid_dim()
        tidx, _, _ = cute.arch.thread_idx()
        q = Int32(tidx) * bi
        k = Int32(split) * bj
        for j, p in enumerate(
            (
                IterationParams(nq, nk, cmt, window, Int32(ns), Int32(split), bi, bj),
                IterationParams(nq, nk, CAUSAL_FROM_BOTTOM_RIGHT, 0, Int32(ns), Int32(split), bi, bj),
            )
        ):
            nxt_q, nxt_k = incr_iteration(p, q, k)
            mOut[tidx, 6 * j + 0] = nxt_q
            mOut[tidx, 6 * j + 1] = nxt_k
            mOut[tidx, 6 * j + 2] = get_query_start(p, k)
            mOut[tidx, 6 * j + 3] = get_num_parallel_blocks_for_query(p, q)
            mOut[tidx, 6 * j + 4] = Int32(is_last_key_for_query(p, q, k))
            mOut[tidx, 6 * j + 5] = get_query_end(p)

    @cute.jit
    def launch(mOut: cute.Tensor, nq: Int32, nk: Int32, cmt: Int32, window: Int32, ns: Int32):
        kernel(mOut, nq, nk, cmt, window).launch(grid=[ns, 1, 1], block=[32, 1, 1])

    out = cute.runtime.make_fake_tensor(Int32, (32, 12), stride=(12, 1))
    args = (Int32(1),) * 5
    assert cute.compile(launch, out, *args, options="--gpu-arch sm_90a") is not None
