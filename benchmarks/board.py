"""The board's power draw and SM clock while a timing runs.

On a power-capped board (H100 SXM: 700 W) a kernel's time is its energy per call divided
by the cap: a kernel that takes fewer cycles at fixed clocks can still run no faster.
So the suites record, beside each timing, the board's mean power (W) and SM clock (MHz)
over the samples taken while it ran (evenly spaced samples: their mean is the window's
average). ``energy_mj`` is power x time.

The samples come from a background ``nvidia-smi --query-gpu=<power>,clocks.sm -lms`` stream
(every ``PERIOD_MS``). The power field is ``power.draw.instant`` where the driver has it: on
Ampere and newer boards ``power.draw`` is a one-second average, so a timing of a few hundred
milliseconds would read mostly the implementation timed before it (on the H100 the suite's
rows read the previous implementation's ~670 W for a kernel running at the 700 W cap).
Older drivers fall back to ``power.draw``; the rows name the field (``power_field``).
NVML through Python bindings is not assumed to be installed. Without nvidia-smi (CPU
machines, CI) ``BoardSampler.start`` returns None and the rows get no board fields.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import threading
from typing import List, Optional, Tuple

import torch

PERIOD_MS = 20  # nvidia-smi's sampling period
# power fields, preferred first: the instantaneous reading, then the one-second average
POWER_FIELDS = ("power.draw.instant", "power.draw")
PROBE_TIMEOUT_S = 10


def power_field(exe: str, gpu: str) -> str:
    """The first of ``POWER_FIELDS`` that this nvidia-smi answers with a number for GPU
    ``gpu`` (the last one where none does)."""
    for field in POWER_FIELDS[:-1]:
        cmd = [exe, f"--id={gpu}", f"--query-gpu={field}", "--format=csv,noheader,nounits"]
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            continue
        try:
            float(got.stdout.strip())
        except ValueError:  # "[N/A]", or an unknown field's message
            continue
        if got.returncode == 0:
            return field
    return POWER_FIELDS[-1]


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


def summarize(samples: List[Tuple[float, float]], ms: Optional[float] = None, field: Optional[str] = None) -> dict:
    """Board fields of a row: mean power and SM clock of ``samples`` (the instantaneous power
    swings around the cap, which holds its average) and their count; with the row's ``ms``,
    its energy per call (mJ); with ``field``, the power field sampled. Empty without samples."""
    if not samples:
        return {}
    watts = statistics.fmean(s[0] for s in samples)
    out = {"power_w": watts, "sm_clock_mhz": statistics.fmean(s[1] for s in samples), "board_samples": len(samples)}
    if field is not None:
        out["power_field"] = field
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

    def __init__(self, proc: subprocess.Popen, field: str = POWER_FIELDS[-1]):
        self._proc = proc
        self.power_field = field  # the nvidia-smi power field sampled
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
        field = power_field(exe, gpu)
        cmd = [
            exe,
            f"--id={gpu}",
            f"--query-gpu={field},clocks.sm",
            "--format=csv,noheader,nounits",
            "-lms",
            str(PERIOD_MS),
        ]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return None
        return cls(proc, field)

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
