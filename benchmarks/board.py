"""The board's power draw and SM clock while a timing runs.

On a power-capped board (H100 SXM: 700 W) a kernel's time is its energy per call divided
by the cap: a kernel that takes fewer cycles at fixed clocks can still run no faster.
So the suites record, beside each timing, the board's median power (W) and SM clock (MHz)
over the samples taken while it ran. ``energy_mj`` is power x time.

The samples come from a background ``nvidia-smi --query-gpu=power.draw,clocks.sm -lms``
stream (every ``PERIOD_MS``). NVML through Python bindings is not assumed to be installed.
Without nvidia-smi (CPU machines, CI) ``BoardSampler.start`` returns None and the rows get no
board fields.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import threading
from typing import List, Optional, Tuple

import torch

PERIOD_MS = 20  # nvidia-smi's sampling period (its power reading is itself a short average)
QUERY = "power.draw,clocks.sm"


def parse_sample(line: str) -> Optional[Tuple[float, float]]:
    """(watts, MHz) of one ``--format=csv,noheader,nounits`` line, None for anything else
    (a header, "[N/A]", a blank line)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        watts, mhz = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return watts, mhz


def summarize(samples: List[Tuple[float, float]], ms: Optional[float] = None) -> dict:
    """Board fields of a row: median power and SM clock of ``samples`` and their count; with
    the row's ``ms``, its energy per call (mJ). Empty without samples."""
    if not samples:
        return {}
    watts = statistics.median(s[0] for s in samples)
    out = {"power_w": watts, "sm_clock_mhz": statistics.median(s[1] for s in samples), "board_samples": len(samples)}
    if ms is not None and not math.isnan(ms):
        out["energy_mj"] = watts * ms
    return out


def smi_id(device_index: int) -> str:
    """nvidia-smi's ``--id`` for torch's CUDA device ``device_index``: its UUID, since CUDA's
    device order (fastest first, CUDA_VISIBLE_DEVICES) need not be nvidia-smi's."""
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is None:  # pragma: no cover - torch without the field
        return str(device_index)
    uuid = str(uuid)
    return uuid if uuid.startswith("GPU-") else "GPU-" + uuid


class BoardSampler:
    """A background sampler of one GPU; ``window()`` collects the samples taken while its
    ``with`` block runs."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self._lock = threading.Lock()
        self._sink: Optional[List[Tuple[float, float]]] = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, gpu: str = "0") -> Optional["BoardSampler"]:
        """A running sampler of GPU ``gpu`` (nvidia-smi's ``--id``: an index in nvidia-smi's
        order, a PCI bus id or a UUID; ``smi_id`` names a torch device), or None where
        nvidia-smi is missing."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        cmd = [exe, f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(PERIOD_MS)]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return None
        return cls(proc)

    def _read(self):
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is None:
                continue
            with self._lock:
                if self._sink is not None:
                    self._sink.append(sample)

    def window(self) -> "_Window":
        return _Window(self)

    def stop(self):
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - nvidia-smi ignoring SIGTERM
            self._proc.kill()


class _Window:
    """``with sampler.window() as w: ...``; then ``w.samples`` holds what arrived meanwhile."""

    def __init__(self, sampler: BoardSampler):
        self._sampler = sampler
        self.samples: List[Tuple[float, float]] = []

    def __enter__(self):
        with self._sampler._lock:
            self._sampler._sink = self.samples
        return self

    def __exit__(self, *exc):
        with self._sampler._lock:
            self._sampler._sink = None
        return False
