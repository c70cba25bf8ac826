"""CPU: the ``backend=`` dispatch of ``efficient_attention_backward`` /
``memory_efficient_attention`` picks the kernel the rules say, stopping before any launch
(both backends' implementations are replaced by recorders), and the choice survives fake
tensors, the op's schema and graph capture."""

import dataclasses
import logging
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from ops import _compile as cc
from ops import attention as A
from ops import attention_checks as AC
from ops import attention_common as C
from ops import attention_sm90 as S
from ops import mem_eff_attention as M
from ops.attention_common import AttentionBackwardArgs

from .attention_sm90_common import BF16, F16, F32, _no_cuda_calls, _problem
from .helpers import trace_custom_ops


class Recorder:
    """Stands in for one backend: records the call, returns zero gradients (no launch)."""

    def __init__(self, name, calls, sink_grad=False):
        self.name, self.calls, self.sink_grad = name, calls, sink_grad  # sink_grad: the sm90 backend's fifth result

    def __call__(self, args):
        self.calls.append((self.name, args))
        query, key = args.query, args.key
        zeros = (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(args.value))
        full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])  # [B, H, Mq, Mk], as the kernel's
        grads = zeros + (query.new_zeros(full) if args.bias is not None and args.bias_requires_grad else None,)
        if not self.sink_grad:
            return grads
        return grads + (None if args.sink is None else torch.zeros_like(args.sink),)


@pytest.fixture
def backends(monkeypatch):
    """CPU tensors through ``efficient_attention_backward``: CUDA checks off, the device's arch
    sm_90a (set ``cc.tensor_arch`` again to change it), both backends recorded. Yields the calls."""
    calls = []
    monkeypatch.setattr(C, "check_cuda", lambda *a: None)
    monkeypatch.setattr(cc, "tensor_arch", lambda t: "sm_90a")
    monkeypatch.setattr(S, "attention_backward_sm90", Recorder("sm90", calls, sink_grad=True))
    monkeypatch.setattr(M, "_backward", Recorder("mem_eff", calls))  # behind the deterministic and grouped-head steps
    return calls


def _eab(b=2, sq=100, sk=130, h=3, d=64, dv=None, hk=None, dtype=BF16, mask_type=0, **kw):
    """One efficient_attention_backward on CPU tensors (a problem the sm90 path takes by default)."""
    q, k, v, do, o = _problem(b=b, sq=sq, sk=sk, h=h, d=d, dv=dv, hk=hk, dtype=dtype)
    args = dict(
        bias=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=sq,
        max_seqlen_k=sk,
        dropout_p=0.0,
        philox_seed=None,
        philox_offset=None,
        bias_requires_grad=False,
        logsumexp=torch.zeros(b, h, (sq + 31) // 32 * 32),
    )
    args.update(kw)
    return A.efficient_attention_backward(do, q, k, v, out=o, custom_mask_type=mask_type, **args)


def _seed():
    return torch.tensor(1, dtype=torch.int64)


FALLS_BACK = [
    # (id, keyword arguments of _eab, fragment of the logged reason)
    ("num-splits-key", dict(num_splits_key=2), "num_splits_key=2"),
    ("num-splits-key-1", dict(num_splits_key=1), "num_splits_key=1"),
    ("shared-storage", dict(sq=100, sk=100, shared_storage_dqdkdv=True), "shared_storage_dqdkdv"),
    ("fp32", dict(dtype=F32), "dtype torch.float32"),
    ("head-dim-80", dict(d=80), "head dims 80"),
    ("dqk-96-dv-256", dict(d=96, dv=256), "head dims 96 / 256"),
]


def test_auto_takes_sm90_with_bias_and_dropout(backends):
    """Bias (broadcast), its gradient and dropout go to the sm90 kernel with the forward's
    philox state; a broadcast bias's gradient comes back in the bias's shape."""
    bias = torch.zeros(3, 100, 130, dtype=BF16)
    seed, offset = torch.tensor(7, dtype=torch.int64), torch.tensor(12, dtype=torch.int64)
    _, _, _, db = _eab(
        mask_type=1, bias=bias, bias_requires_grad=True, dropout_p=0.2, philox_seed=seed, philox_offset=offset
    )
    ((name, a),) = backends
    assert name == "sm90" and a.bias is bias and a.bias_requires_grad is True
    assert a.dropout_p == 0.2 and a.philox_seed is seed and a.philox_offset is offset
    assert db.shape == bias.shape


def test_bias_with_varlen_is_refused(backends):
    cu = torch.tensor([0, 100], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="bias with cu_seqlens"):
        _eab(
            b=1,
            bias=torch.zeros(1, 3, 100, 130, dtype=BF16),
            cu_seqlens_q=cu,
            cu_seqlens_k=torch.tensor([0, 130], dtype=torch.int32),
        )
    assert backends == []


@pytest.mark.parametrize("hk", [1, 2])
def test_auto_takes_sm90_with_grouped_heads(backends, hk):
    dq, dk, dv, _ = _eab(h=4, hk=hk, mask_type=1)
    ((name, _),) = backends
    assert (
        name == "sm90" and dk.shape == (2, 130, hk, 64) and dv.shape == (2, 130, hk, 64) and dq.shape == (2, 100, 4, 64)
    )


@pytest.mark.parametrize("hk", [1, 3])
def test_auto_takes_sm90_with_varlen(backends, hk):
    """Packed sequences go to the sm90 path with their offsets and bounds."""
    cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 30, 130], dtype=torch.int32)
    dq, dk, dv, _ = _eab(
        b=1,
        hk=hk,
        mask_type=2,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=60,
        max_seqlen_k=100,
        logsumexp=torch.zeros(2, 3, 64),
    )
    ((name, a),) = backends
    assert name == "sm90" and dq.shape == (1, 100, 3, 64) and dk.shape == (1, 130, hk, 64)
    assert a.cu_seqlens_q is cu_q and a.cu_seqlens_k is cu_k and (a.max_seqlen_q, a.max_seqlen_k) == (60, 100)


