"""Per-architecture benchmark settings: one module per arch, looked up by name."""

import importlib


def settings(arch: str):
    """The settings module for ``arch`` ("sm90" for sm_90/sm_90a), or sm80's as the default."""
    name = arch.replace("sm_", "sm").rstrip("a")
    try:
        return importlib.import_module(f"benchmarks.arch.{name}")
    except ModuleNotFoundError:
        return importlib.import_module("benchmarks.arch.sm80")
