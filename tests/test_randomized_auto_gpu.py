"""GPU: randomized attention backwards through ``backend="auto"``, the kernel users get.

On sm_90a "auto" runs the Hopper-native backward wherever it applies. Each class is a
feature mix drawn from the seed (dtype, head dims with Dqk != Dv, mask top-left /
bottom-right / none, window, variable lengths with empty and length-1 sequences, bias with
and without its gradient, dropout, deterministic mode): every feature value appears in
about its share of the classes, and invalid mixes are repaired (no bias with variable
lengths, no window without a mask). Within a class everything else is random (batch, query
heads per key head, lengths, window width, bias broadcast, p, scale, seeds), restricted to
the sizes whose call plan compiles the same kernel as the class's anchor case, so each class
compiles once. Every case is checked against the fp64 reference (torch's dropout mask) by
``run_feature_case``; each class asserts that all its cases ran, and the class count times
the cases per class is at least MIN_CASES.

Each class whose head dims the Hopper forward compiles then takes TRAIN_CASES_PER_CLASS
training steps through ``ops.memory_efficient_attention`` (backend "auto"): our forward (a
call counter asserts it ran), O and the LSE against the fp64 reference, then autograd's
backward on our O / LSE / philox state, the gradients (and the bias's) against the
reference's with Δ from our O; dropout's mask is torch's for the generator's state
(``torch.manual_seed``), on variable lengths the backwards' streams. Same sizes as the
class's cases, so the backward compiles nothing new except, with dropout, its variant that
reads the philox seed / offset from the device.

``CUTE_KERNELS_RANDOM_SEED`` draws other mixes and cases (the default below otherwise).
"""

import itertools
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

import ops
from cute_kernels.attention_sm90 import backward_config as sm90_config
from cute_kernels.attention_sm90.forward_config import forward_unsupported
from ops import _compile as cc
from ops import attention_fwd_sm90 as fwd_sm90
from ops import attention_sm90 as S

from .helpers import delta_rounding_floors
from .test_attention_fwd_sm90_gpu import check_forward, forward_reference
from .test_mem_eff_attention_features_gpu import check_dbias, run_feature_case
from .test_mem_eff_attention_gpu import check_grad, key_coverage, seq_args

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
SEED = int(os.environ.get("CUTE_KERNELS_RANDOM_SEED", 20261127))
NUM_CLASSES = 16
CASES_PER_CLASS = 20
TRAIN_CASES_PER_CLASS = 4  # training steps through the op, in the classes our forward takes
MIN_CASES = 300
MAX_ROWS = 384

HEAD_DIMS = [(64, 64), (128, 128), (96, 96), (192, 128), (128, 64), (256, 256)]
FEATURES = {
    "dtype": [F16, BF16],
    "dims": HEAD_DIMS,
    "mask_type": [0, 1, 2],
    "window": [False, True],
    "varlen": [False, True],
    "bias": [None, "bias", "bias_grad"],
    "dropout": [False, True],
    "deterministic": [False, True],
}


def draw_classes(rng: random.Random, n: int) -> list:
    """n feature mixes: each feature's values spread evenly over the classes, in an order
    drawn from ``rng``; then mixes the op refuses are repaired."""
    columns = {}
    for name, values in FEATURES.items():
        col = list(itertools.islice(itertools.cycle(values), n))
        rng.shuffle(col)
        columns[name] = col
    classes = []
    for i in range(n):
        c = {name: columns[name][i] for name in FEATURES}
        if c["varlen"] and c["bias"]:  # torch's forward takes no bias with cu_seqlens: keep one of them
            c["varlen" if i % 2 else "bias"] = False if i % 2 else None
        if c["mask_type"] == 0:
            c["window"] = False
        classes.append(c)
    return classes


CLASSES = draw_classes(random.Random(SEED), NUM_CLASSES)


def class_id(c) -> str:
    parts = [str(c["dtype"])[6:], "d%d-%d" % c["dims"], f"mask{c['mask_type']}"]
    parts += [name for name in ("window", "varlen", "dropout", "deterministic") if c[name]]
    return "-".join(parts + ([c["bias"]] if c["bias"] else []))


def compile_key(c, rows_q: int, rows_k: int, group: int) -> "S.Sm90Config":
    """The sm90 kernel a call of class ``c`` with these sizes compiles (ops.attention_sm90._plan)."""
    d, dv = c["dims"]
    ctas = S._persistent_ctas(torch.empty(0, device="cuda"))
    return S._plan(
        cc.cute_dtype(c["dtype"]),
        d,
        dv,
        c["mask_type"],
        "sm_90a",
        window=c["window"],
        deterministic=c["deterministic"],
        varlen=c["varlen"],
        bias=c["bias"] is not None,
        grad_bias=c["bias"] == "bias_grad",
        dropout=c["dropout"],
        rows_q=rows_q,
        group=group,
        rows_k=rows_k,
        ctas=ctas,
    )[2]


_sizes: dict = {}


