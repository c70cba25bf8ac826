"""How the sm90 attention backward's CTAs are ordered, measured on the GPU.

``python -m benchmarks.sm90_schedule chunk [--cases B,H,S,D ...] [--chunks 1,2,...]``: the
heavy-first order's chunk (``heads_per_chunk``) of causal cases against its model: the full
backward (preprocess, kernel, convert_dq) with every chunk size given, beside FA4's, and each
chunk's modelled makespan over the ideal (``cute_kernels/attention_sm90/lpt_order.py``).

All bf16, [B, S, H, D]; the chunk is a runtime argument of the kernel (one compile
per configuration); timings interleaved over ``--repeats`` (medians, L2 flushed). ``--out``
writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

DEFAULT_CASES = ("2,16,4096,128", "1,16,8192,128", "4,16,2048,128", "2,16,4096,64", "8,16,1024,64")
DEFAULT_CHUNKS = "1,2,3,4,6,8,12,16,0"  # 0: the largest chunk that fits L2 (the order before the model)


def model_ratio(tiles, b, h, s, chunk, num_sms):
    """The heavy-first order's modelled makespan with ``chunk`` heads a chunk over the ideal
    (cute_kernels/attention_sm90/lpt_order.py): causal from the top-left, Sq == Sk == s, B x H pairs."""
    from cute_kernels.attention_sm90.lpt_order import makespan_over_ideal

    return makespan_over_ideal(tiles.key_block_steps(s, s, 1, 1), b * h, chunk, num_sms)


class Problem:
    """Random bf16 Q, K, V, dO [B, S, H, D], the memory-efficient forward's out / LSE, the
    reference gradients (aten's backward), our sm90 backward and FA4's as callables."""

    def __init__(self, b, h, s, d, causal, fa4=None):
        import ops
        from benchmarks.suites.attention_bwd import _setup_efficient, _setup_fa4

        mask = 1 if causal else 0
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        torch.manual_seed(0)
        _, self.ref, _ = _setup_efficient(q, k, v, dout, causal)
        fwd = torch.ops.aten._efficient_attention_forward(q, k, v, None, None, None, s, s, 0.0, mask, True, scale=None)
        out, lse, seed, offset = fwd[:4]

        def ours():
            return ops.efficient_attention_backward(
                dout, q, k, v, None, out, None, None, s, s, lse, 0.0, seed, offset, mask, False, backend="sm90"
            )

        self.ours = ours
        self.fa4 = _setup_fa4(q, k, v, dout, causal, fa4)[0] if fa4 is not None else None

    def check(self):
        from benchmarks.suites.attention_bwd import _check

        return _check(self.ours()[:3], self.ref)


def interleaved(fns: dict, repeats: int) -> dict:
    """Median ms of each callable, timed in turn ``repeats`` times."""
    from benchmarks.timing import bench_ms

    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if callable(fn):
                times[name].append(bench_ms(fn))
            else:  # (setup, fn): setup() before timing fn (a module switch)
                fn[0]()
                times[name].append(bench_ms(fn[1]))
    return {name: statistics.median(t) for name, t in times.items()}


def chunk_sweep(args, fa4, num_sms):
    import ops.attention_sm90 as sm90
    from cute_kernels.attention_sm90 import backward_config as config

    chosen = sm90._heads_per_chunk
    rows = []
    for spec in args.cases or DEFAULT_CASES:
        b, h, s, d = map(int, spec.split(","))
        tiles = config.attention_sm90_tiles(d)
        fit = tiles.lpt_heads_per_chunk(s, 1, 2)
        auto = tiles.lpt_heads_per_chunk(s, 1, 2, seqlen_k=s, pairs=b * h, mask_type=1, num_sms=num_sms)
        chunks = sorted(
            {fit if c == 0 else c for c in map(int, args.chunks.split(",")) if (c or fit) <= b * h} | {auto}
        )
        p = Problem(b, h, s, d, True, fa4)

        def use(c):
            sm90._heads_per_chunk = lambda *a, **kw: c

        checks = {}
        for c in chunks:  # every chunk gives the same gradients (only the CTA order moves)
            use(c)
            checks[c] = p.check()
        fns = {"fa4": p.fa4}
        fns.update({c: (lambda c=c: use(c), p.ours) for c in chunks})
        times = interleaved(fns, args.repeats)
        sm90._heads_per_chunk = chosen
        fa4_ms = times["fa4"]
        print(f"\ncausal {b}x{h}x{s}x{d}: FA4 {fa4_ms:.3f} ms (fit {fit}, model's choice {auto})")
        for c in chunks:
            ms = times[c]
            ratio = model_ratio(tiles, b, h, s, c, num_sms)
            tag = " <- model" if c == auto else (" <- L2 fit (before)" if c == fit else "")
            ok = "ok" if checks[c]["ok"] else f"WRONG {checks[c]['max_rel_err']}"
            print(f"  chunk {c:3d}: {ms:.3f} ms  vs FA4 {fa4_ms / ms:.3f}x  model {ratio:.3f}  {ok}{tag}")
            rows.append(
                {
                    "probe": "chunk",
                    "case": f"{b}x{h}x{s}x{d}:bf16:causal",
                    "chunk": c,
                    "ms": ms,
                    "fa4_ms": fa4_ms,
                    "model_over_ideal": ratio,
                    "check": checks[c],
                    "fit": fit,
                    "auto": auto,
                }
            )
        del p
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", choices=("chunk",))
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--chunks", default=DEFAULT_CHUNKS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from benchmarks.suites.attention_bwd import _import_fa4

    fa4 = _import_fa4()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"gpu: {torch.cuda.get_device_name(0)}, {num_sms} SMs")
    rows = chunk_sweep(args, fa4, num_sms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
