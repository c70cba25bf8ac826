"""The Hopper-native attention backward on an H100 (sm_90a): how its CTAs walk the tiles and
add dQ, each way against fp64:

* persistent CTAs (d64) walking several tiles, with and without carry_dq;
* deterministic mode: three runs bitwise equal, and against fp64; torch's flag followed;
* d128's partial last query block on narrower products, against fp64 and whole blocks;
* convert_dq overlapping the kernel's last wave: deterministic bits equal to the late
  convert's, the overlapped runs against fp64 (three, deterministic ones for causal masks);
* store_first (each query block's first dQ stored): the accumulator handed over full of NaN,
  three runs against fp64 and the zeroed accumulator's run;
* zero_ahead (persistent CTAs zero the accumulator themselves: a round of tiles ahead, or with a
  causal mask from a counter of zeroing jobs): the same, over grids of 1 to 132 CTAs, key blocks
  owning several query blocks or none, both causal corners, and grids smaller than a head's key
  blocks (the dQ-store warp zeroing the blocks nobody has reached).
"""

import logging

import pytest
import torch

from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops import _compile as cc
from ops.reference import attention_backward_ref

from .attention_sm90_gpu_common import (
    BF16,
    F16,
    LOGGER,
    _grouped_id,
    _padded_ref_forward,
    backward,
    check,
    chosen,
    dims_id,
    forward,
    head_dims,
    make_inputs,
    rounding_floors,
)
from .attention_sm90_gpu_common import _needs_sm90  # noqa: F401 (autouse: an sm_90a device)

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------------- persistent CTAs

# the d64 tiles run persistent CTAs (K / V double-buffered across tiles; causal tiles from a
# counter); with one or three CTAs every CTA walks several tiles, K / V buffers alternate and the
# Q / dO pipelines run on across tiles. (dtype, B, H, Hk, Sq, Sk, D, mask[, window])
PERSISTENT_CASES = [
    (BF16, 2, 3, 3, 300, 257, 64, 0),  # partial query and key blocks: 18 tiles
    (F16, 1, 4, 2, 129, 384, 64, 0),  # grouped-query heads: a tile walks 2 query heads
    (BF16, 3, 2, 2, 1, 200, 64, 0),  # one query
    (BF16, 2, 2, 1, 200, 300, 64, 0),  # multi-query
    # causal: tiles taken from the counter, heavy-first
    (BF16, 2, 3, 3, 300, 257, 64, 1),  # top-left, Sq > Sk
    (F16, 1, 4, 2, 130, 520, 64, 1),  # top-left, Sq < Sk: key blocks no query sees (tiles without steps)
    (BF16, 2, 2, 1, 257, 300, 64, 2),  # bottom-right, multi-query
    # sliding windows (dtype, ..., mask, window)
    (BF16, 2, 2, 2, 600, 600, 64, 1, 100),  # across key blocks
    (F16, 1, 4, 2, 520, 130, 64, 2, 60),  # bottom-right, Sq > Sk, grouped heads
    (BF16, 1, 2, 2, 130, 520, 64, 1, 200),  # top-left, Sq < Sk: key blocks no query sees
]


def _persistent_id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}Hk{c[3]}q{c[4]}k{c[5]}d{dims_id(c[6])}m{c[7]}" + (
        f"w{c[8]}" if len(c) > 8 else ""
    )


# without a mask: each case with carry_dq (a tile's last dQ in the next tile's step 0, which the op
# asks for on tiles of at most CARRY_DQ_MAX_STEPS steps: set to 8 here) and without
PERSISTENT_RUNS = [(c, carry) for c in PERSISTENT_CASES for carry in ((True, False) if c[7] == 0 else (None,))]


