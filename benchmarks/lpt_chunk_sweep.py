"""The sm90 attention backward's heavy-first chunk (``heads_per_chunk``) against its model.

``python -m benchmarks.lpt_chunk_sweep [--cases B,H,S,D ...] [--chunks 1,2,...] [--repeats N]``
times the full sm90 backward (preprocess, kernel, convert_dq) of causal bf16 cases with every
chunk size given, interleaved over repeats (medians), beside FA4's backward in the same run,
and prints each chunk's modelled makespan over the ideal (``layouts/lpt_order.py``) next to
its time. The chunk is a runtime argument of the kernel: one compile per head dim. Writes
the rows as JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

DEFAULT_CASES = ("2,16,4096,128", "1,16,8192,128", "4,16,2048,128", "2,16,4096,64", "8,16,1024,64")
DEFAULT_CHUNKS = "1,2,3,4,6,8,12,16,0"  # 0: the largest chunk that fits L2 (the order before the model)


def model_ratio(tiles, b, h, s, chunk, num_sms):
    from layouts.lpt_order import TILE_OVERHEAD_STEPS, heavy_first_order, makespan

    steps = tiles.key_block_steps(s, s, 1, 1)
    costs = [x + TILE_OVERHEAD_STEPS for x in steps]
    ideal = sum(costs) * b * h / num_sms
    return makespan([costs[n] for n, _ in heavy_first_order(len(steps), b * h, chunk)], num_sms) / ideal


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES))
    ap.add_argument("--chunks", default=DEFAULT_CHUNKS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import ops
    import ops.attention_sm90 as sm90
    from benchmarks.suites.attention_bwd import _check, _import_fa4, _setup_efficient, _setup_fa4
    from benchmarks.timing import bench_ms
    from layouts import attention_sm90 as tiling

    fa4 = _import_fa4()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = sm90._heads_per_chunk
    rows = []
    print(f"gpu: {torch.cuda.get_device_name(0)}, {num_sms} SMs")
    for spec in args.cases:
        b, h, s, d = map(int, spec.split(","))
        tiles = tiling.attention_sm90_tiles(d)
        fit = tiles.lpt_heads_per_chunk(s, 1, 2)
        auto = tiles.lpt_heads_per_chunk(s, 1, 2, seqlen_k=s, pairs=b * h, mask_type=1, num_sms=num_sms)
        chunks = sorted({fit if c == 0 else c for c in map(int, args.chunks.split(",")) if (c or fit) <= b * h} | {auto})
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        torch.manual_seed(0)
        _, ref, _ = _setup_efficient(q, k, v, dout, True)
        fwd_out = torch.ops.aten._efficient_attention_forward(q, k, v, None, None, None, s, s, 0.0, 1, True, scale=None)
        out, lse = fwd_out[0], fwd_out[1]

        def ours():
            return ops.efficient_attention_backward(dout, q, k, v, None, out, None, None, s, s, lse, 0.0,
                                                    fwd_out[2], fwd_out[3], 1, False, backend="sm90")  # fmt: skip

        fa4_fn, fa4_grads, _ = _setup_fa4(q, k, v, dout, True, fa4)
        times = {c: [] for c in chunks}
        times["fa4"] = []
        checks = {}
        for c in chunks:  # every chunk gives the same gradients (only the CTA order moves)
            sm90._heads_per_chunk = lambda *a, c=c, **kw: c
            checks[c] = _check(ours()[:3], ref)
        for _ in range(args.repeats):
            times["fa4"].append(bench_ms(fa4_fn))
            for c in chunks:
                sm90._heads_per_chunk = lambda *a, c=c, **kw: c
                times[c].append(bench_ms(ours))
        sm90._heads_per_chunk = chosen
        fa4_ms = statistics.median(times["fa4"])
        print(f"\ncausal {b}x{h}x{s}x{d}: FA4 {fa4_ms:.3f} ms (fit {fit}, model's choice {auto})")
        for c in chunks:
            ms = statistics.median(times[c])
            ratio = model_ratio(tiles, b, h, s, c, num_sms)
            tag = " <- model" if c == auto else (" <- L2 fit (before)" if c == fit else "")
            ok = "ok" if checks[c]["ok"] else f"WRONG {checks[c]['max_rel_err']}"
            print(f"  chunk {c:3d}: {ms:.3f} ms  vs FA4 {fa4_ms / ms:.3f}x  model {ratio:.3f}  {ok}{tag}")
            rows.append({"case": f"{b}x{h}x{s}x{d}:bf16:causal", "chunk": c, "ms": ms, "all_ms": times[c],
                         "fa4_ms": fa4_ms, "model_over_ideal": ratio, "check": checks[c], "fit": fit, "auto": auto})
        del q, k, v, dout, out, lse, ref, fa4_grads
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
