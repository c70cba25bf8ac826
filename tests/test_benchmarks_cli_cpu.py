"""``python -m benchmarks`` on a CPU: the per-GPU results folders."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks.gpus import gpu_slug, results_dir

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


# ------------------------------------------------------------------- results folders


@pytest.mark.parametrize("name,slug", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),  # 1.6 TB/s against the 80 GB boards' 2.0
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA GH200 480GB", "gh200-480gb"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),  # no model token: the whole name
    ("", "gpu"),
])  # fmt: skip
def test_gpu_slug(name, slug):
    assert gpu_slug(name) == slug


def test_variants_of_one_model_do_not_collide():
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB",
             "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"]  # fmt: skip
    assert len({gpu_slug(n) for n in names}) == len(names)


def test_results_dir():
    assert results_dir("/r", "sm_90a", "NVIDIA H100 80GB HBM3") == os.path.join("/r", "sm90-h100")
    assert results_dir("/r", "sm_90a", "NVIDIA H200") == os.path.join("/r", "sm90-h200")
    assert results_dir("/r", "sm_80", "NVIDIA A100-SXM4-80GB") == os.path.join("/r", "sm80-a100")


def _devices(path):
    with open(path) as f:
        data = json.load(f)
    return {r["device"] for r in (data if isinstance(data, list) else [data])}


def test_committed_results_sit_in_their_gpus_folder():
    """Every committed JSON names the full GPU it ran on, and that GPU's folder holds it."""
    folders = [d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d))]
    assert folders
    for folder in folders:
        files = [f for f in os.listdir(os.path.join(RESULTS, folder)) if f.endswith(".json") and ".quick." not in f]
        for f in files:
            (device,) = _devices(os.path.join(RESULTS, folder, f))
            assert folder.endswith("-" + gpu_slug(device)), (folder, f, device)


def test_a_run_writes_into_its_gpus_folder(tmp_path, monkeypatch):
    """On a (stood-in) H200 the rows land in sm90-h200/, quick ones as <suite>.quick.json."""
    import ops._compile

    from benchmarks.suites import dropout_bias_bwd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(ops._compile, "device_arch", lambda index: "sm_90a")
    rows = [{"suite": "dropout_bias_bwd", "case": "c", "impl": "ours", "ms": 1.0, "gbps": 2.0}]
    monkeypatch.setattr(dropout_bias_bwd, "run", lambda settings, quick: [dict(r) for r in rows])
    monkeypatch.setattr(cli, "_plot", lambda rows, path: open(path, "w").close())
    assert cli.main(["--quick", "--suite", "dropout_bias_bwd", "--out", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path / "sm90-h200")) == ["dropout_bias_bwd.quick.json", "dropout_bias_bwd.quick.png"]
    (row,) = json.loads((tmp_path / "sm90-h200" / "dropout_bias_bwd.quick.json").read_text())
    assert row["device"] == "NVIDIA H200" and row["date"]
