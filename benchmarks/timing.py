"""Timing on the device: medians of CUDA-event timings, L2 flushed between runs."""

from __future__ import annotations

import statistics

import torch


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn()`` (triton.testing.do_bench: warm-up, L2 flush, events)."""
    try:
        from triton.testing import do_bench
    except ImportError:  # pragma: no cover - triton ships with CUDA torch
        return _bench_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_rounds(timed, rounds: int, bench=bench_ms) -> list:
    """[(ms per round, exception or None)] of each ``(fn, base)`` in ``timed``: ``rounds`` rounds,
    each timing every fn once with ``bench`` (minus ``base``'s time where it is not None) in an
    order rotated by one from round to round, so that the board's drift (clocks follow its power
    state) falls on all of them alike. A fn that raises drops out with its exception; the
    others go on."""
    n = len(timed)
    times = [[] for _ in range(n)]
    errors = [None] * n
    for r in range(rounds):
        for i in [(r + j) % n for j in range(n)]:
            if errors[i] is not None:
                continue
            fn, base = timed[i]
            try:
                ms = bench(fn)
                if base is not None:
                    ms -= bench(base)
                times[i].append(ms)
            except Exception as e:
                errors[i] = e
    return list(zip(times, errors))


def _bench_events(fn, warmup_ms, rep_ms):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spent = 0.0
    while spent < rep_ms or len(times) < 5:
        flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        spent += times[-1]
    times.sort()
    return times[len(times) // 2]


def copy_ms(nbytes: int) -> float:
    """Median time of a device-to-device copy moving ``nbytes`` in all (half read, half written)."""
    return bench_ms(_copy_fn(nbytes))


def copy_ceiling_gbps(nbytes: int = 2 << 30) -> float:
    """GB/s (read + write) of a large device-to-device copy: the memory-bound ceiling."""
    return nbytes / copy_ms(nbytes) / 1e6


ROUNDS = 5  # interleaved rounds a case (time_case)


def time_case(suite: str, case: str, impls: dict, copy_bytes: int, rounds: int = ROUNDS, bench=bench_ms) -> list:
    """Result rows for one case: the impls and a device copy of ``copy_bytes``, timed in
    ``rounds`` interleaved rounds (``bench_rounds``: every one once a round, the order rotated),
    so that a burst of host or board noise falls on all of them, not on one peer's whole timing.
    A row's ``ms`` is its median round; ``ms_rounds`` keeps them all.

    ``impls`` maps impl name -> ``fn`` or ``(fn, bytes)`` (bytes default ``copy_bytes``);
    GB/s is bytes moved per second. An impl that raises while timed raises here.
    """
    specs = {impl: spec if isinstance(spec, tuple) else (spec, copy_bytes) for impl, spec in impls.items()}
    specs["copy"] = (_copy_fn(copy_bytes), copy_bytes)
    timed = bench_rounds([(fn, None) for fn, _ in specs.values()], rounds, bench)
    rows = []
    for (impl, (_, nbytes)), (times, error) in zip(specs.items(), timed):
        if error is not None:
            raise RuntimeError(f"{suite} {case}: {impl} failed while timed") from error
        ms = statistics.median(times)
        rows.append(
            {"suite": suite, "case": case, "impl": impl, "ms": ms, "gbps": nbytes / ms / 1e6, "ms_rounds": times}
        )
    return rows


def _copy_fn(nbytes: int):
    """A device-to-device copy moving ``nbytes`` in all (half read, half written)."""
    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)
