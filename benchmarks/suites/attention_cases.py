"""The cases, fp32 reference and implementations that attention_fwd and attention_train share.

Case specs (``ATTENTION_FWD`` / ``ATTENTION_TRAIN`` in ``benchmarks/arch/*.py``):
``((B, H, S, D), dtype name, causal[, features])``, ``features`` a ":"-joined string of

- ``kv<N>``: N key / value heads (grouped-query: N divides H);
- ``dv<N>``: the value head dim N (D is the query / key head dim);
- ``window<N>``: a causal sliding window: query n sees the N keys n - N < m <= n;
- ``varlen``: B = 1 and the S tokens packed as the sequences of ``varlen_lengths(S)`` (a fixed,
  seeded mix of lengths), each attending only within itself (``cu_seqlens``);
- ``softcap<N>``: the scaled logits capped at N tanh(s / N) before the mask;
- ``sink``: a learnable sink per query head (fp32 [H], ``SINK_MEAN`` + N(0, 1)): e^sink joins every
  row's softmax denominator; with gradients its own is computed too (``dsink``);
- ``dlse``: the logsumexp returned too (``return_lse=True``, as [B, H, S]) and, with gradients, a
  loss on it: dLSE (fp32 N(0, 1)) goes into the backward with dO, in one backward call.

A case's name is its spec's: ``BxHxSxD:bf16[:causal][:features]`` (``case_name``; ``parse_case``
reads it back). Q [B, S, H, D], K [B, S, Hk, D], V [B, S, Hk, Dv], dO [B, S, H, Dv] contiguous,
seqlen_q = seqlen_k, softmax scale 1 / sqrt(D).

Implementations (``forward``): each one's public entry, ``fwd(q, k, v[, sink])`` returning O as
[B, S, H, Dv] (with ``dlse``: (O, LSE as [B, H, S], ``lse_rows``)):

- ``ours``: ``ops.memory_efficient_attention`` (whatever forward it runs; ``softcap=``, ``sink=``,
  ``return_lse=``; the backward's ``backend`` as the suite pins it, ``OURS``);
- ``fa4``: ``flash_attn.cute.flash_attn_func`` / ``flash_attn_varlen_func`` (GQA, windows as
  (N - 1, 0), varlen, Dv != D, ``softcap=``, ``learnable_sink=``, ``return_lse=``);
- ``sdpa_efficient`` / ``sdpa_flash`` / ``sdpa_cudnn``: ``F.scaled_dot_product_attention`` under
  ``sdpa_kernel`` of that backend on [B, H, S, D] views, ``enable_gqa`` with fewer key heads; no
  varlen, window, softcap, sink or LSE (unavailable); a backend that refuses the inputs ("No
  available kernel") is unavailable with torch's reasons.

Every implementation is checked against an fp32 reference (``reference``: per sequence and key
head) before it is timed: max |x - ref| / max |ref| of each result (``checked``: O, the LSE with
``dlse``, and with gradients dQ, dK, dV, d sink) below TOL; ours is timed only when right, the
peers either way (the row keeps the check).
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

PEER_IMPLS = ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "fa4")
OURS = {"ours": "auto"}  # ours' rows: name -> the backward's ``backend`` (attention_bwd pins two)
IMPLS = tuple(OURS) + PEER_IMPLS
TOKEN = re.compile(r"^(?:(kv|dv|window|softcap)([1-9]\d*)|(varlen|sink|dlse))$")
FLAGS = ("varlen", "sink", "dlse")  # the tokens without a number: Case's bool fields
LONG = {v: k for k, v in SHORT.items()}
VARLEN_SEED = 0
VARLEN_LOG2 = (7.0, 13.0)  # varlen lengths drawn log-uniformly from 2^7 to 2^13 tokens
# the case features each op's benchmark_configurations keys for a forward + backward through
# memory_efficient_attention (attention_train; attention_bwd's autograd cases): the forward's and
# the sm90 backward's take every case whole (the sm90 backward lists nothing for varlen); the
# memory-efficient backward's hold neither a head count nor the mask (grouped heads are repeated,
# the window is a runtime argument), the sink (it only changes the LSE) nor dLSE (its keys come
# with and without the in-kernel Δ), but Dv = D, no varlen and no softcap (it has none)
KEYED = {"attention_fwd_sm90": "all", "mem_eff_attention": ("kv", "window", "sink", "dlse"), "attention_sm90": "all"}
# sinks near the logits' log-sum-exp (128 keys of N(0, 1) logits sum to ~e^5.3): e^4 holds a
# sizeable share of a row's denominator, so the sink's gradient and its effect on O are not noise
SINK_MEAN = 4.0


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
    softcap: int = 0  # 0: none
    sink: bool = False
    dlse: bool = False

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
        tokens += [f"softcap{self.softcap}"] * bool(self.softcap) + ["sink"] * self.sink + ["dlse"] * self.dlse
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
            key = {"kv": "kv_heads", "dv": "head_dim_v"}.get(kind, kind)
            fields[key] = True if kind in FLAGS else int(token[len(kind) :])
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
    ("kv", "dv", "window", "varlen", "softcap", "sink", "dlse"): what the ops'
    ``benchmark_configurations`` take, for the cases whose compile keys they give faithfully
    (each spec once); ``keyed`` "all": every spec whole, features included, for an op that keys
    them all."""
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
        raise ValueError(f"unknown feature {token!r} (kv<N>, dv<N>, window<N>, varlen, softcap<N>, sink, dlse)")
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
    sink: Optional[torch.Tensor] = None  # fp32 [H] with sink
    dlse: Optional[torch.Tensor] = None  # fp32 [B, H, S] with dlse

    def leaves(self) -> tuple:
        """What an implementation's ``fwd`` takes (and a training step differentiates): Q, K, V[, sink]."""
        return (self.q, self.k, self.v) + ((self.sink,) if self.sink is not None else ())

    def output_grads(self) -> tuple:
        """The gradients of fwd's outputs: dO[, dLSE]."""
        return (self.dout,) + ((self.dlse,) if self.dlse is not None else ())


