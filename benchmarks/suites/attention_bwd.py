"""Suite attention_bwd: our attention backwards (dQ, dK, dV), timed alone against peers.

Cases ``BxHxSxD:bf16[:causal][:feature]``: Q, K, V, dO [B, S, H, D] contiguous, seqlen_q =
seqlen_k; feature none, ``bias`` (a [B, H, S, S] attention bias), ``bias_grad``
(the same, its gradient computed too) or ``dropout`` (p = DROPOUT_P); or ``autograd[:features]``
(below). Each implementation's
backward is timed alone, on the outputs of its own forward (computed once, outside the
timing); with a feature, only the peers that support it run (flash: dropout; cuDNN: bias
without its gradient, dropout; FA4: neither), the others keep a row with status
"unavailable". With dropout the peers draw their own masks: their gradients are not
checked against sdpa_efficient (ours uses the same philox seed / offset, and is).

- ``ours``: ``ops.efficient_attention_backward(..., backend="mem_eff")`` (the
  memory-efficient kernel), a drop-in for ``aten._efficient_attention_backward`` (same
  arguments), on the out / logsumexp / philox of ``aten._efficient_attention_forward``;
- ``ours_sm90``: the same call with ``backend="sm90"`` (the Hopper-native kernel,
  ``ops.attention_sm90``) on the same forward's out / logsumexp / philox, every feature
  included, checked like ``ours``;
- ``sdpa_efficient``: ``aten._efficient_attention_backward`` on the same inputs (the
  C++ original; its gradients are the reference of every correctness check);
- ``sdpa_flash``: ``aten._scaled_dot_product_flash_attention_backward`` after
  ``aten._scaled_dot_product_flash_attention`` ([B, H, S, D] views of the same tensors);
- ``sdpa_cudnn``: ``aten._scaled_dot_product_cudnn_attention_backward`` after
  ``aten._scaled_dot_product_cudnn_attention`` ([B, H, S, D] views); should the direct
  call fail, forward+backward through ``F.scaled_dot_product_attention`` under
  ``SDPBackend.CUDNN_ATTENTION`` minus the forward alone (the row's ``method`` says which);
- ``fa4``: FA4's CuTe-DSL ``flash_attn.cute.interface._flash_attn_bwd`` after its
  ``_flash_attn_fwd`` ([B, S, H, D]), when flash_attn.cute imports;
- ``matmul``: the bf16 matmul ceiling: a torch.mm of MATMUL_MNK (``attention_common``)
  measured once per run; its row's ``tflops`` is that rate and its ``ms`` the case's FLOPs
  at that rate (``matmul_ms`` is the measured time of the matmul itself).

FLOPs counted: 2.5 x the forward's 4 B H S^2 D (five S x S x D matmuls), halved when causal.
Timing: every implementation of a case is set up and checked first, then all are timed in
ROUNDS rounds (``attention_common``), each round timing each of them once (do_bench median,
L2 flushed, after WARMUP_MS of the implementation's own calls) in an order rotated from round
to round (``timing.bench_rounds``); a row's ``ms`` is the median of its rounds and
``ms_rounds`` lists them. The board's clocks drift with its power state (H100: the same kernel read 3-6% apart
minutes later, and a timing right after another implementation's calls ran at the clocks that
one left), which a single timing per implementation or a short warm-up would put into the ratios.
Each timed row also gets the board's mean power (``power_w``) and SM clock
(``sm_clock_mhz``) over its timings, ``energy_mj`` (power x ms) and ``power_field`` (the
nvidia-smi field: the instantaneous draw where the driver has it), where nvidia-smi runs
(``benchmarks.board``): at a power cap the ratios follow energy per call, not cycles.
Cases ``BxHxSxD:bf16[:causal]:autograd[:features]`` time the backward through each
implementation's public autograd entry instead, for the features ``efficient_attention_backward``
(aten's arguments) has no room for: the softcap, the sink and a loss on the LSE, with the
features of ``attention_cases`` (``kv<N>``, ``window<N>``, ``softcap<N>``, ``sink``, ``dlse``, ...;
its inputs, fp32 reference and checks). Each implementation's forward runs once, outside the
timing, on leaves that require gradients; the timed call is ``torch.autograd.grad`` of its
outputs (O with dO; with ``dlse`` the LSE with dLSE too) for Q, K, V (and the sink) with
``retain_graph=True``: the backward its training step runs, autograd's own host work included.
``ours``: ``ops.memory_efficient_attention(..., backend="mem_eff")``, ``ours_sm90``: the same with
``backend="sm90"`` (NotImplementedError where the kernel does not take the case: unavailable);
``fa4``: ``flash_attn.cute.flash_attn_func`` (its autograd Function, ``_flash_attn_bwd``);
``sdpa_*``: ``F.scaled_dot_product_attention`` under that backend. ``autograd`` alone times a
case without features the same way: the twin a feature's cost is read against (the rows above
call the backward ops directly).

Rows: ms, ms_rounds, tflops, ``check`` (max |grad - ref| / max |ref| of dQ, dK, dV against
sdpa_efficient; ours and ours_sm90 are timed only when all are below TOL),
``ours_over_peer`` (ours' TFLOP/s over the row's) on every other row, ``sm90_over_peer``
(ours_sm90's TFLOP/s over the peer's) on the rows of the peers (PEERS); an
implementation that fails or is missing keeps its row with ms and tflops NaN,
``status`` ("error", "wrong" or "unavailable") and ``error``.
"""

