"""The cases, fp32 reference and implementations that attention_fwd and attention_train share.

Case specs (``ATTENTION_FWD`` / ``ATTENTION_TRAIN`` in ``benchmarks/arch/*.py``):
``((B, H, S, D), dtype name, causal[, features])``, ``features`` a ":"-joined string of

- ``kv<N>``: N key / value heads (grouped-query: N divides H);
- ``dv<N>``: the value head dim N (D is the query / key head dim);
- ``window<N>``: a causal sliding window: query n sees the N keys n - N < m <= n;
- ``varlen``: B = 1 and the S tokens packed as the sequences of ``varlen_lengths(S)`` (a fixed,
  seeded mix of lengths), each attending only within itself (``cu_seqlens``).

A case's name is its spec's: ``BxHxSxD:bf16[:causal][:features]`` (``case_name``; ``parse_case``
reads it back). Q [B, S, H, D], K [B, S, Hk, D], V [B, S, Hk, Dv], dO [B, S, H, Dv] contiguous,
seqlen_q = seqlen_k, softmax scale 1 / sqrt(D).

Implementations (``forward``): each one's public entry, returning O as [B, S, H, Dv]:

- ``ours``: ``ops.memory_efficient_attention`` (whatever forward it runs);
- ``fa4``: ``flash_attn.cute.flash_attn_func`` / ``flash_attn_varlen_func`` (GQA, windows as
  (N - 1, 0), varlen, Dv != D);
- ``sdpa_efficient`` / ``sdpa_flash`` / ``sdpa_cudnn``: ``F.scaled_dot_product_attention`` under
  ``sdpa_kernel`` of that backend on [B, H, S, D] views, ``enable_gqa`` with fewer key heads; no
  varlen or window (unavailable); a backend that refuses the inputs ("No available kernel") is
  unavailable with torch's reasons.

Every implementation is checked against an fp32 reference (``reference``: per sequence and key
head) before it is timed: max |x - ref| / max |ref| of O (and dQ, dK, dV) below TOL; ours is
timed only when right, the peers either way (the row keeps the check).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import warnings
from typing import Optional, Tuple

import torch

from .attention_bwd import SHORT, TOL, _add_ratios, _max_rel
from .attention_common import NAN, err, matmul_row, time_in_rounds

IMPLS = ("ours", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fa4")
TOKEN = re.compile(r"^(?:(kv|dv|window)([1-9]\d*)|(varlen))$")
LONG = {v: k for k, v in SHORT.items()}
VARLEN_SEED = 0
VARLEN_LOG2 = (7.0, 13.0)  # varlen lengths drawn log-uniformly from 2^7 to 2^13 tokens
CHECKED = ("out", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = False
    kv_heads: int = 0  # 0: heads
    head_dim_v: int = 0  # 0: head_dim
    window: int = 0  # 0: none
    varlen: bool = False

    @property
    def hk(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def features(self) -> str:
        tokens = [f"kv{self.kv_heads}"] * bool(self.kv_heads) + [f"dv{self.head_dim_v}"] * bool(self.head_dim_v)
        tokens += [f"window{self.window}"] * bool(self.window) + ["varlen"] * self.varlen
        return ":".join(tokens)

    @property
    def name(self) -> str:
        shape = f"{self.batch}x{self.heads}x{self.seqlen}x{self.head_dim}:{SHORT[self.dtype]}"
        return ":".join([shape] + ["causal"] * self.causal + [self.features] * bool(self.features))

    @property
    def spec(self) -> tuple:
        head = ((self.batch, self.heads, self.seqlen, self.head_dim), self.dtype, self.causal)
        return head + ((self.features,) if self.features else ())

    def lengths(self) -> Tuple[int, ...]:
        """The sequence lengths: ``varlen_lengths(S)`` with varlen, else S once a batch entry."""
        return varlen_lengths(self.seqlen) if self.varlen else (self.seqlen,) * self.batch

    @classmethod
    def from_spec(cls, spec) -> "Case":
        (b, h, s, d), dtype, causal, *rest = spec
        fields = {}
        for token in rest[0].split(":") if rest and rest[0] else ():
            kind = _kind(token)
            key = {"kv": "kv_heads", "dv": "head_dim_v", "window": "window"}.get(kind, "varlen")
            fields[key] = int(token[len(kind) :]) if kind != "varlen" else True
        case = cls(b, h, s, d, dtype, bool(causal), **fields)
        case._validate()
        return case

    def _validate(self):
        if self.heads % self.hk:
            raise ValueError(f"{self.name}: {self.hk} key heads do not divide {self.heads}")
        if self.window and not self.causal:
            raise ValueError(f"{self.name}: a window needs causal")
        if self.varlen and self.batch != 1:
            raise ValueError(f"{self.name}: varlen packs the sequences along S of batch 1")


def case_name(spec) -> str:
    return Case.from_spec(spec).name


def parse_case(name: str) -> tuple:
    """The spec of a case name (``case_name``'s inverse)."""
    shape, dtype, *rest = name.split(":")
    causal = bool(rest) and rest[0] == "causal"
    features = ":".join(rest[1:] if causal else rest)
    spec = (tuple(int(x) for x in shape.split("x")), LONG[dtype], causal) + ((features,) if features else ())
    return Case.from_spec(spec).spec


def suite_cases(table, quick: bool) -> list:
    """A table's quick cases, or its full and quick ones (each once)."""
    return table["quick"] if quick else list(dict.fromkeys(table["full"] + table["quick"]))


def plain_specs(specs, keyed=()) -> list:
    """``(shape, dtype, causal)`` of the specs whose features are all of the kinds ``keyed``
    ("kv", "dv", "window", "varlen"): what the ops' ``benchmark_configurations`` take, for the
    cases whose compile keys they give faithfully (each spec once); ``keyed`` "all": every spec
    whole, features included, for an op that keys them all."""
    if keyed == "all":
        return list(dict.fromkeys(tuple(spec) for spec in specs))
    out = []
    for spec in specs:
        tokens = spec[3].split(":") if len(spec) > 3 and spec[3] else []
        if all(_kind(t) in keyed for t in tokens):
            out.append(tuple(spec[:3]))
    return list(dict.fromkeys(out))


def _kind(token: str) -> str:
    m = TOKEN.match(token)
    if m is None:
        raise ValueError(f"unknown feature {token!r} (kv<N>, dv<N>, window<N>, varlen)")
    return m[1] or m[3]


def keyed_configs(cases, keyed: dict, arch: str) -> list:
    """``compile_check.Config``s of ``ops.<name>.benchmark_configurations`` for each name of
    ``keyed``, given the cases whose features it keys faithfully (``plain_specs``)."""
    import importlib

    from ..compile_check import Config

    configs = []
    for name, kinds in keyed.items():
        keys = importlib.import_module(f"ops.{name}").benchmark_configurations(plain_specs(cases, kinds), arch)
        configs += [Config(f"ops.{name}:compiled", key if isinstance(key, tuple) else (key,)) for key in keys]
    return configs


def varlen_lengths(total: int, seed: int = VARLEN_SEED) -> Tuple[int, ...]:
    """Sequence lengths summing to ``total``: drawn log-uniformly over VARLEN_LOG2 with
    ``random.Random(seed)``, the last one what is left (a remainder under the smallest length
    joins the sequence before it)."""
    rng, lengths, left = random.Random(seed), [], total
    low = int(2 ** VARLEN_LOG2[0])
    while left > 0:
        n = min(left, int(2 ** rng.uniform(*VARLEN_LOG2)))
        lengths.append(n if left - n >= low else left)
        left -= lengths[-1]
    return tuple(lengths)


def visited_pairs(n: int, causal: bool, window: int = 0) -> float:
    """The (query, key) pairs computed in a sequence of ``n`` tokens: n^2, halved when causal
    (the usual convention), and with a window w exactly sum over queries i of min(i + 1, w)."""
    if window:
        w = min(window, n)
        return w * (w + 1) / 2 + (n - w) * w
    return n * n / 2 if causal else float(n * n)


def forward_flops(case: Case) -> float:
    """2 (D + Dv) H per visited pair (Q K^T and P V), summed over the sequences: 4 B H S^2 D
    for a dense case."""
    pairs = sum(visited_pairs(n, case.causal, case.window) for n in case.lengths())
    return 2 * (case.head_dim + case.dv) * case.heads * pairs


# --------------------------------------------------------------------- inputs and reference


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]  # int32 [num_seqs + 1] with varlen


