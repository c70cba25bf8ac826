"""CPU: the attention_bwd benchmark suite: its compile-only run covers the Hopper-native
backward's configurations, its ratios, interleaved timing rounds, and the sm90 row's
features."""

import math

import cutlass
import pytest

from cute_kernels.attention_sm90 import backward_config as bwd_config
from ops import attention_sm90 as S
from ops import mem_eff_attention as M


def test_suite_compile_only_covers_ours_sm90(monkeypatch):
    """``python -m benchmarks`` without a GPU compiles the sm90 configurations of the
    suite's cases too, features included (sm_90a only), besides the memory-efficient ones."""
    from benchmarks.suites import attention_bwd
    from ops import attention_fwd_sm90 as F

    seen = {"mem_eff": [], "sm90": [], "fwd": []}
    monkeypatch.setattr(M, "compiled", lambda config: seen["mem_eff"].append(config))
    monkeypatch.setattr(S, "compiled", lambda config: seen["sm90"].append(config))
    monkeypatch.setattr(F, "compiled", lambda config: seen["fwd"].append(config))
    assert attention_bwd.compile_only("sm_90a") == sum(map(len, seen.values()))
    bf16 = cutlass.BFloat16
    # the one d64 case without a mask (8x16x1024x64) has 8 steps a tile: it carries dQ where 8
    # steps do; d64's persistent CTAs zero the accumulator themselves (without a mask: 8 key blocks
    # a head, 132 CTAs; causal: from the counter of zeroing jobs); d128 without a mask (a CTA per tile in launch order)
    # overlaps convert_dq up to 32 key blocks a head (not 1x16x8192x128's 64); d128's tiles without a bias or dropout
    # store each query block's first dQ (tiles.store_first; Sq == Sk) and run the partial last query block on
    # narrower products, per Sq (2048 = 25 x 80 + 48, 4096 = 51 x 80 + 16, 8192 = 102 x 80 + 32)
    carry, first = (
        bwd_config.CARRY_DQ_MAX_STEPS >= 8,
        S.STORE_FIRST and bwd_config.attention_sm90_tiles(128).store_first,
    )
    tail = bwd_config.attention_sm90_tiles(128).tail_rows if S.TAIL_BLOCK else (lambda rows: 0)
    zero_ahead = lambda m: S.ZERO_AHEAD and (m == 0 or S.ZERO_AHEAD_CAUSAL)  # noqa: E731
    plain = {
        S.Sm90Config(bf16, 64, 64, m, "sm_90a", carry_dq=carry and m == 0, zero_ahead=zero_ahead(m)) for m in (0, 1)
    }
    plain |= {
        S.Sm90Config(bf16, 128, 128, m, "sm_90a", dq_ready=m == 0 and s <= 4096, store_first=first, tail_m=tail(s))
        for m, s in ((0, 2048), (0, 4096), (0, 8192), (1, 4096))
    }
    features = {
        S.Sm90Config(bf16, 128, 128, 0, "sm_90a", bias=bias, grad_bias=grad_bias, dropout=dropout, dq_ready=True)
        for bias, grad_bias, dropout in ((True, False, False), (True, True, False), (False, False, True))
    }
    # the autograd cases: the softcap, and gpt-oss's d64 with 8 query heads a key head and a window
    # (its sink keys alike; the twins and dLSE are plain cases' keys)
    autograd = {
        S.Sm90Config(bf16, 128, 128, 1, "sm_90a", store_first=first, tail_m=tail(4096), softcap=True),
        S.Sm90Config(bf16, 64, 64, 1, "sm_90a", window=True),
    }
    assert set(seen["sm90"]) == plain | features | autograd
    assert {(k.head_dim, k.softcap, k.sink) for k in seen["fwd"]} >= {(128, True, False), (64, False, True)}
    seen["sm90"].clear()
    attention_bwd.compile_only("sm_80")
    assert seen["sm90"] == []