from __future__ import annotations

import functools
import math

import torch

from .attention_common import NAN, matmul_row, run_cases, time_in_rounds
from .attention_common import err as _err

NAME = "attention_bwd"
FLOPS_SCALE = 2.5  # a backward's FLOPs over the forward's (autograd cases)
AUTOGRAD = "autograd"  # the first feature token of a case timed through autograd
OURS_AUTOGRAD = {"ours": "mem_eff", "ours_sm90": "sm90"}  # their rows: name -> the backward's backend

TOL = 2e-2  # max |grad - ref| / max |ref| (bf16 gradients)
DROPOUT_P = 0.1
FEATURES = (None, "bias", "bias_grad", "dropout")
PEERS = ("sdpa_flash", "sdpa_cudnn", "fa4")  # the rows that get sm90_over_peer
SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _case_name(shape, dtype, causal, feature=None):
    return (
        "x".join(map(str, shape))
        + f":{SHORT[dtype]}"
        + (":causal" if causal else "")
        + (f":{feature}" if feature else "")
    )


def _unpack(spec):
    """(shape, dtype name, causal, feature): the feature entry is optional."""
    shape, dtype_name, causal, *rest = spec
    feature = rest[0] if rest else None
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r} (one of {FEATURES}, or {AUTOGRAD}[:features])")
    return shape, dtype_name, causal, feature


def autograd_spec(spec):
    """The ``attention_cases`` spec of an autograd case (its features after ``autograd``), None
    for the others."""
    feature = spec[3] if len(spec) > 3 else None
    tokens = feature.split(":") if feature else []
    if not tokens or tokens[0] != AUTOGRAD:
        return None
    return tuple(spec[:3]) + ((":".join(tokens[1:]),) if tokens[1:] else ())


def attention_bwd_flops(b, h, s, d, causal):
    """2.5 x the forward's 4 B H S^2 D; half of it under a causal mask."""
    flops = 2.5 * 4 * b * h * s * s * d
    return flops / 2 if causal else flops


def _max_rel(got, ref):
    """max |got - ref| / max |ref|, fp32 (NaN anywhere in ``got`` gives inf)."""
    g, r = got.float(), ref.float()
    if not torch.isfinite(g).all():
        return math.inf
    return ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()


def _check(grads, ref):
    """{"ok", "max_rel_err": {dq, dk, dv[, dbias]}, "tol"}: grads and ref both [B, S, H, D]
    (and the bias gradients [B, H, S, S] when both have one)."""
    names = ("dq", "dk", "dv", "dbias")[: min(len(grads), len(ref))]
    errs = {name: _max_rel(g, r) for name, g, r in zip(names, grads, ref)}
    return {"ok": all(e < TOL for e in errs.values()), "max_rel_err": errs, "tol": TOL}


# ------------------------------------------------------------------ implementations
# Each setup runs the forward it needs once and returns (fn, grads, info): ``fn()`` runs
# the backward alone, ``grads`` is one result of it (dQ, dK, dV), ``info`` goes into
# the row (op names, layouts).


