"""Bad inputs to the dropout-bias ops (``dropout_bias_backward``, ``bias_dropout``,
``BiasDropout``) are refused with an error naming the argument, before any launch
(tests/test_bad_inputs_cpu.py describes the tables and the guard)."""

import pytest

import ops

from .bad_inputs_common import (
    BOOL,
    F16,
    F32,
    F64,
    I32,
    I64,
    U8,
    C,
    Case,
    bd,
    bias_dropout_module,
    bias_dropout_p_changed,
    db_bits,
    dbf,
    check_refused,
    cpu,
    db,
    db_act,
    f32,
    fc,
)

DROPOUT_BIAS_BACKWARD = [
    C(
        "dropout_bias_backward",
        "grad_out-on-cpu",
        lambda: db(grad_out=cpu(4, 8), mask=cpu(4, 8, dtype=BOOL)),
        ValueError,
        "grad_out",
        "CUDA",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-int32",
        lambda: db(grad_out=fc(4, 8, dtype=I32)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-float64",
        lambda: db(grad_out=fc(4, 8, dtype=F64)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-0d",
        lambda: db(grad_out=fc(), mask=fc(dtype=BOOL)),
        ValueError,
        "grad_out",
        "at least one dimension",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-empty-last-dim",
        lambda: db(grad_out=fc(4, 0), mask=fc(4, 0, dtype=BOOL)),
        ValueError,
        "grad_out",
        "N >= 1",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-not-a-tensor",
        lambda: db(grad_out=[[1.0]]),
        TypeError,
        "grad_out",
        "torch.Tensor",
    ),
    C(
        "dropout_bias_backward",
        "grad_out-columns-strided",
        lambda: db(grad_out=fc(8, 4).t()),
        ValueError,
        "grad_out",
        "contiguous",
    ),
    C("dropout_bias_backward", "mask-shape", lambda: db(mask=fc(4, 7, dtype=BOOL)), ValueError, "mask", "shape"),
    C("dropout_bias_backward", "mask-float", lambda: db(mask=fc(4, 8, dtype=F32)), TypeError, "mask", "dtype"),
    C("dropout_bias_backward", "mask-on-cpu", lambda: db(mask=cpu(4, 8, dtype=BOOL)), ValueError, "mask", "cpu"),
    C("dropout_bias_backward", "mask-not-a-tensor", lambda: db(mask=[1, 0]), TypeError, "mask", "torch.Tensor"),
    C(
        "dropout_bias_backward",
        "mask-columns-strided",
        lambda: db(mask=fc(8, 4, dtype=BOOL).t()),
        ValueError,
        "mask",
        "contiguous",
    ),
    C("dropout_bias_backward", "p-1", lambda: db(p=1.0), ValueError, "p", "[0, 1)"),
    C("dropout_bias_backward", "p-negative", lambda: db(p=-0.1), ValueError, "p", "[0, 1)"),
    C("dropout_bias_backward", "p-nan", lambda: db(p=float("nan")), ValueError, "p", "[0, 1)"),
    C("dropout_bias_backward", "p-str", lambda: db(p="0.1"), TypeError, "p", "float"),
    C("dropout_bias_backward", "p-bool", lambda: db(p=True), TypeError, "p", "float"),
    C(
        "dropout_bias_backward",
        "activation-unknown",
        lambda: db_act(activation="tanh"),
        ValueError,
        "activation",
        "one of",
    ),
    C(
        "dropout_bias_backward",
        "activation-without-x",
        lambda: db_act(x=None),
        ValueError,
        "x",
        "needs the pre-activation input",
    ),
    C(
        "dropout_bias_backward",
        "x-without-activation",
        lambda: db(x=fc(4, 8)),
        ValueError,
        "x",
        "only used with an activation",
    ),
    C("dropout_bias_backward", "x-dtype", lambda: db_act(x=fc(4, 8, dtype=F16)), TypeError, "x", "dtype"),
    C("dropout_bias_backward", "x-shape", lambda: db_act(x=fc(4, 9)), ValueError, "x", "shape"),
    C("dropout_bias_backward", "x-on-cpu", lambda: db_act(x=cpu(4, 8)), ValueError, "x", "cpu"),
    C("dropout_bias_backward", "bias-shape", lambda: db(bias=fc(9)), ValueError, "bias", "shape"),
    C("dropout_bias_backward", "bias-int", lambda: db(bias=fc(8, dtype=I32)), TypeError, "bias", "dtype"),
    C("dropout_bias_backward", "bias-on-cpu", lambda: db(bias=cpu(8)), ValueError, "bias", "cpu"),
    C("dropout_bias_backward", "bias-dtype-with-activation", lambda: db_act(bias=f32(8)), TypeError, "bias", "dtype"),
    C(
        "dropout_bias_backward",
        "bits-mask-bool",
        lambda: db_bits(mask=fc(4, 2, dtype=BOOL)),
        TypeError,
        "mask",
        "dtype",
    ),
    C(
        "dropout_bias_backward",
        "bits-mask-per-element",
        lambda: db_bits(mask=fc(4, 12, dtype=U8)),
        ValueError,
        "mask",
        "shape",
    ),
    C(
        "dropout_bias_backward",
        "bits-mask-short",
        lambda: db_bits(mask=fc(4, 1, dtype=U8)),
        ValueError,
        "mask",
        "(4, 2)",
    ),
]

BIAS_DROPOUT = [
    C("bias_dropout", "x-on-cpu", lambda: bd(x=cpu(4, 8)), ValueError, "bias", "cpu"),
    C("bias_dropout", "x-int", lambda: bd(x=fc(4, 8, dtype=I64)), TypeError, "x", "dtype"),
    C("bias_dropout", "x-0d", lambda: bd(x=fc()), ValueError, "x", "at least one dimension"),
    C("bias_dropout", "x-not-a-tensor", lambda: bd(x=1.0), TypeError, "x", "torch.Tensor"),
    C("bias_dropout", "bias-shape", lambda: bd(bias=fc(4, 2)), ValueError, "bias", "shape"),
    C("bias_dropout", "bias-on-cpu", lambda: bd(bias=cpu(8)), ValueError, "bias", "cpu"),
    C("bias_dropout", "bias-dtype", lambda: bd(bias=f32(8)), TypeError, "bias", "dtype"),
    C("bias_dropout", "bias-not-a-tensor", lambda: bd(bias=None), TypeError, "bias", "torch.Tensor"),
    C("bias_dropout", "p-1.5", lambda: bd(p=1.5), ValueError, "p", "[0, 1)"),
    C("bias_dropout", "p-none", lambda: bd(p=None), TypeError, "p", "float"),
    C("bias_dropout", "activation-unknown", lambda: bd(activation="swish"), ValueError, "activation", "one of"),
]

DROPOUT_BIAS_FORWARD = [
    C("dropout_bias_forward", "x-on-cpu", lambda: dbf(x=cpu(4, 8)), ValueError, "x", "CUDA"),
    C("dropout_bias_forward", "x-int", lambda: dbf(x=fc(4, 8, dtype=I64)), TypeError, "x", "dtype"),
    C("dropout_bias_forward", "x-0d", lambda: dbf(x=fc()), ValueError, "x", "at least one dimension"),
    C("dropout_bias_forward", "bias-shape", lambda: dbf(bias=fc(9)), ValueError, "bias", "shape"),
    C("dropout_bias_forward", "bias-dtype", lambda: dbf(bias=f32(8)), TypeError, "bias", "dtype"),
    C("dropout_bias_forward", "bias-on-cpu", lambda: dbf(bias=cpu(8)), ValueError, "bias", "cpu"),
    C("dropout_bias_forward", "p-1", lambda: dbf(p=1.0), ValueError, "p", "[0, 1)"),
    C("dropout_bias_forward", "activation-unknown", lambda: dbf(activation="silu"), ValueError, "activation", "one of"),
]

BIAS_DROPOUT_MODULE = [
    C("BiasDropout", "p-1", lambda: lambda: ops.BiasDropout(8, p=1.0), ValueError, "p", "[0, 1)"),
    C("BiasDropout", "p-str", lambda: lambda: ops.BiasDropout(8, p="0.1"), TypeError, "p", "float"),
    C(
        "BiasDropout",
        "activation-unknown",
        lambda: lambda: ops.BiasDropout(8, activation="tanh"),
        ValueError,
        "activation",
        "one of",
    ),
    C("BiasDropout", "features-negative", lambda: lambda: ops.BiasDropout(-1), ValueError, "features", ">= 0"),
    C("BiasDropout", "features-float", lambda: lambda: ops.BiasDropout(8.0), TypeError, "features", "int"),
    C("BiasDropout", "x-on-cpu", lambda: bias_dropout_module(x=cpu(4, 8)), ValueError, "bias", "cpu"),
    C("BiasDropout", "x-last-dim", lambda: bias_dropout_module(x=fc(4, 9)), ValueError, "x", "last dim"),
    C("BiasDropout", "x-dtype", lambda: bias_dropout_module(x=fc(4, 8, dtype=F16)), TypeError, "x", "dtype"),
    C("BiasDropout", "p-changed-to-1", bias_dropout_p_changed, ValueError, "p", "[0, 1)"),
]

BAD = DROPOUT_BIAS_BACKWARD + BIAS_DROPOUT + DROPOUT_BIAS_FORWARD + BIAS_DROPOUT_MODULE


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_before_launch(case: Case, monkeypatch):
    check_refused(case, monkeypatch)
