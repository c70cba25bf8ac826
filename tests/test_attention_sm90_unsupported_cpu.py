"""CPU: ``ops.attention_sm90.unsupported()`` names each feature the Hopper-native attention
backward does not take, accepts what it does, checks addresses on every call, and makes no
CUDA calls for CPU, meta or fake tensors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ops import _compile as cc
from ops import attention_sm90 as S

from .attention_sm90_common import BF16, F16, F32, PAIRS, _no_cuda_calls, _problem


def _misaligned_query():
    q, k, v, do, o = _problem()
    shifted = torch.zeros(q.numel() + 1, dtype=BF16)[1:].view(q.shape)  # 2 bytes past the allocation
    return shifted, k, v, do, o


def _row_strided_query():
    q, k, v, do, o = _problem()
    return torch.zeros(2, 100, 3, 68, dtype=BF16)[..., :64], k, v, do, o  # head stride 68: not 16 bytes


UNSUPPORTED = [
    # (id, problem, keyword arguments, fragment of the reason)
    ("fp32", lambda: _problem(dtype=F32), {}, "dtype torch.float32"),
    ("head-dim-80", lambda: _problem(d=80), {}, "head dims 80 / 80"),
    ("head-dim-320", lambda: _problem(d=320), {}, "head dims 320 / 320"),
    ("dqk-96-dv-192", lambda: _problem(d=96, dv=192), {}, "head dims 96 / 192 (Dqk 96 with Dv 192"),
    ("dqk-96-dv-256", lambda: _problem(d=96, dv=256), {}, "24-column quarters"),
    ("dv-80", lambda: _problem(d=128, dv=80), {}, "head dims 128 / 80"),
    ("dv-320", lambda: _problem(d=192, dv=320), {}, "head dims 192 / 320"),
    ("heads-not-grouped", lambda: _problem(h=4, hk=3), {}, "query heads 4 not a multiple of key heads 3"),
    ("mask-3", _problem, dict(mask_type=3), "mask type 3"),
    ("misaligned", _misaligned_query, {}, "query is not TMA-aligned"),
    ("row-stride", _row_strided_query, {}, "query is not TMA-aligned"),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_names_the_feature(case):
    _, problem, kw, fragment = case
    reason = S.unsupported(*problem(), arch="sm_90a", **kw)
    assert reason is not None and fragment in reason, reason


@pytest.mark.parametrize("mask_type", [0, 1, 2])
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F16, 96), (F16, 128), (BF16, 192), (F16, 256)])
def test_supported_problems(dtype, d, mask_type):
    assert S.unsupported(*_problem(d=d, dtype=dtype), mask_type=mask_type, arch="sm_90a") is None
    # [B, H, S, D] tensors seen as [B, S, H, D] (SDPA's layout), more queries than keys
    q, k, v, do, o = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _problem(sq=200, sk=70, d=d, dtype=dtype))
    assert S.unsupported(q, k, v, do, o, mask_type=mask_type, window_size=0, dropout_p=0.0, arch="sm_90a") is None
    if mask_type:  # with a sliding window too
        assert S.unsupported(q, k, v, do, o, mask_type=mask_type, window_size=16, arch="sm_90a") is None
    for hk in (1, 3):  # multi-query, grouped-query (H 6)
        assert S.unsupported(*_problem(h=6, hk=hk, d=d, dtype=dtype), mask_type=mask_type, arch="sm_90a") is None


@pytest.mark.parametrize("head_dim,head_dim_v", PAIRS)
def test_supported_problems_with_unequal_head_dims(head_dim, head_dim_v):
    for mask_type in (0, 1, 2):
        assert S.unsupported(*_problem(d=head_dim, dv=head_dim_v), mask_type=mask_type, arch="sm_90a") is None
    assert (
        S.unsupported(*_problem(d=head_dim, dv=head_dim_v, dtype=F16), mask_type=1, window_size=16, arch="sm_90a")
        is None
    )
    assert S.unsupported(*_problem(h=6, hk=2, d=head_dim, dv=head_dim_v), mask_type=2, arch="sm_90a") is None


@pytest.mark.parametrize("remembered", [False, True])
def test_unsupported_checks_addresses_on_every_call(monkeypatch, remembered):
    """Addresses are checked on every call (the same metadata at another address gets its own
    verdict), and the first tensor in argument order with a bad address or bad strides is named.
    ``remembered``: as for CUDA tensors, whose verdicts at aligned addresses are remembered by
    metadata (here CPU tensors that say they are on CUDA)."""
    if remembered:
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(S, "_verdicts", S.Memo())
    q, k, v, do, o = _problem(sq=64, sk=64)
    assert S.unsupported(q, k, v, do, o, arch="sm_90a") is None
    shifted = torch.zeros(k.numel() + 8, dtype=BF16)[8:].view(k.shape)  # 16 bytes in: aligned
    assert S.unsupported(q, shifted, v, do, o, arch="sm_90a") is None
    shifted = torch.zeros(k.numel() + 1, dtype=BF16)[1:].view(k.shape)  # same metadata, 2 bytes in
    assert "key is not TMA-aligned" in S.unsupported(q, shifted, v, do, o, arch="sm_90a")
    assert S.unsupported(q, k, v, do, o, arch="sm_90a") is None
    strided = torch.zeros(*o.shape[:-1], 68, dtype=BF16)[..., :64]  # out: head stride not 16 bytes
    assert "out is not TMA-aligned" in S.unsupported(q, k, v, do, strided, arch="sm_90a")
    assert "key is not TMA-aligned" in S.unsupported(q, shifted, v, do, strided, arch="sm_90a")
    # only aligned calls were remembered: one verdict per metadata (and arch) seen
    assert len(S._verdicts) == (2 if remembered else 0)


def test_unsupported_remembers_the_verdict_not_the_addresses(monkeypatch):
    """A remembered verdict is keyed by what it depends on: metadata, the mask type and the arch."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(S, "_verdicts", S.Memo())
    problem = _problem(h=4, hk=3)
    for _ in range(2):
        assert "not a multiple" in S.unsupported(*problem, arch="sm_90a")
        assert S.unsupported(*problem, arch="sm_80") == "needs sm_90a, the device is sm_80"
        assert S.unsupported(*_problem(d=64), arch="sm_90a") is None
        assert "mask type 3" in S.unsupported(*_problem(d=64), mask_type=3, arch="sm_90a")
    assert len(S._verdicts) == 4


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_100a"])
def test_other_archs_get_a_reason(arch):
    assert S.unsupported(*_problem(), arch=arch) == f"needs sm_90a, the device is {arch}"


