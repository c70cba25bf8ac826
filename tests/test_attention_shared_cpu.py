"""CPU: the parts shared by the attention kernels (``cute_kernels/attention``): named-barrier
ids, and the mask's block ranges and predicates against a brute-force model of the mask."""

import itertools
import json
import pathlib
import subprocess
import sys

import pytest

from cute_kernels.attention.mask import AttentionMask
from cute_kernels.attention.named_barrier import NamedBarrier


def test_named_barrier_ids_distinct_and_below_16():
    ids = [int(b) for b in NamedBarrier]
    assert len(ids) == len(set(ids)) and all(0 < i < 16 for i in ids)  # 0 is __syncthreads


def _sees(mask_type, window, q, k, sq, sk):
    if q >= sq or k >= sk:
        return False
    offset = sk - sq if mask_type == 2 else 0
    if mask_type and k > q + offset:
        return False
    return not (window and k <= q + offset - window)


CASES = list(itertools.product((1, 2), (0, 1, 100), ((64, 128), (80, 64)), (1, 100, 256), (128, 250)))

# the jit methods' bodies run as plain Python in an interpreter that has compiled no kernel: once
# one is traced into a kernel, the DSL runs its body as staged code (host ints then fail its `if`s)
_RANGES = """
import functools, json, sys
from cute_kernels.attention.mask import AttentionMask
out = []
for mask_type, window, (tm, tn), sq, sk in json.loads(sys.argv[1]):
    mask = AttentionMask(tm, tn, mask_type, window > 0)
    object.__setattr__(mask, "causal_offset", functools.partial(AttentionMask.causal_offset.__wrapped__, mask))
    m = [AttentionMask.m_block_range.__wrapped__(mask, n, sq, sk, window) for n in range(-(-sk // tn))]
    n = [AttentionMask.n_block_range.__wrapped__(mask, i, sq, sk, window) for i in range(-(-sq // tm))]
    out.append([int(mask.causal_offset(sq, sk)), [[int(a), int(b)] for a, b in m], [[int(a), int(b)] for a, b in n]])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def jit_ranges():
    """{case: (causal offset, m_block_range per key block, n_block_range per query block)}."""
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _RANGES, json.dumps(CASES)], cwd=root, capture_output=True, text=True, check=True
    )
    return {
        tuple(map(lambda x: tuple(x) if isinstance(x, list) else x, c)): r
        for c, r in zip(CASES, json.loads(done.stdout))
    }


@pytest.mark.parametrize("mask_type,window,tiles,sq,sk", CASES)
def test_mask_block_ranges_and_predicates(jit_ranges, mask_type, window, tiles, sq, sk):
    tm, tn = tiles
    mask = AttentionMask(tm, tn, mask_type, window > 0)
    offset, m_ranges, n_ranges = jit_ranges[mask_type, window, tiles, sq, sk]
    m_blocks, n_blocks = -(-sq // tm), -(-sk // tn)
    sees = {(m, n): False for m in range(m_blocks) for n in range(n_blocks)}
    for q in range(sq):
        for k in range(sk):
            if _sees(mask_type, window, q, k, sq, sk):
                sees[q // tm, k // tn] = True
            assert mask.masked(q, k, sq, sk, offset, window) != _sees(mask_type, window, q, k, sq, sk)
    for n in range(n_blocks):
        lo, hi = m_ranges[n]
        seen = [m for m in range(m_blocks) if sees[m, n]]
        assert set(seen) <= set(range(lo, hi)), (n, lo, hi, seen)
        if seen and sq % tm == 0 and sk % tn == 0:
            assert (lo, hi) == (seen[0], seen[-1] + 1)
    for m in range(m_blocks):
        lo, hi = n_ranges[m]
        seen = [n for n in range(n_blocks) if sees[m, n]]
        assert set(seen) <= set(range(lo, hi)), (m, lo, hi, seen)
        if seen and sq % tm == 0 and sk % tn == 0:
            assert (lo, hi) == (seen[0], seen[-1] + 1)
        for n in range(n_blocks):
            edge = any(
                not _sees(mask_type, window, q, k, sq, sk)
                for q in range(m * tm, (m + 1) * tm)
                for k in range(n * tn, (n + 1) * tn)
            )
            need = mask.needs_masking(m * tm, n * tn, sq, sk, offset, window)
            assert need or not edge, (m, n)


@pytest.mark.parametrize("mask_type,window,tiles,sq,sk", CASES)
def test_mask_walk_forms(jit_ranges, mask_type, window, tiles, sq, sk):
    """The memory-efficient walk's forms (plain Python, the C++'s rounding, rows) against the
    brute-force mask, and against the sm90 walk's ``m_block_range``: the same first query block
    wherever a key block is seen."""
    tm, tn = tiles
    mask = AttentionMask(tm, tn, mask_type, has_window=None)
    offset, m_ranges, _ = jit_ranges[mask_type, window, tiles, sq, sk]
    assert mask.walk_offset(sq, sk) == offset
    assert mask.query_end(sq) == -(-sq // tm) * tm
    m_blocks, n_blocks = -(-sq // tm), -(-sk // tn)
    sees = {(m, n): False for m in range(m_blocks) for n in range(n_blocks)}
    for q in range(sq):
        for k in range(sk):
            if _sees(mask_type, window, q, k, sq, sk):
                sees[q // tm, k // tn] = True
    for n in range(n_blocks):
        seen = [m for m in range(m_blocks) if sees[m, n]]
        first = mask.first_query_for_key(n * tn, sq, sk, window)
        if not seen:
            assert first == mask.query_end(sq), n
            continue
        assert first == seen[0] * tm == m_ranges[n][0] * tm, (n, first, seen, m_ranges[n])
        if window:
            assert min(mask.last_query_for_key(n * tn, sq, sk, window), sq - 1) // tm == seen[-1], n
    for m in range(m_blocks):
        seen = [n for n in range(n_blocks) if sees[m, n]]
        assert mask.key_blocks_for_query(m * tm, sq, sk, window) == len(seen), (m, seen)


def test_forward_barrier_ids_distinct_and_turns_consecutive():
    from cute_kernels.attention.named_barrier import NamedBarrierFwd as B

    ids = [int(b) for b in B]
    assert len(ids) == len(set(ids)) and all(0 < i < 16 for i in ids)
    assert [B.TURN_WG0, B.TURN_WG1, B.TURN_WG2] == [B.TURN_WG0 + w for w in range(3)]
    assert [B.KEEP_FLAGS_WG0, B.KEEP_FLAGS_WG1, B.KEEP_FLAGS_WG2] == [B.KEEP_FLAGS_WG0 + w for w in range(3)]
