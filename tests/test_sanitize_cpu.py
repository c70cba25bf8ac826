"""``python -m benchmarks.sanitize``: its configurations, the sanitizer-output parser, the
command lines and the CLI on a CPU; every workload's calls checked under FakeTensorMode.
The gpu-marked tests run one configuration (and a positive control) under memcheck."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import sanitize as S
from benchmarks.sanitize_workloads import CANARY, FAMILIES, all_configs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = all_configs()
FAKE_OK = [c for c in CONFIGS if not c.gpu_only]


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.sanitize", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# --------------------------------------------------------------------- configurations


def test_configurations_cover_every_family():
    names = [c.name for c in CONFIGS]
    assert names and len(names) == len(set(names)), "configuration names must be unique"
    families = {c.family for c in CONFIGS}
    assert set(FAMILIES) | {CANARY} == families
    for fam in FAMILIES:
        assert sum(c.family == fam for c in CONFIGS) >= 5, fam
    for c in CONFIGS:
        assert c.name.startswith(c.family + "/") and c.group
        assert all(ch not in c.name for ch in " ,<>|&;$"), c.name  # safe in command lines and --only
        if c.tools:
            assert set(c.tools) <= set(S.TOOLS)


def test_configurations_reach_the_important_variants():
    def names(fam):
        return " ".join(c.name for c in CONFIGS if c.family == fam)

    dropout = names("dropout_bias")
    for part in ("fp32-", "fp16-", "bf16-", "relu", "-gelu", "gelu_erf", "uint8mask", "fp32bias", "misaligned"):
        assert part in dropout, part
    norm = names("norm")
    for part in ("x7", "x1000", "x4096", "x65536", "ln-bf16", "ln-fp32", "rms-", "no-bias", "cluster8", "misaligned"):
        assert part in norm, part
    for part in ("fwd-ln-", "fwd-rms-", "x131072", "cluster2", "misaligned-view"):  # the forward's
        assert part in norm, part
    pre = names("attn_prepost")
    for part in (
        "preprocess-",
        "zero-dq",
        "preprocess-varlen",
        "d33",
        "compute_delta",
        "convert_dq",
        "nsplits",
        "convert_dkv",
        "clear_dkv_accum",
    ):
        assert part in pre, part
    mea = names("mem_eff_attention")
    for part in (
        "-d64-",
        "-d128-",
        "-d256-",
        "k128v64",
        "causal_tl",
        "causal_br",
        "window",
        "varlen",
        "splits2",
        "fp16-",
        "bf16-",
        "packed",
        "bhmk",
    ):
        assert part in mea, part
    sm90 = names("attention_sm90")
    for part in (
        "-d64-",
        "-d128-",
        "-d96-",
        "-d192-",
        "-d256-",
        "k128v64",
        "causal_tl",
        "causal_br",
        "window",
        "varlen",
        "gqa",
        "deterministic",
        "bias_grad-dropout",
        "overlap",
        "carry",
        "fp16-",
        "bf16-",
    ):
        assert part in sm90, part
    fwd = " ".join(c.name for c in CONFIGS if c.name.startswith("attention_sm90/fwd-"))
    for part in (  # the Hopper forward: each head-dim pair, masks, heads, windows, bias, dropout, varlen
        "-d64-",
        "-d96-",
        "-d128-",
        "-d192-",
        "k192v128",
        "-d256-",
        "nomask",
        "causal_tl",
        "causal_br",
        "window",
        "gqa",
        "mqa",
        "bias-bcast",
        "bias-padded-face",
        "bias-dropout",
        "-dropout",
        "varlen",
        "empty_keys",
        "fp16-",
        "bf16-",
    ):
        assert part in fwd, part
    assert {c.group for c in CONFIGS if c.name.startswith("attention_sm90/fwd-")} == {
        "attention_sm90_fwd_a",
        "attention_sm90_fwd_b",
    }
    canaries = [c for c in CONFIGS if c.expect_errors]
    assert {t for c in canaries for t in c.tools} == {"memcheck", "racecheck"}


@pytest.mark.parametrize("cfg", FAKE_OK, ids=[c.name for c in FAKE_OK])
def test_workload_calls_check_out_under_fake_tensors(cfg):
    """The public op calls of every workload pass the ops' validation (shapes, dtypes, options)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cfg.run()


