"""CPU: the fp64 attention reference against an independent naive autograd implementation
(masks, windows, variable lengths, empty rows, bias and dropout), and the dropout's philox
twin against Random123's known answers and curand's indexing."""

import pytest
import torch

from ops.reference import (
    attention_backward_ref,
    attention_forward_ref,
    attention_mask_ref,
    curand_philox_words,
    curand_uniform,
    mem_eff_dropout_keep_mask,
    philox4x32_10,
)

from .mem_eff_attention_cpu_common import (
    F64,
    cu,
    naive_attention,
    naive_attention_bias_dropout,
    naive_grads,
    naive_keep,
    rand,
)


def assert_close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not a.isnan().any(), "NaN"
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ------------------------------------------------------------------------ reference


def test_mask_matches_kernel_comments():
    # bottom right, 3 queries and 5 keys: shift 2; window 2 keeps keys in (n + 2 - 2, n + 2]
    keep = attention_mask_ref(3, 5, 2, 2)
    expected = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(keep, expected)
    assert torch.equal(
        attention_mask_ref(3, 5, 1), torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    )
    assert attention_mask_ref(4, 2, 0).all()
    for nq, nk in ((5, 5), (4, 9), (9, 4), (1, 1), (0, 3), (3, 0)):
        for mt in (0, 1, 2):
            for w in (0, 1, 3) if mt else (0,):
                assert torch.equal(attention_mask_ref(nq, nk, mt, w), naive_keep(nq, nk, mt, w)), (nq, nk, mt, w)
    with pytest.raises(ValueError, match="window_size needs a causal mask"):
        attention_mask_ref(3, 3, 0, 2)


DENSE = [
    # (B, Mq, Mk, H, K, Kv)
    (2, 5, 5, 3, 8, 8),
    (1, 7, 13, 2, 8, 5),  # k longer than q, Dqk != Dv
    (2, 13, 7, 2, 4, 12),  # q longer than k: bottom-right leaves empty rows
    (1, 1, 9, 1, 16, 16),
    (1, 9, 1, 2, 8, 3),
]
MASKS = [(0, 0), (1, 0), (2, 0), (1, 1), (1, 3), (2, 2), (2, 20)]


@pytest.mark.parametrize("shape", DENSE, ids=[f"B{b}q{mq}k{mk}h{h}d{k}v{kv}" for b, mq, mk, h, k, kv in DENSE])
def test_reference_dense_against_naive(shape):
    b, mq, mk, h, kd, kv = shape
    gen = torch.Generator().manual_seed(mq * 100 + mk)
    q, k, v = rand(b, mq, h, kd, gen=gen), rand(b, mk, h, kd, gen=gen), rand(b, mk, h, kv, gen=gen)
    do = rand(b, mq, h, kv, gen=gen)
    for mt, w in MASKS:
        for scale in (None, 0.3):
            kw = dict(mask_type=mt, window=w, scale=scale)
            out_n, lses, (dq_n, dk_n, dv_n) = naive_grads(q, k, v, do, **kw)
            rk = dict(custom_mask_type=mt, window_size=w, scale=scale)
            out, lse = attention_forward_ref(q, k, v, **rk)
            assert_close(out, out_n)
            assert_close(lse, torch.stack(lses))
            dq, dk, dv = attention_backward_ref(q, k, v, do, **rk)
            assert_close(dq, dq_n)
            assert_close(dk, dk_n)
            assert_close(dv, dv_n)


