"""The attention_fwd and attention_train suites on a CPU: listed by the CLI, case names and
their parse, FLOP counts (hand-computed), the fp32 reference, a case's rows with stood-in
implementations, and the configurations compiled without a GPU."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from benchmarks import __main__ as cli
from benchmarks import compile_check as CC
from benchmarks.arch import sm80, sm90
from benchmarks.suites import SUITES, attention_bwd, attention_fwd, attention_train
from benchmarks.suites import attention_cases as C

NEW = ("attention_fwd", "attention_train")


# ------------------------------------------------------------------------- listed


def test_suites_are_listed_and_selectable():
    assert set(NEW) <= set(SUITES)
    args = cli._parser().parse_args(["--suite", "attention_fwd", "--suite", "attention_train"])
    assert args.suite == list(NEW)
    for name in NEW:
        assert sm90.__dict__[name.upper()]["quick"] and sm80.__dict__[name.upper()]["full"]


# -------------------------------------------------------------------------- cases


@pytest.mark.parametrize(
    "name,spec",
    [
        ("8x16x1024x64:bf16", ((8, 16, 1024, 64), "bfloat16", False)),
        ("2x16x4096x128:bf16:causal", ((2, 16, 4096, 128), "bfloat16", True)),
        ("4x32x2048x128:bf16:kv8", ((4, 32, 2048, 128), "bfloat16", False, "kv8")),
        ("2x16x4096x192:bf16:causal:dv128", ((2, 16, 4096, 192), "bfloat16", True, "dv128")),
        ("1x16x32768x128:bf16:causal:varlen", ((1, 16, 32768, 128), "bfloat16", True, "varlen")),
        ("4x16x4096x128:bf16:causal:window512", ((4, 16, 4096, 128), "bfloat16", True, "window512")),
        ("1x8x512x64:fp16:causal:kv2:window64:varlen", ((1, 8, 512, 64), "float16", True, "kv2:window64:varlen")),
        ("2x16x4096x128:bf16:causal:softcap30", ((2, 16, 4096, 128), "bfloat16", True, "softcap30")),
        ("2x64x4096x64:bf16:causal:kv8:window128:sink", ((2, 64, 4096, 64), "bfloat16", True, "kv8:window128:sink")),
        ("4x32x2048x128:bf16:dlse", ((4, 32, 2048, 128), "bfloat16", False, "dlse")),
    ],
)
def test_case_names_parse(name, spec):
    assert C.case_name(spec) == name and C.parse_case(name) == spec


def test_every_table_case_round_trips():
    for table, n in ((sm90.ATTENTION_FWD, 12), (sm90.ATTENTION_TRAIN, 17)):
        specs = C.suite_cases(table, quick=False)
        assert set(table["quick"]) <= set(specs) and len(specs) == n
        for spec in specs:
            assert C.parse_case(C.case_name(spec)) == spec
    assert sm80.ATTENTION_TRAIN == sm90.ATTENTION_FWD  # the feature cases compare Hopper kernels


def test_every_feature_case_has_its_twin():
    """The issue's pairs: a feature case and the same case without it, both in the table."""
    specs = C.suite_cases(sm90.ATTENTION_TRAIN, quick=False)
    for spec in specs:
        case = C.Case.from_spec(spec)
        if case.softcap or case.sink or case.dlse:
            twin = dataclasses.replace(case, softcap=0, sink=False, dlse=False)
            assert twin.spec in specs, case.name


def test_case_features():
    case = C.Case.from_spec(((2, 16, 4096, 192), "bfloat16", True, "kv4:dv128:window256"))
    assert (case.hk, case.dv, case.window, case.varlen) == (4, 128, 256, False)
    case = C.Case.from_spec(((2, 16, 64, 64), "bfloat16", True, "dlse:sink:softcap30:kv4"))
    assert (case.softcap, case.sink, case.dlse, case.features) == (30, True, True, "kv4:softcap30:sink:dlse")
    plain = C.Case.from_spec(((2, 16, 4096, 64), "bfloat16", False))
    assert (plain.hk, plain.dv, plain.features, plain.lengths()) == (16, 64, "", (4096, 4096))


