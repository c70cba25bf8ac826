"""GPU: randomized dropout_bias_backward against its reference: shapes (2-D and 3-D), dtypes,
p, activations, bias dtypes, bool / uint8 masks, row-strided views of bigger buffers
(tests/randomized_common.py describes the suite)."""

import math

import pytest
import torch
from hypothesis import strategies as st

import ops

from .randomized_common import BF16, DEV, F16, F32, _dt, _family, _vmax, into_padded
from .test_dropout_bias_gpu import check as check_dropout_bias

pytestmark = pytest.mark.gpu


# ==================================================================== dropout_bias

DB_CLASSES = [
    # (dtype, activation, bias dtype (None: no bias, dBias in dY's dtype), vector width)
    (BF16, None, None, 8),
    (BF16, None, F32, 1),
    (F16, None, None, 2),
    (F32, None, BF16, 4),
    (BF16, "gelu", BF16, 8),
    (F16, "relu", F16, 4),
    (F32, "gelu_erf", F32, 1),
    (BF16, "gelu_erf", BF16, 2),
]
DB_MAX_N = 5000
DB_MAX_ELEMS = 1 << 20


@st.composite
def dropout_bias_specs(draw, ci):
    dtype, activation, bias_dtype, vec = DB_CLASSES[ci]
    if vec == _vmax(dtype):
        n = vec * draw(st.integers(1, DB_MAX_N // vec))
    else:  # an odd multiple: the widest legal vector is exactly vec
        n = vec * (2 * draw(st.integers(0, (DB_MAX_N // vec - 1) // 2)) + 1)
    lead = draw(st.sampled_from([(), (2,), (3,)]))
    max_rows = max(1, min(3000, DB_MAX_ELEMS // n) // math.prod(lead))
    rows = draw(st.integers(1, max_rows))
    p = draw(st.one_of(st.sampled_from([0.0, 0.1, 0.5]), st.floats(0.0, 0.95)))
    # per tensor: None (contiguous) or (extra columns, column offset), multiples of vec
    row_layout = st.one_of(
        st.none(), st.tuples(st.integers(1, 4), st.integers(0, 4)).map(lambda t: (vec * t[0], vec * min(t[0], t[1])))
    )
    return dict(
        dtype=dtype,
        activation=activation,
        bias_dtype=bias_dtype,
        vec=vec,
        shape=lead + (rows, n),
        p=p,
        mask_dtype=draw(st.sampled_from(["bool", "uint8"])),
        layouts={name: draw(row_layout) for name in ("grad_out", "mask", "x")},
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _row_strided(t, layout):
    """t itself, or a copy whose rows are ``extra`` elements longer, starting ``c0`` in."""
    if layout is None:
        return t
    extra, c0 = layout
    return into_padded(t, [0] * (t.dim() - 1) + [extra], None, c0)


def dropout_bias_inputs(s, device=None):
    gen = torch.Generator(device or DEV).manual_seed(s["seed"])
    dev = device or DEV
    shape, dtype = s["shape"], s["dtype"]
    dy = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    mask = torch.rand(shape, generator=gen, device=dev) >= s["p"]
    if s["mask_dtype"] == "uint8":
        mask = mask.to(torch.uint8)
    x = torch.randn(shape, generator=gen, device=dev, dtype=dtype) if s["activation"] else None
    bias = None
    if s["bias_dtype"] is not None:
        bias = torch.randn(shape[-1], generator=gen, device=dev, dtype=s["bias_dtype"])
    dy = _row_strided(dy, s["layouts"]["grad_out"])
    mask = _row_strided(mask, s["layouts"]["mask"])
    if x is not None:
        x = _row_strided(x, s["layouts"]["x"])
    return dy, mask, x, bias


def _dropout_bias_case(s):
    dy, mask, x, bias = dropout_bias_inputs(s)
    act, p = s["activation"], s["p"]
    # poisoned launch vs the fp64 reference (test_dropout_bias_gpu's tolerances)
    dx, db = check_dropout_bias(dy, mask, p, x, bias, act)
    # the public op: the same (deterministic) results
    gi, gb = ops.dropout_bias_backward(dy, mask, p, x, bias, act)
    assert gi.shape == dy.shape and gb.dtype == db.dtype
    assert torch.equal(gi, dx), "dropout_bias_backward differs from the poisoned launch"
    assert torch.equal(gb, db), "dropout_bias_backward's grad_bias differs from the poisoned launch"


_dropout_bias_family = _family("dropout_bias", DB_CLASSES, dropout_bias_specs, _dropout_bias_case)


@pytest.mark.parametrize(
    "ci", range(len(DB_CLASSES)), ids=[f"{_dt(c[0])}-{c[1]}-dbias_{_dt(c[2])}-vec{c[3]}" for c in DB_CLASSES]
)
def test_dropout_bias_randomized(ci):
    _dropout_bias_family(ci)
