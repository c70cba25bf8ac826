"""GPU: randomized efficient_attention_backward against the fp64 reference (tests/randomized_common.py
describes the suite):

* B, H, Mq, Mk, Dqk != Dv up to 256, fp16 / bf16, custom_mask_type 0/1/2, windows, variable
  lengths, num_splits_key, and q / k / v / out / dO that are permuted, padded views of bigger
  buffers (arbitrary strides);
* with bias / bias gradient / dropout: every broadcast kind of bias (dense, padded and
  transposed strides), p, masks, windows, split keys, variable lengths with dropout, fp16 /
  bf16 / fp32, head dims to 256; with torch's dropout mask
  (tests/test_mem_eff_attention_features_gpu.py).
"""

import math

import pytest
import torch
from hypothesis import strategies as st

from ops.reference import attention_backward_ref

from .randomized_common import BF16, DEV, F16, F32, _apply_layout, _dt, _family, _layout, _lengths, _pad_last
from .test_attention_bwd_prepost_gpu import poison_allocator
from .test_mem_eff_attention_gpu import (
    _backward,
    check_grad,
    key_coverage,
    ref_forward,
    segments,
    seq_args,
    torch_backward_ok,
    torch_forward_ok,
)

pytestmark = pytest.mark.gpu


# ==================================================== efficient_attention_backward

# (dtype, max_k = round_up(max(Dqk, Dv), 32), 128-bit aligned, varlen, split keys):
# one compiled configuration each (split keys: Δ from compute_delta, not the kernel).
ME_CLASSES = [
    (BF16, 64, True, False, False),
    (F16, 128, True, False, True),
    (BF16, 256, True, False, False),
    (F16, 96, False, False, True),
    (BF16, 128, True, True, False),
    (F16, 64, True, True, True),
]
ME_SEQLENS = st.one_of(st.integers(1, 300), st.sampled_from([1, 63, 64, 65, 127, 128, 129, 255, 256, 257]))


def me_block_j(max_k):
    return 128 if max_k <= 128 else 64  # cute_kernels/mem_eff_attention/config.py's block_size_j


def _me_layout(aligned, nd=4):
    if aligned:  # pitch and start offset multiples of 8 halves: the 128-bit path stays on
        return _layout(st.sampled_from([0, 8, 16]), st.sampled_from([0, 8, 64]), nd)
    return _layout(st.integers(0, 9), st.integers(0, 9), nd)


@st.composite
def mem_eff_specs(draw, ci):
    dtype, max_k, aligned, varlen, split = ME_CLASSES[ci]
    lo = max_k - 31
    if aligned:
        big = draw(st.sampled_from([d for d in range(lo, max_k + 1) if d % 8 == 0]))
        other = big if draw(st.booleans()) else draw(st.sampled_from(list(range(8, big + 1, 8))))
        misalign = None
    else:
        # one source of misalignment is always there: an odd head dim (the gradients' rows)
        # or an odd start of query; the rest of the layouts are free
        misalign = draw(st.sampled_from(["dqk", "dv", "offset"]))
        big = draw(st.integers(lo, max_k))
        other = big if draw(st.booleans()) else draw(st.integers(1, big))
    dqk, dv = (big, other) if draw(st.booleans()) else (other, big)
    if misalign == "dqk" and dqk % 2 == 0:
        dqk -= 1  # stays >= lo (lo is odd), so max_k is unchanged
    if misalign == "dv" and dv % 2 == 0:
        dv -= 1
    bj = me_block_j(max_k)
    spec = dict(
        cls=ci,
        dtype=dtype,
        max_k=max_k,
        aligned=aligned,
        varlen=varlen,
        split=split,
        misalign=misalign,
        dqk=dqk,
        dv=dv,
        heads=draw(st.integers(1, 3)),
        mask_type=draw(st.sampled_from([0, 1, 2])),
        scale=draw(st.sampled_from([None, None, 0.05, 0.3, 1.0])),
    )
    if varlen:
        lq = draw(_lengths(200))
        lk = draw(st.lists(st.integers(0, 200), min_size=len(lq), max_size=len(lq)).filter(lambda ls: sum(ls) > 0))
        if split:  # the longest key sequence spans more than one key block
            i = draw(st.integers(0, len(lk) - 1))
            lk[i] = draw(st.integers(bj + 1, 2 * bj + 40))
        spec.update(batch=1, lengths=(lq, lk), mq=sum(lq), mk=sum(lk))
        keys = max(lk)
    else:
        spec.update(batch=draw(st.integers(1, 3)), lengths=None, mq=draw(ME_SEQLENS))
        spec["mk"] = draw(st.integers(bj + 1, 400)) if split else draw(ME_SEQLENS)
        keys = spec["mk"]
    spec["window"] = 0 if spec["mask_type"] == 0 else draw(st.one_of(st.just(0), st.integers(1, keys + 16)))
    spec["num_splits_key"] = draw(st.sampled_from([None, 2, 3, 4, 8])) if split else 1
    spec["layouts"] = {name: draw(_me_layout(aligned)) for name in ("q", "k", "v", "out", "grad_out")}
    if misalign == "offset":
        pads, order, offset = spec["layouts"]["q"]
        spec["layouts"]["q"] = (pads, order, offset | 1)
    spec["lse_pad"] = draw(st.sampled_from([0, 0, 1, 40]))
    spec["seed"] = draw(st.integers(0, 2**31 - 1))
    return spec