@pytest.mark.parametrize(
    "spec,message",
    [
        (((2, 16, 64, 64), "bfloat16", False, "kv5"), "do not divide"),
        (((2, 16, 64, 64), "bfloat16", False, "window8"), "needs causal"),
        (((2, 16, 64, 64), "bfloat16", True, "varlen"), "batch 1"),
        (((2, 16, 64, 64), "bfloat16", True, "bias"), "unknown feature"),
        (((2, 16, 64, 64), "bfloat16", True, "kv0"), "unknown feature"),
        (((2, 16, 64, 64), "bfloat16", True, "softcap"), "unknown feature"),
    ],
)
def test_bad_cases_raise(spec, message):
    with pytest.raises(ValueError, match=message):
        C.Case.from_spec(spec)


def test_varlen_lengths_are_a_fixed_mix():
    lengths = C.varlen_lengths(32768)
    assert sum(lengths) == 32768 and lengths == C.varlen_lengths(32768)
    assert min(lengths) >= 128 and max(lengths) <= 8192 and len(set(lengths)) == len(lengths) > 4
    assert C.varlen_lengths(32768, seed=1) != lengths


# -------------------------------------------------------------------------- FLOPs


def _fwd(spec):
    return C.forward_flops(C.Case.from_spec(spec))


def test_flops_dense_causal_gqa_dv():
    assert _fwd(((2, 16, 4096, 128), "bfloat16", False)) == 4 * 2 * 16 * 4096 * 4096 * 128
    assert _fwd(((2, 16, 4096, 128), "bfloat16", True)) == 2 * 2 * 16 * 4096 * 4096 * 128
    # the key heads do not change the work: every query head sees all its keys
    assert _fwd(((4, 32, 2048, 128), "bfloat16", False, "kv8")) == 4 * 4 * 32 * 2048 * 2048 * 128
    # Dqk 192 / Dv 128: 2 x 192 for Q K^T, 2 x 128 for P V, per pair; causal: half the pairs
    assert _fwd(((2, 16, 4096, 192), "bfloat16", True, "dv128")) == 2 * (192 + 128) * 2 * 16 * 4096 * 4096 / 2


def test_flops_window():
    # 4096 queries, window 512: queries 0..511 see 1..512 keys, the other 3584 see 512
    pairs = 512 * 513 / 2 + 3584 * 512
    assert _fwd(((4, 16, 4096, 128), "bfloat16", True, "window512")) == 4 * 4 * 16 * 128 * pairs
    # a window as wide as the sequence: every causal pair, the diagonal included
    assert _fwd(((1, 1, 8, 4), "bfloat16", True, "window8")) == 4 * 4 * (8 * 9 / 2)


def test_flops_varlen(monkeypatch):
    monkeypatch.setattr(C, "varlen_lengths", lambda total: (100, 28))
    assert _fwd(((1, 4, 128, 64), "bfloat16", True, "varlen")) == 4 * 4 * 64 * (100**2 + 28**2) / 2
    assert _fwd(((1, 4, 128, 64), "bfloat16", False, "varlen")) == 4 * 4 * 64 * (100**2 + 28**2)
    # a window within each sequence: 100 -> 10 x 11 / 2 + 90 x 10 pairs, 28 -> 10 x 11 / 2 + 18 x 10
    pairs = 55 + 900 + 55 + 180
    assert _fwd(((1, 4, 128, 64), "bfloat16", True, "window10:varlen")) == 4 * 4 * 64 * pairs


def test_train_flops_are_forward_plus_backward():
    assert attention_fwd.FLOPS_SCALE == 1.0 and attention_train.FLOPS_SCALE == 3.5
    for causal in (False, True):
        spec = ((2, 16, 4096, 128), "bfloat16", causal)
        assert _fwd(spec) * 2.5 == attention_bwd.attention_bwd_flops(2, 16, 4096, 128, causal)


# ---------------------------------------------------------------------- reference