def _setup_efficient(q, k, v, dout, causal, backward=None, feature=None, bias=None):
    """aten._efficient_attention_forward once; ``backward`` (default the aten op) timed.

    Layouts: q, k, v, out, grad_out [B, S, H, D]; logsumexp [B, H, round_up(S, 32)] fp32;
    bias [B, H, S, S]. With dropout both backwards get the forward's philox seed / offset.
    """
    s = q.shape[1]
    mask = 1 if causal else 0  # custom_mask_type: 1 = causal from the top left
    p = DROPOUT_P if feature == "dropout" else 0.0
    bias = bias if feature in ("bias", "bias_grad") else None
    bias_grad = feature == "bias_grad"
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, s, s, p, mask, True, scale=None
    )
    bwd = backward or torch.ops.aten._efficient_attention_backward

    def fn():
        return bwd(dout, q, k, v, bias, out, None, None, s, s, lse, p, seed, offset, mask, bias_grad)

    grads = fn()
    return fn, grads[:4] if bias_grad else grads[:3], {"op": "aten._efficient_attention_backward", "layout": "BSHD"}


def _setup_ours(q, k, v, dout, causal, feature=None, bias=None, backend="mem_eff"):
    """ops.efficient_attention_backward with ``backend`` pinned ("auto" would run the sm90
    kernel on an H100 where it applies: each row measures one kernel)."""
    import ops

    ours = getattr(ops, "efficient_attention_backward", None)
    if ours is None:
        raise RuntimeError("ops.efficient_attention_backward does not exist")
    torch.manual_seed(0)  # the same philox seed / offset as sdpa_efficient's forward
    ours = functools.partial(ours, backend=backend)
    fn, grads, _ = _setup_efficient(q, k, v, dout, causal, backward=ours, feature=feature, bias=bias)
    return fn, grads, {"op": f'ops.efficient_attention_backward(backend="{backend}")', "layout": "BSHD"}


def _setup_ours_sm90(q, k, v, dout, causal, feature=None, bias=None):
    return _setup_ours(q, k, v, dout, causal, feature=feature, bias=bias, backend="sm90")


def _bhsd_grad_out(out_bhsd, dout):
    """dO as [B, H, S, D] with exactly the strides of O (cuDNN wants them equal)."""
    return torch.empty_like(out_bhsd).copy_(dout.transpose(1, 2))


def _setup_flash(q, k, v, dout, causal, feature=None, bias=None):
    """aten._scaled_dot_product_flash_attention{,_backward} on [B, H, S, D] views of the
    [B, S, H, D] tensors (the memory layout the flash kernels use); no bias."""
    if feature in ("bias", "bias_grad"):
        raise NotImplementedError("flash attention takes no attention bias")
    p = DROPOUT_P if feature == "dropout" else 0.0
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        qt, kt, vt, p, causal, False, scale=None
    )
    do = _bhsd_grad_out(out, dout)

    def fn():
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, qt, kt, vt, out, lse, cum_q, cum_k, max_q, max_k, p, causal, rng_state, unused, scale=None
        )

    grads = [g.transpose(1, 2) for g in fn()]
    return fn, grads, {"op": "aten._scaled_dot_product_flash_attention_backward", "layout": "BHSD views of BSHD"}


def _setup_cudnn(q, k, v, dout, causal, feature=None, bias=None):
    """aten._scaled_dot_product_cudnn_attention{,_backward} on [B, H, S, D] views; the bias
    (no gradient: the op returns none) or dropout when the case has them."""
    if feature == "bias_grad":
        raise NotImplementedError("cuDNN's SDPA backward returns no bias gradient")
    p = DROPOUT_P if feature == "dropout" else 0.0
    b = bias if feature == "bias" else None
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        qt, kt, vt, b, True, p, causal, False, scale=None
    )
    do = _bhsd_grad_out(out, dout)

    def fn():
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, qt, kt, vt, out, lse, seed, offset, b, cum_q, cum_k, max_q, max_k, p, causal, scale=None
        )

    grads = [g.transpose(1, 2) for g in fn()]
    return fn, grads, {"op": "aten._scaled_dot_product_cudnn_attention_backward", "layout": "BHSD views of BSHD"}


def _setup_cudnn_fwd_bwd(q, k, v, dout, causal, feature=None, bias=None):
    """Fallback: (fwd, fwd_bwd) through F.scaled_dot_product_attention under cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if feature == "bias_grad":
        raise NotImplementedError("cuDNN's SDPA backward returns no bias gradient")
    p = DROPOUT_P if feature == "dropout" else 0.0
    b = bias if feature == "bias" else None
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    do = dout.transpose(1, 2)

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=b, dropout_p=p, is_causal=causal
            )

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (qt, kt, vt), do)

    grads = [g.transpose(1, 2) for g in fwd_bwd()]
    info = {
        "op": "F.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION",
        "layout": "BHSD views of BSHD",
        "method": "fwd+bwd minus fwd (the backward op alone failed)",
    }
    return fwd, fwd_bwd, grads, info


def _import_fa4():
    """FA4's forward and backward (the rows above), then its autograd entries (autograd cases)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    return _flash_attn_fwd, _flash_attn_bwd, flash_attn_func, flash_attn_varlen_func