def torch_usable(s):
    """Where torch's mem-eff kernels are safe to call on this case: head dims multiples of 8
    (their 128-bit kernels; odd ones are not what the existing tests ran) and windows only
    where the existing tests ran them (max_k <= 128, Dqk == Dv)."""
    if s["dqk"] % 8 or s["dv"] % 8:
        return False
    return s["window"] == 0 or (s["max_k"] <= 128 and s["dqk"] == s["dv"])


def mem_eff_inputs(s, device=None):
    """q, k, v, dO as padded / permuted views of bigger NaN-filled buffers."""
    dev = device or DEV
    gen = torch.Generator(dev).manual_seed(s["seed"])
    b, mq, mk, h, dqk, dv, dtype = s["batch"], s["mq"], s["mk"], s["heads"], s["dqk"], s["dv"], s["dtype"]
    shapes = {"q": (b, mq, h, dqk), "k": (b, mk, h, dqk), "v": (b, mk, h, dv), "grad_out": (b, mq, h, dv)}
    return {
        name: _apply_layout(torch.randn(shape, generator=gen, device=dev, dtype=dtype), s["layouts"][name])
        for name, shape in shapes.items()
    }


def _torch_forward(q, k, v, cq, ck, max_q, max_k, mask_type, scale, win):
    out, lse, seed_t, offset_t, _, _ = torch.ops.aten._efficient_attention_forward(
        q,
        k,
        v,
        None,
        cq,
        ck,
        max_q if cq is not None else None,
        max_k if cq is not None else None,
        0.0,
        mask_type,
        True,
        scale=scale,
        window_size=win,
    )
    return out, lse, seed_t, offset_t


def _torch_backward(*args, **kw):
    return torch.ops.aten._efficient_attention_backward(*args, **kw)[:3]


def _mem_eff_case(s):
    t = mem_eff_inputs(s)
    q, k, v, do = t["q"], t["k"], t["v"], t["grad_out"]
    b, mq, mk, dtype, mask_type, window, scale = (
        s["batch"],
        s["mq"],
        s["mk"],
        s["dtype"],
        s["mask_type"],
        s["window"],
        s["scale"],
    )
    lengths = s["lengths"]
    cq, ck, max_q, max_k = seq_args(mq, mk, lengths)
    segs = segments(b, mq, mk, lengths)
    win = window or None
    qc, kc, vc, doc = (x.contiguous() for x in (q, k, v, do))
    usable = torch_usable(s)
    if usable and torch_forward_ok(mask_type, segs):
        out_c, lse, seed_t, offset_t = _torch_forward(qc, kc, vc, cq, ck, max_q, max_k, mask_type, scale, win)
    else:
        out_c, lse = ref_forward(q, k, v, mask_type, window, scale, cq, ck, max_q)
        seed_t = offset_t = torch.empty((), dtype=torch.int64)
    out = _apply_layout(out_c, s["layouts"]["out"])
    lse_v = _pad_last(lse, s["lse_pad"])
    args = (do, q, k, v, None, out, cq, ck, max_q, max_k, lse_v, 0.0, seed_t, offset_t, mask_type, False)
    poison_allocator(*(2 * math.prod(x.shape) for x in (q, k, v)))  # unwritten gradients show as NaN
    dq, dk, dv, _ = _backward()(*args, scale=scale, num_splits_key=s["num_splits_key"], window_size=win)
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, window_size=window, scale=scale, cu_seqlens_q=cq, cu_seqlens_k=ck
    )
    theirs = [None] * 3
    if usable and torch_backward_ok(mask_type, window, segs):
        targs = (doc, qc, kc, vc, None, out_c, cq, ck, max_q, max_k, lse, 0.0, seed_t, offset_t, mask_type, False)
        theirs = _torch_backward(*targs, scale=scale, window_size=win)
    rows_q, rows_k = key_coverage(b, mq, mk, mask_type, window, lengths)
    label = f"class {s['cls']} Dqk{s['dqk']} Dv{s['dv']} mask{mask_type} w{window} splits{s['num_splits_key']}"
    check_grad(f"dq [{label}]", dq, ref[0], dtype, theirs[0], rows_q)
    check_grad(f"dk [{label}]", dk, ref[1], dtype, theirs[1], rows_k)
    check_grad(f"dv [{label}]", dv, ref[2], dtype, theirs[2], rows_k)


_mem_eff_family = _family("efficient_attention_backward", ME_CLASSES, mem_eff_specs, _mem_eff_case)
_ME_IDS = [
    f"{_dt(c[0])}-k{c[1]}-{'aligned' if c[2] else 'unaligned'}-{'varlen' if c[3] else 'dense'}-{'split' if c[4] else 'nosplit'}"
    for c in ME_CLASSES
]


