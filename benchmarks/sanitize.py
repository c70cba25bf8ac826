"""python -m benchmarks.sanitize: every kernel configuration under compute-sanitizer.

Runs the configurations of ``benchmarks/sanitize_workloads.py`` (the GPU test matrix at
small sizes: dropout + bias, LayerNorm / RMSNorm, the attention-backward pre/post
kernels, the memory-efficient attention backward and, on sm_90a, the Hopper backward and
forward) under NVIDIA compute-sanitizer's memcheck, racecheck and synccheck, and reports the
errors per (configuration, tool).
Exit status 0 only when every configuration ran clean under every tool (and each
positive control, a DSL kernel with a planted bug, was caught).

One sanitizer process runs a whole group of configurations (``--group``), printing a
marker before and after each workload; sanitizer reports are attributed to the
configuration whose marker came last. Processes run ``--jobs`` at a time.

Only our kernels are instrumented: ``--kernel-name kns=kernel_cutlass_`` (every CuTe DSL
kernel's name starts so), so torch's own kernels (random inputs, the attention forward)
run at full speed and cannot add noise; ``--all-kernels`` checks everything. Under
memcheck torch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so every
tensor is its own allocation and an access past its end is caught.

Compiles are not shared between processes: ``cute.compile`` never uses the CuTe DSL's
disk cache (it compiles with ``no_cache=True``), so each sanitizer process JIT-compiles
its group's kernels (on the host, at normal speed). ``--warm`` runs every group once
without a sanitizer first: a quick check that the workloads run at all.

  python -m benchmarks.sanitize --list
  python -m benchmarks.sanitize [--tools memcheck,racecheck,synccheck] [--only SUBSTR]
      [--group family|config|all] [--jobs N] [--timeout S] [--budget S] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
DEFAULT_TOOLS = ("memcheck", "racecheck", "synccheck")
PLAIN = "plain"  # a run without a sanitizer (--warm)
KERNEL_FILTER = "kns=kernel_cutlass_"
ERROR_EXITCODE = 99
BASE_PORT = 49152
PORT_STRIDE = 16  # compute-sanitizer tries --max-connections (10) ports from its base

MARK = "@@sanitize"
BEGIN = f"{MARK} begin"
END = f"{MARK} end"
DONE = f"{MARK} done"
STARTUP, EXIT = "(startup)", "(exit)"

# statuses of one (configuration, tool)
PASSING = ("clean", "fired", "skipped")


# ------------------------------------------------------------------ finding the tool


def sanitizer_candidates() -> List[str]:
    """Where compute-sanitizer may be, in the order looked at."""
    cands = []
    for var in ("COMPUTE_SANITIZER",):
        if os.environ.get(var):
            cands.append(os.environ[var])
    found = shutil.which("compute-sanitizer")
    if found:
        cands.append(found)
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "compute-sanitizer"))
            cands.append(os.path.join(os.environ[var], "compute-sanitizer", "compute-sanitizer"))
    cands.append("/usr/local/cuda/bin/compute-sanitizer")
    cands.append("/usr/local/cuda/compute-sanitizer/compute-sanitizer")
    cands += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    cands += sorted(glob.glob("/opt/nvidia/*/compute-sanitizer*/compute-sanitizer"), reverse=True)
    # the pip wheels: nvidia-cuda-sanitizer-api (cu13: nvidia/cu13/bin/) and -cu12
    # (nvidia/cuda_sanitizer_api/compute-sanitizer/)
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "nvidia")):
            cands += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "bin", "compute-sanitizer")), reverse=True)
            cands += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "compute-sanitizer", "compute-sanitizer")))
    return list(dict.fromkeys(cands))


def find_sanitizer(explicit: Optional[str] = None) -> Optional[str]:
    for path in [explicit] if explicit else sanitizer_candidates():
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def sanitizer_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    m = re.search(r"Version (\S+)", out)
    return m.group(1) if m else "unknown"


# ------------------------------------------------------------------------ the parser

_PREFIX = "========="
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_API_ERROR = re.compile(r"^Program hit .* (on|in) CUDA API call")
_TARGET_ERROR = "Target application returned an error"
EXCERPT_LINES = 60


@dataclass
class Bucket:
    """Sanitizer records attributed to one configuration (or to start-up / exit)."""

    errors: int = 0  # kernel errors, race / sync errors, tool failures
    warnings: int = 0  # "Warning:" records (racecheck's benign hazards, tool notes)
    api_errors: int = 0  # "Program hit ... on CUDA API call": failing API calls
    lines: List[str] = field(default_factory=list)

    def add_line(self, line: str) -> None:
        if len(self.lines) < EXCERPT_LINES:
            self.lines.append(line)


@dataclass
class Parsed:
    """One sanitizer process's output, split by the worker's markers."""

    buckets: Dict[str, Bucket] = field(default_factory=dict)
    begun: List[str] = field(default_factory=list)
    ended: Dict[str, dict] = field(default_factory=dict)  # name -> {status, seconds, detail}
    done: bool = False
    error_summary: Optional[int] = None
    race_summary: Optional[dict] = None  # {hazards, errors, warnings}
    target_error: bool = False

    def bucket(self, name: str) -> Bucket:
        return self.buckets.setdefault(name, Bucket())

    def counted(self, kind: str) -> int:
        return sum(getattr(b, kind) for b in self.buckets.values())

    @property
    def unaccounted_errors(self) -> int:
        """Errors the summary counts that no parsed record accounts for (print limit, odd output).

        racecheck's own summary counts its displayed errors; the general one also counts
        a failing exit status of the program ("Target application returned an error").
        """
        if self.race_summary is not None:
            return max(0, self.race_summary["errors"] - self.counted("errors"))
        if self.error_summary is not None:
            accounted = self.counted("errors") + self.counted("api_errors") + int(self.target_error)
            return max(0, self.error_summary - accounted)
        return 0


def parse_output(text: str) -> Parsed:
    """Split compute-sanitizer output (merged with the worker's stdout) by markers.

    A record starts at a line ``========= X`` whose X is not indented; the indented lines
    after it belong to it. Records go to the configuration whose begin marker came last
    (reports may arrive after its end marker), to ``(startup)`` before the first marker
    and to ``(exit)`` after the worker's done marker.
    """
    p = Parsed()
    current = STARTUP
    in_record = False
    for raw in text.splitlines():
        line = raw.rstrip("\n")
        if line.startswith(MARK):
            in_record = False
            parts = line.split(None, 5)
            if line.startswith(BEGIN) and len(parts) >= 3:
                current = parts[2]
                p.begun.append(current)
            elif line.startswith(END) and len(parts) >= 5:
                name, status = parts[2], parts[3]
                seconds = float(parts[4].rstrip("s")) if re.match(r"^[\d.]+s?$", parts[4]) else None
                p.ended[name] = {"status": status, "seconds": seconds, "detail": parts[5] if len(parts) > 5 else ""}
            elif line.startswith(DONE):
                current = EXIT
                p.done = True
            continue
        if not line.startswith(_PREFIX):
            continue  # the program's own output
        body = line[len(_PREFIX) :]
        if not body.strip():
            in_record = False
            continue
        if body.startswith("  "):  # continuation of the record above
            if in_record:
                p.bucket(current).add_line(line)
            continue
        body = body.strip()
        in_record = False
        m = _ERROR_SUMMARY.search(body)
        if m:
            p.error_summary = int(m.group(1))
            continue
        m = _RACE_SUMMARY.search(body)
        if m:
            p.race_summary = {"hazards": int(m.group(1)), "errors": int(m.group(2)), "warnings": int(m.group(3))}
            continue
        if body.startswith("COMPUTE-SANITIZER") or body.startswith("LEAK SUMMARY"):
            continue
        if body.startswith(_TARGET_ERROR):
            p.target_error = True
            continue
        b = p.bucket(current)
        if body.startswith("Warning"):
            b.warnings += 1
        elif _API_ERROR.search(body):
            b.api_errors += 1
        else:
            b.errors += 1
        b.add_line(line)
        in_record = True
    return p


# ------------------------------------------------------------------------ the worker


def run_worker(names: Sequence[str], settle: float = 0.25, fake: bool = False) -> int:
    """Run configurations in this process, each between markers; 1 if any raised."""
    import torch

    from .sanitize_workloads import all_configs, seed_for

    by_name = {c.name: c for c in all_configs()}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown configuration(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    else:
        torch.cuda.init()  # attach the sanitizer before the long imports
    import ops  # noqa: F401  (imports cutlass: outside every configuration's markers)

    failures = 0
    for name in names:
        cfg = by_name[name]
        print(f"{BEGIN} {name}", flush=True)
        t0 = time.perf_counter()
        status, detail = "ok", ""
        try:
            seed_for(cfg)
            if mode is not None:
                with mode:
                    cfg.run()
            else:
                cfg.run()
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported per configuration, the next one runs
            status = "exception"
            detail = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            traceback.print_exc(file=sys.stdout)
            failures += not cfg.expect_errors
        seconds = time.perf_counter() - t0
        sys.stdout.flush()
        if settle and mode is None:
            time.sleep(settle)  # let the sanitizer print this configuration's reports first
        print(f"{END} {name} {status} {seconds:.2f}s {detail}".rstrip(), flush=True)
    print(DONE, flush=True)
    return 1 if failures else 0


# ------------------------------------------------------------------------ the driver


@dataclass
class Job:
    tool: str  # a sanitizer tool, or PLAIN
    group: str
    configs: List  # Config objects
    command: List[str] = field(default_factory=list)
    returncode: Optional[int] = None
    timed_out: bool = False
    skipped: str = ""  # why it did not run
    seconds: float = 0.0
    output: str = ""
    log: str = ""
    parsed: Optional[Parsed] = None


def select_configs(configs, only: Optional[str], canary: bool = True, arch: Optional[str] = None):
    """Configurations named by ``only`` (substrings), without the positive controls unless
    ``canary``, and with ``arch`` (the device's) only those that run there."""
    subs = [s for s in (only or "").split(",") if s]
    out = []
    for c in configs:
        if subs and not any(s in c.name for s in subs):
            continue
        if arch is not None and c.arch not in (None, arch):
            continue
        if not canary and c.expect_errors:
            continue
        out.append(c)
    return out


def make_jobs(configs, tools: Sequence[str], group_mode: str) -> List[Job]:
    """One job per (tool, group); canaries always get a process of their own."""
    jobs = []
    for tool in tools:
        groups: Dict[str, list] = {}
        for c in configs:
            if tool != PLAIN and c.tools is not None and tool not in c.tools:
                continue
            if tool == PLAIN and c.gpu_only and c.expect_errors:
                continue  # a planted bug is meant for a sanitizer
            if c.expect_errors:
                key = f"canary:{c.name}"
            elif group_mode == "config":
                key = c.name
            elif group_mode == "all":
                key = "all"
            else:
                key = c.group
            groups.setdefault(key, []).append(c)
        jobs += [Job(tool, g, cs) for g, cs in groups.items()]
    # the slowest first: racecheck, then attention (its compiles dominate), larger groups
    tool_rank = {"racecheck": 0, "memcheck": 1, "initcheck": 2, "synccheck": 3, PLAIN: 4}
    jobs.sort(
        key=lambda j: (
            tool_rank.get(j.tool, 5),
            not any(c.family == "mem_eff_attention" for c in j.configs),
            -len(j.configs),
        )
    )
    return jobs


def sanitizer_command(
    sanitizer: str,
    tool: str,
    names: Sequence[str],
    *,
    port: int,
    launch_timeout: int,
    racecheck_report: str = "analysis",
    all_kernels: bool = False,
    settle: float = 0.25,
    padding: int = 256,
    python: str = sys.executable,
) -> List[str]:
    worker = [python, "-m", "benchmarks.sanitize", "--worker", ",".join(names), "--settle", str(settle)]
    if tool == PLAIN:
        return worker
    cmd = [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(ERROR_EXITCODE),
        "--launch-timeout",
        str(launch_timeout),
        "--port",
        str(port),
        "--target-processes",
        "application-only",
        "--print-limit",
        "10000",
        "--show-backtrace",
        "device",
        "--destroy-on-device-error",
        "kernel",
        "--ignore-getprocaddress-notfound",
    ]
    if not all_kernels:
        cmd += ["--kernel-name", KERNEL_FILTER]
    if tool == "racecheck":
        cmd += ["--racecheck-report", racecheck_report]
    if tool == "memcheck" and padding:
        cmd += ["--padding", str(padding)]  # a guard zone after every allocation: overruns land in it
    return cmd + worker


def job_env(tool: str, caching_allocator: bool, lineinfo: bool) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if tool == "memcheck" and not caching_allocator:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    if lineinfo:
        env.setdefault("CUTE_DSL_LINEINFO", "1")  # file:line in the reports
    return env


def run_job(job: Job, env: Dict[str, str], timeout: float, log_dir: Optional[str]) -> None:
    t0 = time.time()
    proc = subprocess.Popen(
        job.command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.timed_out = True
        try:
            os.killpg(proc.pid, 9)  # the sanitizer and the worker it started (one process group)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a descendant outside the process group holds the pipe
            proc.kill()
            out = "(output lost: the process did not end after it was killed)\n"
    job.returncode = proc.returncode
    job.seconds = time.time() - t0
    job.output = out or ""
    job.parsed = parse_output(job.output)
    if log_dir:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{job.tool}.{job.group}")
        job.log = os.path.join(log_dir, safe + ".log")
        with open(job.log, "w") as f:
            f.write(" ".join(job.command) + "\n\n" + job.output)


def job_problems(job: Job, strict: bool = False) -> List[str]:
    """Process-level failures: the run as a whole cannot be trusted or has stray errors."""
    if job.skipped:
        return [f"not run: {job.skipped}"]
    p = job.parsed
    probs = []
    if job.timed_out:
        probs.append(f"timed out after {job.seconds:.0f} s")
    if not p.done:
        probs.append(f"worker did not finish (exit status {job.returncode})")
    if job.tool != PLAIN:
        if p.error_summary is None and p.race_summary is None:
            probs.append("no sanitizer summary in the output (did the tool run?)")
        for name in (STARTUP, EXIT):
            b = p.buckets.get(name)
            if b and b.errors:
                probs.append(f"{b.errors} error(s) outside any configuration {name}")
            if b and strict and b.api_errors:
                probs.append(f"{b.api_errors} CUDA API error(s) outside any configuration {name}")
        if p.unaccounted_errors:
            probs.append(f"{p.unaccounted_errors} error(s) in the summary not attributed to a configuration")
    return probs


def config_result(job: Job, cfg, strict: bool = False) -> dict:
    p = job.parsed
    b = p.buckets.get(cfg.name, Bucket()) if p else Bucket()
    end = p.ended.get(cfg.name) if p else None
    if job.skipped or p is None or cfg.name not in p.begun:
        status = "not run"
    elif end is None:
        status = "incomplete"  # crashed or timed out inside it
    elif cfg.expect_errors:
        status = "fired" if b.errors else "silent"
    elif b.errors or (strict and (b.api_errors or b.warnings)):
        status = "errors"
    elif end["status"] != "ok":
        status = "exception"
    else:
        status = "clean"
    return {
        "config": cfg.name,
        "family": cfg.family,
        "group": job.group,
        "tool": job.tool,
        "status": status,
        "errors": b.errors,
        "warnings": b.warnings,
        "api_errors": b.api_errors,
        "seconds": end["seconds"] if end else None,
        "detail": end["detail"] if end else "",
        "excerpt": b.lines,
        "log": job.log,
    }


CELL = {
    "clean": "ok",
    "fired": "fired",
    "skipped": "-",
    "not run": "NOT RUN",
    "incomplete": "CRASH",
    "silent": "SILENT",
    "exception": "EXC",
}


def format_table(results: List[dict], tools: Sequence[str]) -> str:
    names = list(dict.fromkeys(r["config"] for r in results))
    cell = {(r["config"], r["tool"]): r for r in results}
    width = max([len(n) for n in names] + [13])
    lines = [f"{'configuration':{width}} " + " ".join(f"{t:>10}" for t in tools)]
    for n in names:
        row = []
        for t in tools:
            r = cell.get((n, t))
            if r is None:
                row.append(f"{'-':>10}")
                continue
            s = r["status"]
            text = f"{r['errors']} err" if s == "errors" else CELL.get(s, s)
            if s == "clean" and r["warnings"]:
                text = f"ok/{r['warnings']}w"
            row.append(f"{text:>10}")
        lines.append(f"{n:{width}} " + " ".join(row))
    return "\n".join(lines)


def _print_config_list(configs) -> None:
    from .sanitize_workloads import CANARY, FAMILIES

    for fam in FAMILIES + (CANARY,):
        fam_cfgs = [c for c in configs if c.family == fam]
        if not fam_cfgs:
            continue
        print(f"{fam} ({len(fam_cfgs)})")
        for c in fam_cfgs:
            extra = []
            if c.tools:
                extra.append("tools: " + ",".join(c.tools))
            if c.expect_errors:
                extra.append("positive control: errors expected")
            print(f"  {c.name:60} group {c.group}" + (f"  [{'; '.join(extra)}]" if extra else ""))
    print(f"{len(configs)} configurations")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sanitize", description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--tools", default=",".join(DEFAULT_TOOLS), help=f"comma-separated, of {', '.join(TOOLS)}")
    ap.add_argument(
        "--only", help="run only configurations whose name contains one of these (comma-separated) substrings"
    )
    ap.add_argument(
        "--group",
        choices=("family", "config", "all"),
        default="family",
        help="configurations per sanitizer process: a family's group (default), one each, or all in one",
    )
    ap.add_argument("--jobs", type=int, default=0, help="sanitizer processes at once (default: min(6, CPUs / 2))")
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds for one sanitizer process (default 480)")
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds for the whole run: jobs not started by then are reported as not run (0: none)",
    )
    ap.add_argument("--json", help="report path (default benchmarks/results/<arch>-<gpu>/sanitize.json)")
    ap.add_argument("--log-dir", help="keep each process's full output here (default: a temporary directory)")
    ap.add_argument("--warm", action="store_true", help="first run every group once without a sanitizer")
    ap.add_argument("--no-canary", action="store_true", help="skip the positive controls (planted bugs)")
    ap.add_argument("--all-kernels", action="store_true", help="check every kernel, torch's too (slower, noisier)")
    ap.add_argument("--racecheck-report", choices=("analysis", "hazard", "all"), default="analysis")
    ap.add_argument("--padding", type=int, default=256, help="memcheck's guard bytes after each allocation (0: none)")
    ap.add_argument(
        "--caching-allocator",
        action="store_true",
        help="keep torch's caching allocator under memcheck (misses overruns inside its blocks)",
    )
    ap.add_argument("--no-lineinfo", action="store_true", help="compile without line info (CUTE_DSL_LINEINFO)")
    ap.add_argument("--strict", action="store_true", help="also fail on racecheck warnings and CUDA API errors")
    ap.add_argument("--settle", type=float, default=0.25, help="seconds the worker waits after each workload")
    ap.add_argument("--sanitizer", help="path of compute-sanitizer (default: searched)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # CONFIG[,CONFIG...]: run in this process
    ap.add_argument(
        "--fake", action="store_true", help="with --worker: run under FakeTensorMode (no GPU; checks the calls)"
    )
    args = ap.parse_args(argv)

    if args.worker is not None:
        return run_worker([n for n in args.worker.split(",") if n], args.settle, args.fake)

    from .sanitize_workloads import all_configs

    configs = select_configs(all_configs(), args.only, canary=not args.no_canary)
    if args.list:
        _print_config_list(configs)
        return 0
    if not configs:
        print(f"no configuration matches --only {args.only!r} (see --list)", file=sys.stderr)
        return 2
    tools = [t for t in args.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        print(f"unknown tool(s) {bad}: choose from {', '.join(TOOLS)}", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU here: compute-sanitizer checks kernels as they run, so this needs a GPU.")
        print("`python -m benchmarks.sanitize --list` shows the configurations; the CPU tests run each")
        print("workload under FakeTensorMode (tests/test_sanitize_cpu.py).")
        return 2
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("compute-sanitizer not found. Looked at:", file=sys.stderr)
        for c in sanitizer_candidates() or ["(nothing: no CUDA toolkit or sanitizer wheel found)"]:
            print(f"  {c}", file=sys.stderr)
        print(
            "Install the CUDA toolkit, or `pip install nvidia-cuda-sanitizer-api`, or pass --sanitizer PATH "
            "(or set COMPUTE_SANITIZER / CUDA_HOME).",
            file=sys.stderr,
        )
        return 2

    from ops._compile import device_arch

    from .gpus import results_dir

    arch = device_arch(torch.cuda.current_device())
    configs = select_configs(configs, None, arch=arch)  # e.g. the sm90 kernel's only on sm_90a
    if not configs:
        print(f"no selected configuration runs on {arch}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    version = sanitizer_version(sanitizer)
    jobs_n = args.jobs or max(1, min(6, (os.cpu_count() or 2) // 2))
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="cute_kernels_sanitize_")
    os.makedirs(log_dir, exist_ok=True)
    json_path = args.json or os.path.join(results_dir(RESULTS, arch, device), "sanitize.json")
    print(f"{device} ({arch}), torch {torch.__version__}, compute-sanitizer {version} ({sanitizer})")

    run_tools = ([PLAIN] if args.warm else []) + tools
    jobs = make_jobs(configs, run_tools, args.group)
    print(
        f"{len(configs)} configurations, tools {', '.join(run_tools)}: {len(jobs)} processes, {jobs_n} at a time;"
        f" logs in {log_dir}"
    )

    start = time.time()
    ports = list(range(BASE_PORT, BASE_PORT + PORT_STRIDE * jobs_n, PORT_STRIDE))
    lock = threading.Lock()
    done_count = [0]

    def execute(job: Job) -> Job:
        remaining = args.budget - (time.time() - start) if args.budget else None
        if remaining is not None and remaining < 5:
            job.skipped = f"--budget {args.budget:.0f} s spent"
        else:
            with lock:
                port = ports.pop()
            try:
                job.command = sanitizer_command(
                    sanitizer,
                    job.tool,
                    [c.name for c in job.configs],
                    port=port,
                    launch_timeout=int(args.timeout),
                    racecheck_report=args.racecheck_report,
                    all_kernels=args.all_kernels,
                    settle=args.settle,
                    padding=args.padding,
                )
                env = job_env(job.tool, args.caching_allocator, not args.no_lineinfo)
                timeout = args.timeout if remaining is None else min(args.timeout, remaining)
                run_job(job, env, timeout, log_dir)
            finally:
                with lock:
                    ports.append(port)
        with lock:
            done_count[0] += 1
            n_err = sum(config_result(job, c, args.strict)["status"] not in PASSING for c in job.configs)
            probs = job_problems(job, args.strict)
            state = "ok" if not n_err and not probs else f"{n_err} failing" + (f"; {'; '.join(probs)}" if probs else "")
            print(
                f"[{done_count[0]:2d}/{len(jobs)}] {job.tool:9} {job.group:28} {len(job.configs):2d} configs "
                f"{job.seconds:6.1f} s  {state}",
                flush=True,
            )
        return job

    if args.warm:
        plain = [j for j in jobs if j.tool == PLAIN]
        with ThreadPoolExecutor(jobs_n) as pool:
            list(pool.map(execute, plain))
        jobs_rest = [j for j in jobs if j.tool != PLAIN]
    else:
        jobs_rest = jobs
    with ThreadPoolExecutor(jobs_n) as pool:
        for fut in as_completed([pool.submit(execute, j) for j in jobs_rest]):
            fut.result()
    wall = time.time() - start

    # ------------------------------------------------------------------ the report
    results, processes = [], []
    order = {c.name: i for i, c in enumerate(configs)}
    for job in jobs:
        for c in job.configs:
            results.append(config_result(job, c, args.strict))
        p = job.parsed
        processes.append(
            {
                "tool": job.tool,
                "group": job.group,
                "configs": [c.name for c in job.configs],
                "returncode": job.returncode,
                "seconds": round(job.seconds, 2),
                "timed_out": job.timed_out,
                "skipped": job.skipped,
                "problems": job_problems(job, args.strict),
                "error_summary": p.error_summary if p else None,
                "racecheck_summary": p.race_summary if p else None,
                "outside_configs": {
                    k: {"errors": b.errors, "warnings": b.warnings, "api_errors": b.api_errors, "excerpt": b.lines}
                    for k, b in (p.buckets.items() if p else ())
                    if k in (STARTUP, EXIT)
                },
                "command": job.command,
                "log": job.log,
            }
        )
    for c in configs:  # a tool a configuration is not meant for
        for t in run_tools:
            if not any(r["config"] == c.name and r["tool"] == t for r in results):
                results.append(
                    {
                        "config": c.name,
                        "family": c.family,
                        "group": c.group,
                        "tool": t,
                        "status": "skipped",
                        "errors": 0,
                        "warnings": 0,
                        "api_errors": 0,
                        "seconds": None,
                        "detail": "",
                        "excerpt": [],
                        "log": "",
                    }
                )
    tool_rank = {t: i for i, t in enumerate(run_tools)}
    results.sort(key=lambda r: (order[r["config"]], tool_rank[r["tool"]]))
    failing = [r for r in results if r["status"] not in PASSING]
    proc_failing = [p for p in processes if p["problems"]]
    ok = not failing and not proc_failing

    print()
    print(format_table(results, run_tools))
    print()
    for r in failing:
        print(
            f"FAIL {r['config']} [{r['tool']}]: {r['status']}"
            + (f" ({r['errors']} errors)" if r["errors"] else "")
            + (f" {r['detail']}" if r["detail"] else "")
        )
        for line in r["excerpt"][:12]:
            print(f"    {line}")
    for p in proc_failing:
        print(f"FAIL process {p['tool']} {p['group']}: {'; '.join(p['problems'])} (log {p['log']})")
    print(
        f"{'OK' if ok else 'FAILED'}: {len(results) - len(failing)}/{len(results)} (configuration, tool) pairs pass;"
        f" {wall:.0f} s"
    )

    report = {
        "device": device,
        "arch": arch,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "sanitizer": {"path": sanitizer, "version": version},
        "tools": run_tools,
        "group": args.group,
        "jobs": jobs_n,
        "kernel_filter": None if args.all_kernels else KERNEL_FILTER,
        "seconds": round(wall, 1),
        "ok": ok,
        "results": results,
        "processes": processes,
    }
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