@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize(
    "case,carry",
    PERSISTENT_RUNS,
    ids=[_persistent_id(c) + {True: "-carry", False: "-nocarry", None: ""}[k] for c, k in PERSISTENT_RUNS],
)
def test_persistent_ctas_walk_several_tiles(case, carry, ctas, monkeypatch, caplog):
    from ops import attention_sm90 as sm90_ops

    dtype, b, h, hk, sq, sk, d, mask_type = case[:8]
    window = case[8] if len(case) > 8 else 0
    assert bwd_config.attention_sm90_tiles(d).kv_buffers == 2
    monkeypatch.setattr(sm90_ops, "PERSISTENT_CTAS", ctas)
    if carry is not None:
        steps = (h // hk) * -(-sq // bwd_config.attention_sm90_tiles(d).tile_m)
        assert steps <= 8  # so that carry_dq is on with the limit below
        monkeypatch.setattr(bwd_config, "CARRY_DQ_MAX_STEPS", 8 if carry else 0)
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + ctas)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + ctas)
    kw = dict(window_size=window) if window else {}
    if window:
        out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    else:
        out, lse = forward(q, k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2), mask_type)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        grads = backward("sm90", q, k, v, do, out, lse, mask_type, **kw)
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
        check(f"{name} [{_persistent_id(case)}] {ctas} CTAs", g, r, like, dtype, floor)


# -------------------------------------------------------------------- deterministic mode

# (dtype, B, H, Hk, Sq, Sk, D, mask, window): several key blocks add into each query block
DETERMINISTIC_CASES = [
    (BF16, 2, 4, 2, 600, 700, 128, 0, 0),  # grouped heads, no mask
    (F16, 1, 3, 3, 900, 900, 64, 1, 0),
    (BF16, 1, 2, 2, 700, 400, 128, 2, 0),  # bottom-right, Sq > Sk: query blocks no key block sees
    (BF16, 1, 2, 1, 800, 800, 64, 1, 200),  # a window: query block m starts at a later key block
    (F16, 1, 2, 2, 640, 900, 128, 2, 130),
    (BF16, 1, 4, 2, 600, 700, 192, 0, 0),  # d192: joint dQ handoff, ascending key blocks
    (F16, 1, 2, 2, 700, 700, 256, 1, 0),  # d256: descending key blocks
    (BF16, 1, 2, 1, 640, 900, 256, 2, 130),
    (F16, 1, 4, 2, 600, 700, (192, 128), 0, 0),  # Dqk != Dv, wide tiles, ascending key blocks
    (BF16, 1, 2, 1, 800, 800, (64, 128), 1, 200),  # base tiles, a window
]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=[_grouped_id(c) for c in DETERMINISTIC_CASES])
def test_deterministic_is_bitwise_repeatable(case):
    """Three runs give the same bits (dQ's fp32 adds in key-block order), and the gradients
    are the fp64 ones."""
    dtype, b, h, hk, sq, sk, d, mask_type, window = case
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + sum(head_dims(d)))
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + sum(head_dims(d)))
    out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    kw = dict(window_size=window) if window else {}
    runs = [backward("sm90", q, k, v, do, out, lse, mask_type, deterministic=True, **kw) for _ in range(3)]
    for later in runs[1:]:
        for name, g0, g in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(g0, g), f"{name}: deterministic runs differ"
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), runs[0], ref, (q, k, v), floors):
        check(f"{name} [{_grouped_id(case)}] deterministic", g, r, like, dtype, floor)


# (dtype, B, H, Hk, Sq, Sk, mask, window, deterministic, tail_m) at d128 (tile_m 80): a partial last
# query block runs on products tail_m queries wide (Sq % 80 rounded up to 16), or whole (0)
TAIL_CASES = [
    (BF16, 2, 2, 2, 81, 200, 0, 0, False, 16),  # one row past a whole block
    (F16, 1, 4, 2, 260, 300, 1, 0, False, 32),  # grouped heads: the partial block once per query head
    (BF16, 1, 2, 2, 208, 160, 2, 0, False, 48),  # bottom-right, Sq > Sk
    (BF16, 1, 2, 2, 300, 300, 1, 0, True, 64),  # deterministic
    (F16, 1, 2, 1, 250, 400, 1, 100, False, 16),  # a window
    (BF16, 2, 8, 8, 2048, 2048, 0, 0, False, 48),  # store_first, ConvertDQReady, many key blocks a block
    (BF16, 1, 2, 2, 230, 230, 0, 0, False, 0),  # 70 rows: rounded up they would be the whole block
]


def _tail_id(c):
    return f"{str(c[0])[6:]}-B{c[1]}H{c[2]}Hk{c[3]}q{c[4]}k{c[5]}m{c[6]}w{c[7]}" + ("-det" if c[8] else "")


