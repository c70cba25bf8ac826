import json
import os
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# hermetic tests: a kernel compiled under a test's monkeypatched tiling must not reach
# another process through the disk cache (its own tests turn it on in a temporary folder)
os.environ.setdefault("CUTE_KERNELS_CACHE", "0")

HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """With CUTE_KERNELS_TILE_REPORT=FILE, append the attention checks' tile errors (ours and
    torch's, the largest per gradient / backend / dtype) to FILE as JSON lines: the runs that
    calibrate the bounds in tests/test_mem_eff_attention_gpu.py."""
    path = os.environ.get("CUTE_KERNELS_TILE_REPORT")
    module = sys.modules.get("tests.test_mem_eff_attention_gpu")
    if not path or module is None:
        return
    worst: dict = {}
    for name, dtype, ours, theirs in module.TILE_ERRORS:
        backend = "auto" if "auto" in name else ("mem_eff" if "mem_eff" in name else "-")
        key = f"{name.split(' ')[0]} {backend} {str(dtype)[6:]}"
        w = worst.setdefault(key, [0.0, 0.0, 0])
        w[0], w[1], w[2] = max(w[0], ours), max(w[1], theirs or 0.0), w[2] + 1
    with open(path, "a") as f:
        f.write(json.dumps(worst) + "\n")