def _naive(case, x):
    """O, dQ, dK, dV of F.scaled_dot_product_attention (math, fp32, explicit masks) per sequence."""
    leaves = [t.float().requires_grad_() for t in (x.q, x.k, x.v)]
    q, k, v = leaves
    g = case.heads // case.hk
    k, v = (t.repeat_interleave(g, 2) for t in (k, v))
    out = torch.zeros((*q.shape[:3], case.dv))
    for b, lo, hi in C._segments(case):
        keep = torch.ones(hi - lo, hi - lo, dtype=torch.bool)
        if case.causal:
            keep = keep.tril()
        if case.window:
            keep &= ~keep.tril(-case.window)
        o = F.scaled_dot_product_attention(*(t[b, lo:hi].transpose(0, 1) for t in (q, k, v)), attn_mask=keep)
        out[b, lo:hi] = o.transpose(0, 1)
    out.backward(x.dout.float())
    return (out.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize(
    "spec",
    [
        ((2, 4, 64, 32), "bfloat16", False),
        ((2, 4, 64, 32), "bfloat16", True, "kv2"),
        ((2, 4, 64, 48), "bfloat16", True, "dv16"),
        ((2, 4, 96, 16), "bfloat16", True, "window20"),
        ((1, 4, 400, 16), "bfloat16", True, "kv1:window40:varlen"),
    ],
)
def test_reference_matches_sdpa_math(spec, monkeypatch):
    monkeypatch.setattr(C, "varlen_lengths", lambda total: (150, 130, 120))
    case = C.Case.from_spec(spec)
    x = C.make_inputs(case, device="cpu")
    ref, want = C.reference(case, x, grads=True), _naive(case, x)
    assert [t.shape for t in ref] == [t.shape for t in want]
    for got, exp in zip(ref, want):
        torch.testing.assert_close(got, exp, atol=2e-5, rtol=2e-5)
    assert C.reference(case, x)[0].equal(ref[0])


@pytest.mark.parametrize(
    "spec",
    [
        ((2, 4, 64, 32), "bfloat16", True, "kv2:window20:softcap5:sink:dlse"),
        ((1, 4, 400, 16), "bfloat16", False, "varlen:softcap5:sink:dlse"),
    ],
)
def test_reference_features_match_ops_reference(spec, monkeypatch):
    """The softcap, the sink and a loss on the LSE: O, the LSE, dQ, dK, dV and d sink against
    ops.reference.attention_forward_ref (fp64, autograd) on the same inputs."""
    from ops.reference import attention_forward_ref

    monkeypatch.setattr(C, "varlen_lengths", lambda total: (150, 130, 120))
    case = C.Case.from_spec(spec)
    x = C.make_inputs(case, device="cpu")
    leaves = [t.double().requires_grad_() for t in x.leaves()]
    cu = dict(cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens) if case.varlen else {}
    kw = dict(custom_mask_type=int(case.causal), window_size=case.window, softcap=case.softcap, **cu)
    out, lse = attention_forward_ref(*leaves[:3], sink=leaves[3], **kw)
    lse = C.lse_rows(lse, case)
    torch.autograd.backward((out, lse), (x.dout.double(), x.dlse.double()))
    want = (out, lse, *(t.grad for t in leaves))
    got = C.reference(case, x, grads=True)
    assert C.checked(case, True) == ("out", "lse", "dq", "dk", "dv", "dsink") and len(got) == 6
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.detach().float(), atol=1e-4, rtol=1e-4)
    assert C.reference(case, x)[1].equal(got[1])  # the forward alone: O and the LSE


def test_lse_rows_give_every_layout_as_b_h_s(monkeypatch):
    """Ours' padded rows cut off, ours' per-sequence varlen rows packed, FA4's varlen [H, total]
    batched; an LSE already [B, H, S] comes back as itself (no op in the backward)."""
    monkeypatch.setattr(C, "varlen_lengths", lambda total: (40, 24))
    dense = C.Case.from_spec(((2, 3, 40, 16), "bfloat16", True, "dlse"))
    padded = torch.randn(2, 3, 64)
    assert C.lse_rows(padded, dense).equal(padded[..., :40])
    cut = padded[..., :40]
    assert C.lse_rows(cut, dense) is cut
    packed = C.Case.from_spec(((1, 3, 64, 16), "bfloat16", True, "varlen:dlse"))
    ours = torch.randn(2, 3, 64)  # [sequences, H, >= longest]
    assert C.lse_rows(ours, packed).equal(torch.cat([ours[0, :, :40], ours[1, :, :24]], 1)[None])
    fa4 = torch.randn(3, 64)  # [H, total]
    assert C.lse_rows(fa4, packed).equal(fa4[None])