def test_autograd_cases():
    """``autograd[:features]`` cases: the attention_cases spec after the token; other features
    are attention_bwd's own (the softcap alone is not one of them)."""
    from benchmarks.arch import sm90
    from benchmarks.suites import attention_bwd as suite

    assert suite.autograd_spec(((2, 4, 64, 64), "bfloat16", True, "autograd")) == ((2, 4, 64, 64), "bfloat16", True)
    spec = ((2, 4, 64, 64), "bfloat16", True, "autograd:kv2:sink")
    assert suite.autograd_spec(spec) == ((2, 4, 64, 64), "bfloat16", True, "kv2:sink")
    assert suite.autograd_spec(((2, 4, 64, 64), "bfloat16", True, "dropout")) is None
    with pytest.raises(ValueError, match="autograd"):
        suite._unpack(((2, 4, 64, 64), "bfloat16", True, "softcap30"))
    with pytest.raises(ValueError, match="unknown benchmark case feature"):
        S.benchmark_configurations([((2, 4, 64, 64), "bfloat16", True, "softcap")], "sm_90a")
    # each feature case beside its twin, both timed through autograd
    features = [spec[3] for spec in sm90.ATTENTION_BWD["full"] if len(spec) > 3 and "autograd" in spec[3]]
    assert features == ["autograd", "autograd:softcap30", "autograd:kv8:window128", "autograd:kv8:window128:sink"] + [
        "autograd",
        "autograd:dlse",
    ]


def test_suite_ratios():
    from benchmarks.suites import attention_bwd as suite

    nan = float("nan")
    tf = {
        "ours": 200.0,
        "ours_sm90": 400.0,
        "sdpa_efficient": 100.0,
        "sdpa_flash": 250.0,
        "sdpa_cudnn": 500.0,
        "fa4": nan,
        "matmul": 800.0,
    }
    rows = [{"impl": impl, "tflops": t} for impl, t in tf.items()]
    suite._add_ratios(rows)
    by = {r["impl"]: r for r in rows}
    assert "ours_over_peer" not in by["ours"] and by["ours_sm90"]["ours_over_peer"] == 0.5
    assert by["sdpa_efficient"]["ours_over_peer"] == 2.0 and "sm90_over_peer" not in by["sdpa_efficient"]
    assert by["sdpa_flash"]["sm90_over_peer"] == 1.6 and by["sdpa_cudnn"]["sm90_over_peer"] == 0.8
    assert math.isnan(by["fa4"]["sm90_over_peer"]) and math.isnan(by["fa4"]["ours_over_peer"])  # not timed
    assert {r["impl"] for r in rows if "sm90_over_peer" in r} == set(suite.PEERS)
    # a case without the sm90 row (or with it untimed): no ratio, or NaN
    rows = [{"impl": "ours", "tflops": 1.0}, {"impl": "fa4", "tflops": 2.0}]
    suite._add_ratios(rows)
    assert "sm90_over_peer" not in rows[1] and rows[1]["ours_over_peer"] == 0.5


def test_suite_times_in_interleaved_rounds():
    """Every queued implementation is timed once a round, in an order rotated from round to
    round; fwd's time is subtracted; a failing one drops out with its error, the rest go on."""
    from benchmarks.timing import bench_rounds

    from .helpers import named_call as fn

    calls = []
    clock = {"a": [3.0, 1.0, 2.0], "b": [5.0, 5.0, 6.0], "fwd": [1.0, 1.0, 1.0]}

    def bench(f):
        calls.append(f.name)
        if f.name == "bad":
            f()
        return clock[f.name][sum(c == f.name for c in calls) - 1]

    got = bench_rounds([(fn("a"), None), (fn("b"), fn("fwd")), (fn("bad"), None)], 3, bench)
    assert calls == ["a", "b", "fwd", "bad", "b", "fwd", "a", "a", "b", "fwd"]
    assert got[0] == ([3.0, 1.0, 2.0], None)
    assert got[1] == ([4.0, 4.0, 5.0], None)
    assert got[2][0] == [] and isinstance(got[2][1], RuntimeError) and str(got[2][1]) == "boom"


@pytest.mark.parametrize("feature", ["bias", "bias_grad", "dropout"])
def test_suite_sm90_row_runs_features(monkeypatch, feature):
    """The sm90 row passes the case's feature and bias on, with its backend pinned."""
    from benchmarks.suites import attention_bwd as suite

    calls = []
    monkeypatch.setattr(suite, "_setup_ours", lambda *a, **kw: calls.append((a, kw)))
    suite._setup_ours_sm90("q", "k", "v", "do", False, feature, "bias")
    assert calls == [(("q", "k", "v", "do", False), dict(feature=feature, bias="bias", backend="sm90"))]
