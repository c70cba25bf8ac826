"""Where a run's results go: ``benchmarks/results/<arch>-<gpu>/``, one folder per GPU model.

Boards of one architecture differ in memory bandwidth and power cap (H100 SXM: 3.35 TB/s,
700 W; H200: 4.8 TB/s; H100 PCIe: 2.0 TB/s, 350 W), so their results are kept apart.
"""

from __future__ import annotations

import os
import re

# The memory size a bare model slug stands for: the SXM boards the committed results were
# measured on. A name giving another size keeps it ("A100-SXM4-40GB" -> a100-40gb: 1.6
# against 2.0 TB/s).
REFERENCE_MEMORY = {"a100": "80gb", "h100": "80gb"}
FORM_FACTORS = ("pcie", "nvl")  # named in the slug: other bandwidth and power than the SXM board
_MODEL = re.compile(r"^(?!sxm|hbm|gddr)[a-z]+\d+[a-z]*$")  # h100, a100, gh200, l40s, a6000
_MEMORY = re.compile(r"^\d+gb?$")  # 80gb, 144g


def slug(text: str) -> str:
    """Lower-case letters and digits, runs of anything else as one "-"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def gpu_slug(device_name: str) -> str:
    """A short folder name for a GPU model, from ``torch.cuda.get_device_name()``.

    The model token ("h100"), then "-pcie" / "-nvl" where the name says so, then the memory
    size where it is not the model's REFERENCE_MEMORY: "NVIDIA H100 80GB HBM3" -> h100,
    "NVIDIA H100 PCIe" -> h100-pcie, "NVIDIA A100-PCIE-40GB" -> a100-pcie-40gb. Names
    without a model token ("NVIDIA GeForce RTX 4090") give the slug of the whole name.
    """
    tokens = slug(device_name).split("-")
    model = next((t for t in tokens if _MODEL.match(t)), None)
    if model is None:
        return slug(device_name)
    parts = [model] + [f for f in FORM_FACTORS if f in tokens]
    memory = next((t for t in tokens if _MEMORY.match(t)), None)
    if memory is not None and memory != REFERENCE_MEMORY.get(model):
        parts.append(memory)
    return "-".join(parts)


def arch_folder(arch: str) -> str:
    """The DSL target without its underscore and feature suffix: sm_90a -> sm90, sm_80 -> sm80."""
    return arch.replace("sm_", "sm").rstrip("a")


def results_dir(root: str, arch: str, device_name: str) -> str:
    """``root/<arch>-<gpu>``: the folder of one GPU model's results (``root``: benchmarks/results)."""
    return os.path.join(root, f"{arch_folder(arch)}-{gpu_slug(device_name)}")
