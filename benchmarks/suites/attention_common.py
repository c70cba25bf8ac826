"""What the attention suites (attention_bwd, attention_fwd, attention_train) time alike: a case's
implementations in interleaved rounds with the board sampled, and the matmul ceiling row."""

from __future__ import annotations

import functools
import statistics

from ..board import BoardSampler, smi_id, summarize

NAN = float("nan")
ROUNDS = 5  # interleaved timing rounds per case (attention_bwd's docstring)
# each timing's warm-up: that long of the implementation's own calls first, so the board's power
# state is its own. H100 (700 W), d128, medians of 7 rounds: with do_bench's 25 ms the sm90 / FA4
# ratio at 1x16x8192x128 read 1.001x alone and 1.075x among the other implementations (0.966x and
# 0.970x in two suite runs); with 300 ms 1.013x and 1.012x (docs/benchmarks.md)
WARMUP_MS = 300
MATMUL_MNK = (8192, 8192, 8192)


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


def run_cases(specs, import_fa4, run_case) -> list:
    """The rows of ``run_case(spec, fa4, fa4_missing, matmul, board)`` over ``specs``: FA4 imported
    once (``fa4`` None and ``fa4_missing`` its error where it does not), the matmul ceiling
    measured once, the board sampled throughout where nvidia-smi runs."""
    import torch

    try:
        fa4, fa4_missing = import_fa4(), None
    except Exception as e:  # not installed, or its DSL does not load: recorded, not faked
        fa4, fa4_missing = None, err(e)
    try:
        matmul = matmul_ceiling()
    except Exception as e:
        matmul = err(e)
    board = BoardSampler.start(smi_id(torch.cuda.current_device()))  # None without nvidia-smi
    rows = []
    try:
        for spec in specs:
            rows += run_case(spec, fa4, fa4_missing, matmul, board)
            torch.cuda.empty_cache()
    finally:
        if board is not None:
            board.stop()
    return rows


def time_in_rounds(pending, board, row):
    """Time ``pending`` [(impl, fn, info, check, base)] together: ROUNDS rounds of
    ``timing.bench_rounds`` (``fn`` minus ``base`` where base is not None), each timing after
    WARMUP_MS of its own calls; then ``row(impl, ms, ...)`` per entry, with the median, the
    rounds and, given a ``board`` (``BoardSampler``), its power and clock over the timings."""
    from ..timing import bench_ms, bench_rounds

    bench = functools.partial(bench_ms, warmup_ms=WARMUP_MS)
    samples = {}  # id(fn) -> the board's samples over its timings (warm-ups included: the same calls)

    def bench_sampled(fn):
        with board.window() as w:
            ms = bench(fn)
        samples.setdefault(id(fn), []).extend(w.samples)
        return ms

    timings = bench_rounds(
        [(fn, base) for _, fn, _, _, base in pending], ROUNDS, bench=bench if board is None else bench_sampled
    )
    for (impl, fn, info, check, _), (ms, error) in zip(pending, timings):
        if error is None:
            median = statistics.median(ms)
            # a fwd+bwd minus fwd row: the board over the fwd+bwd timings, energy per (fwd+bwd - fwd) call
            board_fields = summarize(samples.get(id(fn), []), median, board.power_field if board else None)
            row(impl, median, ms_rounds=ms, status="ok", check=check, **board_fields, **info)
        else:
            row(impl, status="error", error=err(error), check=check, **info)


def matmul_ceiling():
    """(TFLOP/s, ms) of a bf16 torch.mm of MATMUL_MNK (output preallocated)."""
    import torch

    from ..timing import bench_ms

    m, n, k = MATMUL_MNK
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: torch.mm(a, b, out=c))
    return 2 * m * n * k / ms / 1e9, ms


def matmul_row(row, matmul, flops):
    """The ceiling row: ``matmul`` is matmul_ceiling()'s (TFLOP/s, ms) or the error of measuring
    it; the row's ms is the case's ``flops`` at that rate."""
    if isinstance(matmul, tuple):
        tflops, mm_ms = matmul
        row("matmul", flops / tflops / 1e9, status="ok", matmul_mnk=list(MATMUL_MNK), matmul_ms=mm_ms)
    else:
        row("matmul", status="error", error=matmul, matmul_mnk=list(MATMUL_MNK))
