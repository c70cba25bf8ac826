"""Iteration order of PyTorch's mem-eff attention backward (``AttentionBackwardKernel``).

A CTA (split ``split_key`` of ``num_splits_key``) owns key blocks ``split_key``,
``split_key + num_splits_key``, ... and, for each, walks the query blocks that can
see an unmasked element of it. These are the C++ ``getQueryStartShift``,
``getQueryEnd``, ``getSmallestQueryForKey``, ``getQueryStart``,
``getNumParallelBlocksForQuery``, ``incrIteration`` and the ``isLast`` lambda.

One source for two worlds: every function takes Python ints (host, tests) or DSL
``Int32`` values (traced into a kernel). So no Python ``if``/``and``/``or``/``min``/
``max`` touches a value that may be dynamic; both branches are computed and picked
with ``_select``. Block sizes are compile-time Python ints.
"""

from typing import Any, NamedTuple

import cutlass

NO_CUSTOM_MASK = 0
CAUSAL_FROM_TOP_LEFT = 1
CAUSAL_FROM_BOTTOM_RIGHT = 2


class IterationParams(NamedTuple):
    num_queries: Any
    num_keys: Any
    custom_mask_type: Any  # NO_CUSTOM_MASK / CAUSAL_FROM_TOP_LEFT / CAUSAL_FROM_BOTTOM_RIGHT
    window_size: Any  # 0: no local window (only allowed with a causal mask)
    num_splits_key: Any  # gridDim.x in the kernel
    split_key: Any  # blockIdx.x in the kernel
    block_size_i: int  # kBlockSizeI (queries), compile time
    block_size_j: int  # kBlockSizeJ (keys), compile time


# ----------------------------------------------------------------------------- helpers


def _is_py(x) -> bool:
    return isinstance(x, (bool, int))


def _is_bool(x) -> bool:
    return isinstance(x, (bool, cutlass.Boolean))


def _min(a, b):
    return cutlass.min(a, b)  # Python ints in -> Python int out


def _max(a, b):
    return cutlass.max(a, b)


def _select(cond, a, b):
    if isinstance(cond, bool):
        return a if cond else b
    # arith.select needs both operands of one type.
    ty = cutlass.Boolean if _is_bool(a) and _is_bool(b) else cutlass.Int32
    return ty(cutlass.select_(cond, ty(a), ty(b)))


def _and(a, b):
    # A Python bool on either side is folded, so static flags cost nothing.
    if isinstance(a, bool):
        return b if a else False
    if isinstance(b, bool):
        return a if b else False
    return a & b


def _or(a, b):
    if isinstance(a, bool):
        return True if a else b
    if isinstance(b, bool):
        return True if b else a
    return a | b


def _not(a):
    if isinstance(a, bool):
        return not a
    return cutlass.not_(a)


def _cdiv_trunc(a, b: int):
    """C++ ``a / b`` (truncates toward zero) for a positive compile-time ``b``.

    Python ``//`` floors; DSL ``Int32 //`` is ``arith.floordivsi`` (also floors),
    while DSL ``Int32 %`` is ``arith.remsi`` (truncates, unlike Python ``%``).
    """
    if _is_py(a):
        q = abs(a) // b
        return q if a >= 0 else -q
    q = a // b
    return _select(_and(a < 0, q * b != a), q + 1, q)


def _ceil_div(a, b: int):
    return (a + (b - 1)) // b  # a >= 0: floor == trunc


def _align_up(a, b: int):
    return _ceil_div(a, b) * b


def _mask_shift(p):
    """Diagonal offset: 0 from top-left, num_keys - num_queries from bottom-right."""
    return _select(p.custom_mask_type == CAUSAL_FROM_BOTTOM_RIGHT, p.num_keys - p.num_queries, 0)


# ----------------------------------------------------------------------------- iteration order


def get_query_end(p: IterationParams):
    return _align_up(p.num_queries, p.block_size_i)


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
    shift = _mask_shift(p)
    window_size = _select(p.window_size == 0, p.num_queries + p.num_keys, p.window_size)
    last_key_for_block = _min(key_start + p.block_size_j, p.num_keys) - 1
    first_query = key_start - shift
    last_query = last_key_for_block - shift + window_size - 1
    empty = _or(last_query < 0, first_query >= p.num_queries)
    # Clamped to >= 0 before dividing (as the C++), so floor == trunc.
    first_block = (_max(0, first_query) // p.block_size_i) * p.block_size_i
    masked = _select(empty, get_query_end(p), first_block)
    return _select(p.custom_mask_type == NO_CUSTOM_MASK, 0, masked)


def get_query_start(p: IterationParams, key_start):
    return get_smallest_query_for_key(p, key_start) + get_query_start_shift(p)


def get_num_parallel_blocks_for_query(p: IterationParams, query_start):
    """How many splits write dQ block ``query_start`` (the dQ counter's target)."""
    bj = p.block_size_j
    shift = _mask_shift(p)
    last_query_for_block = _min(query_start + p.block_size_i, p.num_queries) - 1
    last_key_for_block = _min(last_query_for_block + shift, p.num_keys - 1)
    no_window = p.window_size == 0
    first_key_for_block = _select(no_window, 0, _max(query_start - p.window_size + 1 + shift, 0))
    # last_key_for_block may be negative here: C++ truncates (the result is then
    # overridden by the `< 0` test below, but keep C++ arithmetic anyway).
    last_kb = _cdiv_trunc(last_key_for_block, bj)
    masked_blocks = _select(no_window, last_kb + 1, last_kb - first_key_for_block // bj + 1)
    masked_blocks = _select(_or(last_key_for_block < 0, first_key_for_block >= p.num_keys), 0, masked_blocks)
    num_key_blocks = _select(p.custom_mask_type == NO_CUSTOM_MASK, _ceil_div(p.num_keys, bj), masked_blocks)
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
    shift = _mask_shift(p)
    last_key_for_block = _min(key_start + p.block_size_j, p.num_keys) - 1
    last_query = last_key_for_block - shift + p.window_size - 1
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
