"""Iteration order of PyTorch's mem-eff attention backward (``AttentionBackwardKernel``).

A CTA (split ``split_key`` of ``num_splits_key``) owns key blocks ``split_key``,
``split_key + num_splits_key``, ... and, for each, walks the query blocks that can
see an unmasked element of it. These are the C++ ``getQueryStartShift``,
``getQueryEnd``, ``getSmallestQueryForKey``, ``getQueryStart``,
``getNumParallelBlocksForQuery``, ``incrIteration`` and the ``isLast`` lambda.
What the mask decides (the first / last query a key block's keys can see, the
key blocks a query block sees, the walk's end) is ``AttentionMask``'s
(``cute_kernels/attention/mask.py``: ``first_query_for_key``, ``last_query_for_key``,
``key_blocks_for_query``, ``query_end``, ``walk_offset``, the C++'s forms); this module
keeps the split bookkeeping around them (the start shift of unmasked split-key runs,
the next block, the last visit of a query block).

One source for two worlds: every function takes Python ints (host, tests) or DSL
``Int32`` values (traced into a kernel). So no Python ``if``/``and``/``or``/``min``/
``max`` touches a value that may be dynamic; both branches are computed and picked
with ``_select`` (``cute_kernels/common/host_or_dsl.py``). Block sizes are compile-time
Python ints.
"""

from typing import Any, NamedTuple

from cute_kernels.attention.mask import CAUSAL_BOTTOM_RIGHT, CAUSAL_TOP_LEFT, NO_MASK, AttentionMask
from cute_kernels.common.host_or_dsl import and_ as _and
from cute_kernels.common.host_or_dsl import cdiv_trunc as _cdiv_trunc  # noqa: F401 (the tests' name)
from cute_kernels.common.host_or_dsl import max_ as _max
from cute_kernels.common.host_or_dsl import min_ as _min
from cute_kernels.common.host_or_dsl import not_ as _not
from cute_kernels.common.host_or_dsl import or_ as _or
from cute_kernels.common.host_or_dsl import select as _select

NO_CUSTOM_MASK = NO_MASK
CAUSAL_FROM_TOP_LEFT = CAUSAL_TOP_LEFT
CAUSAL_FROM_BOTTOM_RIGHT = CAUSAL_BOTTOM_RIGHT


class IterationParams(NamedTuple):
    num_queries: Any
    num_keys: Any
    custom_mask_type: Any  # NO_CUSTOM_MASK / CAUSAL_FROM_TOP_LEFT / CAUSAL_FROM_BOTTOM_RIGHT
    window_size: Any  # 0: no local window (only allowed with a causal mask)
    num_splits_key: Any  # gridDim.x in the kernel
    split_key: Any  # blockIdx.x in the kernel
    block_size_i: int  # kBlockSizeI (queries), compile time
    block_size_j: int  # kBlockSizeJ (keys), compile time

    @property
    def mask(self) -> AttentionMask:
        """The walk's mask: query blocks of block_size_i, key blocks of block_size_j, the
        mask type and window read at runtime."""
        return AttentionMask(self.block_size_i, self.block_size_j, self.custom_mask_type, has_window=None)


# ----------------------------------------------------------------------------- iteration order


def get_query_end(p: IterationParams):
    return p.mask.query_end(p.num_queries)


def get_query_start_shift(p: IterationParams):
    """Unmasked split-key runs start each split at a different query block, so the
    splits do not queue on the same dQ lock."""
    cond = _and(p.custom_mask_type == NO_CUSTOM_MASK, p.num_splits_key > 1)
    # query_end is 0 only when num_queries == 0, where the shift is never used: avoid % 0.
    # Non-negative operands: Python and DSL % agree with C++.
    shift = (p.split_key * p.block_size_i) % _max(get_query_end(p), 1)
    return _select(cond, shift, 0)


def get_smallest_query_for_key(p: IterationParams, key_start):
    """First query block (as a row) with an unmasked element in key block
    ``key_start``; get_query_end(p) when the key block is fully masked."""
    return p.mask.first_query_for_key(key_start, p.num_queries, p.num_keys, p.window_size)


def get_query_start(p: IterationParams, key_start):
    return get_smallest_query_for_key(p, key_start) + get_query_start_shift(p)


def get_num_parallel_blocks_for_query(p: IterationParams, query_start):
    """How many splits write dQ block ``query_start`` (the dQ counter's target)."""
    num_key_blocks = p.mask.key_blocks_for_query(query_start, p.num_queries, p.num_keys, p.window_size)
    return _min(p.num_splits_key, num_key_blocks)


def incr_iteration(p: IterationParams, query_start, key_start):
    """The block after (query_start, key_start): ``(next_query, next_key)``.

    ``next_key != key_start`` means this split is done with key block ``key_start``.
    """
    next_query = query_start + p.block_size_i
    query_shift = get_query_start_shift(p)
    has_shift = query_shift != 0
    # With a shift (no mask, split keys): wrap past the end to the smallest query,
    # and move on once the walk comes back around to query_shift.
    wrap = next_query >= p.num_queries
    back_at_shift = _and(query_start < query_shift, query_shift <= next_query)
    shift_next_key = _and(_not(wrap), back_at_shift)
    # Without: stay while next_query is a query row, and (local window) not past the
    # last query that sees this key block.
    last_query = p.mask.last_query_for_key(key_start, p.num_queries, p.num_keys, p.window_size)
    stay_window = _and(next_query <= last_query, next_query < p.num_queries)
    stay = _select(p.window_size > 0, stay_window, next_query < p.num_queries)
    go_next_key = _select(has_shift, shift_next_key, _not(stay))

    same_key_query = _select(_and(has_shift, wrap), get_smallest_query_for_key(p, key_start), next_query)
    new_key = key_start + p.num_splits_key * p.block_size_j
    next_query = _select(go_next_key, get_query_start(p, new_key), same_key_query)
    next_key = _select(go_next_key, new_key, key_start)
    return next_query, next_key


def is_last_key_for_query(p: IterationParams, query_start, key_start):
    """The ``isLast`` lambda: this split will not visit query block ``query_start``
    again (its next key block is past the end or starts below this query block).
    It then bumps the dQ counter; the split that brings it to
    get_num_parallel_blocks_for_query writes dQ."""
    next_key = key_start + p.num_splits_key * p.block_size_j
    return _or(p.num_keys <= next_key, query_start < get_smallest_query_for_key(p, next_key))


# ----------------------------------------------------------------------------- host


def visited_blocks(
    num_queries: int,
    num_keys: int,
    custom_mask_type: int,
    window_size: int,
    num_splits_key: int,
    block_size_i: int,
    block_size_j: int,
):
    """Yield ``(split, query_start, key_start)`` in the order attention_kernel's loop
    visits them, split after split (pure Python)."""
    for split in range(num_splits_key):
        p = IterationParams(
            num_queries,
            num_keys,
            custom_mask_type,
            window_size,
            num_splits_key,
            split,
            block_size_i,
            block_size_j,
        )
        key_start = split * block_size_j
        while key_start < num_keys:
            next_key = key_start
            query_start = get_query_start(p, key_start)
            while next_key == key_start and query_start < num_queries:
                yield split, query_start, key_start
                query_start, next_key = incr_iteration(p, query_start, key_start)
            key_start += num_splits_key * block_size_j
