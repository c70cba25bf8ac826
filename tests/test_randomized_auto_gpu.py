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

``CUTE_KERNELS_RANDOM_SEED`` draws other mixes and cases (the default below otherwise).
"""

import itertools
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

from cute_kernels.attention_sm90 import backward_config as sm90_config
from ops import _compile as cc
from ops import attention_sm90 as S

from .test_mem_eff_attention_features_gpu import run_feature_case

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
SEED = int(os.environ.get("CUTE_KERNELS_RANDOM_SEED", 20261127))
NUM_CLASSES = 16
CASES_PER_CLASS = 20
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
    @settings(
        max_examples=CASES_PER_CLASS,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(data=st.data())
    def run(data):
        _run(ci, data.draw(case_specs(ci), label="case"))
        ran.append(1)

    run()
    assert len(ran) == CASES_PER_CLASS, f"{len(ran)} of {CASES_PER_CLASS} cases ran"
    assert len(sm90_calls) == len(ran), f"'auto' took the sm90 kernel in {len(sm90_calls)} of {len(ran)} cases"
    print(f"\n{class_id(CLASSES[ci])}: {len(ran)} cases through backend='auto', all on the sm90 kernel")
