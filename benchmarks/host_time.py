"""python -m benchmarks.host_time: how much of a short call is host time.

For each case it runs the public op (forward alone under no_grad, and forward + backward) and
prints three figures a call: the wall time of back-to-back calls, the host time of the calls
alone (the queue drained every 10 calls, so it never fills), and the GPU time of the kernels
the calls launched (torch.profiler). Where host time is near or above kernel time, the op's
Python (validation, dispatch, allocation) bounds the call, not its kernels.
``--profile`` adds a cProfile of the forward + backward of the first case (top 30 by
cumulative time). Cases: attention (ops.memory_efficient_attention) and LayerNorm
(ops.layer_norm), bf16.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import ops

ATTENTION_CASES = [(8, 16, 1024, 64, False), (4, 16, 2048, 128, False), (2, 16, 4096, 64, True)]
NORM_CASES = [(32768, 1024), (16384, 4096)]


def _attention(b, h, s, d, causal):
    """(forward alone, forward + backward) of one attention case."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            ops.memory_efficient_attention(q, k, v, causal=causal)

    def train():
        for t in (q, k, v):
            t.grad = None
        ops.memory_efficient_attention(q, k, v, causal=causal).backward(dout)

    return forward, train


def _layer_norm(rows, n):
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w, b = (torch.randn(n, device="cuda", requires_grad=True) for _ in range(2))
    dy = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            ops.layer_norm(x, (n,), w, b)

    def train():
        for t in (x, w, b):
            t.grad = None
        ops.layer_norm(x, (n,), w, b).backward(dy)

    return forward, train


def wall_ms(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def host_ms(fn, calls: int = 50) -> float:
    total = 0.0
    for i in range(calls):
        if i % 10 == 0:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total / calls * 1e3


def kernel_ms(fn, calls: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__.partition("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="a cProfile of the first case's forward + backward")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    print(f"{'case':32} {'call':8} {'wall ms':>8} {'host ms':>8} {'kernels ms':>10}")
    cases = [(f"attention {'x'.join(map(str, c[:4]))}{' causal' * c[4]}", _attention(*c)) for c in ATTENTION_CASES]
    cases += [(f"layer_norm {r}x{n}", _layer_norm(r, n)) for r, n in NORM_CASES]
    for name, fns in cases:
        for call, fn in zip(("forward", "train"), fns):
            print(f"{name:32} {call:8} {wall_ms(fn):8.3f} {host_ms(fn):8.3f} {kernel_ms(fn):10.3f}", flush=True)
    if args.profile:
        _, train = cases[0][1]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            train()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
