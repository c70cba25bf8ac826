"""``python -m benchmarks`` on a CPU: the per-GPU results folders, the configurations compiled
without a GPU (the --quick selection, both arches, each once) and the progress lines. Nothing
here compiles a kernel: the compile caches are stood in for."""

from __future__ import annotations

import io
import json
import os
import sys
import types

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks import compile_check as CC
from benchmarks.gpus import gpu_slug, results_dir
from benchmarks.suites import SUITES

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


# ------------------------------------------------------------------- results folders


@pytest.mark.parametrize(
    "name,slug",
    [
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
    ],
)
def test_gpu_slug(name, slug):
    assert gpu_slug(name) == slug


def test_variants_of_one_model_do_not_collide():
    names = [
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H100 PCIe",
        "NVIDIA H100 NVL",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA A100-PCIE-40GB",
        "NVIDIA A100 80GB PCIe",
    ]
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


# ------------------------------------------------- configurations compiled without a GPU


@pytest.fixture(scope="module")
def configs():
    """(suite, quick) -> arch -> [Config]: listed, not compiled."""
    return {(s, q): CC.suite_configs(s, q) for s in SUITES for q in (True, False)}


NO_KERNEL = {("attention_fwd", "sm_80")}  # (suite, arch): ours runs torch's kernels there, compiles none


def _names_arch(key, arch):
    """A key names its arch: as an entry, or as the ``arch`` of its one config object."""
    return arch in key or getattr(key[0], "arch", None) == arch


@pytest.mark.parametrize("suite", SUITES)
def test_quick_compiles_a_subset_once_per_arch(configs, suite):
    for arch in CC.ARCHES:
        quick, full = configs[suite, True][arch], configs[suite, False][arch]
        if (suite, arch) in NO_KERNEL:
            assert not full
            continue
        assert quick and set(quick) <= set(full) and len(quick) < len(full)
        for c in quick + full:
            assert _names_arch(c.key, arch), c  # every key names the arch it compiles for
    for q in (True, False):
        listed = [c for arch in CC.ARCHES for c in configs[suite, q][arch]]
        assert len(listed) == len(set(listed)), "a configuration listed twice"


def test_quick_selection(configs):
    """What the quick cases run: dropout's fp32 4-wide and bf16 8-wide vectors; LayerNorm
    bf16 at 4096 and 1024 columns (one finalize serves both); the forward's LayerNorm at 4096 and
    RMSNorm at 1024 columns, and in training their backwards too; pre / post at d128 bf16; the
    attention cases through both kernels, the Hopper one on sm_90a only."""
    import cutlass

    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    def keys(suite, arch, cache=""):
        return [c.key for c in configs[suite, True][arch] if c.cache.endswith(cache)]

    for arch in CC.ARCHES:
        assert keys("dropout_bias_bwd", arch) == [
            (f32, f32, None, 4, arch, False),
            (f32, f32, None, 4, arch, True),
            (bf16, bf16, None, 8, arch, False),
            (bf16, bf16, None, 8, arch, True),
        ]
        assert keys("dropout_bias_fwd", arch) == [(f32, None, 4, arch, False), (bf16, None, 8, arch, False)]
        assert len(keys("layer_norm_bwd", arch, ":compiled")) == 2
        assert len(keys("layer_norm_bwd", arch, ":compiled_finalize")) == 1
        assert [k[4] for k in keys("layer_norm_fwd", arch)] == [False, True]  # LayerNorm 4096, RMSNorm 1024
        assert len(keys("norm_train", arch, "norm_forward:compiled")) == 2
        assert len(keys("norm_train", arch, "norm:compiled")) == len(keys("norm_train", arch, "finalize")) == 2
        pre = [(bf16, 128, 8, False, False, arch), (bf16, 128, 8, False, True, arch), (bf16, 128, 8, False, arch)]
        assert keys("attn_bwd_preprocess", arch) == pre  # compute_dot_do_o without, with the clear; compute_delta
        assert keys("attn_bwd_postprocess", arch) == [(bf16, 128, 8, False, arch)] * 2  # convert_dq, convert_dkv
        assert len(keys("attention_bwd", arch, "mem_eff_attention:compiled")) == 6  # 3 cases x computes_delta
        # the sm90 backward's: 3 cases, and the softcap's through autograd (its forward too)
        assert len(keys("attention_bwd", arch, "attention_sm90:compiled")) == (4 if arch == "sm_90a" else 0)
        assert len(keys("attention_bwd", arch, "attention_fwd_sm90:compiled")) == (arch == "sm_90a")


def test_full_covers_both_arches(configs):
    """sm_80 compiles everything that runs there: all but the Hopper attention kernel and the
    LayerNorm rows that need clusters."""
    full = {s: configs[s, False] for s in SUITES}
    for suite in ("dropout_bias_fwd", "dropout_bias_bwd", "attn_bwd_preprocess", "attn_bwd_postprocess"):
        assert len(full[suite]["sm_80"]) == len(full[suite]["sm_90a"])
    for suite in ("layer_norm_bwd", "layer_norm_fwd", "norm_train"):
        assert 0 < len(full[suite]["sm_80"]) < len(full[suite]["sm_90a"])
    assert not any("attention_sm90" in c.cache for c in full["attention_bwd"]["sm_80"])


