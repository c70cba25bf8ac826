"""torchrun --nproc-per-node N -m benchmarks.context_parallel [--seqlen S] [--batch B] [--heads H]
[--kv-heads Hk] [--head-dim D] [--no-causal] [--out DIR] [--largest [--max-step-s T]]

A training step's attention (forward + backward) over one sequence sharded across the N GPUs
of one host, each implementation through its public entry:

- ``ours``: ``ops.context_parallel_attention`` (K / V all-gathered, our forward and backward
  per rank, dK / dV reduce-scattered);
- ``torch_cp_cudnn`` / ``torch_cp_flash``: torch's ``context_parallel`` (its ring, head-tail
  load balancing, the all-gather rotation by default) over SDPA's cuDNN / flash backend;
- ``torch_cp_efficient_ours``: the same ring over SDPA's efficient backend under
  ``ops.use_for_sdpa()`` (our kernels inside torch's ring);
- ``one_gpu_ours``: ``ops.memory_efficient_attention`` on the full sequence on each GPU alone
  (the work the ring splits; its TFLOP/s are one GPU's).

Every implementation's gathered O, dQ, dK, dV are first compared with ``one_gpu_ours``
(``check``: relative Frobenius errors). Then all are timed in ROUNDS interleaved rounds of a
fixed number of steps (every rank runs the same steps: collectives need it), a round's time
the slowest rank's; the row's ``ms`` is the median round. TFLOP/s per GPU count 3.5 x the
forward's 4 B H S^2 D (halved when causal) over N GPUs.

``--largest``: ours alone, one timed step at each of --seqlen, 2x, 4x, ... (after an untimed
one at --seqlen, which compiles) until a rank runs out of memory or a step takes over
--max-step-s; rows ``ours_largest_probe`` with the step's ms and the largest peak memory of a
rank (``peak_gib``), the last row's status saying why it stopped.

Rank 0 writes ``benchmarks/results/<arch>-<gpu>/context_parallel.json``, replacing the rows of
the same case, N and implementation. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as the shared machines need.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys

from .gpus import results_dir

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SUITE = "context_parallel"
IMPLS = ("ours", "torch_cp_cudnn", "torch_cp_flash", "torch_cp_efficient_ours", "one_gpu_ours")
ROUNDS = 5
WARMUP_STEPS = 3
STEPS = 10  # timed steps a round
FLOPS_SCALE = 3.5  # forward 1 + backward 2.5, as the attention_train suite counts


def set_environment() -> None:
    """NVLink multicast off before NCCL starts: the shared machines must never turn it on."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def case_name(a) -> str:
    """``BxHxSxD:bf16[:causal][:kv<Hk>]``, the attention suites' syntax, S the global length."""
    name = f"{a.batch}x{a.heads}x{a.seqlen}x{a.head_dim}:bf16" + (":causal" if a.causal else "")
    return name + (f":kv{a.kv_heads}" if a.kv_heads != a.heads else "")


def step_flops(a) -> float:
    """A step's FLOPs over all GPUs: 3.5 x 4 B H S^2 D, halved when causal."""
    return FLOPS_SCALE * 4 * a.batch * a.heads * a.seqlen**2 * a.head_dim * (0.5 if a.causal else 1.0)


def merge_rows(old: list, new: list) -> list:
    """``old`` without the rows of ``new``'s (case, gpus, impl), then ``new``: runs on 2 and 4
    GPUs, and ``--largest``'s probes, share the file."""
    done = {(r["case"], r["gpus"], r["impl"]) for r in new}
    return [r for r in old if (r.get("case"), r.get("gpus"), r.get("impl")) not in done] + new