@pytest.mark.parametrize("case", TAIL_CASES, ids=[_tail_id(c) for c in TAIL_CASES])
def test_partial_last_block_on_narrow_products(case, monkeypatch):
    """The op compiles d128's partial last query block on tail_m-wide products (the kernel's
    tail_m, chosen per Sq); dQ / dK / dV against fp64, and against the whole-block kernel
    (``TAIL_BLOCK`` off) within twice the rounding floor."""
    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, mask_type, window, det, tail_m = case
    d = 128
    plan = S._plan(
        cc.cute_dtype(dtype),
        d,
        d,
        mask_type,
        "sm_90a",
        window=window > 0,
        deterministic=det,
        varlen=False,
        bias=False,
        grad_bias=False,
        dropout=False,
        rows_q=sq,
        group=h // hk,
        rows_k=sk,
        ctas=132,
    )
    assert plan[2].tail_m == tail_m
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + 11 * h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + 11 * hk)
    out, lse = _padded_ref_forward(q, k, v, mask_type, window)
    kw = dict(deterministic=det, **(dict(window_size=window) if window else {}))
    ours = backward("sm90", q, k, v, do, out, lse, mask_type, **kw)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, window_size=window)
    floors = rounding_floors(q, k, do, out, dtype)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, ref, (q, k, v), floors):
        check(f"{name} [{_tail_id(case)}]", g, r, like, dtype, floor)
    monkeypatch.setattr(S, "TAIL_BLOCK", False)
    whole = backward("sm90", q, k, v, do, out, lse, mask_type, **kw)
    floors = [None if f is None else 2 * f for f in floors]
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), ours, whole, (q, k, v), floors):
        check(f"{name} [{_tail_id(case)}] vs whole blocks", g, r, like, dtype, floor)


# (dtype, B, H, Hk, Sq, Sk, D, mask): several waves of CTAs, so heads complete while the grid runs
OVERLAP_CASES = [
    (BF16, 2, 8, 8, 2048, 2048, 96, 0),
    (F16, 2, 8, 4, 1536, 2048, 128, 0),  # grouped heads: a key head's count completes its query heads
    (BF16, 1, 4, 4, 1024, 1500, (192, 128), 0),  # wide tiles, Dqk != Dv
    (BF16, 2, 8, 8, 1024, 1024, 128, 1),  # causal: overlapped only in deterministic mode (launch order)
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=[_grouped_id(c + (0,)) for c in OVERLAP_CASES])
def test_convert_overlap_is_the_late_convert(case, monkeypatch):
    """convert_dq overlapping the kernel (ConvertDQReady: a head converted once all its key
    blocks have counted their dQ adds) gives deterministic mode the late convert_dq's bits;
    the overlapped runs against fp64 (a head converted before its adds are all visible would
    be off by whole blocks' contributions): the deterministic one, then three plain runs, or
    with a causal mask (overlapped only when deterministic) two more deterministic ones."""
    from ops import attention_bwd_prepost as P
    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, d, mask_type = case
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + hk)
    out, lse = _padded_ref_forward(q, k, v, mask_type, 0)
    overlapped = []
    launch = P.launch_convert_dq_ready
    monkeypatch.setattr(P, "launch_convert_dq_ready", lambda *a: overlapped.append(1) or launch(*a))
    runs = {}
    for ready in (True, False):
        monkeypatch.setattr(S, "DQ_READY", ready)
        runs[ready] = backward("sm90", q, k, v, do, out, lse, mask_type, deterministic=True)
    assert len(overlapped) == 1, "the overlapping convert was not taken"
    for name, a, c in zip(("dq", "dk", "dv"), runs[True], runs[False]):
        assert torch.equal(a, c), f"{name}: overlapped and late convert_dq differ"
    # equal bits do not make either right: the overlapped runs against fp64 too, the
    # deterministic one and more (a causal mask overlaps only in deterministic mode: its
    # further runs are deterministic too, three overlapped runs in all; without one, three
    # plain runs, whose adds race)
    monkeypatch.setattr(S, "DQ_READY", True)
    deterministic = mask_type != 0
    checked = [("deterministic", runs[True])]
    for i in range(2 if deterministic else 3):
        checked.append((f"run {i}", backward("sm90", q, k, v, do, out, lse, mask_type, deterministic=deterministic)))
    assert len(overlapped) == len(checked), "the overlapping convert was not taken"
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    floors = rounding_floors(q, k, do, out, dtype)
    for label, got in checked:
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), got, ref, (q, k, v), floors):
            check(f"{name} [{_grouped_id(case + (0,))}] {label}", g, r, like, dtype, floor)


