"""CPU: the validation of ``memory_efficient_attention`` (bad inputs raise before any launch,
cu_seqlens values, the window forms it takes), its fake implementation and graph capture."""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from ops import attention as A
from ops import attention_checks as AC
from tests.helpers import trace_custom_ops

from .mem_eff_attention_cpu_common import F64, cu


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


def _mea(**kw):
    args = dict(query=fake_cuda(1, 40, 2, 64), key=fake_cuda(1, 48, 2, 64), value=fake_cuda(1, 48, 2, 32))
    args.update(kw)
    return args


def _cu(n=3, dtype=torch.int32):
    return fake_cuda(n, dtype=dtype)


BAD = [
    ("cpu query", lambda: _mea(query=torch.zeros(1, 40, 2, 64)), ValueError, "query must be a CUDA"),
    ("key not a tensor", lambda: _mea(key=[1.0]), TypeError, "key must be a torch.Tensor"),
    ("cpu key", lambda: _mea(key=torch.zeros(1, 48, 2, 64, dtype=torch.bfloat16)), ValueError, "key is on cpu"),
    ("int query", lambda: _mea(query=fake_cuda(1, 40, 2, 64, dtype=torch.int32)), TypeError, "query must have dtype"),
    ("fp64 query", lambda: _mea(query=fake_cuda(1, 40, 2, 64, dtype=F64)), TypeError, "query must have dtype"),
    (
        "key dtype",
        lambda: _mea(key=fake_cuda(1, 48, 2, 64, dtype=torch.float16)),
        TypeError,
        "key must have query's dtype",
    ),
    (
        "value dtype",
        lambda: _mea(value=fake_cuda(1, 48, 2, 32, dtype=torch.float32)),
        TypeError,
        "value must have query's dtype",
    ),
    ("3-D query", lambda: _mea(query=fake_cuda(40, 2, 64)), ValueError, "query must be 4-D"),
    ("5-D value", lambda: _mea(value=fake_cuda(1, 48, 2, 1, 32)), ValueError, "value must be 4-D"),
    ("key heads", lambda: _mea(key=fake_cuda(1, 48, 3, 64)), ValueError, "Hk heads dividing query's 2"),
    ("key head_dim", lambda: _mea(key=fake_cuda(1, 48, 2, 32)), ValueError, "key must have shape (1, Mk, Hk, 64)"),
    ("key batch", lambda: _mea(key=fake_cuda(2, 48, 2, 64)), ValueError, "key must have shape"),
    (
        "value seqlen",
        lambda: _mea(value=fake_cuda(1, 47, 2, 32)),
        ValueError,
        "value must have key's batch, seqlen and heads",
    ),
    (
        "empty head_dim",
        lambda: _mea(query=fake_cuda(1, 40, 2, 0), key=fake_cuda(1, 48, 2, 0)),
        ValueError,
        "query must have head_dim >= 1",
    ),
    (
        "strided head_dim",
        lambda: _mea(
            query=torch.empty_strided((1, 40, 2, 64), (10240, 256, 128, 2), device="cuda", dtype=torch.bfloat16)
        ),
        ValueError,
        "query must be contiguous in its last dim",
    ),
    (
        "causal typo",
        lambda: _mea(causal="bottom-right"),
        ValueError,
        "causal must be False, True, 'top_left' or 'bottom_right'",
    ),
    ("causal int", lambda: _mea(causal=1), ValueError, "causal must be"),
    ("window without causal", lambda: _mea(window_size=8), ValueError, "window_size needs causal"),
    ("negative window", lambda: _mea(causal=True, window_size=-1), ValueError, "window_size must be >= 0"),
    ("float window", lambda: _mea(causal=True, window_size=2.0), TypeError, "window_size must be an int"),
    ("nan scale", lambda: _mea(scale=float("nan")), TypeError, "scale must be a finite float"),
    ("string scale", lambda: _mea(scale="0.1"), TypeError, "scale must be a finite float"),
    ("cu_seqlens_q alone", lambda: _mea(cu_seqlens_q=_cu()), ValueError, "cu_seqlens_k is required"),
    ("cu_seqlens_k alone", lambda: _mea(cu_seqlens_k=_cu()), ValueError, "cu_seqlens_q is required"),
    (
        "int64 cu_seqlens",
        lambda: _mea(cu_seqlens_q=_cu(dtype=torch.int64), cu_seqlens_k=_cu(), max_seqlen_q=8, max_seqlen_k=8),
        TypeError,
        "cu_seqlens_q must be int32",
    ),
    (
        "2-D cu_seqlens",
        lambda: _mea(
            cu_seqlens_q=_cu(), cu_seqlens_k=fake_cuda(3, 1, dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=8
        ),
        ValueError,
        "cu_seqlens_k must be a 1-D tensor",
    ),
    (
        "short cu_seqlens",
        lambda: _mea(cu_seqlens_q=_cu(1), cu_seqlens_k=_cu(1), max_seqlen_q=8, max_seqlen_k=8),
        ValueError,
        "cu_seqlens_q must be a 1-D tensor [num_seqs + 1] with at least 2 entries",
    ),
    (
        "cu_seqlens lengths differ",
        lambda: _mea(cu_seqlens_q=_cu(3), cu_seqlens_k=_cu(4), max_seqlen_q=8, max_seqlen_k=8),
        ValueError,
        "cu_seqlens_k must have cu_seqlens_q's shape",
    ),
    (
        "cpu cu_seqlens",
        lambda: _mea(
            cu_seqlens_q=torch.zeros(3, dtype=torch.int32), cu_seqlens_k=_cu(), max_seqlen_q=8, max_seqlen_k=8
        ),
        ValueError,
        "cu_seqlens_q is on cpu",
    ),
    (
        "varlen batch 2",
        lambda: _mea(
            query=fake_cuda(2, 40, 2, 64),
            key=fake_cuda(2, 48, 2, 64),
            value=fake_cuda(2, 48, 2, 32),
            cu_seqlens_q=_cu(),
            cu_seqlens_k=_cu(),
            max_seqlen_q=8,
            max_seqlen_k=8,
        ),
        ValueError,
        "query must have batch 1 with cu_seqlens_q",
    ),
    (
        "max_seqlen without cu_seqlens",
        lambda: _mea(max_seqlen_q=40),
        ValueError,
        "max_seqlen_q is only used with cu_seqlens",
    ),
    (
        "zero max_seqlen",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=8, max_seqlen_k=0),
        ValueError,
        "max_seqlen_k must be >= 1",
    ),
    (
        "float max_seqlen",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=8.0, max_seqlen_k=8),
        TypeError,
        "max_seqlen_q must be an int",
    ),
    (
        "max_seqlen past M",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=41, max_seqlen_k=8),
        ValueError,
        "max_seqlen_q (41) is longer than query's packed length 40",
    ),
    (
        "varlen max_seqlen missing when tracing",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=8),
        ValueError,
        "max_seqlen_q and max_seqlen_k are required",
    ),
    (
        "bottom_right more queries",
        lambda: _mea(query=fake_cuda(1, 60, 2, 64), causal="bottom_right"),
        NotImplementedError,
        "causal='bottom_right' with more queries than keys (60 > 48)",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_before_launch(case):
    _, build, err, fragment = case
    with FakeTensorMode(allow_non_fake_inputs=True):
        kwargs = build()
        with pytest.raises(err, match=re.escape(fragment)):
            ops.memory_efficient_attention(**kwargs)


CU_VALUES = [
    ([1, 3, 5], 10, None, "cu_seqlens_q must start at 0"),
    ([0, 4, 3, 6], 10, None, "cu_seqlens_q must be non-decreasing"),
    ([0, 4, 11], 10, None, "cu_seqlens_q ends at 11, past the packed length 10"),
    ([0, 4, 10], 10, 5, "max_seqlen_q (5) is shorter than the longest sequence in cu_seqlens_q (6)"),
]


@pytest.mark.parametrize(
    "values,total,max_seqlen,fragment", CU_VALUES, ids=["start", "decreasing", "past-end", "max-short"]
)
def test_cu_seqlens_values_are_checked(values, total, max_seqlen, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        AC.check_cu_values("cu_seqlens_q", torch.tensor(values, dtype=torch.int32), total, max_seqlen, "max_seqlen_q")
    longest, lengths = AC.check_cu_values("cu_seqlens_q", cu([3, 0, 5]), 8, None, "max_seqlen_q")
    assert longest == 5 and lengths == [3, 0, 5]


def test_cu_seqlens_values_are_read_once_per_tensor_and_version(monkeypatch):
    """The same cu_seqlens tensor passed again unchanged is not read back (a device
    synchronisation each time on a GPU); another tensor, another packed length or an in-place
    change (its version) is checked again."""
    reads = []
    real = AC.check_cu_values
    monkeypatch.setattr(AC, "check_cu_values", lambda *a: reads.append(a[1]) or real(*a))
    t = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert AC.cu_values_once("cu_seqlens_q", t, 8, None, "max_seqlen_q") == (5, [3, 5])
    assert AC.cu_values_once("cu_seqlens_q", t, 8, None, "max_seqlen_q") == (5, [3, 5])
    assert len(reads) == 1
    AC.cu_values_once("cu_seqlens_q", t, 9, None, "max_seqlen_q")  # another packed length
    AC.cu_values_once("cu_seqlens_q", t.clone(), 8, None, "max_seqlen_q")  # another tensor
    assert len(reads) == 3
    t[2] = 11  # in place: past the packed length now
    with pytest.raises(ValueError, match="ends at 11"):
        AC.cu_values_once("cu_seqlens_q", t, 9, None, "max_seqlen_q")
    with torch.inference_mode():  # no version counter: every call reads
        u = torch.tensor([0, 2], dtype=torch.int32)
    for _ in range(2):
        AC.cu_values_once("cu_seqlens_q", u, 8, None, "max_seqlen_q")
    assert len(reads) == 6


def test_varlen_dropout_refuses_torchs_forward():
    """Where our forward does not apply, dropout with variable lengths raises instead of running
    torch's forward, whose keep mask no backward replays (meta tensors: no arch, so not ours)."""
    q, k, v = (torch.empty(1, 90, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    cq = ck = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match="dropout with variable lengths needs our forward"):
        A._mea_impl(q, k, v, cq, ck, 60, 60, 0, 0, None, None, 0.1)


def test_fake_implementation_shapes():
    with FakeTensorMode():
        q, k, v = fake_cuda(2, 70, 3, 64), fake_cuda(2, 50, 3, 64), fake_cuda(2, 50, 3, 40)
        out, lse, seed, offset = A._mea_forward(q, k, v, None, None, 70, 50, 1, 0, None)
        assert seed.dtype == offset.dtype == torch.int64 and seed.shape == offset.shape == ()
        assert out.shape == (2, 70, 3, 40) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 3, 96) and lse.dtype == torch.float32  # rows padded to a multiple of 32
        q, k, v = fake_cuda(1, 90, 2, 32), fake_cuda(1, 80, 2, 32), fake_cuda(1, 80, 2, 32)
        cq, ck = fake_cuda(5, dtype=torch.int32), fake_cuda(5, dtype=torch.int32)
        out, lse, _, _ = A._mea_forward(q, k, v, cq, ck, 33, 40, 2, 8, 0.5)
        assert out.shape == (1, 90, 2, 32) and lse.shape == (4, 2, 64)  # [num_seqs, H, round_up(max_seqlen_q, 32)]
        out = ops.memory_efficient_attention(
            q, k, v, causal=True, window_size=4, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=33, max_seqlen_k=40
        )
        assert out.shape == (1, 90, 2, 32)


def test_traces_in_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) sees the forward as our op, validation included."""
    monkeypatch.setattr(AC, "check_cuda", lambda *a: None)  # CPU tensors stand in for CUDA ones
    q, k, v = torch.randn(1, 12, 2, 16), torch.randn(1, 12, 2, 16), torch.randn(1, 12, 2, 8)
    found = trace_custom_ops(
        lambda q, k, v: ops.memory_efficient_attention(q, k, v, causal="bottom_right", scale=0.2) * 2, q, k, v
    )
    assert any("memory_efficient_attention" in f for f in found)
    cq = cu([5, 7])
    found = trace_custom_ops(
        lambda q, k, v, c: ops.memory_efficient_attention(
            q, k, v, causal=True, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=7, max_seqlen_k=7
        ),
        q,
        k,
        v,
        cq,
    )
    assert any("memory_efficient_attention" in f for f in found)


@pytest.mark.parametrize(
    "mask_type,window,want",
    [
        (0, None, (0, 0)),
        (1, 0, (1, 0)),
        (1, 7, (1, 7)),
        (2, 3, (2, 3)),
        (0, (-1, -1), (0, 0)),
        (1, (-1, -1), (1, 0)),
        (0, (-1, 0), (2, 0)),  # FlashAttention's (left, right)
        (0, (5, 0), (2, 6)),
        (1, (5, 0), (1, 6)),
        (2, (0, 0), (2, 1)),
        (1, (5, -1), (1, 6)),
    ],
)
def test_window_forms(mask_type, window, want):
    """An int w keeps the w keys up to the diagonal; (left, 0) is w = left + 1, bottom-right
    without causal (FlashAttention aligns its windows there); -1 is unbounded."""
    assert AC.window_of(mask_type, window) == want


@pytest.mark.parametrize(
    "window,exc,fragment",
    [
        ((-5, -5), ValueError, "-1 for unbounded"),
        ((3, 2), NotImplementedError, "past the diagonal"),
        ((3, -1), NotImplementedError, "any key after"),
        ((1.5, 0), TypeError, "two ints"),
        (-2, ValueError, ">= 0"),
    ],
)
def test_window_forms_refused(window, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        AC.window_of(0, window)
