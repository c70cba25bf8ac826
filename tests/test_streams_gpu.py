"""GPU: the ops issued on two CUDA streams at once give what they give one at a time.

Each test computes its ops' results one at a time on the current stream, then issues
them again on two side streams, interleaved, several times: on each side stream a spin
(``torch.cuda._sleep``) first, so that the two streams' work overlaps on the device,
then fresh copies of the inputs made on that stream, so an op that launched on another
stream than torch's current one would read inputs not yet written. The side streams
wait for the current one (the inputs) and the current one for them (the outputs).

Where an op is deterministic the results must be bitwise equal: dropout_bias_backward
and the norms' backward (fixed-order column sums, each stream its own ticket counters),
the attention pre/post-processing, and the memory-efficient attention backward with
one key split. With several key splits its dQ partials of one query block are added by
the splits in whatever order they arrive (an atomic lock or red.add on the fp32
workspace in cute_kernels/mem_eff_attention/attention_backward_kernel.py ``grad_q``), so
dQ may differ in the last bits and is compared within one rounding; dK / dV stay in
registers per key block, written once, so they are still compared bitwise.
"""

import pytest
import torch

import ops
from ops import attention_bwd_prepost as A

from .test_layer_norm_gpu import _inputs as norm_inputs
from .test_mem_eff_attention_gpu import _backward, make_qkv

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
REPS = 3  # issues of each op per stream
SPIN_CYCLES = 2_000_000  # about a millisecond at H100 clocks


