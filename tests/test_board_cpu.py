"""The benchmarks' board sampler (benchmarks.board): nvidia-smi's lines parsed, samples taken
only inside a window, no sampler where nvidia-smi is missing. A stand-in nvidia-smi (a
script on PATH that prints the lines the real one does) drives the real thread and process."""

from __future__ import annotations

import math
import os
import stat
import sys
import time

import pytest

from benchmarks import board as B


def test_parse_sample():
    assert B.parse_sample("695.12, 1755\n") == (695.12, 1755.0)
    assert B.parse_sample("[N/A], 1755") is None
    assert B.parse_sample("power.draw [W], clocks.current.sm [MHz]") is None
    assert B.parse_sample("") is None
    assert B.parse_sample("1, 2, 3") is None


def test_summarize():
    samples = [(690.0, 1500.0), (700.0, 1600.0), (698.0, 1700.0)]
    got = B.summarize(samples, 2.0)
    assert got == {"power_w": 696.0, "sm_clock_mhz": 1600.0, "board_samples": 3, "energy_mj": 1392.0}  # means
    assert "energy_mj" not in B.summarize(samples, math.nan)
    assert "energy_mj" not in B.summarize(samples)
    assert B.summarize([], 1.0) == {}


def _fake_smi(tmp_path, monkeypatch, line="700.5, 1515", instant="701.25"):
    """An nvidia-smi on PATH. With ``-lms`` it prints a header-like line, then ``line`` every
    5 ms; without, it answers the one-shot power-field probe: ``instant`` for
    power.draw.instant, or (``instant`` None) an unknown field's message and exit status 2,
    as a driver without the field does. Each call's arguments are appended to ``calls``."""
    script = tmp_path / "nvidia-smi"
    calls = tmp_path / "calls"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if '-lms' not in sys.argv:\n"
        f"    if {instant!r} is None:\n"
        "        print('Field \"power.draw.instant\" is not a valid field to query.')\n"
        "        sys.exit(2)\n"
        f"    print({instant!r})\n"
        "    sys.exit(0)\n"
        "print('[N/A], [N/A]', flush=True)\n"
        "while True:\n"
        f"    print({line!r}, flush=True)\n"
        "    time.sleep(0.005)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    return calls


@pytest.mark.parametrize(
    "instant,field", [("701.25", "power.draw.instant"), ("[N/A]", "power.draw"), (None, "power.draw")]
)
def test_sampler_prefers_the_instantaneous_power(tmp_path, monkeypatch, instant, field):
    """power.draw is a one-second average on Ampere and newer: the stream asks for
    power.draw.instant where the probe gets a number for it, else for power.draw."""
    calls = _fake_smi(tmp_path, monkeypatch, instant=instant)
    sampler = B.BoardSampler.start("GPU-x")
    assert sampler is not None
    try:
        assert sampler.power_field == field
        deadline = time.time() + 10
        while calls.read_text().count("\n") < 2 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
    probe, stream = calls.read_text().splitlines()
    assert "--query-gpu=power.draw.instant" in probe.split() and "-lms" not in probe.split()
    assert f"--query-gpu={field},clocks.sm" in stream.split() and "--id=GPU-x" in stream.split()
    assert B.summarize([(1.0, 2.0)], 1.0, sampler.power_field)["power_field"] == field


def test_sampler_collects_inside_windows_only(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch)
    sampler = B.BoardSampler.start("0")
    assert sampler is not None
    try:
        time.sleep(0.2)  # lines before any window are dropped
        with sampler.window() as w:
            deadline = time.time() + 10
            while len(w.samples) < 5 and time.time() < deadline:
                time.sleep(0.01)
        n = len(w.samples)
        assert n >= 5 and set(w.samples) == {(700.5, 1515.0)}
        time.sleep(0.1)
        assert len(w.samples) == n  # closed: nothing more arrives in it
        with sampler.window() as w2:
            pass
        assert all(s == (700.5, 1515.0) for s in w2.samples)
    finally:
        sampler.stop()
    assert sampler._proc.poll() is not None


def test_no_sampler_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    assert B.BoardSampler.start("0") is None


def test_results_table_shows_the_board_where_recorded():
    from benchmarks.__main__ import _table

    rows = [
        dict(suite="attention_bwd", case="c", impl="ours", ms=1.0, tflops=100.0, power_w=695.4, sm_clock_mhz=1500.0),
        dict(suite="attention_bwd", case="c", impl="fa4", ms=1.1, tflops=90.0),
    ]
    head, ours, fa4 = _table(rows).splitlines()
    assert head.split()[-2:] == ["W", "MHz"] and ours.split()[-2:] == ["695", "1500"]
    assert fa4.split()[-1] == "1.10"  # no board fields: blank columns
    assert "W" not in _table([dict(suite="s", case="c", impl="ours", ms=1.0, gbps=3.0)]).splitlines()[0].split()