@pytest.mark.parametrize("hk", [0, 3])
def test_key_heads_must_divide_query_heads(backends, hk):
    with pytest.raises(ValueError, match="divides query's 4"):
        _eab(h=4, hk=hk)
    assert backends == []


def test_mem_eff_sums_grouped_heads(monkeypatch):
    """The memory-efficient kernel has one key head per query head: it runs on key / value
    repeated per query head, and dK / dV are summed back over each group (in fp32)."""
    seen = []

    def kernel(args):
        query, key, value = args.query, args.key, args.value
        seen.append((key.shape, value.shape, torch.equal(key[:, :, 0], key[:, :, 1])))
        # gradients that tell the query heads apart: head j's entries are j
        heads = torch.arange(query.shape[2], dtype=torch.float32).view(1, 1, -1, 1)
        return (torch.zeros_like(query), (key * 0 + heads).to(key.dtype), (value * 0 + 2 * heads).to(value.dtype), None)

    monkeypatch.setattr(M, "_backward", kernel)
    q, k, v, do, o = _problem(h=6, hk=2, dtype=F16)
    k.normal_()
    args = AttentionBackwardArgs(
        grad_out=do, query=q, key=k, value=v, out=o, logsumexp=torch.zeros(2, 6, 128), scale=0.1
    )
    dq, dk, dv, db = M.attention_backward_mem_eff(args)
    assert seen == [((2, 130, 6, 64), (2, 130, 6, 64), True)]
    # key head 0 serves query heads 0, 1, 2 (sum 3), key head 1 heads 3, 4, 5 (sum 12)
    assert dk.shape == k.shape and dk.dtype == F16 and (dk[:, :, 0] == 3).all() and (dk[:, :, 1] == 12).all()
    assert (dv[:, :, 0] == 6).all() and (dv[:, :, 1] == 24).all() and db is None
    with pytest.raises(ValueError, match="shared_storage_dqdkdv"):
        M.attention_backward_mem_eff(dataclasses.replace(args, shared_storage_dqdkdv=True))


