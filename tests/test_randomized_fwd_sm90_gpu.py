"""GPU: the Hopper attention forward (sm_90a), randomized: every head-dim pair it compiles,
fp16 / bf16, masks none / top-left / bottom-right (more queries than keys through the
kernel's torch face; the ops' NotImplementedError checked), windows, grouped- and
multi-query heads, odd lengths, variable lengths with empty and one-row sequences (the ops'
refusal of a bias there checked), bias of every broadcast and layout, dropout, padded and
permuted views, through the kernel's torch face, efficient_attention_forward,
memory_efficient_attention and SDPA under use_for_sdpa (a call counter asserts ours ran); O
and the LSE against the fp64 reference with torch's keep mask for the philox state the call
took (tests/test_attention_fwd_sm90_gpu.py; tests/randomized_common.py describes the suite)."""

import contextlib

import pytest
import torch
from hypothesis import strategies as st

import ops
from ops import _compile as cc
from ops import attention_fwd_sm90 as fwd_sm90

from .randomized_common import BF16, DEV, F16, _apply_layout, _dt, _family, _layout
from .test_attention_bwd_prepost_gpu import poison_allocator
from .test_attention_fwd_sm90_gpu import check_forward, forward_reference
from .test_mem_eff_attention_gpu import cu_seqlens

pytestmark = pytest.mark.gpu


# ================================================= attention forward (Hopper, sm_90a)

# (dtype, (Dqk, Dv), mask type, window, varlen, bias, dropout): one compiled forward each
# (ops.attention_fwd_sm90.ForwardConfig). Every head-dim pair the forward compiles, both dtypes,
# every mask, and the features together: bias with dropout under each mask, windows with
# bottom-right masks, variable lengths with dropout (never with a bias: the op refuses it).
FWD_CLASSES = [
    (BF16, (64, 64), 0, False, False, False, False),
    (F16, (64, 64), 2, True, True, False, True),
    (BF16, (64, 64), 1, False, False, True, True),
    (F16, (96, 96), 1, True, False, True, False),
    (BF16, (96, 96), 2, False, True, False, True),
    (F16, (128, 128), 2, True, False, True, True),
    (BF16, (128, 128), 1, True, True, False, True),
    (BF16, (128, 128), 0, False, True, False, False),
    (F16, (192, 192), 0, False, False, True, True),
    (BF16, (192, 192), 2, True, True, False, False),
    (BF16, (192, 128), 1, False, False, False, True),
    (F16, (192, 128), 2, True, True, False, True),
    (F16, (256, 256), 1, True, False, True, False),
    (BF16, (256, 256), 2, False, True, False, True),
    (F16, (256, 256), 0, False, False, True, True),
]
# lengths around the tiles' edges (tile_m 128 / 192, tile_n 64 to 160) and anything up to 400
FWD_SEQLENS = st.one_of(
    st.integers(1, 400),
    st.sampled_from([1, 2, 63, 64, 65, 79, 81, 97, 111, 113, 127, 128, 129, 161, 191, 192, 193, 257, 383, 385]),
)
FWD_BIAS_KINDS = ("full", "batch", "heads", "both", "heads_3d", "queries", "keys", "row")
_CAUSAL = {0: False, 1: True, 2: "bottom_right"}


def _fwd_bias_shape(kind, b, h, mq, mk):
    return {
        "full": (b, h, mq, mk),
        "batch": (1, h, mq, mk),
        "heads": (b, 1, mq, mk),
        "both": (mq, mk),
        "heads_3d": (h, mq, mk),
        "queries": (b, h, 1, mk),
        "keys": (b, h, mq, 1),
        "row": (mk,),
    }[kind]


FWD_ENTRIES = ("kernel", "memory_efficient_attention", "sdpa", "efficient_attention_forward")
SDPA_BIAS_KINDS = ("full", "batch", "heads", "both", "heads_3d")


def _sdpa_class(ci):
    """Whether F.scaled_dot_product_attention expresses the class's problems: dense, Dqk == Dv, no
    mask or top-left causal without a bias, no window (and, per case, one key head per query head)."""
    dtype, (dqk, dv), mask_type, window, varlen, bias, dropout = FWD_CLASSES[ci]
    return not varlen and dqk == dv and not window and (mask_type == 0 or (mask_type == 1 and not bias))


