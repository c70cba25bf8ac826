"""CPU: the host side of the Hopper-native attention backward, launches recorded: the dQ / dK /
dV buffers sized by their head dims, convert_dq overlapping the grid's idle tail, call plans
per signature, one scratch allocation for the launches' buffers, and the flags handed over
instead of a zeroed accumulator (store_first, zero_ahead)."""

import cutlass
import pytest
import torch

from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops import _compile as cc
from ops import attention_sm90 as S
from ops.attention_common import AttentionBackwardArgs

from .attention_sm90_common import BF16, F32, _problem


def _sm90(grad_out, query, key, value, out, logsumexp, scale, mask_type=0, **kw):
    """attention_backward_sm90 of these arguments."""
    args = AttentionBackwardArgs(
        grad_out=grad_out,
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        scale=scale,
        custom_mask_type=mask_type,
        **kw,
    )
    return S.attention_backward_sm90(args)


@pytest.mark.parametrize("dq_head_dim,fused", [(None, True), (64, True), (128, False), (192, False)])
def test_preprocess_sizes_dq_accum_by_the_query_head_dim(monkeypatch, dq_head_dim, fused):
    """out / dO are Dv wide, the dQ accumulator Dqk wide: the fused clear walks out's width,
    so with another width the accumulator is zeroed apart and the launch computes Δ only."""
    from ops import attention_bwd_prepost as P

    launches = []
    monkeypatch.setattr(P, "launch_preprocess", lambda out, do, delta, acc, *a: launches.append(acc))
    out = torch.zeros(2, 100, 3, 64, dtype=BF16)
    delta, acc = P._preprocess_impl(out, out, 1.0, None, None, True, dq_head_dim=dq_head_dim)
    assert acc.shape == (2, 128, 3, dq_head_dim or 64) and acc.dtype == F32 and delta.shape == (2, 3, 128)
    (launched,) = launches
    assert (launched is acc) if fused else (launched is None and (acc == 0).all())
    # packed sequences: the slack rows of each sequence too
    launches.clear()
    cu = torch.tensor([0, 30, 100], dtype=torch.int32)
    _, acc = P._preprocess_impl(out[0], out[0], 1.0, cu, 70, True, dq_head_dim=dq_head_dim)
    assert acc.shape == P.dq_accum_shape(2, 100, 3, dq_head_dim or 64, varlen=True)


@pytest.mark.parametrize("head_dim,head_dim_v", [(64, 64), (128, 64), (64, 96), (192, 128), (256, 192)])
def test_host_sizes_gradients_by_their_head_dims(monkeypatch, head_dim, head_dim_v):
    """attention_backward_sm90 on CPU tensors with the launches recorded: the kernel is
    compiled for (Dqk, Dv), the dQ accumulator it gets is Dqk wide, dK Dqk and dV Dv wide,
    and convert_dq turns the accumulator into a Dqk-wide dQ."""
    from ops import attention_bwd_prepost as P

    keys, launches = [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: None)
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))
    converted = []

    def convert(acc, scale, d, sq, *rest, ready=None):
        converted.append((acc.shape, d))
        return torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16)

    monkeypatch.setattr(P, "convert_dq", convert)
    q, k, v, do, o = _problem(h=4, hk=2, d=head_dim, dv=head_dim_v)
    dq, dk, dv, db, dsink = _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 1)
    # (only d128's own tiles store each block's first dQ: none of these pairs; d64's persistent
    # causal CTAs zero the accumulator themselves)
    assert keys == [
        S.Sm90Config(cutlass.BFloat16, head_dim, head_dim_v, 1, "sm_90a", zero_ahead=head_dim == head_dim_v == 64)
    ]
    assert db is None and dsink is None
    ((q_, k_, v_, do_, lse, delta, acc, dk_, dv_, *_),) = launches
    # the LSE in log2 units from the preprocess launch, shaped as Δ
    assert acc.shape == (2, 128, 4, head_dim) and delta.shape == lse.shape == (2, 4, 128)
    assert dk_ is dk and dv_ is dv and dk.shape == (2, 130, 2, head_dim) and dv.shape == (2, 130, 2, head_dim_v)
    assert converted == [((2, 128, 4, head_dim), head_dim)] and dq.shape == q.shape