@pytest.mark.parametrize("h,hk", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
def test_reference_grouped_heads_against_naive(h, hk):
    """Key / value with Hk heads serve H / Hk consecutive query heads each: the reference
    equals autograd through key / value repeated per query head."""
    gen = torch.Generator().manual_seed(h * 10 + hk)
    q, k, v, do = (
        rand(2, 6, h, 8, gen=gen),
        rand(2, 9, hk, 8, gen=gen),
        rand(2, 9, hk, 5, gen=gen),
        rand(2, 6, h, 5, gen=gen),
    )
    kx, vx = (t.detach().requires_grad_() for t in (k, v))
    out_n, lses = naive_attention(
        q, kx.repeat_interleave(h // hk, 2), vx.repeat_interleave(h // hk, 2), mask_type=2, window=4
    )
    dk_n, dv_n = torch.autograd.grad(out_n, (kx, vx), do)
    out, lse = attention_forward_ref(q, k, v, custom_mask_type=2, window_size=4)
    assert_close(out, out_n)
    assert_close(lse, torch.stack(lses))
    dq, dk, dv = attention_backward_ref(q, k, v, do, custom_mask_type=2, window_size=4)
    assert dk.shape == k.shape and dv.shape == v.shape
    assert_close(dk, dk_n)
    assert_close(dv, dv_n)
    with pytest.raises(ValueError, match="must divide query heads"):
        attention_backward_ref(q, rand(2, 9, h - 1, 8, gen=gen), rand(2, 9, h - 1, 5, gen=gen), do)


VARLEN = [
    ([3, 0, 1, 6, 4], [5, 2, 0, 6, 1]),  # empty q, empty k, length 1, q longer than k
    ([1], [1]),
    ([0, 7], [4, 3]),
]


@pytest.mark.parametrize("lengths", VARLEN, ids=["mixed", "single", "empty-first"])
def test_reference_varlen_against_naive(lengths):
    lq, lk = lengths
    gen = torch.Generator().manual_seed(sum(lq))
    h, kd, kv = 2, 8, 6
    extra = 2  # packed rows past the last sequence stay untouched (zero grads)
    q, k, v = (
        rand(1, sum(lq) + extra, h, kd, gen=gen),
        rand(1, sum(lk), h, kd, gen=gen),
        rand(1, sum(lk), h, kv, gen=gen),
    )
    do = rand(1, sum(lq) + extra, h, kv, gen=gen)
    cq, ck = cu(lq), cu(lk)
    for mt, w in MASKS:
        out_n, lses, grads_n = naive_grads(q, k, v, do, mask_type=mt, window=w, cu_q=cq, cu_k=ck)
        rk = dict(custom_mask_type=mt, window_size=w, cu_seqlens_q=cq, cu_seqlens_k=ck)
        out, lse = attention_forward_ref(q, k, v, **rk)
        assert_close(out, out_n)
        assert lse.shape == (len(lq), h, max(lq))
        for i, x in enumerate(lses):
            assert_close(lse[i, :, : lq[i]], x)
            assert torch.isinf(lse[i, :, lq[i] :]).all()
        for got, want in zip(attention_backward_ref(q, k, v, do, **rk), grads_n):
            assert_close(got, want)


def test_reference_fully_masked_rows_give_zero():
    """Bottom-right with Mq > Mk and a top-left window past the keys: rows with no key."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = rand(1, 10, 2, 8, gen=gen), rand(1, 4, 2, 8, gen=gen), rand(1, 4, 2, 8, gen=gen)
    do = rand(1, 10, 2, 8, gen=gen)
    for mt, w, empty in ((2, 0, range(0, 6)), (1, 2, range(5, 10)), (2, 1, range(0, 6))):
        out, lse = attention_forward_ref(q, k, v, custom_mask_type=mt, window_size=w)
        dq, dk, dv = attention_backward_ref(q, k, v, do, custom_mask_type=mt, window_size=w)
        rows = list(empty)
        assert (out[0, rows] == 0).all() and (lse[0, :, rows] == 0).all()
        assert (dq[0, rows] == 0).all()
        for t in (out, lse, dq, dk, dv):
            assert torch.isfinite(t).all()
        _, _, (dq_n, dk_n, dv_n) = naive_grads(q, k, v, do, mask_type=mt, window=w)
        assert_close(dk, dk_n)
        assert_close(dv, dv_n)
    _, lse = attention_forward_ref(q, k, v, custom_mask_type=2, empty_row_lse=float("-inf"))
    assert torch.isneginf(lse[0, :, :6]).all()


def test_reference_accepts_low_precision_inputs():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (rand(1, 6, 2, 8, gen=gen).to(torch.bfloat16) for _ in range(3))
    dq, dk, dv = attention_backward_ref(q, k, v, rand(1, 6, 2, 8, gen=gen).half(), custom_mask_type=1)
    assert dq.dtype == dk.dtype == dv.dtype == F64


# ---------------------------------------------------------------- bias and dropout


@pytest.mark.parametrize("mask_type,window", [(0, 0), (1, 0), (2, 3)])
def test_reference_with_bias_and_dropout_matches_autograd(mask_type, window):
    gen = torch.Generator().manual_seed(7 + mask_type)
    b, h, mq, mk, d, dv, p = 2, 3, 9, 11, 8, 5, 0.3
    q, k, v = rand(b, mq, h, d, gen=gen), rand(b, mk, h, d, gen=gen), rand(b, mk, h, dv, gen=gen)
    bias = rand(b, h, mq, mk, gen=gen)
    do = rand(b, mq, h, dv, gen=gen)
    mask = mem_eff_dropout_keep_mask(99, 5, b, h, mq, mk, p)
    assert 0 < mask.sum() < mask.numel()
    z = mask.double() / (1 - p)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = naive_attention_bias_dropout(*leaves[:3], leaves[3], z, mask_type, window)
    want = torch.autograd.grad(out, leaves, do)
    got_out, _ = attention_forward_ref(
        q, k, v, custom_mask_type=mask_type, window_size=window, bias=bias, dropout_mask=mask, dropout_p=p
    )
    assert_close(got_out, out.detach())
    got = attention_backward_ref(
        q,
        k,
        v,
        do,
        custom_mask_type=mask_type,
        window_size=window,
        bias=bias,
        dropout_mask=mask,
        dropout_p=p,
        return_grad_bias=True,
    )
    for g, w in zip(got, want):
        assert_close(g, w)


# Random123's known-answer vectors (kat_vectors, philox4x32 10): counter, key, output
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_twin_known_answers(counter, key, want):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == want


class CurandPhiloxState:
    """curand's curandStatePhilox4_32_10_t written from curand_philox4x32_x.h's semantics with
    Python ints (an independent check of the twin's word indexing): curand_init, skipahead,
    curand4 with its STATE mixing of the current and the next output."""

    def __init__(self, seed, subsequence, offset):
        self.key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
        self.ctr = subsequence << 64  # skipahead_sequence: counter.zw += subsequence
        self.state = 0
        self.skipahead(offset)

    def _output(self):
        c = self.ctr % (1 << 128)
        words = [(c >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
        return [int(w) for w in philox4x32_10(words, self.key)]

    def skipahead(self, n):
        self.state += n & 3
        n //= 4
        if self.state > 3:
            n += 1
            self.state -= 4
        self.ctr += n
        self.output = self._output()

    def uniform4(self):
        cur = self.output
        self.ctr += 1  # Philox_State_Incr
        self.output = self._output()
        words = (cur + self.output)[self.state : self.state + 4]
        return curand_uniform(words)


@pytest.mark.parametrize(
    "seed,offset,elem", [(0, 0, 0), (2**63 + 5, 3, 1), (123456789, 6, 10**6 + 2), (2**40 + 7, 2**33 + 1, 5)]
)
def test_curand_skipahead_and_uniform4_match_word_indexing(seed, offset, elem):
    """curand_init(seed, 0, offset) + skipahead(elem) + curand_uniform4 (PyTorch's pattern)
    reads words offset + elem .. + 3: what the twin (and the DSL) index directly."""
    import numpy as np

    st = CurandPhiloxState(seed, 0, offset)
    st.skipahead(elem)
    got = np.concatenate([st.uniform4() for _ in range(3)])
    idx = np.arange(12, dtype=np.uint64) + np.uint64(offset + elem)
    want = curand_uniform(curand_philox_words(seed, idx))
    assert np.array_equal(got, want)
    assert got.dtype == np.float32 and (got > 0).all() and (got <= 1).all()


def test_keep_mask_layout_and_rate():
    """Element (b, h, n, m) is word offset + (b H + h) Mq Mk + n Mk + m; about 1 - p kept."""
    import numpy as np

    b, h, mq, mk, p, seed, off = 2, 3, 17, 13, 0.25, 2024, 11
    mask = mem_eff_dropout_keep_mask(seed, off, b, h, mq, mk, p)
    assert mask.shape == (b, h, mq, mk) and mask.dtype == torch.bool
    words = curand_philox_words(seed, np.arange(b * h * mq * mk, dtype=np.uint64) + np.uint64(off))
    assert torch.equal(mask.flatten(), torch.from_numpy(curand_uniform(words) > np.float32(p)))
    rate = mask.double().mean().item()
    assert abs(rate - (1 - p)) < 0.05
    # a different offset draws a different mask; the same one the same mask
    assert not torch.equal(mask, mem_eff_dropout_keep_mask(seed, off + 1, b, h, mq, mk, p))
    assert torch.equal(mask, mem_eff_dropout_keep_mask(seed, off, b, h, mq, mk, p))
