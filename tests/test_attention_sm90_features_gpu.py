"""The Hopper-native attention backward on an H100 (sm_90a) with attention bias of every
broadcast kind and layout, its gradient, and dropout with torch's keep mask (through dV with
identity dO rows, bit for bit), with masks, windows, every head dim, variable lengths, grouped
heads and deterministic mode: against fp64 (the mask torch drew), the memory-efficient kernel
and torch's own backward."""

import pytest
import torch

import ops
from ops.reference import attention_backward_ref, attention_forward_ref

from .attention_sm90_gpu_common import BF16, DEV, F16, TOL, check, make_inputs, rounding_floors
from .attention_sm90_gpu_common import _needs_sm90  # noqa: F401 (autouse: an sm_90a device)

pytestmark = pytest.mark.gpu


# (dtype, B, Mq, Mk, H, D, features of run_feature_case): bias of every broadcast kind and
# layout (element reads: strides 0, padded rows, keys not contiguous), with and without its
# gradient; dropout with masks and windows; both together; every head dim
FEATURE_CASES = [
    (BF16, 2, 100, 140, 3, 64, dict(bias_shape=(2, 3, 100, 140), bias_grad=True, mask_type=1)),
    (F16, 2, 100, 140, 3, 64, dict(bias_shape=(100, 140), bias_grad=True)),  # over batch and heads
    (BF16, 2, 100, 140, 3, 128, dict(bias_shape=(2, 3, 100, 1), bias_grad=True, mask_type=2)),  # over keys
    (F16, 2, 100, 140, 3, 128, dict(bias_shape=(2, 3, 1, 140), bias_grad=False)),  # over queries
    (F16, 2, 100, 140, 3, 96, dict(bias_shape=(2, 3, 100, 140), bias_layout="transposed", bias_grad=True)),
    (BF16, 2, 100, 140, 3, 192, dict(bias_shape=(2, 3, 100, 140), bias_layout="padded", mask_type=1)),
    (F16, 2, 100, 140, 3, 256, dict(bias_shape=(1, 3, 100, 140), bias_grad=True, mask_type=2, window=30)),
    (F16, 2, 130, 190, 2, 64, dict(dropout_p=0.1)),
    (BF16, 2, 130, 190, 2, 128, dict(dropout_p=0.5, mask_type=1)),
    (F16, 2, 130, 190, 2, 96, dict(dropout_p=0.3, mask_type=2, window=17)),
    (BF16, 2, 130, 190, 2, 192, dict(dropout_p=0.2, mask_type=1, window=40)),
    (F16, 2, 130, 190, 2, 256, dict(dropout_p=0.2)),
    (BF16, 2, 90, 150, 2, 128, dict(bias_shape=(2, 1, 90, 150), bias_grad=True, dropout_p=0.2, mask_type=1)),
    (F16, 2, 90, 150, 2, 192, dict(bias_shape=(2, 1, 90, 150), bias_grad=True, dropout_p=0.2)),
    (BF16, 1, 300, 520, 2, 64, dict(bias_shape=(1, 2, 300, 520), bias_grad=True, dropout_p=0.15)),  # several blocks
    # Dqk != Dv: (Dqk, Dv)
    (BF16, 2, 100, 140, 3, (192, 128), dict(bias_shape=(2, 3, 100, 140), bias_grad=True, dropout_p=0.2, mask_type=1)),
    (F16, 2, 100, 140, 3, (128, 64), dict(bias_shape=(1, 3, 100, 140), bias_grad=True, dropout_p=0.1)),
    (BF16, 2, 130, 190, 2, (64, 256), dict(dropout_p=0.3, mask_type=2)),
]


def _feature_id(c):
    flags = "-".join(f"{k}{v}" for k, v in c[6].items())
    return f"{str(c[0])[6:]}-B{c[1]}q{c[2]}k{c[3]}H{c[4]}d{c[5]}-{flags}"


@pytest.mark.parametrize("case", FEATURE_CASES, ids=[_feature_id(c) for c in FEATURE_CASES])
def test_bias_and_dropout_vs_reference(case):
    from .test_mem_eff_attention_features_gpu import run_feature_case

    dtype, b, mq, mk, h, d, kw = case
    kd, kv = d if isinstance(d, tuple) else (d, d)
    run_feature_case(dtype, b, mq, mk, h, kd, kv, backend="sm90", seed=mq + kd, **kw)


