"""GPU (sm_90a): used lengths (``seqused_q / seqused_k``) through ``ops.memory_efficient_attention``
(our forward, the sm90 backward) against the fp64 reference on each sequence's used rows: O and
the LSE, dQ / dK / dV, with garbage in every padding row of q / k / v / dO (any use of it shows),
exact zeros (O, gradients) and +inf (LSE) on the padding; masks top-left, bottom-right (a
sequence with more used queries than keys too) and windows on the used lengths, grouped-query
heads, used lengths 0 and 1, with cu_seqlens, d64 and d128. The forward also with NaN in the
query / key padding (masked there, never multiplied); torch.compile."""

import pytest
import torch

import ops
from ops import _compile as cc
from ops.reference import attention_backward_ref, attention_forward_ref

from .test_attention_fwd_sm90_gpu import check_forward
from .test_attention_sm90_gpu import check, rounding_floors

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16
CAUSAL = {0: False, 1: "top_left", 2: "bottom_right"}
GARBAGE = 30.0  # the padding's scale: finite (a straddling tile loads it with weight 0), far off the data


@pytest.fixture(autouse=True)
def _needs_sm90():
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("used lengths need our forward and the sm90 backward: an sm_90a device (H100 / H200)")


# (id, B, H, Hk, Sq, Sk, d, mask, window, used_q, used_k, lengths (cu_seqlens) or None, dtype)
CASES = [
    ("d128-gqa-top-left", 3, 4, 2, 300, 300, 128, 1, 0, [300, 1, 150], [257, 0, 300], None, BF16),
    ("d128-no-mask", 2, 2, 2, 200, 333, 128, 0, 0, [0, 199], [333, 1], None, F16),
    ("d64-mqa-bottom-right", 2, 4, 1, 256, 300, 64, 2, 0, [200, 250], [300, 120], None, BF16),
    ("d64-bottom-right-window", 2, 2, 2, 400, 400, 64, 2, 50, [399, 130], [333, 400], None, F16),
    (
        "varlen-d128-causal",
        1,
        4,
        2,
        None,
        None,
        128,
        1,
        0,
        [3, 0, 250, 1, 129],
        [5, 2, 1, 9, 200],
        ([5, 0, 300, 1, 129], [5, 3, 300, 10, 200]),
        BF16,
    ),
    (
        "varlen-d64-bottom-right-window",
        1,
        2,
        1,
        None,
        None,
        64,
        2,
        64,
        [50, 300, 0],
        [300, 350, 4],
        ([50, 400, 1], [300, 400, 10]),
        BF16,
    ),
]


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def _padding(m, used, cu):
    """[B, M] bool: True on the padding rows (past each sequence's used rows)."""
    rows = torch.arange(m, device=DEV)
    if cu is None:
        return rows.view(1, -1) >= used.view(-1, 1)
    pad = torch.ones(1, m, dtype=torch.bool, device=DEV)
    for i in range(used.numel()):
        start = int(cu[i])
        pad[0, start : start + int(used[i])] = False
    return pad


def _inputs(case, fill=GARBAGE, fill_qk=None):
    """q, k, v, dO with ``fill`` times noise in their padding rows (``fill_qk``: q's and k's padding
    set to that value), the op's and the reference's keyword arguments, the padding masks."""
    _, b, h, hk, sq, sk, d, mask, window, used_q, used_k, lengths, dtype = case
    cu_q = cu_k = None
    if lengths is not None:
        cu_q, cu_k = _cu(lengths[0]), _cu(lengths[1])
        sq, sk = sum(lengths[0]), sum(lengths[1])
    gen = torch.Generator(DEV).manual_seed(b * h + d + mask)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, d), r(b, sq, h, d)
    uq, uk = (torch.tensor(u, device=DEV, dtype=torch.int32) for u in (used_q, used_k))
    pad_q, pad_k = _padding(sq, uq, cu_q), _padding(sk, uk, cu_k)
    for t, pad in ((q, pad_q), (do, pad_q), (k, pad_k), (v, pad_k)):
        t[pad] = (fill * torch.randn(t[pad].shape, device=DEV, generator=gen)).to(dtype)
    if fill_qk is not None:
        q[pad_q], k[pad_k] = fill_qk, fill_qk
    kw = dict(causal=CAUSAL[mask], window_size=window or None, seqused_q=uq, seqused_k=uk)
    ref_kw = dict(custom_mask_type=mask, window_size=window, seqused_q=uq, seqused_k=uk)
    if lengths is not None:
        varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        kw.update(varlen, max_seqlen_q=max(lengths[0]), max_seqlen_k=max(lengths[1]))
        ref_kw.update(varlen)
    return (q, k, v, do), kw, ref_kw, (pad_q, pad_k)