@pytest.mark.parametrize(
    "mask_type,deterministic,overlaps",
    [(0, False, True), (0, True, True), (1, False, False), (1, True, True), (2, False, False)],
)
def test_convert_overlaps_where_the_grid_has_an_idle_tail(monkeypatch, mask_type, deterministic, overlaps):
    """A CTA per tile in launch order (d128: schedule "grid"; causal only with determinism's
    launch order) counts each key block's dQ into a zeroed [sequences, Hk] int32, and
    ConvertDQReady gets the counts, their tile counter, the query heads per key head and the
    count that completes a head: the grid's key blocks, ceil(Sk / tile_n). Persistent CTAs
    (d64) and the heavy-first order do not."""
    from ops import attention_bwd_prepost as P

    keys, launches, readies = [], [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: None)
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))

    def convert(acc, scale, d, sq, *rest, ready=None):
        readies.append(ready)
        return torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16)

    monkeypatch.setattr(P, "convert_dq", convert)
    q, k, v, do, o = _problem(h=4, hk=2, d=128, dv=128)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, mask_type, deterministic=deterministic)
    assert keys[-1].dq_ready is overlaps
    counts = launches[-1][11]
    if not overlaps:
        assert counts is None and readies == [None]
        return
    ((tiles, counts_, group, expected),) = readies
    assert counts_ is counts and counts.shape == (2, 2) and counts.dtype == torch.int32 and not counts.any()
    assert tiles.shape == (1,) and not tiles.any() and tiles.data_ptr() + 4 == counts.data_ptr()
    assert group == 2 and expected == -(-130 // bwd_config.attention_sm90_tiles(128).tile_n)
    # nor where a head has more key blocks than DQ_READY_MAX_KEY_BLOCKS
    blocks = bwd_config.DQ_READY_MAX_KEY_BLOCKS
    assert S._overlaps_convert("grid", mask_type, deterministic, blocks)
    assert not S._overlaps_convert("grid", mask_type, deterministic, blocks + 1)
    # d64's persistent CTAs never count
    keys.clear()
    q, k, v, do, o = _problem(h=4, hk=2, d=64, dv=64)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, mask_type, deterministic=deterministic)
    assert keys[-1].dq_ready is (deterministic and overlaps)