def test_no_arch_without_a_real_cuda_tensor(monkeypatch):
    """CPU, meta and fake CUDA tensors: no device query, a reason instead of a guess."""
    _no_cuda_calls(monkeypatch)
    assert "the device is cpu" in S.unsupported(*_problem())
    meta = _problem(device="meta")
    assert cc.tensor_arch(meta[0]) is None and "the device is meta" in S.unsupported(*meta)
    with FakeTensorMode():
        fake = _problem(device="cuda")
        assert cc.tensor_arch(fake[0]) is None
        assert "no CUDA arch known" in S.unsupported(*fake)
        # with the arch given, fake tensors are judged on their metadata (no data_ptr)
        assert S.unsupported(*fake, mask_type=2, arch="sm_90a") is None
        assert "not a multiple" in S.unsupported(*_problem(h=4, hk=3, device="cuda"), arch="sm_90a")
    assert S.unsupported(*meta, arch="sm_90a") is None


def test_is_fake_tensor_fast_path_agrees_with_torch():
    """cc.is_fake_tensor answers plain tensors at once and otherwise as torch's is_fake:
    fake tensors (FakeTensorMode) and functional wrappers of real or fake ones."""
    from torch._subclasses.fake_tensor import is_fake

    plain = torch.zeros(2, 3)
    with FakeTensorMode():
        fake = torch.zeros(2, 3)
    cases = [plain, plain[:, 1:], fake, torch._to_functional_tensor(plain), torch._to_functional_tensor(fake)]
    got = [cc.is_fake_tensor(t) for t in cases]
    assert got == [is_fake(t) for t in cases] == [False, False, True, False, True]