def _unzeroed_accumulator_runs(S, monkeypatch, dims, mask_type, seed, taken, off):
    """Three backwards with the op's unzeroed dQ accumulator handed over full of NaN, then one
    with the switches ``off`` (module attributes of ``S`` set False: the preprocess zeroes it),
    all against fp64. ``dims``: (dtype, B, H, Hk, Sq, Sk, D); ``taken``: the assertion message
    when the runs did not take the unzeroed path."""
    dtype, b, h, hk, sq, sk, d = dims
    poisoned = []

    def nan_accum(dq_accum):
        poisoned.append(dq_accum.shape)
        return dq_accum.fill_(float("nan"))

    monkeypatch.setattr(S, "_unzeroed_dq_accum", nan_accum)
    q, _, _, do = make_inputs(b, h, sq, sk, d, dtype, seed=sq + seed * h)
    _, k, v, _ = make_inputs(b, hk, sq, sk, d, dtype, seed=sk + seed * hk)
    out, lse = _padded_ref_forward(q, k, v, mask_type, 0)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    floors = rounding_floors(q, k, do, out, dtype)
    runs = [backward("sm90", q, k, v, do, out, lse, mask_type) for _ in range(3)]
    assert len(poisoned) == 3, taken
    for name in off:
        monkeypatch.setattr(S, name, False)
    zeroed = backward("sm90", q, k, v, do, out, lse, mask_type)
    assert len(poisoned) == 3
    case_id = _grouped_id(tuple(dims) + (mask_type, 0))
    for i, got in enumerate(runs + [zeroed]):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), got, ref, (q, k, v), floors):
            check(f"{name} [{case_id}] run {i}", g, r, like, dtype, floor)


# (dtype, B, H, Hk, Sq, Sk, D, mask, persistent CTAs or None): every query block is seen, so the
# op asks for store_first; several key blocks reach each query block
STORE_FIRST_CASES = [
    (BF16, 2, 4, 4, 1024, 1024, 64, 0, 3),  # persistent CTAs walking several tiles, carry_dq
    (F16, 1, 4, 2, 700, 900, 64, 0, None),  # grouped heads, a partial last block, rotated order
    (BF16, 2, 8, 8, 2048, 2048, 128, 0, None),  # a CTA per tile, ConvertDQReady overlapping
    (F16, 1, 4, 4, 1000, 1300, 96, 1, None),  # causal top-left, Sq < Sk
    (BF16, 1, 4, 2, 1300, 700, 128, 1, None),  # causal top-left, Sq > Sk
    (BF16, 1, 2, 2, 600, 900, 64, 2, None),  # causal bottom-right, Sq <= Sk (dynamic tiles)
    (F16, 1, 4, 2, 700, 900, (192, 128), 0, None),  # wide tiles: the joint dQ handoff
    (BF16, 1, 2, 2, 640, 640, 256, 1, None),
]


@pytest.mark.parametrize("case", STORE_FIRST_CASES, ids=[_grouped_id(c[:8] + (0,)) for c in STORE_FIRST_CASES])
def test_store_first_needs_no_zeroed_accumulator(case, monkeypatch):
    """store_first: each query block's first dQ is stored, not added, so the accumulator is
    handed to the kernel full of NaN; dQ / dK / dV against fp64 (a block added before its
    first store lands, or stored over another's add, is off by whole blocks) and the zeroed
    accumulator's run, in three runs (claims race differently)."""
    import dataclasses

    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, d, mask_type, ctas = case
    if ctas is not None:
        monkeypatch.setattr(S, "PERSISTENT_CTAS", ctas)
    # every tile kind, also those that do not ask for it (tiles.store_first: chosen by speed)
    tiles = S._tiles
    monkeypatch.setattr(S, "_tiles", lambda *a: dataclasses.replace(tiles(*a), store_first=True))
    # (the zeroed run: the preprocess zeroes the accumulator, not the kernel's zero_ahead either)
    _unzeroed_accumulator_runs(
        S,
        monkeypatch,
        (dtype, b, h, hk, sq, sk, d),
        mask_type,
        7,
        "store_first was not taken",
        ("STORE_FIRST", "ZERO_AHEAD"),
    )