# --------------------------------------------------------------------- a case's rows


def _stand_in(case, cu_seqlens, wrong=False):
    """A CPU forward through sdpa math (repeated key heads), per sequence with varlen."""

    def fwd(q, k, v):
        g = case.heads // case.hk
        k, v = (t.repeat_interleave(g, 2) for t in (k, v))
        outs = []
        for b, lo, hi in C._segments(case):
            qs, ks, vs = (t[b : b + 1, lo:hi].transpose(1, 2) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=case.causal).transpose(1, 2))
        out = torch.cat(outs, dim=1 if case.varlen else 0)
        return out * 1.5 if wrong else out

    return fwd


@pytest.fixture
def cpu_case(monkeypatch):
    """run_case on the CPU: inputs made there, the implementations stood in (ours right,
    sdpa_flash unavailable, sdpa_cudnn failing, fa4 wrong), the rounds replaced by 2 ms a call."""
    make = C.make_inputs
    monkeypatch.setattr(C, "make_inputs", lambda case: make(case, device="cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def forward(impl, case, cu_seqlens, fa4=None, backend="auto"):
        if impl == "sdpa_flash":
            raise NotImplementedError("not this one")
        if impl == "sdpa_cudnn":
            return (lambda q, k, v: 1 / 0), {}
        return _stand_in(case, cu_seqlens, wrong=impl == "fa4"), {"op": impl}

    def rounds(pending, board, row):
        for impl, fn, info, check, _ in pending:
            fn()  # the timed call runs as timed
            row(impl, 2.0, status="ok", check=check, **info)

    monkeypatch.setattr(C, "forward", forward)
    monkeypatch.setattr(C, "time_in_rounds", rounds)

    def run(suite, spec, fa4=("fa4",), matmul=(100.0, 1.0)):
        grads = suite is attention_train
        rows = C.run_case(suite.NAME, suite._step, grads, suite.FLOPS_SCALE, spec, fa4, "no fa4", matmul)
        return {r["impl"]: r for r in rows}

    return run


@pytest.mark.parametrize("suite", [attention_fwd, attention_train])
@pytest.mark.parametrize("spec", [((2, 4, 64, 32), "bfloat16", True, "kv2"), ((1, 2, 96, 16), "bfloat16", False)])
def test_case_rows(cpu_case, suite, spec):
    rows = cpu_case(suite, spec)
    assert list(rows) == ["ours", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fa4", "matmul"]
    ours, fa4 = rows["ours"], rows["fa4"]
    flops = suite.FLOPS_SCALE * C.forward_flops(C.Case.from_spec(spec))
    assert ours["status"] == "ok" and ours["tflops"] == flops / 2.0 / 1e9 and ours["check"]["ok"]
    assert set(ours["check"]["max_rel_err"]) == ({"out", "dq", "dk", "dv"} if suite is attention_train else {"out"})
    assert ours["case"] == C.case_name(spec) and ours["suite"] == suite.NAME
    assert fa4["status"] == "ok" and not fa4["check"]["ok"]  # a peer is timed either way
    assert rows["sdpa_flash"]["status"] == "unavailable" and "not this one" in rows["sdpa_flash"]["error"]
    assert rows["sdpa_cudnn"]["status"] == "error" and math.isnan(rows["sdpa_cudnn"]["ms"])
    assert rows["matmul"]["tflops"] == pytest.approx(100.0) and rows["sdpa_efficient"]["ours_over_peer"] == 1.0


def test_wrong_ours_is_not_timed_and_missing_fa4_is_unavailable(cpu_case, monkeypatch):
    forward = C.forward
    monkeypatch.setattr(C, "forward", lambda impl, *a: forward("fa4" if impl == "ours" else impl, *a))
    rows = cpu_case(attention_fwd, ((1, 2, 64, 16), "bfloat16", True), fa4=None)
    assert rows["ours"]["status"] == "wrong" and math.isnan(rows["ours"]["ms"])
    assert rows["fa4"] == {**rows["fa4"], "status": "unavailable", "error": "no fa4"}


def test_varlen_rows_list_the_lengths(cpu_case, monkeypatch):
    monkeypatch.setattr(C, "varlen_lengths", lambda total: (40, 24))
    rows = cpu_case(attention_train, ((1, 2, 64, 16), "bfloat16", True, "varlen"))
    assert rows["ours"]["status"] == "ok" and rows["ours"]["seqlens"] == [40, 24]


def _reference_impl(case, cu_seqlens):
    """A CPU implementation with every feature: ops.reference's fp64 forward (autograd), O in
    the inputs' dtype, the LSE fp32 in its own layout (varlen: per sequence) through lse_rows."""
    from ops.reference import attention_forward_ref

    def fwd(q, k, v, sink=None):
        cu = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens) if case.varlen else {}
        kw = dict(custom_mask_type=int(case.causal), window_size=case.window, softcap=case.softcap, **cu)
        out, lse = attention_forward_ref(q, k, v, sink=sink, **kw)
        return (out.to(q.dtype), C.lse_rows(lse.float(), case)) if case.dlse else out.to(q.dtype)

    return fwd


FEATURES = ((2, 4, 64, 32), "bfloat16", True, "kv2:window20:softcap5:sink:dlse")


@pytest.mark.parametrize("suite", [attention_train, attention_bwd])
def test_feature_rows(cpu_case, monkeypatch, suite):
    """A training step (and attention_bwd's backward through autograd) with the softcap, the sink
    and a loss on the LSE: every result checked, the sink's gradient too; SDPA unavailable; the
    backward alone pins ours' backends, its rows named as its cases."""
    backends = {}

    def forward(impl, case, cu_seqlens, fa4=None, backend="auto"):
        if impl.startswith("sdpa"):
            return C._forward_sdpa(case, impl)
        backends[impl] = backend
        return _reference_impl(case, cu_seqlens), {"op": impl}

    monkeypatch.setattr(C, "forward", forward)
    if suite is attention_train:
        rows = cpu_case(attention_train, FEATURES)
        name, impls = C.case_name(FEATURES), ["ours"]
    else:
        spec = FEATURES[:3] + ("autograd:" + FEATURES[3],)
        rows = {r["impl"]: r for r in attention_bwd._run_case(spec, (0, 1, 2, 3), "no fa4", (100.0, 1.0))}
        name, impls = "2x4x64x32:bf16:causal:autograd:kv2:window20:softcap5:sink:dlse", ["ours", "ours_sm90"]
    assert list(rows) == impls + ["sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fa4", "matmul"]
    for impl in impls + ["fa4"]:
        check = rows[impl]["check"]
        assert rows[impl]["status"] == "ok" and check["ok"] and rows[impl]["case"] == name
        assert set(check["max_rel_err"]) == {"out", "lse", "dq", "dk", "dv", "dsink"}
    assert {rows[impl]["status"] for impl in ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn")} == {"unavailable"}
    scale = 3.5 if suite is attention_train else 2.5
    assert rows["ours"]["tflops"] == scale * C.forward_flops(C.Case.from_spec(FEATURES)) / 2.0 / 1e9
    assert backends == (
        {"ours": "auto", "fa4": "auto"} if suite is attention_train else {**attention_bwd.OURS_AUTOGRAD, "fa4": "auto"}
    )


def test_sdpa_refusal_is_unavailable_with_torchs_reasons():
    def refuse():
        import warnings

        warnings.warn("Flash attention kernel not used because: head dim 192")
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(NotImplementedError, match="No available kernel.*head dim 192"):
        C.first_call(refuse)
    with pytest.raises(RuntimeError, match="other"):
        C.first_call(lambda: (_ for _ in ()).throw(RuntimeError("other")))


@pytest.mark.parametrize("impl", ["sdpa_efficient", "sdpa_flash", "sdpa_cudnn"])
@pytest.mark.parametrize("feature", ["varlen", "window64", "softcap30", "sink", "dlse"])
def test_sdpa_lacks_varlen_windows_softcap_sinks_and_the_lse(impl, feature):
    case = C.Case.from_spec(((1, 4, 256, 64), "bfloat16", True, feature))
    with pytest.raises(NotImplementedError, match="F.scaled_dot_product_attention"):
        C.forward(impl, case, None)


def test_fa4_and_ours_get_the_features(monkeypatch):
    """FA4: the window as (N - 1, 0), varlen through flash_attn_varlen_func on [T, H, D]; ours:
    window_size N and cu_seqlens with the longest length."""
    calls = []

    def fa4(*args, **kw):
        calls.append((args[0].shape, kw))
        return args[0][..., :1] * 0, None  # (out, lse)

    case = C.Case.from_spec(((1, 4, 256, 64), "bfloat16", True, "window64:varlen"))
    monkeypatch.setattr(C, "varlen_lengths", lambda total: (200, 56))
    x = C.make_inputs(case, device="cpu")
    fwd, info = C.forward("fa4", case, x.cu_seqlens, (None, fa4))
    assert fwd(x.q, x.k, x.v).shape == (1, 256, 4, 1) and info["op"].endswith("flash_attn_varlen_func")
    ((shape, kw),) = calls
    assert shape == (256, 4, 64) and kw["window_size"] == (63, 0) and kw["causal"] is True
    assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 200 and kw["cu_seqlens_q"].tolist() == [0, 200, 256]

    seen = {}
    monkeypatch.setitem(
        sys.modules, "ops", types.SimpleNamespace(memory_efficient_attention=lambda q, k, v, **kw: seen.update(kw))
    )
    C.forward("ours", case, x.cu_seqlens)[0](x.q, x.k, x.v)
    assert seen["window_size"] == 64 and seen["causal"] is True and seen["max_seqlen_q"] == 200


def test_fa4_and_ours_get_softcap_sink_and_lse(monkeypatch):
    """FA4: softcap=, learnable_sink=, return_lse=; ours: softcap=, sink=, return_lse= and the
    backend where one is pinned; both return (O, the LSE as [B, H, S])."""
    case = C.Case.from_spec(((2, 4, 40, 16), "bfloat16", True, "kv2:softcap30:sink:dlse"))
    x = C.make_inputs(case, device="cpu")
    calls = []

    def fa4(q, k, v, **kw):
        calls.append(kw)
        return q * 0, torch.zeros(2, 4, 40)

    fwd, _ = C.forward("fa4", case, None, (fa4, None))
    out, lse = fwd(*x.leaves())
    assert out.shape == x.q.shape and lse.shape == (2, 4, 40)
    assert calls == [dict(causal=True, softcap=30.0, return_lse=True, learnable_sink=x.sink)]

    def ours(q, k, v, **kw):
        calls.append(kw)
        return q * 0, torch.zeros(2, 4, 64)  # the LSE's rows padded to 32

    monkeypatch.setitem(sys.modules, "ops", types.SimpleNamespace(memory_efficient_attention=ours))
    fwd, info = C.forward("ours_sm90", case, None, None, "sm90")
    assert fwd(*x.leaves())[1].shape == (2, 4, 40) and info["op"] == 'ops.memory_efficient_attention(backend="sm90")'
    kw = calls[-1]
    assert (kw["softcap"], kw["sink"] is x.sink, kw["return_lse"], kw["backend"]) == (30, True, True, "sm90")


# ------------------------------------------------- configurations compiled without a GPU


def _caches(configs):
    return [c.cache.split(":")[0].split(".")[-1] for c in configs]


def test_fwd_configs_are_the_forward_kernels_keys():
    """Our forward's keys: sm_90a only, the head dims it compiles (Dqk 192 / Dv 128 its own key),
    the window and variable-length cases their own keys, GQA alike."""
    assert attention_fwd.compile_configs("sm_80", False) == []
    full = attention_fwd.compile_configs("sm_90a", False)
    quick = attention_fwd.compile_configs("sm_90a", True)
    assert set(_caches(full)) == {"attention_fwd_sm90"} and set(quick) < set(full)
    keys = {(k.head_dim, k.head_dim_v, k.mask_type, k.window, k.varlen) for (k,) in (c.key for c in full)}
    plain = {
        (64, 64, 0, False, False),
        (128, 128, 0, False, False),
        (128, 128, 1, False, False),
        (64, 64, 1, False, False),
        (192, 192, 1, False, False),
        (256, 256, 0, False, False),
        (192, 128, 1, False, False),
    }
    assert keys == plain | {(128, 128, 1, True, False), (128, 128, 1, False, True)}


def test_plain_specs_keep_what_each_op_keys():
    specs = [
        ((2, 16, 64, 128), "bfloat16", True),
        ((4, 32, 64, 128), "bfloat16", False, "kv8"),
        ((2, 16, 64, 128), "bfloat16", True, "window8"),
        ((2, 16, 64, 192), "bfloat16", True, "dv128"),
        ((1, 16, 64, 128), "bfloat16", True, "varlen"),
    ]
    assert C.plain_specs(specs) == [specs[0]]
    assert C.plain_specs(specs, ("kv",)) == [specs[0], specs[1][:3]]
    assert C.plain_specs(specs, ("kv", "window")) == [specs[0], specs[1][:3]]  # window8's plain form is specs[0]
    assert C.plain_specs(specs + specs, "all") == specs


def test_train_configs_list_forward_and_backwards():
    """Both backwards and the forward; on sm_90a the feature cases' own keys: the forward with
    the softcap and with the sink (d64, window), the sm90 backward with the softcap and at d64
    with the window (the sink and dLSE key alike)."""
    keys = [c.key[0] for c in attention_train.compile_configs("sm_90a", False) if "mem_eff" not in c.cache]
    feats = {(type(k).__name__, k.head_dim, k.window, k.softcap, getattr(k, "sink", None)) for k in keys}
    want = {("ForwardConfig", 128, False, True, False), ("ForwardConfig", 64, True, False, True)}
    want |= {("ForwardConfig", 64, True, False, False), ("Sm90Config", 128, False, True, None)}
    assert want | {("Sm90Config", 64, True, False, None)} <= feats
    for arch in CC.ARCHES:
        full = _caches(attention_train.compile_configs(arch, False))
        want = {"mem_eff_attention"} | ({"attention_fwd_sm90", "attention_sm90"} if arch == "sm_90a" else set())
        assert set(full) == want
    # the backwards' keys of attention_bwd's plain cases come back here
    bwd = set(attention_bwd.compile_configs("sm_90a", False))
    plain = [c for c in attention_train.compile_configs("sm_90a", False) if "attention_fwd" not in c.cache]
    assert len(plain) > 0 and len(set(plain) - bwd) > 0  # d192 / d256 are new


def test_cpu_cli_run_compiles_the_quick_configurations(monkeypatch, capsys):
    """``python -m benchmarks --quick --suite attention_fwd --suite attention_train`` on a CPU:
    each listed configuration compiled once (the compile caches stood in)."""
    import ops.attention_fwd_sm90
    import ops.attention_sm90
    import ops.mem_eff_attention

    seen = []
    for mod in (ops.attention_fwd_sm90, ops.attention_sm90, ops.mem_eff_attention):
        monkeypatch.setattr(mod, "compiled", lambda *key, m=mod.__name__: seen.append((m, key)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--quick", "--suite", "attention_fwd", "--suite", "attention_train"]) == 0
    out = capsys.readouterr().out
    assert "attention_fwd: compiling 5 configurations (sm_80 0, sm_90a 5)" in out
    listed = [c for s in NEW for arch in CC.ARCHES for c in CC.suite_configs(s, True)[arch]]
    assert sorted(map(repr, seen)) == sorted(repr((c.cache.split(":")[0], c.key)) for c in listed)
    assert f"{len(listed)} configurations compiled" in out


@pytest.mark.compile
def test_quick_forward_configurations_compile():
    """The forward kernel's quick configurations compile for sm_90a with fake tensors."""
    assert (
        attention_fwd.compile_only("sm_90a", quick=True) == 5
    )  # plain d128, d64 causal, the 512 window, the packed sequences (short- and long-causal tiles)
