"""benchmarks.timing.time_case, the memory-bound suites' timer, without a GPU: its rows come
from interleaved rounds (every implementation and the copy once a round, the order rotated),
the median round is the row's time, and an implementation failing while timed fails the case."""

import pytest

from benchmarks import timing

from .helpers import named_call as _fn


def _bench(calls, clock):
    def bench(f):
        calls.append(f.name)
        f()
        return clock[f.name][sum(c == f.name for c in calls) - 1]

    return bench


def test_rows_are_median_rounds_of_interleaved_timings(monkeypatch):
    monkeypatch.setattr(timing, "_copy_fn", lambda nbytes: _fn("copy"))
    calls = []
    clock = {"ours": [2.0, 9.0, 1.0], "peer": [4.0, 4.0, 5.0], "copy": [1.0, 1.0, 1.0]}
    impls = {"ours": _fn("ours"), "peer": (_fn("peer"), 2000)}
    rows = timing.time_case("s", "c", impls, 1000, rounds=3, bench=_bench(calls, clock))
    assert calls == ["ours", "peer", "copy", "peer", "copy", "ours", "copy", "ours", "peer"]
    by = {r["impl"]: r for r in rows}
    assert [r["impl"] for r in rows] == ["ours", "peer", "copy"]
    assert by["ours"]["ms"] == 2.0 and by["ours"]["ms_rounds"] == [2.0, 9.0, 1.0]  # one slow round is not the row
    assert by["peer"]["ms"] == 4.0 and by["peer"]["gbps"] == 2000 / 4.0 / 1e6
    assert by["copy"]["gbps"] == 1000 / 1.0 / 1e6


def test_an_implementation_failing_while_timed_fails_the_case(monkeypatch):
    monkeypatch.setattr(timing, "_copy_fn", lambda nbytes: _fn("copy"))
    clock = {"ours": [1.0] * 3, "copy": [1.0] * 3}
    with pytest.raises(RuntimeError, match="bad failed while timed") as err:
        timing.time_case("s", "c", {"ours": _fn("ours"), "bad": _fn("bad")}, 8, rounds=3, bench=_bench([], clock))
    assert str(err.value.__cause__) == "boom"
