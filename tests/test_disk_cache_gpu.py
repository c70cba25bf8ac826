"""The disk cache on the GPU: a second process loads what the first compiled, and computes the same."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

PROGRAM = """
import json, logging, sys, torch, ops
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
gen = torch.Generator("cuda").manual_seed(0)
dy, x = (torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen)
mask = torch.rand(256, 1024, device="cuda", generator=gen) > 0.1
dx, dbias = ops.dropout_bias_backward(dy, mask, 0.1, x, bias, "gelu")
print(json.dumps([dx.float().sum().item(), dbias.float().sum().item()]))
"""


def run(folder):
    env = dict(os.environ, CUTE_KERNELS_CACHE="1", CUTE_KERNELS_CACHE_DIR=str(folder))
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_second_process_loads_and_agrees(tmp_path):
    first, log1 = run(tmp_path)
    assert "compiling dropout_bias_bwd" in log1
    assert list(tmp_path.rglob("*.o")), "nothing was stored"
    second, log2 = run(tmp_path)
    assert "compiling" not in log2, "the second process compiled again"
    assert first == second
    for entry in tmp_path.rglob("*.o"):  # a damaged entry is compiled again, no failure
        entry.write_bytes(b"\0" * 64)
    third, log3 = run(tmp_path)
    assert third == first and "does not load" in log3 and "compiling dropout_bias_bwd" in log3