# --------------------------------------------------------------------------- parser

CLEAN = """\
========= COMPUTE-SANITIZER
@@sanitize begin dropout_bias/a
@@sanitize end dropout_bias/a ok 0.51s
@@sanitize begin dropout_bias/b
@@sanitize end dropout_bias/b ok 0.02s
@@sanitize done
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_3 = """\
========= COMPUTE-SANITIZER
@@sanitize begin norm/a
@@sanitize end norm/a ok 1.20s
@@sanitize begin norm/b
========= Invalid __global__ write of size 16 bytes
=========     at kernel_cutlass_kernel_cute_kernelslayer_normln_bwdLnBwd_object_at__tensorptrbf16+0x1a40 in ln_bwd.py:210
=========     by thread (64,0,0) in block (3,0,0)
=========     Address 0x7f2a3c000400 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f2a3c000000 of size 1024 bytes
=========
========= Invalid __global__ write of size 16 bytes
=========     at kernel_cutlass_kernel_cute_kernelslayer_normln_bwdLnBwd_object_at__tensorptrbf16+0x1a40 in ln_bwd.py:210
=========     by thread (65,0,0) in block (3,0,0)
=========     Address 0x7f2a3c000410 is out of bounds
=========
@@sanitize end norm/b ok 0.80s
========= Invalid __shared__ read of size 4 bytes
=========     at kernel_cutlass_kernel_cute_kernelslayer_normln_bwd_finalizeLnBwdFinalize_object_at_+0x300
=========     by thread (1,0,0) in block (0,0,0)
=========
@@sanitize begin norm/c
@@sanitize end norm/c ok 0.30s
@@sanitize done
========= ERROR SUMMARY: 3 errors
"""

RACECHECK_2 = """\
========= COMPUTE-SANITIZER
@@sanitize begin mem_eff_attention/a
========= Error: Race reported between Write access at kernel_cutlass_kernel_cute_kernelsmem_eff_attention+0x1f0 in attention_backward_kernel.py:812
=========     and Read access at kernel_cutlass_kernel_cute_kernelsmem_eff_attention+0x2a0 in attention_backward_kernel.py:840 [1024 hazards]
=========
========= Warning: Race reported between Write access at kernel_cutlass_kernel_cute_kernelsmem_eff_attention+0x400
=========     and Write access at kernel_cutlass_kernel_cute_kernelsmem_eff_attention+0x400 [32 hazards]
=========
@@sanitize end mem_eff_attention/a ok 12.31s
@@sanitize begin mem_eff_attention/b
========= Error: Race reported between Read access at kernel_cutlass_kernel_cute_kernelsmem_eff_attention+0x500
=========     and Write access at kernel_cutlass_kernel_cute_kernelsmem_eff_attention+0x520 [8 hazards]
=========
@@sanitize end mem_eff_attention/b ok 3.02s
@@sanitize done
========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)
"""


def test_parse_clean_output():
    p = S.parse_output(CLEAN)
    assert p.error_summary == 0 and p.race_summary is None and p.done
    assert p.begun == ["dropout_bias/a", "dropout_bias/b"]
    assert p.ended["dropout_bias/a"] == {"status": "ok", "seconds": 0.51, "detail": ""}
    assert p.counted("errors") == 0 and p.unaccounted_errors == 0


def test_parse_memcheck_errors_go_to_the_last_begun_configuration():
    p = S.parse_output(MEMCHECK_3)
    assert p.error_summary == 3
    assert "norm/a" not in p.buckets
    b = p.buckets["norm/b"]
    assert b.errors == 3  # two before its end marker, one reported after it (attributed to the last begin)
    assert b.lines[0] == "========= Invalid __global__ write of size 16 bytes"
    assert any("ln_bwd.py:210" in line for line in b.lines)
    assert "norm/c" not in p.buckets and p.unaccounted_errors == 0


def test_parse_racecheck_summary_errors_and_warnings():
    p = S.parse_output(RACECHECK_2)
    assert p.race_summary == {"hazards": 3, "errors": 2, "warnings": 1}
    a, b = p.buckets["mem_eff_attention/a"], p.buckets["mem_eff_attention/b"]
    assert (a.errors, a.warnings, b.errors, b.warnings) == (1, 1, 1, 0)
    assert "[1024 hazards]" in a.lines[1]
    assert p.unaccounted_errors == 0


def test_parse_singular_summaries():
    assert S.parse_output("========= ERROR SUMMARY: 1 error\n").error_summary == 1
    p = S.parse_output("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert p.race_summary == {"hazards": 1, "errors": 1, "warnings": 0}
    assert p.unaccounted_errors == 1  # the summary counts an error that no record shows


def test_parse_startup_exit_api_and_target_errors():
    text = """\