def rel_err(x, ref) -> float:
    """|x - ref| / |ref| (Frobenius, fp64)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def _parser():
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m benchmarks.context_parallel",
        description=head,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--seqlen", type=int, default=None, help="global tokens (default: 16384 per GPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="key / value heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--out", default=RESULTS, help="results root (default: benchmarks/results)")
    ap.add_argument(
        "--largest",
        action="store_true",
        help="instead: the longest sequence ours trains, doubling from --seqlen until a step runs out "
        "of memory or takes over --max-step-s (one step each, no peers, no check)",
    )
    ap.add_argument("--max-step-s", type=float, default=30.0, help="--largest stops after a step this long")
    return ap


def parse_args(argv, world: int):
    a = _parser().parse_args(argv)
    a.seqlen = a.seqlen or 16384 * world
    a.kv_heads = a.kv_heads or a.heads
    if a.seqlen % (2 * world):
        raise SystemExit(f"--seqlen must split into 2 x {world} chunks, got {a.seqlen}")
    return a


# ---------------------------------------------------------------------- the steps (GPU)


class _Impl:
    """One implementation: ``block()`` a context for a round of steps (torch's shards its
    buffers on entry), ``step()`` a forward and backward, ``result()`` the gathered (O, dQ, dK,
    dV) in [B, S, H, D]."""

    def __init__(self, block, step, result):
        self.block, self.step, self.result = block, step, result


def _ours(x, group):
    import ops
    from ops.context_parallel import shard, unshard

    leaves = [shard(t, group).requires_grad_() for t in (x["q"], x["k"], x["v"])]
    dout, out = shard(x["dout"], group), [None]

    def step():
        for t in leaves:
            t.grad = None
        out[0] = ops.context_parallel_attention(*leaves, group=group, causal=x["causal"])
        out[0].backward(dout)

    def result():
        return [unshard(t, group) for t in (out[0].detach(), *(t.grad for t in leaves))]

    return _Impl(contextlib.nullcontext, step, result)


def _torch_cp(x, mesh, backend, ours_inside):
    """torch's context_parallel on [B, H, S, D] copies; each block shards fresh copies."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard
    from torch.nn.attention import sdpa_kernel

    import ops

    state = {}

    @contextlib.contextmanager
    def block():
        bufs = [x[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "dout")]
        balanced = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = x["causal"]  # torch's ring refuses head-tail chunks unmasked
        try:
            with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
                for t in bufs[:3]:
                    t.requires_grad_()
                state["bufs"] = bufs
                with sdpa_kernel([backend]), ops.use_for_sdpa(enabled=ours_inside):
                    yield
        finally:
            _cp_options.enable_load_balance = balanced
        for t in bufs[:3]:
            t.requires_grad_(False)

    def step():
        q, k, v, dout = state["bufs"]
        for t in (q, k, v):
            t.grad = None
        state["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=x["causal"], enable_gqa=x["gqa"])
        state["out"].backward(dout)

    def result():  # inside block(): the gather undoes the chunks' order only where they were balanced
        q, k, v, _ = state["bufs"]
        tensors = [state["out"].detach(), q.grad, k.grad, v.grad]
        return [t.transpose(1, 2) for t in context_parallel_unshard(mesh, tensors, [2] * 4)]

    return _Impl(block, step, result)


def _one_gpu(x):
    import ops

    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    out = [None]

    def step():
        for t in leaves:
            t.grad = None
        out[0] = ops.memory_efficient_attention(*leaves, causal=x["causal"])
        out[0].backward(x["dout"])

    return _Impl(contextlib.nullcontext, step, lambda: [out[0].detach(), *(t.grad for t in leaves)])


def _impls(x, group, mesh) -> dict:
    from torch.nn.attention import SDPBackend

    return {
        "ours": lambda: _ours(x, group),
        "torch_cp_cudnn": lambda: _torch_cp(x, mesh, SDPBackend.CUDNN_ATTENTION, False),
        "torch_cp_flash": lambda: _torch_cp(x, mesh, SDPBackend.FLASH_ATTENTION, False),
        "torch_cp_efficient_ours": lambda: _torch_cp(x, mesh, SDPBackend.EFFICIENT_ATTENTION, True),
        "one_gpu_ours": lambda: _one_gpu(x),
    }


def _round_ms(impl, steps: int) -> float:
    """Milliseconds a step over ``steps`` steps, the slowest rank's."""
    import torch
    import torch.distributed as dist

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with impl.block():
        for _ in range(WARMUP_STEPS):
            impl.step()
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        for _ in range(steps):
            impl.step()
        end.record()
        torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / steps], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _checked(impls: dict, error) -> dict:
    """Each implementation set up and run once: {name: (impl or None, check dict or error)}."""
    import torch

    done, base = {}, None
    for name in ("one_gpu_ours",) + tuple(n for n in IMPLS if n != "one_gpu_ours"):
        try:
            impl = impls[name]()
            with impl.block():
                impl.step()
                got = impl.result()
            base = got if name == "one_gpu_ours" else base
            check = {} if base is None else {k: rel_err(g, b) for k, g, b in zip(("out", "dq", "dk", "dv"), got, base)}
            done[name] = (impl, check)
        except Exception as e:  # recorded, not faked: a backend that refuses the case keeps its row
            done[name] = (None, error(e))
        torch.cuda.synchronize()
    return done


def _inputs(a):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)  # the same full tensors on every rank

    def randn(heads):
        return torch.randn(a.batch, a.seqlen, heads, a.head_dim, generator=g, device="cuda", dtype=torch.bfloat16)

    x = {"q": randn(a.heads), "k": randn(a.kv_heads), "v": randn(a.kv_heads), "dout": randn(a.heads)}
    return {**x, "causal": a.causal, "gqa": a.kv_heads != a.heads}