def make_inputs(case: Case, device="cuda") -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, case.dtype)
    b, s, h, hk = case.batch, case.seqlen, case.heads, case.hk
    shapes = ((b, s, h, case.head_dim), (b, s, hk, case.head_dim), (b, s, hk, case.dv), (b, s, h, case.dv))
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes)
    cu = None
    if case.varlen:
        cu = torch.tensor([0, *_cumsum(case.lengths())], dtype=torch.int32, device=device)
    return Inputs(q, k, v, dout, cu)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _segments(case: Case):
    """(batch index, first token, end) of every sequence."""
    if not case.varlen:
        return [(i, 0, case.seqlen) for i in range(case.batch)]
    ends = list(_cumsum(case.lengths()))
    return [(0, end - n, end) for n, end in zip(case.lengths(), ends)]


def _allowed(n: int, case: Case, device) -> Optional[torch.Tensor]:
    """[n, n] bool: key m visible to query i (None: all are)."""
    if not case.causal:
        return None
    i = torch.arange(n, device=device)[:, None]
    m = torch.arange(n, device=device)[None, :]
    keep = m <= i
    return keep & (m > i - case.window) if case.window else keep


def reference(case: Case, x: Inputs, grads: bool = False):
    """fp32 O [B, S, H, Dv] (and with ``grads`` dQ, dK, dV), computed per sequence and key head
    (its query heads together): a tuple in CHECKED's order."""
    q, k, v = x.q, x.k, x.v
    outs = [torch.empty((*q.shape[:3], case.dv), dtype=torch.float32, device=q.device)]
    if grads:
        outs += [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
    g, scale = case.heads // case.hk, case.head_dim**-0.5
    for b, lo, hi in _segments(case):
        keep = _allowed(hi - lo, case, q.device)
        for j in range(case.hk):
            hq = slice(j * g, (j + 1) * g)
            blocks = (q[b, lo:hi, hq].transpose(0, 1), k[b, lo:hi, j], v[b, lo:hi, j])  # [g, n, D], [n, D], [n, Dv]
            dout = x.dout[b, lo:hi, hq].transpose(0, 1) if grads else None
            o, *d = _reference_block(*blocks, keep, scale, dout)
            outs[0][b, lo:hi, hq] = o.transpose(0, 1)
            if grads:
                outs[1][b, lo:hi, hq] = d[0].transpose(0, 1)
                outs[2][b, lo:hi, j], outs[3][b, lo:hi, j] = d[1], d[2]
    return tuple(outs)


def _reference_block(q, k, v, keep, scale, dout=None):
    """softmax(scale q k^T, masked) v in fp32, and (dq, dk, dv) of ``dout`` when given."""
    q, k, v = (t.float().requires_grad_(dout is not None) for t in (q, k, v))
    with torch.enable_grad():
        s = (q @ k.T) * scale
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)
        o = torch.softmax(s, dim=-1) @ v
    if dout is None:
        return (o.detach(),)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), dout.float()))