@pytest.mark.parametrize("ci", range(len(ME_CLASSES)), ids=_ME_IDS)
def test_efficient_attention_backward_randomized(ci):
    _mem_eff_family(ci)


# ============================================== efficient_attention_backward: bias / dropout

# (dtype, max_k, bias: None / "aligned" / "unaligned", bias grad, dropout, varlen): each a
# compiled configuration (twice: split keys or not)
BD_CLASSES = [
    (F16, 64, "aligned", True, True, False),
    (BF16, 128, "aligned", False, True, False),
    (BF16, 128, "unaligned", True, False, False),
    (F16, 128, None, False, True, True),
    (BF16, 256, "aligned", True, True, False),
    (F32, 64, "unaligned", True, True, False),
    (F16, 96, "aligned", True, False, False),
    (BF16, 64, None, False, True, False),
]


@st.composite
def bias_dropout_specs(draw, ci):
    dtype, max_k, bias, grad, dropout, varlen = BD_CLASSES[ci]
    dqk = draw(st.sampled_from([d for d in range(max_k - 31, max_k + 1) if d % 8 == 0]))
    dv = draw(st.sampled_from([dqk, draw(st.sampled_from(list(range(8, dqk + 1, 8))))]))
    dqk, dv = (dqk, dv) if draw(st.booleans()) else (dv, dqk)
    spec = dict(
        cls=ci,
        dtype=dtype,
        kd=dqk,
        kv=dv,
        h=draw(st.integers(1, 3)),
        mask_type=draw(st.sampled_from([0, 1, 2])),
        scale=draw(st.sampled_from([None, None, 0.3])),
        splits=draw(st.sampled_from([None, 1, 2, 3])),
        dropout_p=draw(st.sampled_from([0.05, 0.1, 0.3, 0.6])) if dropout else 0.0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    if varlen:
        lq = draw(st.lists(st.integers(0, 150), min_size=1, max_size=4).filter(lambda ls: sum(ls) > 0))
        lk = draw(st.lists(st.integers(0, 200), min_size=len(lq), max_size=len(lq)).filter(lambda ls: sum(ls) > 0))
        if spec["mask_type"] == 2:  # bottom right needs Mq <= Mk per sequence (torch's forward)
            lk = [max(a, b) for a, b in zip(lq, lk)]
        spec.update(b=1, mq=0, mk=0, lengths=(lq, lk), keys=max(lk))
    else:
        mq, mk = draw(st.integers(1, 260)), draw(st.integers(1, 300))
        if spec["mask_type"] == 2:
            mq = min(mq, mk)
        spec.update(b=draw(st.integers(1, 3)), mq=mq, mk=mk, lengths=None, keys=mk)
    spec["window"] = 0 if spec["mask_type"] == 0 else draw(st.one_of(st.just(0), st.integers(1, spec["keys"] + 16)))
    if bias is not None:
        b, h, mq, mk = spec["b"], spec["h"], spec["mq"], spec["mk"]
        keep = draw(
            st.sampled_from(
                ["full", "batch", "heads", "both", "queries", "keys"]
                if bias == "unaligned"
                else ["full", "batch", "heads", "both", "queries"]
            )
        )
        shape = {
            "full": (b, h, mq, mk),
            "batch": (1, h, mq, mk),
            "heads": (b, 1, mq, mk),
            "both": (mq, mk),
            "queries": (b, h, 1, mk),
            "keys": (b, h, mq, 1),
        }[keep]
        layout = "dense"
        if bias == "aligned":
            spec["mk"] = mk = -(-mk // 8) * 8  # rows a whole number of 128-bit vectors
            shape = shape[:-1] + (mk,)
        elif keep != "keys":
            layout = draw(st.sampled_from(["padded", "transposed"]))
        spec.update(bias_shape=shape, bias_layout=layout, bias_grad=grad)
    else:
        spec.update(bias_shape=None, bias_layout="dense", bias_grad=False)
    return spec


def _bias_dropout_case(s):
    from .test_mem_eff_attention_features_gpu import run_feature_case

    run_feature_case(
        s["dtype"],
        s["b"],
        s["mq"],
        s["mk"],
        s["h"],
        s["kd"],
        s["kv"],
        bias_shape=s["bias_shape"],
        bias_layout=s["bias_layout"],
        bias_grad=s["bias_grad"],
        dropout_p=s["dropout_p"],
        mask_type=s["mask_type"],
        window=s["window"],
        scale=s["scale"],
        lengths=s["lengths"],
        splits=s["splits"],
        seed=s["seed"],
    )


_bias_dropout_family = _family(
    "efficient_attention_backward_bias_dropout", BD_CLASSES, bias_dropout_specs, _bias_dropout_case
)
_BD_IDS = [
    f"{_dt(c[0])}-k{c[1]}-bias_{c[2]}{'_grad' if c[3] else ''}-{'dropout' if c[4] else 'nodropout'}-{'varlen' if c[5] else 'dense'}"
    for c in BD_CLASSES
]


@pytest.mark.parametrize("ci", range(len(BD_CLASSES)), ids=_BD_IDS)
def test_efficient_attention_backward_bias_dropout_randomized(ci):
    _bias_dropout_family(ci)
