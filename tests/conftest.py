import os

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