def _rows(a, world, done, rounds) -> list:
    import torch

    flops, date, device = step_flops(a), datetime.date.today().isoformat(), torch.cuda.get_device_name()
    rows = []
    for name in IMPLS:
        impl, check = done[name]
        r = dict(suite=SUITE, case=case_name(a), impl=name, gpus=world, causal=a.causal, device=device, date=date)
        r["torch"] = torch.__version__
        if impl is None:
            rows.append({**r, "ms": float("nan"), "tflops": float("nan"), "status": "error", "error": check})
            continue
        ms = statistics.median(rounds[name])
        gpus = 1 if name == "one_gpu_ours" else world  # one GPU runs the whole sequence
        tflops = flops / gpus / ms / 1e9
        rows.append({**r, "ms": ms, "tflops": tflops, "ms_rounds": rounds[name], "status": "ok", "check": check})
    return rows


def _write(a, rows) -> str:
    import torch

    from ops._compile import device_arch

    out_dir = results_dir(a.out, device_arch(torch.cuda.current_device()), torch.cuda.get_device_name())
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{SUITE}.json")
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    with open(path, "w") as f:
        json.dump(merge_rows(old, rows), f, indent=1)
    return path


def main(argv=None) -> int:
    set_environment()
    a = parse_args(argv, int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's; --help needs no GPU
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .suites.attention_common import err

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        world = dist.get_world_size()
        if a.largest:
            rows = _largest(a, world, None)
        else:
            mesh = init_device_mesh("cuda", (world,))
            done = _checked(_impls(_inputs(a), None, mesh), err)
            rows = _rows(a, world, done, _time(done))
        if dist.get_rank() == 0:
            for row in rows:
                rate = f"{row['ms']:9.3f} ms {row['tflops']:6.1f} TFLOP/s per GPU" if row["status"] == "ok" else ""
                extra = row.get("check", row.get("error", row.get("peak_gib", row["status"])))
                print(f"{row['case']} {world} GPUs {row['impl']:24} {rate} {extra}")
            print(f"wrote {_write(a, rows)}")
    finally:
        dist.destroy_process_group()
    return 0


def _largest(a, world: int, group) -> list:
    """Rows of ``--largest``: ours, one forward + backward step at doubling sequence lengths
    from the rank's own shards (no full tensors), until one runs out of memory on some rank or
    takes over ``a.max_step_s``; each row has the step's ms and the largest peak memory of a rank."""
    import torch
    import torch.distributed as dist

    import ops

    rows, seqlen = [], a.seqlen
    while True:
        local = seqlen // world
        ms, peak, oom = 0.0, 0.0, False
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            shape = (a.batch, local, a.heads, a.head_dim)
            kv = (a.batch, local, a.kv_heads, a.head_dim)
            q, k, v = (
                torch.randn(s_, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s_ in (shape, kv, kv)
            )

            def step():
                ops.context_parallel_attention(q, k, v, group=group, causal=a.causal).backward(torch.randn_like(q))

            if not rows:  # the first length compiles the kernels: a step before the timed one
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            ms, peak = start.elapsed_time(end), torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError:
            oom = True
        q = k = v = None
        flags = torch.tensor([float(oom), ms, peak], device="cuda")  # the slowest, fullest rank's
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        status = "out of memory" if flags[0].item() else "ok"
        b = argparse.Namespace(**{**vars(a), "seqlen": seqlen})
        row = dict(
            suite=SUITE, case=case_name(b), impl="ours_largest_probe", gpus=world, causal=a.causal, status=status
        )
        row.update(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), torch=torch.__version__)
        if status == "ok":
            row.update(
                ms=flags[1].item(), tflops=step_flops(b) / world / flags[1].item() / 1e9, peak_gib=flags[2].item()
            )
        rows.append(row)
        if status != "ok" or row["ms"] > a.max_step_s * 1e3:
            return rows
        seqlen *= 2


def _time(done) -> dict:
    """{impl: [ms a step, per round]} of the implementations that ran, in ROUNDS rounds whose
    order rotates by one (the board's drift falls on all of them alike)."""
    timed = [n for n in IMPLS if done[n][0] is not None]
    rounds = {n: [] for n in timed}
    for r in range(ROUNDS if timed else 0):
        for name in timed[r % len(timed) :] + timed[: r % len(timed)]:
            rounds[name].append(_round_ms(done[name][0], STEPS))
    return rounds


if __name__ == "__main__":
    sys.exit(main())