def check(results, ref) -> dict:
    """{"ok", "max_rel_err": {out[, dq, dk, dv]}, "tol"}: each result against the fp32 reference."""
    errs = {name: _max_rel(got, want) for name, got, want in zip(CHECKED, results, ref)}
    return {"ok": all(e < TOL for e in errs.values()), "max_rel_err": errs, "tol": TOL, "reference": "fp32"}


# --------------------------------------------------------------------------- implementations


def import_fa4():
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


def forward(impl: str, case: Case, cu_seqlens, fa4=None):
    """(fwd(q, k, v) -> O [B, S, H, Dv], row info) through ``impl``'s public entry;
    NotImplementedError where it lacks one of the case's features."""
    if impl == "ours":
        return _forward_ours(case, cu_seqlens)
    if impl == "fa4":
        return _forward_fa4(case, cu_seqlens, fa4)
    return _forward_sdpa(case, impl)


def _varlen_args(case: Case, cu_seqlens) -> dict:
    longest = max(case.lengths())
    return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest)


def _forward_ours(case: Case, cu_seqlens):
    import ops

    kw = dict(causal=case.causal, window_size=case.window or None)
    if case.varlen:
        kw.update(_varlen_args(case, cu_seqlens))
    return lambda q, k, v: ops.memory_efficient_attention(q, k, v, **kw), {
        "op": "ops.memory_efficient_attention",
        "layout": "BSHD",
    }


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def _forward_fa4(case: Case, cu_seqlens, fa4):
    func, varlen_func = fa4
    kw = dict(causal=case.causal)
    if case.window:
        kw["window_size"] = (case.window - 1, 0)  # FA4's left reach: the window's other keys
    if not case.varlen:
        return lambda q, k, v: _first(func(q, k, v, **kw)), {"op": "flash_attn.cute.flash_attn_func", "layout": "BSHD"}
    kw.update(_varlen_args(case, cu_seqlens))

    def fwd(q, k, v):
        return _first(varlen_func(q[0], k[0], v[0], **kw)).unsqueeze(0)

    return fwd, {"op": "flash_attn.cute.flash_attn_varlen_func", "layout": "THD (BSHD, B = 1)"}