def make_inputs(case: Case, device="cuda") -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, case.dtype)
    b, s, h, hk = case.batch, case.seqlen, case.heads, case.hk
    shapes = ((b, s, h, case.head_dim), (b, s, hk, case.head_dim), (b, s, hk, case.dv), (b, s, h, case.dv))
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes)
    cu = None
    if case.varlen:
        cu = torch.tensor([0, *_cumsum(case.lengths())], dtype=torch.int32, device=device)
    sink = torch.randn(h, generator=gen, device=device) + SINK_MEAN if case.sink else None
    dlse = torch.randn(b, h, s, generator=gen, device=device) if case.dlse else None
    return Inputs(q, k, v, dout, cu, sink, dlse)


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


def checked(case: Case, grads: bool) -> tuple:
    """The names of the results a case checks, in ``reference``'s order."""
    names = ("out",) + ("lse",) * case.dlse
    return names + (("dq", "dk", "dv") + ("dsink",) * case.sink if grads else ())


def reference(case: Case, x: Inputs, grads: bool = False):
    """fp32 O [B, S, H, Dv] (with dlse the LSE [B, H, S]; with ``grads`` dQ, dK, dV and d sink
    [H] of the loss <O, dO> + <LSE, dLSE>), computed per sequence and key head (its query heads
    together): a tuple in ``checked(case, grads)``'s order."""
    q, k, v = x.q, x.k, x.v
    f32 = dict(dtype=torch.float32, device=q.device)
    out, lse = torch.empty((*q.shape[:3], case.dv), **f32), torch.empty((q.shape[0], case.heads, q.shape[1]), **f32)
    dq, dk, dv = (torch.empty(t.shape, **f32) for t in (q, k, v)) if grads else (None,) * 3
    dsink = torch.zeros(case.heads, **f32)
    g, scale = case.heads // case.hk, case.head_dim**-0.5
    for b, lo, hi in _segments(case):
        keep = _allowed(hi - lo, case, q.device)
        for j in range(case.hk):
            hq = slice(j * g, (j + 1) * g)
            blocks = (q[b, lo:hi, hq].transpose(0, 1), k[b, lo:hi, j], v[b, lo:hi, j])  # [g, n, D], [n, D], [n, Dv]
            sink = x.sink[hq] if case.sink else None
            dout = x.dout[b, lo:hi, hq].transpose(0, 1) if grads else None
            dlse = x.dlse[b, hq, lo:hi] if grads and case.dlse else None
            o, lse[b, hq, lo:hi], d = _reference_block(*blocks, keep, scale, case.softcap, sink, dout, dlse)
            out[b, lo:hi, hq] = o.transpose(0, 1)
            if grads:
                dq[b, lo:hi, hq] = d[0].transpose(0, 1)
                dk[b, lo:hi, j], dv[b, lo:hi, j] = d[1], d[2]
                if case.sink:
                    dsink[hq] += d[3]
    results = (out,) + (lse,) * case.dlse
    return results + ((dq, dk, dv) + (dsink,) * case.sink if grads else ())


