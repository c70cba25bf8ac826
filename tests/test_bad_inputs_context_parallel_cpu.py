"""Bad inputs to ``context_parallel_attention`` are refused with an error naming the argument,
before any collective (tests/test_bad_inputs_cpu.py describes the tables and the guard)."""

import pytest

from .bad_inputs_common import F64, C, Case, check_refused, cpa, cpu, fc

CONTEXT_PARALLEL_ATTENTION = [
    C("context_parallel_attention", "query-3d", lambda: cpa(query=fc(64, 4, 64)), ValueError, "query", "4-D"),
    C(
        "context_parallel_attention",
        "odd-local-seqlen",
        lambda: cpa(query=fc(1, 63, 4, 64), key=fc(1, 63, 2, 64), value=fc(1, 63, 2, 32)),
        ValueError,
        "query",
        "two chunks",
    ),
    C("context_parallel_attention", "key-heads", lambda: cpa(key=fc(1, 64, 3, 64)), ValueError, "key", "Hk dividing"),
    C(
        "context_parallel_attention",
        "key-local-seqlen",
        lambda: cpa(key=fc(1, 32, 2, 64), value=fc(1, 32, 2, 32)),
        ValueError,
        "key",
        "local seqlen",
    ),
    C("context_parallel_attention", "value-on-cpu", lambda: cpa(value=cpu(1, 64, 2, 32)), ValueError, "value", "agree"),
    C(
        "context_parallel_attention",
        "query-float64",
        lambda: cpa(
            query=fc(1, 64, 4, 64, dtype=F64), key=fc(1, 64, 2, 64, dtype=F64), value=fc(1, 64, 2, 32, dtype=F64)
        ),
        TypeError,
        "query",
        "dtype",
    ),
    C(
        "context_parallel_attention",
        "window-without-causal",
        lambda: cpa(causal=False, window_size=8),
        ValueError,
        "window_size",
        "needs causal",
    ),
    C("context_parallel_attention", "scale-nan", lambda: cpa(scale=float("nan")), TypeError, "scale", "finite"),
    C("context_parallel_attention", "backend", lambda: cpa(backend="fast"), ValueError, "backend", "'auto'"),
    C("context_parallel_attention", "return_lse-str", lambda: cpa(return_lse="yes"), TypeError, "return_lse", "bool"),
    C(
        "context_parallel_attention",
        "attention-fn",
        lambda: cpa(attention=len),
        TypeError,
        "attention",
        "ChunkAttention",
    ),
]


@pytest.mark.parametrize("case", CONTEXT_PARALLEL_ATTENTION)
def test_bad_input_is_refused_before_launch(case: Case, monkeypatch):
    check_refused(case, monkeypatch)
