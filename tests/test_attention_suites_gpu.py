"""GPU (sm_90a): the attention suites' feature cases (softcap, learnable sinks, a loss on the
LSE) set up as attention_train and attention_bwd's autograd cases set them up, at small sizes:
every implementation's results checked against the suites' fp32 reference (itself checked
against the fp64 ``ops.reference`` in tests/test_attention_suites_cpu.py); ours must be right,
FA4 (where it imports) and SDPA keep the status and check the suite would record. Nothing is
timed: each timed call runs once."""

import pytest

from benchmarks.suites import attention_bwd, attention_train
from benchmarks.suites import attention_cases as C

pytestmark = pytest.mark.gpu

CASES = [
    ((2, 4, 384, 128), "bfloat16", True, "softcap30"),
    ((1, 16, 512, 64), "bfloat16", True, "kv2:window128:sink"),
    ((2, 4, 256, 128), "bfloat16", False, "dlse"),
]


@pytest.fixture
def rows(monkeypatch):
    def run_once(pending, board, row):
        for impl, fn, info, check, _ in pending:
            fn()
            row(impl, 1.0, status="ok", check=check, **info)

    monkeypatch.setattr(C, "time_in_rounds", run_once)
    try:
        fa4, missing = C.import_fa4(), None
    except Exception as e:  # noqa: BLE001  FA4 missing or failing to load: its rows say so
        fa4, missing = None, repr(e)

    def run(suite, spec):
        if suite is attention_train:
            got = C.run_case(suite.NAME, suite._step, True, suite.FLOPS_SCALE, spec, fa4, missing, (1.0, 1.0))
        else:
            fa4_bwd = None if fa4 is None else (None, None, *fa4)
            autograd = spec[:3] + ("autograd:" + spec[3],)
            got = attention_bwd._run_autograd_case(autograd, fa4_bwd, missing, (1.0, 1.0))
        return {r["impl"]: r for r in got}

    return run


@pytest.mark.parametrize("suite", [attention_train, attention_bwd], ids=["train", "bwd"])
@pytest.mark.parametrize("spec", CASES, ids=[c[3] for c in CASES])
def test_feature_case_rows(rows, suite, spec):
    got = rows(suite, spec)
    case = C.Case.from_spec(spec)
    names = set(C.checked(case, True))
    ours = ["ours"] if suite is attention_train else ["ours", "ours_sm90"]
    for impl in ours:
        r = got[impl]
        if suite is attention_bwd and impl == "ours" and case.softcap:  # the memory-efficient backward has none
            assert r["status"] == "unavailable" and "softcap" in r["error"]
            continue
        assert r["status"] == "ok", r.get("error")
        assert r["check"]["ok"] and set(r["check"]["max_rel_err"]) == names, r["check"]
    for impl in ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn"):
        assert got[impl]["status"] == "unavailable" and "scaled_dot_product_attention" in got[impl]["error"]
    fa4 = got["fa4"]
    print("fa4:", fa4["status"], fa4.get("check") or fa4.get("error"))
    assert fa4["status"] in ("ok", "unavailable", "error")
    if fa4["status"] == "ok":
        assert set(fa4["check"]["max_rel_err"]) == names
