"""Without a GPU: compile the suites' kernel configurations with fake tensors instead.

Each suite lists its configurations (``compile_configs(arch, quick)``) as ``Config``s: a
compile cache of ``ops`` and the key it is called with. Listing is cheap (no compile), so
the selection is testable on its own and configurations are deduplicated before any compile.
Every suite is compiled for the DSL targets of the boards it runs on (``ARCHES``); a kernel
that does not run on an arch lists nothing for it (the Hopper attention backward: sm_90a only).
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence

ARCHES = ("sm_80", "sm_90a")  # A100; H100 / H200


@dataclass(frozen=True)
class Config:
    """One compile: ``cache`` names a compile cache ("ops.norm:compiled"), ``key`` its arguments
    (the attention backwards' caches take one, a frozen dataclass: ``(Sm90Config(...),)``)."""

    cache: str
    key: tuple

    def compile(self):
        # the cache is looked up at call time, so tests can stand in for it
        module, name = self.cache.split(":")
        return getattr(importlib.import_module(module), name)(*self.key)


def widest_vec(n: int, bits: int, max_bits: int = 128) -> int:
    """The vector (elements) an op takes for contiguous, aligned rows of ``n`` elements of
    ``bits``: the widest of at most ``max_bits`` that divides the row, as
    ops._compile.max_vector_elems finds it for freshly allocated tensors."""
    v = max(1, max_bits // bits)
    while n % v:
        v //= 2
    return v


def suite_configs(suite: str, quick: bool, arches: Sequence[str] = ARCHES) -> Dict[str, List[Config]]:
    """arch -> the configurations of ``suite`` for it (each configuration listed once)."""
    mod = importlib.import_module(f"benchmarks.suites.{suite}")
    seen = set()
    out = {}
    for arch in arches:
        out[arch] = [c for c in dict.fromkeys(mod.compile_configs(arch, quick)) if c not in seen]
        seen.update(out[arch])
    return out


def compile_all(configs: Iterable[Config]) -> int:
    """Compile each configuration; the count compiled."""
    n = 0
    for c in configs:
        c.compile()
        n += 1
    return n


class Progress:
    """A suite's compile progress on ``stream``: one line updated in place on a terminal,
    else a line every ``every`` configurations (logs and CI keep each line)."""

    def __init__(self, label: str, total: int, stream=None, every: int = 0):
        self.label, self.total = label, total
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every or max(1, math.ceil(total / 10))
        self.start = time.monotonic()

    def _write(self, text: str):
        self.stream.write(text)
        self.stream.flush()

    def begin(self, detail: str = ""):
        head = f"{self.label}: compiling {self.total} configurations{detail}"
        self._write(f"{head} ... 0/{self.total}" if self.tty else head + "\n")
        self._head = head

    def step(self, done: int):
        if self.tty:
            self._write(f"\r{self._head} ... {done}/{self.total}")
        elif done % self.every == 0 and done < self.total:
            self._write(f"  {self.label}: {done}/{self.total} ({time.monotonic() - self.start:.0f} s)\n")

    def end(self, done: int):
        """The closing line (also after a failed compile: ``done`` short of the total)."""
        seconds = time.monotonic() - self.start
        if self.tty:
            self._write(f"\r{self._head} ... {done}/{self.total} in {seconds:.1f} s\n")
        else:
            self._write(f"  {self.label}: {done}/{self.total} compiled in {seconds:.1f} s\n")


def compile_suites(
    suites: Sequence[str], quick: bool, stream=None, arches: Sequence[str] = ARCHES, every: int = 0
) -> int:
    """Compile every suite's configurations with a progress line each; the count compiled."""
    total = 0
    for name in suites:
        per_arch = suite_configs(name, quick, arches)
        configs = [c for arch in arches for c in per_arch[arch]]
        progress = Progress(name, len(configs), stream, every)
        progress.begin(" (" + ", ".join(f"{arch} {len(per_arch[arch])}" for arch in arches) + ")")
        done = 0
        try:
            for c in configs:
                c.compile()
                done += 1
                progress.step(done)
        finally:
            progress.end(done)
        total += done
    return total