# (dtype, B, H, Hk, Sq, Sk, D, persistent CTAs or None, mask): d64 (persistent CTAs; without a mask
# over equal tiles, a head's key blocks within the grid, with one from a tile counter), so the op
# asks for zero_ahead
ZERO_AHEAD_CASES = [
    (BF16, 2, 4, 4, 1024, 384, 64, 3, 0),  # 3 key blocks owning 2-3 query blocks each, 8 tiles a CTA, carry_dq
    (F16, 1, 4, 2, 700, 900, 64, None, 0),  # grouped heads, 8 key blocks over 6 query blocks (some own none)
    (BF16, 1, 2, 2, 300, 3000, 64, 30, 0),  # 24 key blocks a head on 30 CTAs: a head's tiles over two rounds
    (BF16, 1, 2, 2, 2000, 200, 64, 2, 0),  # 2 CTAs, tiles of 16 steps (no carry_dq)
    (BF16, 4, 16, 16, 1024, 1024, 64, None, 0),  # the whole device, 512 tiles
    # fewer CTAs than a head's key blocks (forced: the op would not take it): a tile's blocks whose
    # owners the same CTA runs later are zeroed by its dQ-store warp, as for a CTA not resident
    (BF16, 1, 2, 2, 1000, 1024, 64, 1, 0),
    (F16, 2, 4, 2, 512, 1500, 64, 5, 0),
    # causal (tiles from the counter; every block zeroed at the kernel's start, taken from a counter of jobs)
    (BF16, 2, 4, 4, 1024, 1024, 64, 3, 1),  # 3 CTAs over 32 tiles
    (F16, 1, 4, 2, 700, 900, 64, None, 2),  # bottom-right, Sq < Sk, grouped heads
    (BF16, 1, 2, 2, 1300, 700, 64, 5, 1),  # top-left, Sq > Sk: the last key block owns the blocks past it
    (BF16, 2, 16, 16, 2048, 2048, 64, None, 1),  # the whole device
]


@pytest.mark.parametrize("case", ZERO_AHEAD_CASES, ids=[_grouped_id(c[:7] + (c[8], 0)) for c in ZERO_AHEAD_CASES])
def test_zero_ahead_needs_no_zeroed_accumulator(case, monkeypatch):
    """zero_ahead: persistent CTAs zero each query block's accumulator rows a round of tiles
    before the block's first add (or the dQ-store warp does, at the add, where the owner has not
    got there), so the accumulator is handed to the kernel full of NaN; dQ / dK / dV against fp64
    (a block zeroed twice or late, or added before its zeros, is off by whole blocks or NaN) and
    the preprocess-zeroed run, in three runs."""
    from ops import attention_sm90 as S

    dtype, b, h, hk, sq, sk, d, ctas, mask_type = case
    if ctas is not None:
        monkeypatch.setattr(S, "PERSISTENT_CTAS", ctas)
        ahead = S._zeroes_ahead
        monkeypatch.setattr(
            S,
            "_zeroes_ahead",
            lambda schedule, first, blocks, n, steps, reached=True: ahead(
                schedule, first, min(blocks, n), n, steps, reached
            ),
        )
    _unzeroed_accumulator_runs(
        S, monkeypatch, (dtype, b, h, hk, sq, sk, d), mask_type, 3, "zero_ahead was not taken", ("ZERO_AHEAD",)
    )


def test_deterministic_follows_torch_flag():
    """deterministic=None: torch.use_deterministic_algorithms(True) makes repeated backwards equal."""
    q, k, v, do = make_inputs(1, 2, 1000, 1000, 128, BF16, seed=21)
    out, lse = forward(q, k, v, 0)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = (backward("sm90", q, k, v, do, out, lse, 0) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