def _fake_cache(monkeypatch):
    """A module ``fake_ops`` whose ``compiled`` records its keys."""
    seen = []
    monkeypatch.setitem(sys.modules, "fake_ops", types.SimpleNamespace(compiled=lambda *k: seen.append(k)))
    return seen


def test_compile_suites_compiles_each_listed_configuration_once(monkeypatch):
    seen = _fake_cache(monkeypatch)
    listed = {
        "sm_80": [CC.Config("fake_ops:compiled", (i, "sm_80")) for i in range(3)],
        "sm_90a": [CC.Config("fake_ops:compiled", (i, "sm_90a")) for i in range(4)],
    }
    monkeypatch.setattr(CC, "suite_configs", lambda suite, quick, arches: listed)
    out = io.StringIO()
    assert CC.compile_suites(["a", "b"], True, out) == 14
    assert seen == [c.key for arch in CC.ARCHES for c in listed[arch]] * 2


# ------------------------------------------------------------------------- progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_lines_without_a_terminal(monkeypatch):
    _fake_cache(monkeypatch)
    listed = {
        "sm_80": [CC.Config("fake_ops:compiled", (i, "sm_80")) for i in range(2)],
        "sm_90a": [CC.Config("fake_ops:compiled", (i, "sm_90a")) for i in range(3)],
    }
    monkeypatch.setattr(CC, "suite_configs", lambda suite, quick, arches: listed)
    out = io.StringIO()
    CC.compile_suites(["attention_bwd"], True, out, every=2)
    lines = out.getvalue().splitlines()
    assert lines[0] == "attention_bwd: compiling 5 configurations (sm_80 2, sm_90a 3)"
    assert [line.split(" (")[0] for line in lines[1:3]] == ["  attention_bwd: 2/5", "  attention_bwd: 4/5"]
    assert lines[3].startswith("  attention_bwd: 5/5 compiled in ") and len(lines) == 4


def test_progress_in_place_on_a_terminal():
    out = _Tty()
    p = CC.Progress("layer_norm_bwd", 3, out)
    p.begin()
    for i in (1, 2, 3):
        p.step(i)
    p.end(3)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith(" s\n")  # one line, rewritten
    assert [part.rsplit(" ", 1)[-1] for part in text.split("\r")[:4]] == ["0/3", "1/3", "2/3", "3/3"]


def test_progress_line_closes_on_a_failed_compile(monkeypatch):
    def boom(*key):
        raise RuntimeError("no")

    monkeypatch.setitem(sys.modules, "fake_ops", types.SimpleNamespace(compiled=boom))
    listed = {arch: [CC.Config("fake_ops:compiled", (arch,))] for arch in CC.ARCHES}
    monkeypatch.setattr(CC, "suite_configs", lambda suite, quick, arches: listed)
    out = _Tty()
    with pytest.raises(RuntimeError):
        CC.compile_suites(["s"], False, out)
    assert "0/2 in" in out.getvalue() and out.getvalue().endswith("\n")


def test_cpu_run_honours_quick(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(CC, "compile_suites", lambda suites, quick: calls.append((suites, quick)) or 7)
    assert cli.main(["--quick", "--suite", "layer_norm_bwd"]) == 0
    assert calls == [(["layer_norm_bwd"], True)]
    out = capsys.readouterr().out
    assert "--quick cases" in out and "sm_80 and sm_90a" in out and "7 configurations compiled" in out


def test_help_documents_the_results(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for part in ("<arch>-<gpu>", "sm90-h100", ".quick.json", "--quick", "sm_80 and sm_90a", "benchmarks/README.md"):
        assert part in text, part


# ------------------------------------------------------- benchmarks.context_parallel (torchrun)


def test_context_parallel_arguments_and_case_name():
    from benchmarks import context_parallel as CP

    a = CP.parse_args([], world=2)
    assert (a.seqlen, a.kv_heads, a.causal) == (32768, 16, True)
    assert CP.case_name(a) == "1x16x32768x128:bf16:causal"
    assert CP.case_name(CP.parse_args(["--kv-heads", "4", "--no-causal"], world=4)) == "1x16x65536x128:bf16:kv4"
    assert CP.step_flops(a) == 3.5 * 4 * 16 * 32768**2 * 128 / 2
    with pytest.raises(SystemExit):
        CP.parse_args(["--seqlen", "1002"], world=4)
    probe = CP.parse_args(["--largest", "--max-step-s", "5"], world=2)
    assert (probe.largest, probe.max_step_s, a.largest) == (True, 5.0, False)


def test_context_parallel_rows_of_other_gpu_counts_stay(monkeypatch):
    from benchmarks import context_parallel as CP

    old = [{"case": "c", "gpus": 2, "impl": "ours"}, {"case": "c", "gpus": 4, "impl": "ours"}]
    new = [{"case": "c", "gpus": 4, "impl": "ours", "ms": 1.0}]
    assert CP.merge_rows(old, new) == [old[0], new[0]]
    probe = [{"case": "c", "gpus": 2, "impl": "ours_largest_probe", "ms": 2.0}]
    assert CP.merge_rows(old, probe) == old + probe  # a probe of the same case keeps the benchmark's rows
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)  # restored after the test
    with pytest.raises(SystemExit):  # --help before any GPU or process group
        CP.main(["--help"])
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