def class_sizes(ci: int) -> list:
    """(rows_q, rows_k, group) triples whose compiled kernel is the class's anchor's: a case
    of any of them compiles nothing new. Bottom-right masks keep rows_q <= rows_k."""
    if ci not in _sizes:
        c = CLASSES[ci]
        grid = [1, 2, 17, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, MAX_ROWS]
        triples = [(q, k, g) for q in grid for k in grid for g in (1, 2, 4) if c["mask_type"] != 2 or q <= k]
        anchor = compile_key(c, 256, 256, 1)
        _sizes[ci] = [t for t in triples if compile_key(c, *t) == anchor]
    return _sizes[ci]


@st.composite
def case_specs(draw, ci):
    c = CLASSES[ci]
    rows_q, rows_k, group = draw(st.sampled_from(class_sizes(ci)))
    kv_heads = draw(st.integers(1, 2))
    spec = dict(
        kv_heads=kv_heads,
        h=kv_heads * group,
        scale=draw(st.sampled_from([None, None, 0.05, 0.3])),
        seed=draw(st.integers(0, 2**31 - 1)),
        lengths=None,
    )
    if c["varlen"]:  # sequences no longer than the class's rows, one of them that long
        n = draw(st.integers(1, 4))
        lq = draw(
            st.lists(st.sampled_from([x for x in (0, 1, 2, 33) if x <= rows_q] + [rows_q]), min_size=n, max_size=n)
        )
        lk = [draw(st.integers(min(q, rows_k) if c["mask_type"] == 2 else 0, rows_k)) for q in lq]
        i = draw(st.integers(0, n - 1))
        lq[i], lk[i] = rows_q, rows_k
        spec.update(b=1, mq=sum(lq), mk=sum(lk), lengths=(lq, lk))
    else:
        spec.update(b=draw(st.integers(1, 2)), mq=rows_q, mk=rows_k)
    keys = rows_k
    spec["window"] = draw(st.integers(1, keys + 8)) if c["window"] else 0
    spec["dropout_p"] = draw(st.sampled_from([0.1, 0.3, 0.6])) if c["dropout"] else 0.0
    spec["bias_shape"] = None
    if c["bias"]:
        b, h, mq, mk = spec["b"], spec["h"], spec["mq"], spec["mk"]
        spec["bias_shape"] = draw(
            st.sampled_from([(b, h, mq, mk), (1, h, mq, mk), (b, 1, mq, mk), (mq, mk), (b, h, 1, mk)])
        )
        spec["bias_layout"] = draw(st.sampled_from(["dense", "padded", "transposed"]))
    return spec


def _run(ci, s):
    c = CLASSES[ci]
    d, dv = c["dims"]
    note(f"class {class_id(c)}, case {s} (CUTE_KERNELS_RANDOM_SEED={SEED})")
    run_feature_case(
        c["dtype"],
        s["b"],
        s["mq"],
        s["mk"],
        s["h"],
        d,
        dv,
        kv_heads=s["kv_heads"],
        bias_shape=s["bias_shape"],
        bias_layout=s.get("bias_layout", "dense"),
        bias_grad=c["bias"] == "bias_grad",
        dropout_p=s["dropout_p"],
        mask_type=c["mask_type"],
        window=s["window"],
        scale=s["scale"],
        lengths=s["lengths"],
        seed=s["seed"],
        deterministic=c["deterministic"],
        backend="auto",
    )


_CAUSAL = {0: False, 1: True, 2: "bottom_right"}


def trains_our_forward(c) -> bool:
    """Whether the op's forward is ours in the class's training steps (its head dims compile; the
    rest, fp16 / bf16, aligned inputs, any mask / window / bias / dropout, holds for every class)."""
    return forward_unsupported(*c["dims"]) is None


