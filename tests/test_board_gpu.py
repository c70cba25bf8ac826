"""GPU: the benchmarks' board sampler reads this board (nvidia-smi by the device's UUID)
while work runs: a plausible power draw and SM clock."""

import time

import pytest
import torch

from benchmarks import board as B

pytestmark = pytest.mark.gpu


def _load(sampler, a, seconds, min_samples=0):
    """Matmuls for ``seconds`` (longer, up to 10 s, until ``min_samples`` arrived); the
    samples of a window over them."""
    with sampler.window() as w:
        t0 = time.time()
        while time.time() - t0 < seconds or (len(w.samples) < min_samples and time.time() - t0 < 10):
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
    return w.samples


def test_sampler_reads_the_board_under_load():
    sampler = B.BoardSampler.start(B.smi_id(torch.cuda.current_device()))
    assert sampler is not None, "nvidia-smi not found beside the GPU"
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    try:
        samples = _load(sampler, a, 0.5, min_samples=3)
    finally:
        sampler.stop()
    assert len(samples) >= 3
    fields = B.summarize(samples, 1.0)
    assert 20 < fields["power_w"] < 2000 and 100 < fields["sm_clock_mhz"] < 4000
    assert fields["energy_mj"] == fields["power_w"]


def test_power_follows_the_load_from_its_start():
    """A window opened as work starts on an idle board reads the work's power, not the idle
    time before it (power.draw, a one-second average on Ampere and newer, reads the mix:
    the sampler takes power.draw.instant where the driver has it)."""
    sampler = B.BoardSampler.start(B.smi_id(torch.cuda.current_device()))
    assert sampler is not None, "nvidia-smi not found beside the GPU"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    try:
        torch.cuda.synchronize()
        time.sleep(1.5)  # idle
        first = _load(sampler, a, 0.4)
        _load(sampler, a, 1.5)
        steady = _load(sampler, a, 0.4)
    finally:
        sampler.stop()
    assert len(first) >= 5 and len(steady) >= 5
    p_first, p_steady = B.summarize(first)["power_w"], B.summarize(steady)["power_w"]
    assert p_first >= 0.8 * p_steady, (sampler.power_field, p_first, p_steady)