def _check_outputs(label, out, lse, case, ref_kw, q, k, v, pad_q):
    """O and the LSE against the reference; O exactly 0 and the LSE +inf on the padding."""
    ref_out, ref_lse = attention_forward_ref(q, k, v, **ref_kw)
    lengths = case[11]
    dtype = case[12]
    check_forward(label, out, lse, ref_out, ref_lse, dtype, None if lengths is None else (case[9], case[10]))
    assert (out[pad_q] == 0).all(), f"{label}: O is not 0 on the padding rows"
    used = ref_kw["seqused_q"].view(-1, 1, 1)
    rows = torch.arange(lse.shape[-1], device=DEV).view(1, 1, -1)
    past = (rows >= used).expand(lse.shape)
    if lengths is not None:  # (past a sequence's next multiple of 32: the padding's own rows)
        past = past & (rows < torch.tensor(lengths[0], device=DEV).view(-1, 1, 1))
    assert (lse[past] == float("inf")).all(), f"{label}: LSE is not +inf on the padding rows"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_fp64_reference(case):
    """O, the LSE and dQ / dK / dV against the reference on the used rows; the padding's outputs
    and gradients exactly 0 (LSE +inf), whatever it holds."""
    (q, k, v, do), kw, ref_kw, (pad_q, pad_k) = _inputs(case)
    dtype, label = case[12], case[0]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ops.memory_efficient_attention(*leaves, return_lse=True, **kw)
    torch.autograd.backward(out, do)
    _check_outputs(label, out.detach(), lse, case, ref_kw, q, k, v, pad_q)
    ref = attention_backward_ref(q, k, v, do, out=out.detach(), **ref_kw)
    # the rounding floors of the used rows (the padding's garbage would only loosen them)
    used = [x.masked_fill(pad.view(*pad.shape, 1, 1), 0) for x, pad in ((q, pad_q), (k, pad_k), (do, pad_q))]
    floors = rounding_floors(used[0], used[1], used[2], out.detach(), dtype)
    for name, g, r, like, floor, pad in zip(
        ("dq", "dk", "dv"), [x.grad for x in leaves], ref, (q, k, v), floors, (pad_q, pad_k, pad_k)
    ):
        check(f"{name} [{label}]", g, r, like, dtype, floor)
        assert (g[pad] == 0).all(), f"{label}: {name} is not 0 on the padding rows"


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[CASES[0][0], CASES[4][0]])
def test_forward_masks_nan_in_query_and_key_padding(case):
    """NaN in the query and key padding: the forward masks those scores and selects the padding
    rows' O away, so nothing of it reaches O or the LSE."""
    (q, k, v, _), kw, ref_kw, (pad_q, _) = _inputs(case, fill_qk=float("nan"))
    out, lse = ops.memory_efficient_attention(q, k, v, return_lse=True, **kw)
    _check_outputs(case[0] + " nan", out, lse, case, ref_kw, q, k, v, pad_q)


def test_torch_compile_keeps_used_lengths():
    """torch.compile(fullgraph=True): the op's schema carries the used lengths forward and back;
    the compiled step's gradients are the eager one's."""
    case = CASES[0]
    (q, k, v, do), kw, _, _ = _inputs(case)

    def step(q, k, v):
        return (ops.memory_efficient_attention(q, k, v, **kw).float() * do.float()).sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b) or (a.double() - b.double()).abs().max().item() <= 1e-3 * a.double().abs().max()


def test_used_lengths_refused_where_our_kernels_do_not_apply():
    """torch's forward and the memory-efficient backward take no used lengths: NotImplementedError
    naming them (fp32: torch's forward; backend="mem_eff")."""
    q, k, v = (torch.randn(2, 64, 2, 64, device=DEV, dtype=BF16) for _ in range(3))
    used = torch.tensor([10, 64], device=DEV, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="seqused"):
        ops.memory_efficient_attention(q, k, v, seqused_k=used, backend="mem_eff")
    with pytest.raises(NotImplementedError, match="seqused"), torch.no_grad():
        ops.memory_efficient_attention(*(t.float() for t in (q, k, v)), seqused_q=used)