def _reference_block(q, k, v, keep, scale, softcap=0, sink=None, dout=None, dlse=None):
    """(O [g, n, Dv], LSE [g, n], gradients) in fp32: the logits scale q k^T, capped at softcap
    tanh(s / softcap) where given, masked; the LSE over them (and e^sink); O = e^(s - LSE) v. With
    ``dout``: (dq, dk, dv[, d sink]) of <O, dout> (+ <LSE, dlse> where given), else ()."""
    given = (q, k, v) + ((sink,) if sink is not None else ())
    leaves = [t.detach().float().requires_grad_(dout is not None) for t in given]
    with torch.enable_grad():
        s = (leaves[0] @ leaves[1].T) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        if sink is not None:
            lse = torch.logaddexp(lse, leaves[3][:, None].expand_as(lse))
        o = torch.exp(s - lse[..., None]) @ leaves[2]
    if dout is None:
        return o.detach(), lse.detach(), ()
    outs, grads = ((o, lse), (dout.float(), dlse.float())) if dlse is not None else ((o,), (dout.float(),))
    return o.detach(), lse.detach(), torch.autograd.grad(outs, leaves, grads)


def check(results, ref, names) -> dict:
    """{"ok", "max_rel_err": {name: ...}, "tol"}: each result against the fp32 reference."""
    errs = {name: _max_rel(got, want) for name, got, want in zip(names, results, ref)}
    return {"ok": all(e < TOL for e in errs.values()), "max_rel_err": errs, "tol": TOL, "reference": "fp32"}


def lse_rows(lse: torch.Tensor, case: Case) -> torch.Tensor:
    """An implementation's LSE as [B, H, S] ([1, H, total] with varlen: the packed rows): FA4's
    varlen [H, total] gets its batch dim; ours' rows past S (padding) are cut, and with varlen
    ([sequences, H, >= longest]) each sequence's rows packed. Differentiable, and the tensor
    itself where the layout already is [B, H, S] (no op for the backward to run)."""
    if lse.dim() == 2:
        return lse.unsqueeze(0)
    if case.varlen:
        return torch.cat([lse[i, :, :n] for i, n in enumerate(case.lengths())], dim=1).unsqueeze(0)
    return lse if lse.shape[-1] == case.seqlen else lse[..., : case.seqlen]


def as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


# --------------------------------------------------------------------------- implementations


def import_fa4():
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


def forward(impl: str, case: Case, cu_seqlens, fa4=None, backend: str = "auto"):
    """(fwd(q, k, v[, sink]) -> O [B, S, H, Dv] (with dlse (O, LSE [B, H, S])), row info) through
    ``impl``'s public entry (ours' rows with the backward's ``backend``); NotImplementedError
    where it lacks one of the case's features."""
    if impl.startswith("sdpa"):
        return _forward_sdpa(case, impl)
    if impl == "fa4":
        return _forward_fa4(case, cu_seqlens, fa4)
    return _forward_ours(case, cu_seqlens, backend)


def _varlen_args(case: Case, cu_seqlens) -> dict:
    longest = max(case.lengths())
    return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest)


def _forward_ours(case: Case, cu_seqlens, backend: str = "auto"):
    import ops

    kw = dict(causal=case.causal, window_size=case.window or None, softcap=case.softcap or None)
    kw.update(return_lse=case.dlse, **({} if backend == "auto" else {"backend": backend}))
    if case.varlen:
        kw.update(_varlen_args(case, cu_seqlens))

    def fwd(q, k, v, sink=None):
        result = ops.memory_efficient_attention(q, k, v, sink=sink, **kw)
        return (result[0], lse_rows(result[1], case)) if case.dlse else result

    op = "ops.memory_efficient_attention" + ("" if backend == "auto" else f'(backend="{backend}")')
    return fwd, {"op": op, "layout": "BSHD"}