def _setup_fa4(q, k, v, dout, causal, fa4):
    """FA4's _flash_attn_fwd once (out, lse [B, H, S] fp32), its _flash_attn_bwd timed.

    _flash_attn_bwd runs FA4's whole backward: preprocess (dO.O), the main kernel and
    the dQ (and dK/dV) postprocess, each call allocating its accumulators.
    """
    fwd, bwd = fa4[:2]
    res = fwd(q, k, v, causal=causal, return_lse=True)
    out, lse = res[0], res[1]

    def fn():
        return bwd(q, k, v, out, dout, lse, None, causal)

    return fn, fn()[:3], {"op": "flash_attn.cute.interface._flash_attn_bwd", "layout": "BSHD"}


# ------------------------------------------------------------------------------ run


def run(settings, quick: bool):
    return run_cases(settings.ATTENTION_BWD["quick" if quick else "full"], _import_fa4, _run_case)


def _run_case(spec, fa4, fa4_missing, matmul, board=None):
    """The rows of one case; ``matmul`` is (TFLOP/s, ms) or the error of measuring it;
    ``board``: a ``BoardSampler`` (the rows then get the board's power and clock), or None."""
    if autograd_spec(spec) is not None:
        return _run_autograd_case(spec, fa4, fa4_missing, matmul, board)
    shape, dtype_name, causal, feature = _unpack(spec)
    b, h, s, d = shape
    dtype = getattr(torch, dtype_name)
    case = _case_name(shape, dtype_name, causal, feature)
    flops = attention_bwd_flops(b, h, s, d, causal)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(4))
    bias = torch.randn(b, h, s, s, device="cuda", dtype=dtype) if feature in ("bias", "bias_grad") else None
    rows = []

    def row(impl, ms=NAN, **extra):
        tflops = flops / ms / 1e9 if ms > 0 else NAN  # NaN: not timed (or a fwd+bwd - fwd <= 0)
        r = {
            "suite": NAME,
            "case": case,
            "impl": impl,
            "ms": ms,
            "tflops": tflops,
            "causal": causal,
            "feature": feature,
        }
        r.update(extra)
        rows.append(r)

    pending = []  # (impl, fn, info, check, fwd): timed together in rounds, after every setup

    def timed(impl, fn, info, check=None, fwd=None):
        """Queue ``fn`` (minus ``fwd`` when given) for the rounds; its row is written there."""
        pending.append((impl, fn, info, check, fwd))

    # the reference: the C++ original, on these inputs
    ref = eff = None
    try:
        torch.manual_seed(0)  # the philox seed / offset ours gets too
        fn, ref, info = _setup_efficient(q, k, v, dout, causal, feature=feature, bias=bias)
        eff = (fn, info)
    except Exception as e:
        row("sdpa_efficient", status="error", error=_err(e))

    # ours (both kernels): correctness first, timed only when right
    for impl, setup in (("ours", _setup_ours), ("ours_sm90", _setup_ours_sm90)):
        try:
            fn, grads, info = setup(q, k, v, dout, causal, feature, bias)
            if ref is None:
                row(impl, status="error", error="no reference (sdpa_efficient failed): not timed", **info)
            else:
                check = _check(grads, ref)
                del grads
                if check["ok"]:
                    timed(impl, fn, info, check)
                else:
                    row(
                        impl,
                        status="wrong",
                        check=check,
                        error=f"max rel err {check['max_rel_err']} >= {TOL}: not timed",
                        **info,
                    )
        except NotImplementedError as e:  # a feature the sm90 path does not take
            row(impl, status="unavailable", error=_err(e))
        except Exception as e:
            row(impl, status="error", error=_err(e))

    if eff is not None:
        timed("sdpa_efficient", eff[0], eff[1], {"ok": True, "reference": True})

    # peers: their gradients are checked too (recorded), and timed either way
    peers = [("sdpa_flash", _setup_flash), ("sdpa_cudnn", _setup_cudnn)]
    if fa4 is not None and feature is None:
        peers.append(("fa4", lambda *a: _setup_fa4(*a[:5], fa4)))
    # with dropout a peer draws its own mask: its gradients cannot match the reference's
    checkable = feature != "dropout"
    for impl, setup in peers:
        try:
            fn, grads, info = setup(q, k, v, dout, causal, feature, bias)
            check = _check(grads, ref) if ref is not None and checkable else None
            del grads
            timed(impl, fn, info, check)
        except NotImplementedError as e:  # the feature is not supported by this peer
            row(impl, status="unavailable", error=_err(e))
        except Exception as e:
            if impl != "sdpa_cudnn":
                row(impl, status="error", error=_err(e))
                continue
            direct_error = _err(e)
            try:
                fwd, fwd_bwd, grads, info = _setup_cudnn_fwd_bwd(q, k, v, dout, causal, feature, bias)
                check = _check(grads, ref) if ref is not None and checkable else None
                del grads
                timed(impl, fwd_bwd, dict(info, direct_error=direct_error), check, fwd=fwd)
            except Exception as e2:
                row(impl, status="error", error=f"{direct_error}; fallback: {_err(e2)}")
        torch.cuda.synchronize()
    time_in_rounds(pending, board, row)
    if fa4 is None:
        row("fa4", status="unavailable", error=fa4_missing)
    elif feature is not None:
        row("fa4", status="unavailable", error=f"FA4's interface takes no {feature}")

    matmul_row(row, matmul, flops)

    _add_ratios(rows)
    return rows