def _flat(out):
    """The tensors of an op's result (tuples flattened, None dropped)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out if o is not None for t in _flat(o)]


def _one_at_a_time(fn, args):
    out = fn(*args)
    torch.cuda.synchronize()
    return _flat(out)


def run_on_two_streams(fn_a, args_a, fn_b, args_b, reps=REPS):
    """fn_a(*args_a) on one side stream and fn_b(*args_b) on another, interleaved, reps
    times each; returns ([outputs of each fn_a call], [outputs of each fn_b call])."""
    cur = torch.cuda.current_stream()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    for s, args in zip(streams, (args_a, args_b)):
        s.wait_stream(cur)  # the inputs, made on the current stream, are ready
        for a in args:
            if isinstance(a, torch.Tensor):
                a.record_stream(s)
    keep, outs = [], ([], [])
    for _ in range(reps):
        for i, (s, fn, args) in enumerate(zip(streams, (fn_a, fn_b), (args_a, args_b))):
            with torch.cuda.stream(s):
                torch.cuda._sleep(SPIN_CYCLES)
                fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                keep.append(fresh)  # alive until the streams are done with them
                outs[i].append(_flat(fn(*fresh)))
    for s in streams:
        cur.wait_stream(s)
    torch.cuda.synchronize()
    return outs


def assert_bitwise(name, runs, want):
    for r, got in enumerate(runs):
        assert len(got) == len(want), (name, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (name, i, g.shape, w.shape, g.dtype, w.dtype)
            if not torch.equal(g, w):
                diff = (g.double() - w.double()).abs().nan_to_num(float("inf")).max().item()
                pytest.fail(
                    f"{name}: output {i} of concurrent run {r} differs from the one-at-a-time result (max |diff| {diff:.3g})"
                )


def _two_stream_check(name_a, fn_a, args_a, name_b, fn_b, args_b):
    want_a, want_b = _one_at_a_time(fn_a, args_a), _one_at_a_time(fn_b, args_b)
    runs_a, runs_b = run_on_two_streams(fn_a, args_a, fn_b, args_b)
    assert_bitwise(name_a, runs_a, want_a)
    assert_bitwise(name_b, runs_b, want_b)


# ===================================================================== dropout_bias


def _dropout_inputs(rows, n, dtype, activation, bias_dtype, seed):
    g = torch.Generator(DEV).manual_seed(seed)
    dy = torch.randn(rows, n, device=DEV, generator=g).to(dtype)
    mask = torch.rand(rows, n, device=DEV, generator=g) >= 0.1
    x = torch.randn(rows, n, device=DEV, generator=g).to(dtype) if activation else None
    bias = torch.randn(n, device=DEV, generator=g).to(bias_dtype) if bias_dtype else None
    return [dy, mask, x, bias]


def _dropout_fn(activation):
    return lambda dy, mask, x, bias: ops.dropout_bias_backward(dy, mask, 0.1, x, bias, activation)


@pytest.mark.parametrize("shapes", ["same", "different"])
def test_dropout_bias_two_streams(shapes):
    a = _dropout_inputs(8192, 4096, BF16, "gelu", BF16, 1)
    if shapes == "same":
        b, act_b = _dropout_inputs(8192, 4096, BF16, "gelu", BF16, 2), "gelu"
    else:
        b, act_b = _dropout_inputs(6001, 2048, BF16, None, F32, 3), None
    _two_stream_check("dropout_bias A", _dropout_fn("gelu"), a, "dropout_bias B", _dropout_fn(act_b), b)


# ============================================================================ norms


def _ln_fn(dz, x, w, mean, rstd, b):
    return ops.layer_norm_backward(dz, x, w, mean, rstd, b)


def _rms_fn(dz, x, w, rstd):
    return ops.rms_norm_backward(dz, x, w, rstd)


@pytest.mark.parametrize("kind", ["same_shape", "different_shapes", "layer_norm_and_rms_norm"])
def test_norm_two_streams(kind):
    x, dz, w, b, mean, rstd = norm_inputs((8192, 4096), BF16, F32, seed=1)
    args_a = [dz, x, w, mean, rstd, b]
    if kind == "same_shape":
        x2, dz2, w2, b2, mean2, rstd2 = norm_inputs((8192, 4096), BF16, F32, seed=2)
        fn_b, args_b = _ln_fn, [dz2, x2, w2, mean2, rstd2, b2]
    elif kind == "different_shapes":
        x2, dz2, w2, b2, mean2, rstd2 = norm_inputs((4001, 1000), F16, F16, has_b=False, seed=3)
        fn_b, args_b = _ln_fn, [dz2, x2, w2, mean2, rstd2, None]
    else:
        x2, dz2, w2, _, _, rstd2 = norm_inputs((8192, 4096), BF16, BF16, has_b=False, is_rms=True, seed=4)
        fn_b, args_b = _rms_fn, [dz2, x2, w2, rstd2]
    _two_stream_check("norm A", _ln_fn, args_a, f"norm B ({kind})", fn_b, args_b)


# ============================================================ attention pre/post


def _prepost_a(out, grad_out, acc):
    delta, zeroed = A.attention_bwd_preprocess(out, grad_out, scale=0.9, zero_dq_accum=True)
    dq = A.attention_bwd_convert_dq(acc, 0.125, head_dim=out.shape[-1], seqlen_q=out.shape[1], p_dropout=0.1)
    return delta, zeroed, dq


def _prepost_b(total_k):
    def fn(out, grad_out, cu, dk_acc, dv_acc, cu_k):  # no host sync inside: total_k is a Python int
        delta = A.attention_bwd_compute_delta(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=1500)
        dk, dv = A.attention_bwd_convert_dkv(
            dk_acc, dv_acc, 0.1, head_dim=100, seqlen_k=total_k, cu_seqlens_k=cu_k, dtype=F16
        )
        return delta, dk, dv

    return fn


def test_attention_bwd_prepost_two_streams():
    g = torch.Generator(DEV).manual_seed(5)
    r = lambda *s, dtype=F32: torch.randn(*s, device=DEV, generator=g).to(dtype)  # noqa: E731
    b, s, h, d = 4, 2000, 8, 128
    args_a = [r(b, s, h, d, dtype=BF16), r(b, s, h, d, dtype=BF16), r(*A.dq_accum_shape(b, s, h, d, nsplits=2))]
    lengths = [1500, 700, 0, 1200]
    cu = torch.tensor([0] + lengths, device=DEV).cumsum(0).to(torch.int32)
    total = sum(lengths)
    acc_shape = A.dkv_accum_shape(len(lengths), 4, 1500, 100)
    args_b = [r(total, 6, 100, dtype=F16), r(total, 6, 100, dtype=F16), cu, r(*acc_shape), r(*acc_shape), cu]
    _two_stream_check(
        "prepost A (preprocess, convert_dq)",
        _prepost_a,
        args_a,
        "prepost B (compute_delta, convert_dkv)",
        _prepost_b(total),
        args_b,
    )


# ====================================================== memory-efficient attention


def _attention_inputs(b, mq, mk, h, d, mask_type, seed):
    gen = torch.Generator(DEV).manual_seed(seed)
    q, k, v, do = make_qkv(b, mq, mk, h, d, d, BF16, gen)
    out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, mask_type, True
    )
    return [do, q, k, v, out, lse]


def _attention_fn(mask_type, splits):
    def fn(do, q, k, v, out, lse):
        empty = torch.empty((), dtype=torch.int64)
        args = (do, q, k, v, None, out, None, None, q.shape[1], k.shape[1], lse, 0.0, empty, empty, mask_type, False)
        return _backward()(*args, num_splits_key=splits)[:3]

    return fn


@pytest.mark.parametrize("splits", [1, 4])
def test_mem_eff_attention_two_streams(splits):
    args_a = _attention_inputs(2, 1024, 1024, 4, 64, 1, seed=6)
    args_b = _attention_inputs(1, 700, 900, 2, 64, 2, seed=7)
    fn_a, fn_b = _attention_fn(1, splits), _attention_fn(2, splits)
    if splits == 1:  # deterministic: bitwise
        _two_stream_check("attention A", fn_a, args_a, "attention B", fn_b, args_b)
        return
    want_a, want_b = _one_at_a_time(fn_a, args_a), _one_at_a_time(fn_b, args_b)
    runs_a, runs_b = run_on_two_streams(fn_a, args_a, fn_b, args_b)
    for name, runs, want in (("attention A", runs_a, want_a), ("attention B", runs_b, want_b)):
        # dK, dV: bitwise; dQ: the splits' fp32 partials summed in another order, then rounded
        assert_bitwise(f"{name} dk, dv", [run[1:] for run in runs], want[1:])
        for r, run in enumerate(runs):
            got, ref = run[0], want[0]
            assert torch.isfinite(got).all(), f"{name} dq of concurrent run {r}: NaN / inf"
            eps = torch.finfo(ref.dtype).eps
            torch.testing.assert_close(
                got,
                ref,
                rtol=2 * eps,
                atol=1e-4 * ref.abs().max().item(),
                msg=lambda m: f"{name} dq of concurrent run {r}: {m}",
            )


# ============================================================= several ops at once


def test_mixed_ops_two_streams():
    """Stream 1: dropout_bias then LayerNorm backward; stream 2: attention backward (one
    split) then preprocess: different kernels overlapping."""
    drop = _dropout_inputs(4096, 4096, BF16, "relu", BF16, 8)
    x, dz, w, b, mean, rstd = norm_inputs((4096, 4096), BF16, F32, seed=9)
    att = _attention_inputs(2, 1024, 1024, 4, 64, 1, seed=10)
    attention = _attention_fn(1, 1)

    def fn_a(dy, mask, xa, bias, dz, x, w, mean, rstd, b):
        return _dropout_fn("relu")(dy, mask, xa, bias), _ln_fn(dz, x, w, mean, rstd, b)

    def fn_b(do, q, k, v, out, lse):
        return attention(do, q, k, v, out, lse), A.attention_bwd_preprocess(out, do)

    _two_stream_check(
        "dropout_bias + layer_norm", fn_a, drop + [dz, x, w, mean, rstd, b], "attention + preprocess", fn_b, att
    )