def _forward_fa4(case: Case, cu_seqlens, fa4):
    func, varlen_func = fa4
    kw = dict(causal=case.causal)
    if case.window:
        kw["window_size"] = (case.window - 1, 0)  # FA4's left reach: the window's other keys
    if case.softcap:
        kw["softcap"] = float(case.softcap)
    if case.dlse:
        kw["return_lse"] = True

    def outputs(result, out):
        return (out, lse_rows(result[1], case)) if case.dlse else out

    if not case.varlen:

        def fwd(q, k, v, sink=None):
            result = func(q, k, v, learnable_sink=sink, **kw)
            return outputs(result, result[0])

        return fwd, {"op": "flash_attn.cute.flash_attn_func", "layout": "BSHD"}
    kw.update(_varlen_args(case, cu_seqlens))

    def fwd_varlen(q, k, v, sink=None):
        result = varlen_func(q[0], k[0], v[0], learnable_sink=sink, **kw)
        return outputs(result, result[0].unsqueeze(0))

    return fwd_varlen, {"op": "flash_attn.cute.flash_attn_varlen_func", "layout": "THD (BSHD, B = 1)"}


_SDPA_LACKS = (  # (the case's feature, what F.scaled_dot_product_attention lacks)
    ("varlen", "takes no cu_seqlens (packed variable lengths)"),
    ("window", "has no sliding window (only a dense attn_mask)"),
    ("softcap", "has no softcap"),
    ("sink", "has no learnable sink"),
    ("dlse", "returns no logsumexp (a loss on it cannot be differentiated)"),
)


def _forward_sdpa(case: Case, impl: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for feature, lack in _SDPA_LACKS:
        if getattr(case, feature):
            raise NotImplementedError(f"F.scaled_dot_product_attention {lack}")
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


def run_case(
    suite: str, step, grads: bool, flops_scale: float, spec, fa4, fa4_missing, matmul, board=None, ours=None
) -> list:
    """The rows of one case: ``step(fwd, inputs) -> (fn, results)`` makes the timed call of a
    forward and runs it once (results in ``checked(case, grads)``'s order); ``flops_scale`` x the
    forward's FLOPs is a call's work; ``ours``: ours' rows, name -> the backward's backend (default
    ``OURS``). Every implementation is set up and checked, then all are timed in rounds
    (``attention_common.time_in_rounds``); then the matmul ceiling row."""
    case = Case.from_spec(spec)
    ours = ours or OURS
    impls = tuple(ours) + PEER_IMPLS
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
    names = checked(case, grads)
    for impl in impls:
        if impl == "fa4" and fa4 is None:
            row(impl, status="unavailable", error=fa4_missing)
            continue
        entry = _setup(impl, case, x, step, fa4, ref, ref_error, names, ours.get(impl))
        if isinstance(entry, dict):
            row(impl, **entry)
        else:
            pending.append(entry)
        torch.cuda.synchronize()
    del ref
    time_in_rounds(pending, board, row)
    matmul_row(row, matmul, flops)
    _add_ratios(rows)
    return sorted(rows, key=lambda r: (impls + ("matmul",)).index(r["impl"]))  # a fixed order, timed or not


def _setup(impl, case, x, step, fa4, ref, ref_error=None, names=None, backend=None):
    """A pending entry (impl, fn, info, check, None) for the rounds, or the fields of an
    untimed row: unavailable, failed, wrong (ours: ``backend`` not None), or ours without a
    reference."""
    try:
        fwd, info = forward(impl, case, x.cu_seqlens, fa4, backend or "auto")
        fn, results = step(fwd, x)
        result_check = check(results, ref, names or checked(case, False)) if ref is not None else None
        del results
    except NotImplementedError as e:
        return dict(status="unavailable", error=err(e))
    except Exception as e:
        return dict(status="error", error=err(e))
    if backend is not None and result_check is None:
        return dict(status="error", error=f"no fp32 reference ({ref_error}): not timed", **info)
    if backend is not None and not result_check["ok"]:
        errs = result_check["max_rel_err"]
        return dict(status="wrong", check=result_check, error=f"max rel err {errs} >= {TOL}: not timed", **info)
    return (impl, fn, info, result_check, None)