def _forward_sdpa(case: Case, impl: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if case.varlen:
        raise NotImplementedError("F.scaled_dot_product_attention takes no cu_seqlens (packed variable lengths)")
    if case.window:
        raise NotImplementedError("F.scaled_dot_product_attention has no sliding window (only a dense attn_mask)")
    backend = {
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    }[impl]
    kw = dict(is_causal=case.causal, enable_gqa=case.hk != case.heads)

    def fwd(q, k, v):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), **kw)
        return out.transpose(1, 2)

    return fwd, {"op": f"F.scaled_dot_product_attention under {backend}", "layout": "BHSD views of BSHD"}


def first_call(fn):
    """``fn()`` once; SDPA's "No available kernel" (the backend refuses the inputs) comes out as
    NotImplementedError with torch's reasons (the warnings it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            reasons = "; ".join(dict.fromkeys(str(w.message) for w in caught))
            raise NotImplementedError(f"{str(e).strip()} {reasons}".strip()) from e


# ------------------------------------------------------------------------------ a case


def run_case(suite: str, step, grads: bool, flops_scale: float, spec, fa4, fa4_missing, matmul, board=None) -> list:
    """The rows of one case: ``step(fwd, inputs) -> (fn, results)`` makes the timed call of a
    forward and runs it once (results: O, with ``grads`` O, dQ, dK, dV); ``flops_scale`` x the
    forward's FLOPs is a call's work. Every implementation is set up and checked, then all are timed
    in rounds (``attention_common.time_in_rounds``); then the matmul ceiling row."""
    case = Case.from_spec(spec)
    flops = flops_scale * forward_flops(case)
    x = make_inputs(case)
    rows, pending = [], []

    def row(impl, ms=NAN, **extra):
        tflops = flops / ms / 1e9 if ms > 0 else NAN
        r = dict(suite=suite, case=case.name, impl=impl, ms=ms, tflops=tflops, causal=case.causal)
        r.update(feature=case.features or None, **({"seqlens": list(case.lengths())} if case.varlen else {}))
        rows.append({**r, **extra})

    try:
        ref, ref_error = reference(case, x, grads), None
    except Exception as e:  # ours is not timed without it; the peers are, unchecked
        ref, ref_error = None, err(e)
    for impl in IMPLS:
        if impl == "fa4" and fa4 is None:
            row(impl, status="unavailable", error=fa4_missing)
            continue
        entry = _setup(impl, case, x, step, fa4, ref, ref_error)
        if isinstance(entry, dict):
            row(impl, **entry)
        else:
            pending.append(entry)
        torch.cuda.synchronize()
    del ref
    time_in_rounds(pending, board, row)
    matmul_row(row, matmul, flops)
    _add_ratios(rows)
    return sorted(rows, key=lambda r: (IMPLS + ("matmul",)).index(r["impl"]))  # a fixed order, timed or not


def _setup(impl, case, x, step, fa4, ref, ref_error=None):
    """A pending entry (impl, fn, info, check, None) for the rounds, or the fields of an
    untimed row: unavailable, failed, wrong (ours), or ours without a reference."""
    try:
        fwd, info = forward(impl, case, x.cu_seqlens, fa4)
        fn, results = step(fwd, x)
        result_check = check(results, ref) if ref is not None else None
        del results
    except NotImplementedError as e:
        return dict(status="unavailable", error=err(e))
    except Exception as e:
        return dict(status="error", error=err(e))
    if impl == "ours" and result_check is None:
        return dict(status="error", error=f"no fp32 reference ({ref_error}): not timed", **info)
    if impl == "ours" and not result_check["ok"]:
        errs = result_check["max_rel_err"]
        return dict(status="wrong", check=result_check, error=f"max rel err {errs} >= {TOL}: not timed", **info)
    return (impl, fn, info, result_check, None)
