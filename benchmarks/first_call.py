"""A configuration's first call in a new process: compiling it, or loading it from the disk cache.

``python -m benchmarks.first_call`` runs each case in fresh processes: one with the cache
off (it compiles), then two sharing an empty cache folder (the first compiles and stores,
the second loads), and prints the first call's seconds (CUDA initialised and the inputs
made beforehand; the call synchronised).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CASES = ("attention_sm90_d128", "mem_eff_attention_d64", "layer_norm_bwd")


def _call(case: str):
    """One backward of ``case``; returns a function that runs it (inputs made up front)."""
    import torch

    import ops

    dev, bf16 = "cuda", torch.bfloat16
    if case == "layer_norm_bwd":
        x, dy = (torch.randn(4096, 4096, device=dev, dtype=bf16) for _ in range(2))
        w, b = (torch.randn(4096, device=dev, dtype=bf16) for _ in range(2))
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [4096], w, b, 1e-5)
        return lambda: ops.layer_norm_backward(dy, x, w, mean, rstd, b)
    d, backend = (128, "sm90") if case == "attention_sm90_d128" else (64, "mem_eff")
    q, k, v, do = (torch.randn(2, 1024, 8, d, device=dev, dtype=bf16) for _ in range(4))
    out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, 1, True
    )
    return lambda: ops.efficient_attention_backward(
        do, q, k, v, None, out, None, None, None, None, lse, 0.0, None, None, 1, False, backend=backend
    )


def child(case: str) -> dict:
    import torch

    fn = _call(case)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return {"case": case, "first_call_s": time.perf_counter() - start}


def run_fresh(case: str, cache_dir) -> float:
    env = dict(os.environ, CUTE_KERNELS_CACHE="0" if cache_dir is None else "1")
    if cache_dir is not None:
        env["CUTE_KERNELS_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, "-m", "benchmarks.first_call", "--child", case]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["first_call_s"]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    print(f"{'case':24} {'no cache':>10} {'cache: 1st':>11} {'cache: 2nd':>11}")
    for case in CASES:
        off = run_fresh(case, None)
        with tempfile.TemporaryDirectory() as folder:
            first, second = run_fresh(case, folder), run_fresh(case, folder)
        print(f"{case:24} {off:9.2f}s {first:10.2f}s {second:10.3f}s")


if __name__ == "__main__":
    main()