========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "named symbol not found" on CUDA API call to cuGetProcAddress.
=========     Saved host backtrace up to driver entry point at error
@@sanitize begin canary/x
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaDeviceSynchronize.
@@sanitize end canary/x exception 0.10s RuntimeError: CUDA error: unspecified launch failure
@@sanitize done
========= Barrier error detected. Divergent thread(s) in block
=========     at kernel_cutlass_kernel+0x10
========= Target application returned an error
========= ERROR SUMMARY: 4 errors
"""
    p = S.parse_output(text)
    assert p.buckets[S.STARTUP].api_errors == 1 and p.buckets[S.STARTUP].errors == 0
    assert p.buckets["canary/x"].api_errors == 1
    assert (
        p.ended["canary/x"]["status"] == "exception" and "unspecified launch failure" in p.ended["canary/x"]["detail"]
    )
    assert p.buckets[S.EXIT].errors == 1 and p.target_error
    assert p.unaccounted_errors == 0  # 1 + 1 API errors, 1 error, the exit status
    job = S.Job("synccheck", "g", [], parsed=p)
    probs = S.job_problems(job)
    assert any("(exit)" in x for x in probs) and not any("(startup)" in x for x in probs)
    assert any("(startup)" in x for x in S.job_problems(job, strict=True))


class _Cfg:
    def __init__(self, name, expect_errors=False):
        self.name, self.expect_errors, self.family = name, expect_errors, name.split("/")[0]


def test_config_results_and_process_problems():
    text = MEMCHECK_3.replace("@@sanitize begin norm/c\n@@sanitize end norm/c ok 0.30s\n", "@@sanitize begin norm/c\n")
    text = text.replace("@@sanitize end norm/a ok 1.20s", "@@sanitize end norm/a exception 1.20s ValueError: bad")
    text = text.replace("@@sanitize done\n", "")
    job = S.Job("memcheck", "norm", [], parsed=S.parse_output(text), returncode=-9, timed_out=True, seconds=480)
    status = {n: S.config_result(job, _Cfg(n))["status"] for n in ("norm/a", "norm/b", "norm/c", "norm/d")}
    assert status == {"norm/a": "exception", "norm/b": "errors", "norm/c": "incomplete", "norm/d": "not run"}
    r = S.config_result(job, _Cfg("norm/b"))
    assert r["errors"] == 3 and r["tool"] == "memcheck" and r["excerpt"]
    probs = S.job_problems(job)
    assert any("timed out" in x for x in probs) and any("did not finish" in x for x in probs)
    clean = S.Job("memcheck", "g", [], parsed=S.parse_output(CLEAN))
    assert S.job_problems(clean) == []
    assert S.config_result(clean, _Cfg("dropout_bias/a"))["status"] == "clean"
    # a positive control must fire
    assert S.config_result(clean, _Cfg("dropout_bias/a", expect_errors=True))["status"] == "silent"
    fired = S.Job("memcheck", "g", [], parsed=S.parse_output(MEMCHECK_3))
    assert S.config_result(fired, _Cfg("norm/b", expect_errors=True))["status"] == "fired"
    # no summary at all: the tool did not run
    none = S.Job("racecheck", "g", [], parsed=S.parse_output(CLEAN.replace("========= ERROR SUMMARY: 0 errors\n", "")))
    assert any("no sanitizer summary" in x for x in S.job_problems(none))


def test_format_table():
    results = [
        {"config": "a/x", "tool": "memcheck", "status": "clean", "errors": 0, "warnings": 0},
        {"config": "a/x", "tool": "racecheck", "status": "errors", "errors": 2, "warnings": 0},
        {"config": "a/y", "tool": "memcheck", "status": "incomplete", "errors": 0, "warnings": 0},
    ]
    table = S.format_table(results, ["memcheck", "racecheck"])
    lines = table.splitlines()
    assert "memcheck" in lines[0] and "racecheck" in lines[0]
    assert lines[1].split()[1:] == ["ok", "2", "err"] and lines[2].split()[1:] == ["CRASH", "-"]


# ----------------------------------------------------------------- jobs and commands


def test_make_jobs_groups_by_family_and_isolates_canaries():
    jobs = S.make_jobs(CONFIGS, ["memcheck", "racecheck", "synccheck"], "family")
    groups = {c.group for c in CONFIGS if not c.expect_errors}
    for tool in ("memcheck", "racecheck", "synccheck"):
        tj = [j for j in jobs if j.tool == tool]
        assert {j.group for j in tj if not j.group.startswith("canary:")} == groups
        canaries = [j for j in tj if j.group.startswith("canary:")]
        assert all(len(j.configs) == 1 and tool in j.configs[0].tools for j in canaries)
        assert len(canaries) == (0 if tool == "synccheck" else 1)
    assert jobs[0].tool == "racecheck"  # the slowest first
    covered = [(j.tool, c.name) for j in jobs for c in j.configs]
    assert len(covered) == len(set(covered))
    one_each = S.make_jobs(CONFIGS, ["memcheck"], "config")
    assert len(one_each) == sum(not c.tools or "memcheck" in c.tools for c in CONFIGS)
    together = S.make_jobs([c for c in CONFIGS if not c.expect_errors], ["synccheck"], "all")
    assert len(together) == 1 and len(together[0].configs) == len(CONFIGS) - 2


def test_sanitizer_command_lines():
    names = ["norm/a", "norm/b"]
    race = S.sanitizer_command("/x/compute-sanitizer", "racecheck", names, port=49168, launch_timeout=300)
    assert race[:3] == ["/x/compute-sanitizer", "--tool", "racecheck"]
    joined = " ".join(race)
    for part in (
        "--error-exitcode 99",
        "--kernel-name kns=kernel_cutlass_",
        "--racecheck-report analysis",
        "--port 49168",
        "--launch-timeout 300",
        "--destroy-on-device-error kernel",
        "-m benchmarks.sanitize --worker norm/a,norm/b",
    ):
        assert part in joined, part
    assert "--padding" not in joined
    mem = " ".join(S.sanitizer_command("cs", "memcheck", names, port=1, launch_timeout=1, all_kernels=True))
    assert "--padding 256" in mem and "--racecheck-report" not in mem and "--kernel-name" not in mem
    plain = S.sanitizer_command("cs", S.PLAIN, names, port=1, launch_timeout=1)
    assert plain[0] == sys.executable and "--worker" in plain
    env = S.job_env("memcheck", caching_allocator=False, lineinfo=True)
    assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and str(ROOT) in env["PYTHONPATH"]
    if "PYTORCH_NO_CUDA_MEMORY_CACHING" not in os.environ:
        assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in S.job_env("racecheck", False, True)


def test_select_configs():
    picked = S.select_configs(CONFIGS, "norm/rms,clear_dkv")
    assert picked and all("norm/rms" in c.name or "clear_dkv" in c.name for c in picked)
    assert not any(c.expect_errors for c in S.select_configs(CONFIGS, None, canary=False))
    # the sm90 kernel's configurations run on sm_90a only; the others anywhere
    sm80, sm90 = S.select_configs(CONFIGS, None, arch="sm_80"), S.select_configs(CONFIGS, None, arch="sm_90a")
    assert sm90 == CONFIGS and sm80 == [c for c in CONFIGS if c.family != "attention_sm90"]
    assert all(c.arch == "sm_90a" for c in CONFIGS if c.family == "attention_sm90")


def _fake_tool(path: Path) -> Path:
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\necho 'NVIDIA (R) Compute Sanitizer'\necho 'Version 2025.3.1.0 (build 1)'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_sanitizer(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPUTE_SANITIZER", raising=False)
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        monkeypatch.delenv(var, raising=False)
    # the cu13 wheel's layout on sys.path
    tool = _fake_tool(tmp_path / "site" / "nvidia" / "cu13" / "bin" / "compute-sanitizer")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")] + sys.path)
    assert str(tool) in S.sanitizer_candidates()
    # CUDA_HOME comes before the wheels
    home_tool = _fake_tool(tmp_path / "cuda" / "bin" / "compute-sanitizer")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    cands = S.sanitizer_candidates()
    assert cands.index(str(home_tool)) < cands.index(str(tool))
    assert S.find_sanitizer(str(home_tool)) == str(home_tool)
    assert S.find_sanitizer(str(tmp_path / "missing")) is None
    assert S.sanitizer_version(str(home_tool)) == "2025.3.1.0"


# ------------------------------------------------------------------------------ CLI


def test_list():
    p = cli("--list")
    assert p.returncode == 0, p.stderr
    for c in CONFIGS:
        assert c.name in p.stdout
    assert f"{len(CONFIGS)} configurations" in p.stdout


def test_list_only():
    p = cli("--list", "--only", "mem_eff_attention/")
    assert p.returncode == 0 and "norm/" not in p.stdout and "mem_eff_attention/" in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_gpu_says_so_and_fails():
    p = cli("--only", "norm/")
    assert p.returncode != 0
    assert "No CUDA GPU" in p.stdout


def test_worker_under_fake_tensors_prints_markers():
    names = ["dropout_bias/fp32-1x1", "mem_eff_attention/bf16-d64-2x100x257-nomask"]
    p = cli("--worker", ",".join(names), "--fake")
    assert p.returncode == 0, p.stdout + p.stderr
    parsed = S.parse_output(p.stdout)
    assert parsed.begun == names and parsed.done
    assert all(parsed.ended[n]["status"] == "ok" for n in names)


def test_unknown_worker_configuration():
    p = cli("--worker", "nope/none", "--fake")
    assert p.returncode == 2 and "unknown configuration" in p.stderr


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["oob", "race"])
def test_canary_compiles(kind):
    import cutlass
    import cutlass.cute as cute

    from benchmarks.sanitize_canary import Canary
    from ops import _compile as cc

    fn = cc.compile_kernel(
        Canary(kind), cc.fake_tensor(cutlass.Float32, (cute.sym_int(),), 1), cc.fake_stream(), arch="sm_90a"
    )
    assert callable(fn)


# ------------------------------------------------------------------------------ GPU


def _needs_sanitizer():
    if S.find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")


@pytest.mark.gpu
def test_memcheck_one_configuration(tmp_path):
    _needs_sanitizer()
    out = tmp_path / "sanitize.json"
    p = cli(
        "--tools",
        "memcheck",
        "--only",
        "dropout_bias/fp32-1x1",
        "--no-canary",
        "--json",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and [(r["config"], r["tool"], r["status"]) for r in report["results"]] == [
        ("dropout_bias/fp32-1x1", "memcheck", "clean")
    ]
    assert report["processes"][0]["error_summary"] == 0


@pytest.mark.gpu
def test_memcheck_catches_the_planted_overrun(tmp_path):
    _needs_sanitizer()
    out = tmp_path / "sanitize.json"
    p = cli("--tools", "memcheck", "--only", "canary/memcheck", "--json", str(out), timeout=600)
    report = json.loads(out.read_text())
    assert p.returncode == 0, p.stdout[-4000:]
    (r,) = report["results"]
    assert r["status"] == "fired" and r["errors"] > 0, r


# ------------------------------------------------- the driver, with a stand-in sanitizer

STAND_IN = r'''#!{python}
"""Stands in for compute-sanitizer: runs the worker under FakeTensorMode, relays its output,
plants one memcheck error in every configuration whose name contains 'rms', and prints the
summary a real tool prints."""
import subprocess, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Compute Sanitizer\nVersion 2025.3.1.0 (build 0)")
    sys.exit(0)
tool = args[args.index("--tool") + 1]
cmd = args[args.index("-m") - 1:] + ["--fake"]
print("========= COMPUTE-SANITIZER", flush=True)
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
errors = 0
for line in proc.stdout:
    sys.stdout.write(line)
    if line.startswith("@@sanitize begin") and "rms" in line and tool == "memcheck":
        print("========= Invalid __global__ read of size 16 bytes")
        print("=========     at kernel_cutlass_kernel_cute_kernelslayer_norm+0x10")
        print("=========")
        errors += 1
    sys.stdout.flush()
rc = proc.wait()
if tool == "racecheck":
    print("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
else:
    print(f"========= ERROR SUMMARY: {{errors}} error{{'' if errors == 1 else 's'}}")
sys.exit(99 if errors else rc)
'''


def _pretend_gpu(monkeypatch):
    import ops._compile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(ops._compile, "device_arch", lambda index: "sm_90a")


def test_driver_end_to_end_with_a_stand_in_sanitizer(tmp_path, monkeypatch, capsys):
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(STAND_IN.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    _pretend_gpu(monkeypatch)
    out = tmp_path / "report.json"
    only = "dropout_bias/fp32-1x1,dropout_bias/bf16-3x12288,norm/rms-bf16-301x1000,norm/ln-bf16-301x7"
    rc = S.main(
        [
            "--sanitizer",
            str(tool),
            "--only",
            only,
            "--no-canary",
            "--jobs",
            "3",
            "--settle",
            "0",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ]
    )
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 1 and not report["ok"] and "FAILED" in printed
    status = {(r["config"], r["tool"]): (r["status"], r["errors"]) for r in report["results"]}
    assert len(status) == 4 * 3
    assert status[("norm/rms-bf16-301x1000", "memcheck")] == ("errors", 1)
    assert all(v == ("clean", 0) for k, v in status.items() if k != ("norm/rms-bf16-301x1000", "memcheck"))
    assert len(report["processes"]) == 2 * 3 and not any(p["problems"] for p in report["processes"])
    assert report["sanitizer"]["version"] == "2025.3.1.0" and report["device"] == "Stand-in GPU"
    assert all(os.path.isfile(p["log"]) for p in report["processes"])
    assert "FAIL norm/rms-bf16-301x1000 [memcheck]: errors (1 errors)" in printed
    # the clean ones alone pass; --warm runs the worker without a sanitizer first (here under fake tensors)
    command = S.sanitizer_command
    monkeypatch.setattr(
        S, "sanitizer_command", lambda san, t, *a, **k: command(san, t, *a, **k) + ["--fake"] * (t == S.PLAIN)
    )
    rc = S.main(
        [
            "--sanitizer",
            str(tool),
            "--only",
            "dropout_bias/fp32-1x1",
            "--no-canary",
            "--tools",
            "synccheck",
            "--settle",
            "0",
            "--json",
            str(out),
            "--warm",
            "--log-dir",
            str(tmp_path / "logs2"),
        ]
    )
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"] and report["tools"] == ["plain", "synccheck"]
