"""GPU: the attention gradient bounds catch the errors a wrong kernel would make.

Each test takes the correct kernels' gradients on a case (they pass ``check_grad``), plants one error of the size a subtle kernel bug makes, and asserts
that the same check now fails: one key block of dK (a query block of dQ) scaled by 1.05, one
key block missing from dK and dV, one dropout bit flipped in the mask the reference uses, one
query block of dBias scaled by 1.05. Both backends, bf16 (the loosest bounds).
"""

import pytest
import torch

from ops import attention as A
from ops.reference import attention_backward_ref, attention_forward_ref

from .test_mem_eff_attention_features_gpu import check_dbias, philox_state, torch_keep_mask
from .helpers import delta_rounding_floors
from .test_mem_eff_attention_gpu import LSE_ALIGN, check_grad

pytestmark = pytest.mark.gpu
DEV, BF16 = "cuda", torch.bfloat16
B, M_, H, D = 2, 256, 4, 64
BACKENDS = ["auto", "mem_eff"]


def _case(backend, dropout_p=0.0, bias=False, seed=0):
    """(inputs, our gradients, the dropout mask) of one causal bf16 backward."""
    gen = torch.Generator(DEV).manual_seed(seed)
    q, k, v, do = (torch.randn(B, M_, H, D, device=DEV, dtype=BF16, generator=gen) for _ in range(4))
    attn_bias = torch.randn(B, H, M_, M_, device=DEV, dtype=BF16, generator=gen) if bias else None
    mask = None
    seed_t = offset_t = torch.empty((), dtype=torch.int64)
    if dropout_p:
        seed_t, offset_t = philox_state(B, H, M_, M_, dropout_p)
        mask = torch_keep_mask((B, H, M_, M_), dropout_p, int(seed_t), int(offset_t))
    out, lse = attention_forward_ref(
        q, k, v, custom_mask_type=1, bias=attn_bias, dropout_mask=mask, dropout_p=dropout_p
    )
    lse_t = torch.full((B, H, M_ + (-M_) % LSE_ALIGN), float("inf"), device=DEV)
    lse_t[..., :M_] = lse.float()
    out = out.to(BF16)
    grads = A.efficient_attention_backward(
        do, q, k, v, attn_bias, out, None, None, M_, M_, lse_t, dropout_p, seed_t, offset_t, 1, bias, backend=backend
    )
    return (q, k, v, do, attn_bias, out), grads, mask, delta_rounding_floors(q, k, do, out, BF16)


def _ref(inputs, mask=None, dropout_p=0.0):
    q, k, v, do, attn_bias, out = inputs
    return attention_backward_ref(
        q,
        k,
        v,
        do,
        custom_mask_type=1,
        bias=attn_bias,
        dropout_mask=mask,
        dropout_p=dropout_p,
        return_grad_bias=attn_bias is not None,
        out=out,
    )


def _fails(check, *args):
    with pytest.raises(AssertionError):
        check(*args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_block_off_by_five_percent(backend):
    inputs, (dq, dk, dv, _), _, (dq_floor, dk_floor) = _case(backend)
    ref = _ref(inputs)
    check_grad("dk", dk, ref[1], BF16, floor=dk_floor)
    planted = dk.clone()
    planted[1, 64:128, 2] *= 1.05  # one key block of one head
    _fails(check_grad, "dk", planted, ref[1], BF16, None, None, dk_floor)
    check_grad("dq", dq, ref[0], BF16, floor=dq_floor)
    planted = dq.clone()
    planted[0, 128:192, 3] *= 1.05
    _fails(check_grad, "dq", planted, ref[0], BF16, None, None, dq_floor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_key_block(backend):
    inputs, (_, dk, dv, _), _, (_, dk_floor) = _case(backend, seed=1)
    ref = _ref(inputs)
    for name, got, want, floor in (("dk", dk, ref[1], dk_floor), ("dv", dv, ref[2], None)):
        check_grad(name, got, want, BF16, floor=floor)
        planted = got.clone()
        planted[0, 192:256, 1] = 0  # the last key block of one head never written back
        _fails(check_grad, name, planted, want, BF16, None, None, floor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flipped_dropout_bit(backend):
    inputs, (_, _, dv, _), mask, _ = _case(backend, dropout_p=0.3, seed=2)
    check_grad("dv", dv, _ref(inputs, mask, 0.3)[2], BF16)
    # an early query sees few keys (n + 1): flip a kept bit of the first one that has one
    b, h = 0, 1
    n = next(n for n in range(2, M_) if mask[b, h, n, : n + 1].any())
    m = int(mask[b, h, n, : n + 1].nonzero()[0])
    flipped = mask.clone()
    flipped[b, h, n, m] = False
    _fails(check_grad, "dv", dv, _ref(inputs, flipped, 0.3)[2], BF16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_gradient_block_off_by_five_percent(backend):
    inputs, (_, _, _, db), _, _ = _case(backend, bias=True, seed=3)
    q, k, v, do, attn_bias, out = inputs
    ref_ds = _ref(inputs)[3]
    check_dbias("dbias", db, ref_ds, attn_bias, do, out, BF16)
    planted = db.clone()
    planted[1, 2, 64:128] *= 1.05  # one query block of one head
    _fails(check_dbias, "dbias", planted, ref_ds, attn_bias, do, out, BF16)