@st.composite
def forward_specs(draw, ci):
    dtype, (dqk, dv), mask_type, window, varlen, bias, dropout = FWD_CLASSES[ci]
    # the entry point: the kernel's torch face, the ops, or SDPA under ops.use_for_sdpa
    entry = draw(st.sampled_from(FWD_ENTRIES if _sdpa_class(ci) else [e for e in FWD_ENTRIES if e != "sdpa"]))
    hk = draw(st.integers(1, 3))
    group = 1 if entry == "sdpa" else draw(st.sampled_from([1, 1, 2, 3, 4]))  # hk 1 with a group: multi-query
    spec = dict(
        cls=ci,
        dtype=dtype,
        dqk=dqk,
        dv=dv,
        mask_type=mask_type,
        hk=hk,
        h=hk * group,
        scale=draw(st.sampled_from([None, None, 0.05, 0.3])),
        p=draw(st.sampled_from([0.1, 0.3, 0.6])) if dropout else 0.0,
        seed=draw(st.integers(0, 2**31 - 1)),
        # the kernel's own philox state (the ops take the generator's): a seed with the top bit
        # set among them, offsets as torch's forward leaves them (multiples of 4)
        philox=(
            draw(st.one_of(st.integers(0, 2**31 - 1), st.just(2**63 + 17 - 2**64))),
            4 * draw(st.integers(0, 2**33)),
        ),
    )
    # bottom-right with more queries than keys: the kernel's business, the ops raise (mostly avoided)
    q_past_k_ok = mask_type == 2 and draw(st.sampled_from([False, False, False, True]))
    if varlen:
        n = draw(st.integers(1, 5))
        length = st.one_of(st.sampled_from([0, 1, 2, 17]), st.integers(0, 300))  # empty and one-row sequences
        lq = draw(st.lists(length, min_size=n, max_size=n).filter(lambda ls: sum(ls) > 0))
        lk = draw(st.lists(length, min_size=n, max_size=n).filter(lambda ls: sum(ls) > 0))
        if mask_type == 2 and not q_past_k_ok:
            lk = [max(a, b) for a, b in zip(lq, lk)]
        # max_seqlen as callers pass them: the longest, or more (within the packed lengths)
        max_q = min(max(lq) + draw(st.sampled_from([0, 0, 0, 1, 40])), sum(lq))
        max_k = min(max(lk) + draw(st.sampled_from([0, 0, 0, 1, 40])), sum(lk))
        spec.update(b=1, lengths=(lq, lk), mq=sum(lq), mk=sum(lk), keys=max(lk), max_q=max_q, max_k=max_k)
        spec["q_past_k"] = mask_type == 2 and any(a > b for a, b in zip(lq, lk))
        spec["try_bias"] = draw(st.booleans())  # the ops refuse a bias with cu_seqlens: checked
    else:
        mq, mk = draw(FWD_SEQLENS), draw(FWD_SEQLENS)
        if mask_type == 2 and mq > mk and not q_past_k_ok:
            mq, mk = mk, mq
        spec.update(b=draw(st.integers(1, 3)), lengths=None, mq=mq, mk=mk, keys=mk, max_q=mq, max_k=mk)
        spec["q_past_k"] = mask_type == 2 and mq > mk
        spec["try_bias"] = False
    spec["window"] = draw(st.integers(1, spec["keys"] + 16)) if window else 0
    spec.update(bias_shape=None, bias_kind=None, bias_layout="dense")
    if bias:
        kind = draw(st.sampled_from(SDPA_BIAS_KINDS if entry == "sdpa" else FWD_BIAS_KINDS))
        shape = _fwd_bias_shape(kind, spec["b"], spec["h"], spec["mq"], spec["mk"])
        # SDPA refuses a mask whose keys are not contiguous before any backend runs
        layouts = ["dense", "padded"] + ([] if entry == "sdpa" else ["transposed"])
        layout = draw(st.sampled_from(layouts)) if len(shape) >= 2 else "dense"
        spec.update(bias_shape=shape, bias_kind=kind, bias_layout=layout)
    # q / k / v as padded, permuted views of NaN-filled buffers, TMA-aligned (pitches and starts
    # multiples of 16 bytes): what the kernel reads past a view shows
    aligned = _layout(st.sampled_from([0, 8, 16]), st.sampled_from([0, 8, 64]), 4)
    spec["layouts"] = {name: draw(aligned) for name in ("q", "k", "v")}
    spec["entry"] = entry
    return spec