def _examples(n: int):
    """Hypothesis settings of a class's draws: n examples from the seed alone (no database, no
    shrinking, no deadline: a compile can take seconds)."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def _train(ci, s):
    """One training step of class ``ci``'s case ``s`` through ``ops.memory_efficient_attention``."""
    c = CLASSES[ci]
    d, dv = c["dims"]
    dtype, mask_type, lengths = c["dtype"], c["mask_type"], s["lengths"]
    window, scale, p = s["window"], s["scale"], s["dropout_p"]
    b, mq, mk, h, hk = s["b"], s["mq"], s["mk"], s["h"], s["kv_heads"]
    note(f"class {class_id(c)}, training case {s} (CUTE_KERNELS_RANDOM_SEED={SEED})")
    gen = torch.Generator("cuda").manual_seed(s["seed"])
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(b, mq, h, d), r(b, mk, hk, d), r(b, mk, hk, dv), r(b, mq, h, dv)
    bias = None
    if s["bias_shape"] is not None:
        shape, layout = s["bias_shape"], s["bias_layout"]
        if layout == "padded":  # rows of a wider buffer
            bias = r(*shape[:-1], shape[-1] + 3)[..., : shape[-1]]
        elif layout == "transposed":  # keys not contiguous
            bias = r(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
        else:
            bias = r(*shape)
        bias.requires_grad_(c["bias"] == "bias_grad")  # a leaf view: its gradient keeps its shape
    cq, ck, max_q, max_k = seq_args(mq, mk, lengths)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(s["seed"])  # the forward's philox state: (seed, 0)
    out, lse = ops.memory_efficient_attention(
        *leaves,
        causal=_CAUSAL[mask_type],
        window_size=window or None,
        scale=scale,
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        max_seqlen_q=max_q if lengths else None,
        max_seqlen_k=max_k if lengths else None,
        attn_bias=bias,
        dropout_p=p,
        backend="auto",
        deterministic=c["deterministic"],
        return_lse=True,
    )
    out.backward(do)
    out, lse = out.detach(), lse.detach()
    b_ref = None if bias is None else bias.detach()
    ref_out, ref_lse, ref = forward_reference(
        q,
        k,
        v,
        mask_type=mask_type,
        window=window,
        scale=scale,
        bias=b_ref,
        lengths=lengths,
        max_q=max_q,
        max_k=max_k,
        p=p,
        seed=s["seed"],
        offset=0,
        grad_out=do,
        out=out,
    )
    label = (
        f"training {class_id(c)} B{b} Mq{mq} Mk{mk} H{h}/{hk} w{window} p{p} "
        f"bias{s['bias_shape']}:{s.get('bias_layout')} lengths{lengths}"
    )
    check_forward(label, out, lse, ref_out, ref_lse, dtype, lengths)
    rows_q, rows_k = key_coverage(b, mq, mk, mask_type, window, lengths)
    dq_floor, dk_floor = delta_rounding_floors(q, k, do, out, dtype, scale)
    grads = [x.grad for x in leaves]
    check_grad(f"dq [{label}]", grads[0], ref[0], dtype, None, rows_q, floor=dq_floor)
    check_grad(f"dk [{label}]", grads[1], ref[1], dtype, None, rows_k, floor=dk_floor)
    check_grad(f"dv [{label}]", grads[2], ref[2], dtype, None, rows_k)
    if c["bias"] == "bias_grad":
        check_dbias(f"dbias [{label}]", bias.grad, ref[3], b_ref, do, out, dtype)


def test_classes_cover_every_feature():
    for name, values in FEATURES.items():
        seen = {repr(c[name]) for c in CLASSES}
        expected = {repr(v) for v in values}
        if name == "window":  # repaired away where the mask is none; at least one remains
            expected = {repr(True)} | ({repr(False)} if any(c["mask_type"] == 0 for c in CLASSES) else set())
        assert expected <= seen, (name, expected - seen)
    assert NUM_CLASSES * CASES_PER_CLASS >= MIN_CASES


def test_auto_runs_the_sm90_kernel_for_every_class():
    """Each class's anchor is an sm90 problem (so "auto" means the Hopper kernel here)."""
    for c in CLASSES:
        d, dv = c["dims"]
        assert sm90_config.head_dims_unsupported(d, dv) is None, class_id(c)
    assert all(class_sizes(ci) for ci in range(NUM_CLASSES))


@pytest.mark.parametrize("ci", range(NUM_CLASSES), ids=[class_id(c) for c in CLASSES])
def test_attention_auto_randomized(ci, monkeypatch):
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("backend='auto' runs the sm90 kernel on sm_90a only")
    ran, sm90_calls = [], []
    real = S.attention_backward_sm90
    monkeypatch.setattr(S, "attention_backward_sm90", lambda *a, **k: sm90_calls.append(1) or real(*a, **k))

    @seed(SEED + ci)
    @_examples(CASES_PER_CLASS)
    @given(data=st.data())
    def run(data):
        _run(ci, data.draw(case_specs(ci), label="case"))
        ran.append(1)

    run()
    assert len(ran) == CASES_PER_CLASS, f"{len(ran)} of {CASES_PER_CLASS} cases ran"
    assert len(sm90_calls) == len(ran), f"'auto' took the sm90 kernel in {len(sm90_calls)} of {len(ran)} cases"
    print(f"\n{class_id(CLASSES[ci])}: {len(ran)} cases through backend='auto', all on the sm90 kernel")
    if not trains_our_forward(CLASSES[ci]):
        return
    # training steps in the same process: the backward kernels compiled above serve them
    trained, fwd_calls = [], []
    real_fwd = fwd_sm90.attention_forward_sm90
    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90", lambda *a, **k: fwd_calls.append(1) or real_fwd(*a, **k))

    @seed(SEED + 7919 * (ci + 1))
    @_examples(TRAIN_CASES_PER_CLASS)
    @given(data=st.data())
    def train(data):
        _train(ci, data.draw(case_specs(ci), label="training case"))
        trained.append(1)

    train()
    assert len(trained) == TRAIN_CASES_PER_CLASS, f"{len(trained)} of {TRAIN_CASES_PER_CLASS} training steps ran"
    assert len(fwd_calls) == len(trained), f"our forward ran in {len(fwd_calls)} of {len(trained)} training steps"
    assert len(sm90_calls) == len(ran) + len(trained), "'auto' left the sm90 backward in a training step"
    print(f"{class_id(CLASSES[ci])}: {len(trained)} training steps, our forward and the sm90 backward")