def _autograd_step(fwd, x):
    """The forward once (outside the timing), then the timed call: the backward of its outputs
    through ``torch.autograd.grad`` (the graph retained); the results (O[, LSE], dQ, dK, dV[,
    d sink]) of one such call."""
    from .attention_cases import as_tuple, first_call

    leaves = [t.detach().requires_grad_() for t in x.leaves()]
    outs = as_tuple(first_call(lambda: fwd(*leaves)))
    grads = x.output_grads()

    def fn():
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    return fn, (*(t.detach() for t in outs), *first_call(fn))


def _run_autograd_case(spec, fa4, fa4_missing, matmul, board=None):
    """An autograd case's rows (``attention_cases.run_case`` with ``_autograd_step``), named as
    the case is here."""
    from .attention_cases import Case, run_case

    inner = autograd_spec(spec)
    case = Case.from_spec(inner)
    feature = ":".join([AUTOGRAD] + [case.features] * bool(case.features))
    fa4 = None if fa4 is None else fa4[2:]
    rows = run_case(NAME, _autograd_step, True, FLOPS_SCALE, inner, fa4, fa4_missing, matmul, board, OURS_AUTOGRAD)
    for r in rows:
        r.update(case=_case_name(case.spec[0], case.dtype, case.causal, feature), feature=feature)
    return rows


def _add_ratios(rows):
    """``ours_over_peer`` on every row but ours, ``sm90_over_peer`` on the peers' rows
    (TFLOP/s over TFLOP/s: NaN where either side was not timed)."""
    by_impl = {r["impl"]: r for r in rows}
    ours, sm90 = by_impl.get("ours"), by_impl.get("ours_sm90")
    for r in rows:
        if r["impl"] != "ours" and ours is not None:
            r["ours_over_peer"] = ours["tflops"] / r["tflops"]
        if r["impl"] in PEERS and sm90 is not None:
            r["sm90_over_peer"] = sm90["tflops"] / r["tflops"]


def compile_configs(arch: str, quick: bool):
    """The kernel configurations of the suite's cases (the quick ones with ``quick``) for
    ``arch``: ``benchmark_configurations(cases, arch)`` of ``ops.mem_eff_attention`` (ours)
    and of ``ops.attention_sm90`` (ours_sm90: sm_90a only); for the autograd cases those of
    ``attention_cases.KEYED`` (our forward's too: it runs there)."""
    from ops import attention_sm90, mem_eff_attention

    from ..arch import settings
    from ..compile_check import Config
    from .attention_cases import KEYED, keyed_configs, suite_cases

    cases = suite_cases(settings(arch).ATTENTION_BWD, quick)
    direct = [spec for spec in cases if autograd_spec(spec) is None]
    mods = (mem_eff_attention, attention_sm90)
    configs = [
        Config(f"{mod.__name__}:compiled", (key,)) for mod in mods for key in mod.benchmark_configurations(direct, arch)
    ]
    autograd = [autograd_spec(spec) for spec in cases if autograd_spec(spec) is not None]
    return list(dict.fromkeys(configs + keyed_configs(autograd, KEYED, arch)))


def compile_only(arch: str, quick: bool = False):
    """Compile ``compile_configs(arch, quick)`` with fake tensors; the count compiled."""
    from ..compile_check import compile_all

    return compile_all(compile_configs(arch, quick))