def forward_inputs(s, device=None):
    dev = device or DEV
    gen = torch.Generator(dev).manual_seed(s["seed"])
    b, mq, mk, h, hk, dtype = s["b"], s["mq"], s["mk"], s["h"], s["hk"], s["dtype"]
    r = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=dtype)  # noqa: E731
    shapes = {"q": (b, mq, h, s["dqk"]), "k": (b, mk, hk, s["dqk"]), "v": (b, mk, hk, s["dv"])}
    t = {name: _apply_layout(r(*shape), s["layouts"][name]) for name, shape in shapes.items()}
    bias, shape = None, s["bias_shape"]
    if shape is not None:
        if s["bias_layout"] == "padded":  # rows of a wider buffer: strides not multiples of 8
            bias = r(*shape[:-1], shape[-1] + 3)[..., : shape[-1]]
        elif s["bias_layout"] == "transposed":  # keys not contiguous
            bias = r(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
        else:
            bias = r(*shape)
    return t["q"], t["k"], t["v"], bias


@contextlib.contextmanager
def counted_forward():
    """Counts the calls of the forward kernel's torch face (the ops and SDPA reach it through the
    module attribute): a case asserts that ours ran, not torch's forward."""
    calls = []
    real = fwd_sm90.attention_forward_sm90

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    fwd_sm90.attention_forward_sm90 = counted
    try:
        yield calls
    finally:
        fwd_sm90.attention_forward_sm90 = real


def _forward_case(s):
    q, k, v, bias = forward_inputs(s)
    dtype, mask_type, window, scale, p = s["dtype"], s["mask_type"], s["window"], s["scale"], s["p"]
    lengths, max_q, max_k = s["lengths"], s["max_q"], s["max_k"]
    cq, ck = (cu_seqlens(lengths[0]), cu_seqlens(lengths[1])) if lengths else (None, None)
    seqlens = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max_q if lengths else None)
    seqlens["max_seqlen_k"] = max_k if lengths else None
    entry = s["entry"]
    mea = dict(causal=_CAUSAL[mask_type], window_size=window or None, scale=scale, dropout_p=p, return_lse=True)
    if entry != "kernel" and s["q_past_k"]:  # the ops refuse what torch's forward gets wrong
        with pytest.raises(NotImplementedError, match="bottom_right"), torch.no_grad():
            ops.memory_efficient_attention(q, k, v, attn_bias=bias, **seqlens, **mea)
        entry = "kernel"  # the kernel's face takes it
    label = (
        f"class {s['cls']} {entry} {_dt(dtype)} B{s['b']} Mq{s['mq']} Mk{s['mk']} H{s['h']}/{s['hk']} "
        f"D{s['dqk']}/{s['dv']} mask{mask_type} w{window} p{p} bias{s['bias_shape']}:{s['bias_layout']} "
        f"lengths{lengths}"
    )
    why = fwd_sm90.unsupported(q, k, v, mask_type=mask_type, bias=bias, dropout_p=p)
    assert why is None, f"{label}: the forward refuses it ({why})"
    if lengths and s["try_bias"] and not s["q_past_k"]:
        with pytest.raises(NotImplementedError, match="cu_seqlens"), torch.no_grad():
            ops.memory_efficient_attention(q, k, v, attn_bias=q.new_zeros(s["mq"], s["mk"]), **seqlens, **mea)
    seed, offset = s["philox"] if entry == "kernel" else (s["seed"], 0)
    rows = len(lengths[0]) if lengths else s["b"]
    poison_allocator(
        q.shape[0] * q.shape[1] * q.shape[2] * s["dv"] * q.element_size(), rows * s["h"] * -(-max_q // 32) * 128
    )
    lse = None
    with counted_forward() as calls, torch.no_grad():
        if entry == "kernel":
            rng = (torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)) if p else (None,) * 2
            out, lse = fwd_sm90.attention_forward_sm90(
                q, k, v, scale, mask_type, window, cq, ck, max_q, max_k, bias, p, *rng
            )
        elif entry == "efficient_attention_forward":
            out, lse, seed_t, offset_t, _, _ = ops.efficient_attention_forward(
                q,
                k,
                v,
                bias,
                cq,
                ck,
                seqlens["max_seqlen_q"],
                seqlens["max_seqlen_k"],
                p,
                mask_type,
                True,
                scale=scale,
                window_size=window or None,
            )
            if p:
                seed, offset = int(seed_t), int(offset_t)
        elif entry == "memory_efficient_attention":
            torch.manual_seed(seed)  # the generator's philox state: (seed, 0)
            out, lse = ops.memory_efficient_attention(q, k, v, attn_bias=bias, **seqlens, **mea)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            t = lambda x: x.transpose(1, 2)  # noqa: E731
            torch.manual_seed(seed)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa():
                out = t(
                    torch.nn.functional.scaled_dot_product_attention(
                        t(q), t(k), t(v), attn_mask=bias, dropout_p=p, is_causal=mask_type == 1, scale=scale
                    )
                )
    assert len(calls) == 1, f"{label}: our forward ran {len(calls)} times (torch's forward instead?)"
    ref_out, ref_lse = forward_reference(
        q,
        k,
        v,
        mask_type=mask_type,
        window=window,
        scale=scale,
        bias=bias,
        lengths=lengths,
        max_q=max_q,
        max_k=max_k,
        p=p,
        seed=seed,
        offset=offset,
    )
    check_forward(label, out, lse, ref_out, ref_lse, dtype, lengths)


_forward_family = _family("attention_forward", FWD_CLASSES, forward_specs, _forward_case, seed_per_class=True)
_FWD_IDS = [
    f"{_dt(c[0])}-d{c[1][0]}-{c[1][1]}-mask{c[2]}"
    + "".join(f"-{n}" for n, on in zip(("window", "varlen", "bias", "dropout"), c[3:]) if on)
    for c in FWD_CLASSES
]


@pytest.mark.parametrize("ci", range(len(FWD_CLASSES)), ids=_FWD_IDS)
def test_attention_forward_randomized(ci):
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("the Hopper forward runs on sm_90a only")
    _forward_family(ci)
