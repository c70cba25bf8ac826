"""CPU: the parts shared by the attention kernels (``cute_kernels/attention``): named-barrier
ids, and the mask's block ranges and predicates against a brute-force model of the mask."""

import functools
import itertools

import pytest

from cute_kernels.attention.mask import AttentionMask
from cute_kernels.attention.named_barrier import NamedBarrier


def test_named_barrier_ids_distinct_and_below_16():
    ids = [int(b) for b in NamedBarrier]
    assert len(ids) == len(set(ids)) and all(0 < i < 16 for i in ids)  # 0 is __syncthreads


def _host(mask: AttentionMask) -> AttentionMask:
    """The mask with its jit methods run as plain Python (ints in, ints out)."""
    object.__setattr__(mask, "causal_offset", functools.partial(AttentionMask.causal_offset.__wrapped__, mask))
    return mask


def _sees(mask_type, window, q, k, sq, sk):
    if q >= sq or k >= sk:
        return False
    offset = sk - sq if mask_type == 2 else 0
    if mask_type and k > q + offset:
        return False
    return not (window and k <= q + offset - window)


CASES = list(itertools.product((1, 2), (0, 1, 100), ((64, 128), (80, 64)), (1, 100, 256), (128, 250)))


@pytest.mark.parametrize("mask_type,window,tiles,sq,sk", CASES)
def test_mask_block_ranges_and_predicates(mask_type, window, tiles, sq, sk):
    tm, tn = tiles
    mask = _host(AttentionMask(tm, tn, mask_type, window > 0))
    m_blocks, n_blocks = -(-sq // tm), -(-sk // tn)
    sees = {(m, n): False for m in range(m_blocks) for n in range(n_blocks)}
    for q in range(sq):
        for k in range(sk):
            if _sees(mask_type, window, q, k, sq, sk):
                sees[q // tm, k // tn] = True
            assert mask.masked(q, k, sq, sk, mask.causal_offset(sq, sk), window) != _sees(
                mask_type, window, q, k, sq, sk
            )
    for n in range(n_blocks):
        lo, hi = AttentionMask.m_block_range.__wrapped__(mask, n, sq, sk, window)
        seen = [m for m in range(m_blocks) if sees[m, n]]
        assert set(seen) <= set(range(lo, hi)), (n, lo, hi, seen)
        if seen and sq % tm == 0 and sk % tn == 0:
            assert (lo, hi) == (seen[0], seen[-1] + 1)
    for m in range(m_blocks):
        lo, hi = AttentionMask.n_block_range.__wrapped__(mask, m, sq, sk, window)
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
            need = mask.needs_masking(m * tm, n * tn, sq, sk, mask.causal_offset(sq, sk), window)
            assert need or not edge, (m, n)
