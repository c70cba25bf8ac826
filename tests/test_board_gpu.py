"""GPU: the benchmarks' board sampler reads this board (nvidia-smi by the device's UUID)
while work runs: a plausible power draw and SM clock."""

import time

import pytest
import torch

from benchmarks import board as B

pytestmark = pytest.mark.gpu


def test_sampler_reads_the_board_under_load():
    sampler = B.BoardSampler.start(B.smi_id(torch.cuda.current_device()))
    assert sampler is not None, "nvidia-smi not found beside the GPU"
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    try:
        with sampler.window() as w:
            t0 = time.time()
            while time.time() - t0 < 0.5 or (len(w.samples) < 3 and time.time() - t0 < 10):
                for _ in range(20):
                    a @ a
                torch.cuda.synchronize()
    finally:
        sampler.stop()
    assert len(w.samples) >= 3
    fields = B.summarize(w.samples, 1.0)
    assert 20 < fields["power_w"] < 2000 and 100 < fields["sm_clock_mhz"] < 4000
    assert fields["energy_mj"] == fields["power_w"]