@pytest.mark.parametrize("flag", [False, True])
def test_deterministic_reaches_either_backend(backends, flag):
    """deterministic=None follows torch.are_deterministic_algorithms_enabled(); the sm90
    kernel gets the flag, the memory-efficient one a single key split."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(flag)
    try:
        _eab(mask_type=1)
        _eab(mask_type=1, backend="mem_eff")
    finally:
        torch.use_deterministic_algorithms(before)
    (sm90_call, mem_eff_call) = backends
    assert sm90_call[0] == "sm90" and sm90_call[1].deterministic is flag
    assert mem_eff_call[0] == "mem_eff" and mem_eff_call[1].num_splits_key == (1 if flag else None)


def test_deterministic_refuses_key_splits(backends):
    with pytest.raises(ValueError, match="deterministic needs num_splits_key None or 1"):
        _eab(deterministic=True, num_splits_key=2)
    _eab(deterministic=True, num_splits_key=1, backend="mem_eff")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        _eab(deterministic="yes")
    assert [c[0] for c in backends] == ["mem_eff"]


def test_auto_takes_sm90_with_a_window(backends):
    _eab(mask_type=1, window_size=8)
    ((name, a),) = backends
    assert (name, a.custom_mask_type, a.window, a.deterministic, a.cu_seqlens_q) == ("sm90", 1, 8, False, None)


@pytest.mark.parametrize("mask_type,sq,sk", [(0, 100, 130), (1, 130, 100), (2, 100, 130), (2, 130, 100)])
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (BF16, 96), (F16, 128), (F16, 192), (BF16, 256)])
def test_auto_takes_sm90_where_it_applies(backends, caplog, dtype, d, mask_type, sq, sk):
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        dq, dk, dv, db = _eab(sq=sq, sk=sk, d=d, dtype=dtype, mask_type=mask_type, scale=0.3)
    # the drop-in's logsumexp, scale, mask type, window, deterministic
    ((name, a),) = backends
    assert name == "sm90" and a.logsumexp.shape == (2, 3, (sq + 31) // 32 * 32)
    assert (a.scale, a.custom_mask_type, a.window, a.deterministic) == (0.3, mask_type, 0, False)
    assert db is None and dq.shape == (2, sq, 3, d) and dk.shape == dv.shape == (2, sk, 3, d)
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "cute_kernels.attention"]
    assert msg.startswith("attention backward: sm90 (backend='auto', supported") and f"mask {mask_type}" in msg


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (64, 128), (192, 128), (256, 64)])
def test_auto_takes_sm90_with_unequal_head_dims(backends, head_dim, head_dim_v):
    dq, dk, dv, db = _eab(h=4, hk=2, d=head_dim, dv=head_dim_v, mask_type=1)
    ((name, _),) = backends
    assert name == "sm90" and db is None
    assert (
        dq.shape == (2, 100, 4, head_dim) and dk.shape == (2, 130, 2, head_dim) and dv.shape == (2, 130, 2, head_dim_v)
    )


@pytest.mark.parametrize("case", FALLS_BACK, ids=[c[0] for c in FALLS_BACK])
def test_auto_falls_back_to_mem_eff(backends, caplog, case):
    _, kw, fragment = case
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        _eab(**kw)
    assert [name for name, *_ in backends] == ["mem_eff"]
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "cute_kernels.attention"]
    assert msg.startswith("attention backward: mem_eff (backend='auto', not on sm90:") and fragment in msg, msg


@pytest.mark.parametrize("case", FALLS_BACK, ids=[c[0] for c in FALLS_BACK])
def test_sm90_refuses_what_it_cannot_take(backends, case):
    _, kw, fragment = case
    with pytest.raises(
        NotImplementedError, match=r"backend='sm90' cannot take this attention backward: .*" + re.escape(fragment)
    ):
        _eab(backend="sm90", **kw)
    assert backends == []  # refused before either backend


@pytest.mark.parametrize("arch", ["sm_80", "sm_100a", None])
def test_auto_on_other_devices_takes_mem_eff(backends, monkeypatch, arch):
    monkeypatch.setattr(cc, "tensor_arch", lambda t: arch)
    _eab()
    assert [name for name, *_ in backends] == ["mem_eff"]
    with pytest.raises(NotImplementedError, match="needs sm_90a"):
        _eab(backend="sm90")


def test_explicit_backends(backends):
    _eab(backend="sm90", mask_type=1)
    _eab(backend="mem_eff", mask_type=1)
    _eab(backend="mem_eff", num_splits_key=3)
    assert [name for name, *_ in backends] == ["sm90", "mem_eff", "mem_eff"]


def test_unsupported_is_the_rule(backends, monkeypatch):
    """auto asks attention_sm90.unsupported() (with its features) and follows its answer."""
    seen = []

    def verdict(*args, **kw):
        seen.append(kw)
        return "a reason of its own"

    monkeypatch.setattr(S, "unsupported", verdict)
    _eab(mask_type=2, window_size=None)
    assert [name for name, *_ in backends] == ["mem_eff"]
    assert seen == [
        dict(mask_type=2, window_size=None, bias=None, dropout_p=0.0, arch=None, softcap=0.0, grad_bias=False)
    ]
    with pytest.raises(NotImplementedError, match="a reason of its own"):
        _eab(backend="sm90")


@pytest.mark.parametrize("bad", ["hopper", "SM90", "", None, 90])
def test_bad_backend_is_a_value_error(backends, bad):
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'sm90', 'mem_eff'"):
        _eab(backend=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        with FakeTensorMode():
            q = torch.empty(1, 8, 2, 64, device="cuda", dtype=BF16)
            ops.memory_efficient_attention(q, q, q, backend=bad)
    assert backends == []


def test_the_choice_is_made_at_run_time_under_fake_tensors(monkeypatch):
    """FakeTensorMode (torch.compile's tracing): the fake implementation answers, for every
    backend value, without asking a device; the real one decides when it runs."""
    _no_cuda_calls(monkeypatch)
    with FakeTensorMode():
        q, k, v, do, o = _problem(d=96, dv=256, device="cuda")  # not an sm90 problem: decided later
        lse = torch.empty(2, 3, 128, device="cuda")
        for backend in ("auto", "sm90", "mem_eff"):
            dq, dk, dv, db = A.efficient_attention_backward(
                do, q, k, v, None, o, None, None, 100, 130, lse, 0.0, None, None, 1, False, backend=backend
            )
            assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and db is None
            assert dk.is_contiguous() and dv.is_contiguous()


def test_the_backward_op_takes_the_arguments_object_flat():
    """The op's schema lists AttentionBackwardArgs' fields in their order: the op builds the
    object from its parameters and the fake from its positional arguments."""
    schema = torch.ops.cute_kernels.efficient_attention_backward.default._schema
    assert tuple(a.name for a in schema.arguments) == C.OP_FIELDS


def test_schemas_carry_the_backend():
    for op in (torch.ops.cute_kernels.efficient_attention_backward, torch.ops.cute_kernels.memory_efficient_attention):
        assert "str backend" in str(op.default._schema), op.default._schema
        assert "bool deterministic" in str(op.default._schema), op.default._schema


class _Captured(Exception):
    """Raised instead of running the captured graph."""


@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_keeps_the_backend(monkeypatch, deterministic):
    """torch.compile(fullgraph=True) captures the op with the backend and the deterministic
    flag among its arguments."""
    monkeypatch.setattr(C, "check_cuda", lambda *a: None)

    def backend(gm, example_inputs):
        args = [
            n.args
            for n in gm.graph.nodes
            if n.op == "call_function" and "efficient_attention_backward" in str(n.target)
        ]

        def run(*a):
            raise _Captured(args)

        return run

    q, k, v, do, o = _problem(sq=64, sk=64)
    lse = torch.zeros(2, 3, 64)

    def fn(q, k, v, do, o, lse):
        return A.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            o,
            None,
            None,
            64,
            64,
            lse,
            0.0,
            None,
            None,
            1,
            False,
            backend="sm90",
            deterministic=deterministic,
        )[0]

    torch._dynamo.reset()
    with pytest.raises(_Captured) as info:
        torch.compile(fn, fullgraph=True, backend=backend)(q, k, v, do, o, lse)
    torch._dynamo.reset()
    (args,) = info.value.args[0]
    at = C.OP_FIELDS.index("backend")  # (fields past deterministic are the op's own backward's)
    assert args[at : at + 2] == ("sm90", deterministic), args


def test_memory_efficient_attention_traces_with_backend(monkeypatch):
    monkeypatch.setattr(AC, "check_cuda", lambda *a: None)
    q, k, v = torch.randn(1, 12, 2, 64), torch.randn(1, 12, 2, 64), torch.randn(1, 12, 2, 64)
    found = trace_custom_ops(
        lambda q, k, v: ops.memory_efficient_attention(q, k, v, causal=True, backend="sm90") * 2, q, k, v
    )
    assert any("memory_efficient_attention" in f for f in found)