def test_call_plans_follow_the_signature_and_the_settings(monkeypatch):
    """attention_backward_sm90 makes its choices (tiles, flags, grids, the compile key) once
    per call signature (``_call_plan``): a repeated call reuses them; another module setting,
    mask or shape makes a new plan, and the compile key follows the setting."""
    from ops import attention_bwd_prepost as P

    keys, plans = [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: None)
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: None))
    monkeypatch.setattr(
        P,
        "convert_dq",
        lambda acc, scale, d, sq, *rest, ready=None: torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16),
    )
    monkeypatch.setattr(S, "_call_plans", S.Memo())
    plan = S._plan
    monkeypatch.setattr(S, "_plan", lambda *a, **kw: plans.append(1) or plan(*a, **kw))
    lse = torch.zeros(2, 4, 128)

    def call(mask_type=0, sq=100):
        q, k, v, do, o = _problem(sq=sq, h=4, hk=2, d=128, dv=128)
        dq, dk, dv, _, _ = _sm90(do, q, k, v, o, lse, 0.1, mask_type)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    call()
    call()
    assert len(plans) == 1 and len(keys) == 2 and keys[0] == keys[1] and keys[0].store_first
    monkeypatch.setattr(S, "STORE_FIRST", False)
    call()
    assert len(plans) == 2 and not keys[-1].store_first
    call(mask_type=1)
    assert len(plans) == 3 and keys[-1].mask_type == 1
    call(sq=60)
    call(sq=60)
    assert len(plans) == 4 and len(S._call_plans) == 4


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 128), (64, 64), (64, 128)])
def test_one_scratch_allocation_holds_the_launches_buffers(monkeypatch, deterministic, head_dim, head_dim_v):
    """Δ, the LSE in log2 units, the zeroed int32s (counters, counts, flags, semaphores) and the
    dQ accumulator are parts of one fp32 allocation (host time): disjoint, 128-byte aligned,
    the int32s zeroed; the accumulator is zeroed by the preprocess where Dqk and Dv round alike,
    apart where they do not, and not at all where the kernel stores first or zeroes it."""
    from ops import attention_bwd_prepost as P

    keys, launches, pre = [], [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(
        P,
        "launch_preprocess",
        lambda out, do, delta, acc, scale, cu, mq, lse, lse2, dlse, sink, terms: pre.append((delta, acc, lse2)),
    )
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))
    monkeypatch.setattr(
        P,
        "convert_dq",
        lambda acc, scale, d, sq, *r, ready=None: torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16),
    )
    empty = torch.empty  # the scratch (the one 1-D fp32 allocation) filled with 7s
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *a, **kw: (lambda t: t.fill_(7.0) if t.dtype == F32 and t.dim() == 1 else t)(empty(*a, **kw)),
    )
    q, k, v, do, o = _problem(h=4, hk=2, d=head_dim, dv=head_dim_v)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0, deterministic=deterministic)
    (key,), (launch,), ((delta, fused, lse2),) = keys, launches, pre
    _, _, _, _, lse, delta_, acc, _, _, semaphore, counter, counts, first = launch[:13]
    assert lse is lse2 and delta_ is delta and delta.shape == lse.shape == (2, 4, 128)
    parts = [t for t in (delta, lse, acc, semaphore, counter, counts, first) if t is not None]
    base = delta.untyped_storage().data_ptr()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts)
    assert all(t.untyped_storage().data_ptr() == base for t in parts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # disjoint
    assert all((t.data_ptr() - base) % 128 == 0 for t in (delta, lse, acc))
    for t in parts[3:]:
        assert t.dtype == torch.int32 and not t.any()
    assert (semaphore is not None) is deterministic
    if deterministic:
        assert semaphore.shape == (2, 4, -(-100 // S._tiles(head_dim, head_dim_v, False, False, False).tile_m))
    unzeroed = key.store_first or key.zero_ahead
    same_width = P.head_dim_rounded(head_dim) == P.head_dim_rounded(head_dim_v)
    assert (fused is acc) is (not unzeroed and same_width) and (fused is None) is (unzeroed or not same_width)
    # zeroed apart (host-side here: the allocation was filled with 7s) or left as allocated
    assert (acc == 0).all() if not unzeroed and not same_width else (acc == 7).all()


def _record_unzeroed_calls(monkeypatch):
    """attention_backward_sm90 on CPU tensors with the kernel launch recorded: (compile keys,
    launch arguments, whether each preprocess launch zeroes an accumulator) lists the calls fill."""
    from ops import attention_bwd_prepost as P

    keys, launches, zeroing = [], [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda out, do, delta, acc, *a: zeroing.append(acc is not None))
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: launches.append(a)))
    monkeypatch.setattr(
        P,
        "convert_dq",
        lambda acc, scale, d, sq, *r, ready=None: torch.zeros(acc.shape[0], sq, acc.shape[2], d, dtype=BF16),
    )
    return keys, launches, zeroing


def test_store_first_call_hands_over_flags_not_zeros(monkeypatch):
    """A store_first call: the accumulator is the op's unzeroed buffer, the preprocess is asked
    for no zeroing, and the kernel gets a zeroed int32 flag per (batch, query head, query
    block) beside ConvertDQReady's counts in one buffer."""
    keys, launches, zeroing = _record_unzeroed_calls(monkeypatch)
    q, k, v, do, o = _problem(h=4, hk=2, d=128, dv=128)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].store_first is True and zeroing == [False]
    acc, counts, flags = launches[-1][6], launches[-1][11], launches[-1][12]
    blocks = -(-q.shape[1] // bwd_config.attention_sm90_tiles(128).tile_m)
    assert acc.shape[1] >= q.shape[1] and acc.dtype == torch.float32  # (TMA clips a block past its rows)
    assert flags.shape == (2, 4, blocks) and flags.dtype == torch.int32 and not flags.any()
    assert flags.data_ptr() == counts.data_ptr() + 4 * counts.numel()
    monkeypatch.setattr(S, "STORE_FIRST", False)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].store_first is False and zeroing == [False, True] and launches[-1][12] is None


def test_zero_ahead_call_hands_over_flags_not_zeros(monkeypatch):
    """A d64 call without a mask on a GPU of 132 multiprocessors: an unzeroed accumulator, no
    zeroing asked of the preprocess, a zeroed flag per (batch, query head, query block); with
    fewer CTAs than a head's key blocks the preprocess zeroes it as before."""
    keys, launches, zeroing = _record_unzeroed_calls(monkeypatch)
    monkeypatch.setattr(S, "PERSISTENT_CTAS", 132)
    q, k, v, do, o = _problem(h=4, hk=2, d=64, dv=64)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].zero_ahead is True and keys[-1].store_first is False and zeroing == [False]
    acc, flags = launches[-1][6], launches[-1][12]
    blocks = -(-q.shape[1] // bwd_config.attention_sm90_tiles(64).tile_m)
    assert acc.shape[1] >= q.shape[1] and acc.dtype == torch.float32
    assert flags.shape == (2, 4, blocks) and flags.dtype == torch.int32 and not flags.any()
    monkeypatch.setattr(S, "PERSISTENT_CTAS", 1)  # 2 key blocks a head (130 keys)
    _sm90(do, q, k, v, o, torch.zeros(2, 4, 128), 0.1, 0)
    assert keys[-1].zero_ahead is False and zeroing == [False, True] and launches[-1][12] is None