@pytest.mark.parametrize("dtype,mask_type,d", [(F16, 0, 64), (BF16, 1, 64), (F16, 2, 128), (BF16, 0, 256)])
def test_dropout_uses_torchs_mask(dtype, mask_type, d):
    """Identity dO rows: dV shows, bit for bit, which (query, key) the kernel kept."""
    from .test_mem_eff_attention_features_gpu import check_mask_through_dv

    check_mask_through_dv(dtype, mask_type, "sm90", d=d)


def test_dropout_varlen():
    from .test_mem_eff_attention_features_gpu import run_feature_case

    for mask_type, d in ((1, 64), (0, 128), (2, 192)):
        run_feature_case(
            F16,
            1,
            0,
            0,
            2,
            d,
            d,
            dropout_p=0.25,
            lengths=([70, 0, 129, 5], [90, 3, 200, 0]),
            mask_type=mask_type,
            backend="sm90",
        )


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_bias_and_dropout_vs_torch_backward(dtype):
    """Same inputs, same philox seed / offset as torch's own backward."""
    from .test_mem_eff_attention_features_gpu import run_feature_case

    run_feature_case(dtype, 2, 128, 256, 4, 64, 64, dropout_p=0.1, compare_torch=True, backend="sm90")
    run_feature_case(dtype, 2, 128, 256, 4, 128, 128, dropout_p=0.3, mask_type=1, compare_torch=True, backend="sm90")
    run_feature_case(
        dtype,
        2,
        128,
        256,
        4,
        64,
        64,
        bias_shape=(2, 1, 128, 256),
        bias_grad=True,
        dropout_p=0.1,
        compare_torch=True,
        backend="sm90",
    )


@pytest.mark.parametrize("deterministic", [False, True])
def test_grouped_heads_with_bias_and_dropout(deterministic):
    """Grouped-query heads with a bias requiring grad and dropout: sm90 (one CTA walks the
    group's query heads, the mask of each) against fp64 and the memory-efficient kernel;
    deterministic mode three times bitwise equal."""
    from .test_mem_eff_attention_features_gpu import philox_state, torch_keep_mask

    dtype, b, h, hk, mq, mk, d, p, mask_type = BF16, 2, 4, 2, 150, 200, 128, 0.2, 1
    q, _, _, do = make_inputs(b, h, mq, mk, d, dtype, seed=31)
    _, k, v, _ = make_inputs(b, hk, mq, mk, d, dtype, seed=32)
    bias = torch.randn(b, h, mq, mk, device=DEV, dtype=dtype, generator=torch.Generator(DEV).manual_seed(33))
    seed, offset = philox_state(b, h, mq, mk, p)
    mask = torch_keep_mask((b, h, mq, mk), p, int(seed), int(offset))
    kr, vr = (t.repeat_interleave(h // hk, 2) for t in (k, v))
    out, lse = attention_forward_ref(q, kr, vr, custom_mask_type=mask_type, bias=bias, dropout_mask=mask, dropout_p=p)
    lse_t = torch.full((b, h, -(-mq // 32) * 32), float("inf"), device=DEV)
    lse_t[..., :mq] = lse.float()
    out = out.to(dtype)
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, bias=bias, dropout_mask=mask, dropout_p=p, return_grad_bias=True
    )

    def run(backend):
        return ops.efficient_attention_backward(
            do,
            q,
            k,
            v,
            bias,
            out,
            None,
            None,
            mq,
            mk,
            lse_t,
            p,
            seed,
            offset,
            mask_type,
            True,
            backend=backend,
            deterministic=deterministic,
        )

    ours, theirs = run("sm90"), run("mem_eff")
    if deterministic:
        for _ in range(2):
            assert all(torch.equal(a, c) for a, c in zip(ours, run("sm90"))), "deterministic runs differ"
    floors = rounding_floors(q, k, do, out, dtype)
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads[:3], ref[:3], (q, k, v), floors):
            check(f"{name} {backend}", g, r, like, dtype, floor)
    mag = max(ref[3].abs().max().item(), (do.double().abs() * out.double().abs()).sum(-1).max().item())
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        err = (grads[3].double() - ref[3]).abs().max().item()
        assert err <= TOL[dtype] * mag, f"dbias {backend}: {err:.3g} > {TOL[dtype]} * {mag:.3g}"
