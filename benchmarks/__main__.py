"""python -m benchmarks [--quick] [--suite NAME]: every kernel against its peers on this GPU.

On a GPU: times each suite's cases, prints a table and writes
benchmarks/results/<arch>-<gpu>/<suite>.json (rows: suite, case, impl, ms, gbps or tflops,
device = the full GPU name, date; the attention suites add the board's power_w, sm_clock_mhz,
energy_mj) with a PNG plot beside it. <arch>-<gpu> is e.g. sm90-h100, sm90-h200,
sm90-h100-pcie, sm80-a100: one folder per GPU model, whose bandwidth and power cap differ.
--quick runs a few cases per suite and writes <suite>.quick.json / .png instead (not
committed: .gitignore), so a quick run never overwrites a full one.

Without a GPU nothing can be timed: it compiles the kernel configurations with fake tensors
for sm_80 and sm_90a instead (every configuration; with --quick only those the quick cases
run), one progress line per suite, and writes nothing.

python -m benchmarks.sanitize runs the kernels under compute-sanitizer and writes
sanitize.json into the same folder. More: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time

from .gpus import results_dir
from .suites import SUITES

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _table(rows):
    ours = {r["case"]: r for r in rows if r["impl"] == "ours"}
    board = any("power_w" in r for r in rows)  # the board's power / clock (benchmarks.board)
    head = f"{'suite':18} {'case':34} {'impl':14} {'ms':>9} {'GB/s|TF/s':>10} {'ours x':>7}"
    lines = [head + (f" {'W':>5} {'MHz':>5}" if board else "")]
    for r in rows:
        rate = r.get("gbps", r.get("tflops"))
        o = ours.get(r["case"])
        speedup = f"{r['ms'] / o['ms']:.2f}" if o and r["impl"] != "ours" else ""
        line = f"{r['suite']:18} {r['case']:34} {r['impl']:14} {r['ms']:9.4f} {rate:10.1f} {speedup:>7}"
        if board:
            line += f" {r['power_w']:5.0f} {r['sm_clock_mhz']:5.0f}" if "power_w" in r else f" {'':5} {'':5}"
        lines.append(line)
    return "\n".join(lines)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    key = "gbps" if "gbps" in rows[0] else "tflops"
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cases)), 4))
    w = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = [next((r[key] for r in rows if r["case"] == c and r["impl"] == impl), 0) for c in cases]
        ax.bar([j + i * w for j in range(len(cases))], vals, w, label=impl)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB/s" if key == "gbps" else "TFLOP/s")
    ax.set_title(f"{rows[0]['suite']} on {rows[0]['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser():
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a few cases per suite, written as <suite>.quick.json; without a GPU, compile only their configurations",
    )
    ap.add_argument("--suite", action="append", choices=SUITES, help="run only this suite (repeatable)")
    ap.add_argument("--out", default=RESULTS, help="results root (default: benchmarks/results)")
    return ap


def _compile_without_gpu(suites, quick):
    from .compile_check import ARCHES, compile_suites

    which = "the configurations of the --quick cases" if quick else "every kernel configuration"
    print(f"No CUDA GPU here: nothing can be timed. Compiling {which} with fake tensors")
    print(f"for {' and '.join(ARCHES)} instead (nothing is written).")
    t0 = time.time()
    n = compile_suites(suites, quick)
    print(f"{n} configurations compiled in {time.time() - t0:.1f} s")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    suites = args.suite or list(SUITES)

    import torch

    if not torch.cuda.is_available():
        return _compile_without_gpu(suites, args.quick)

    from ops._compile import device_arch

    from .arch import settings as arch_settings

    arch = device_arch(torch.cuda.current_device())
    settings = arch_settings(arch)
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    out_dir = results_dir(args.out, arch, device)
    os.makedirs(out_dir, exist_ok=True)
    print(f"{device} ({arch}), torch {torch.__version__}")
    for name in suites:
        mod = importlib.import_module(f"benchmarks.suites.{name}")
        rows = mod.run(settings, args.quick)
        for r in rows:
            r.update(device=device, date=date)
        path = os.path.join(out_dir, f"{name}{'.quick' if args.quick else ''}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        _plot(rows, path[:-5] + ".png")
        print(_table(rows))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
