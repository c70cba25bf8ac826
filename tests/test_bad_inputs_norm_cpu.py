"""Bad inputs to the norm ops (``layer_norm`` / ``rms_norm``, their backwards, ``LayerNorm`` /
``RMSNorm``) are refused with an error naming the argument, before any launch
(tests/test_bad_inputs_cpu.py describes the tables and the guard)."""

import pytest
import torch

import ops

from .bad_inputs_common import (
    F16,
    F32,
    F64,
    I32,
    I64,
    C,
    Case,
    check_refused,
    cpu,
    dan,
    darn,
    dropout_add_norm_module,
    f32,
    fc,
    layer_norm_module,
    ln,
    lnb,
    rms_norm_module,
    rn,
    rnb,
)

LAYER_NORM_BACKWARD = [
    C("layer_norm_backward", "x-on-cpu", lambda: lnb(x=cpu(4, 8), grad_out=cpu(4, 8)), ValueError, "x", "CUDA"),
    C("layer_norm_backward", "x-int", lambda: lnb(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C("layer_norm_backward", "x-0d", lambda: lnb(x=fc(), grad_out=fc()), ValueError, "x", "at least one dimension"),
    C("layer_norm_backward", "x-empty-last-dim", lambda: lnb(x=fc(4, 0), grad_out=fc(4, 0)), ValueError, "x", "N >= 1"),
    C("layer_norm_backward", "x-columns-strided", lambda: lnb(x=fc(8, 4).t()), ValueError, "x", "contiguous"),
    C("layer_norm_backward", "grad_out-shape", lambda: lnb(grad_out=fc(4, 9)), ValueError, "grad_out", "shape"),
    C(
        "layer_norm_backward",
        "grad_out-int64",
        lambda: lnb(grad_out=fc(4, 8, dtype=I64)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C("layer_norm_backward", "grad_out-on-cpu", lambda: lnb(grad_out=cpu(4, 8)), ValueError, "grad_out", "cpu"),
    C(
        "layer_norm_backward",
        "grad_out-columns-strided",
        lambda: lnb(grad_out=fc(8, 4).t()),
        ValueError,
        "grad_out",
        "contiguous",
    ),
    C(
        "layer_norm_backward",
        "grad_out-not-a-tensor",
        lambda: lnb(grad_out=None),
        TypeError,
        "grad_out",
        "torch.Tensor",
    ),
    C("layer_norm_backward", "weight-shape", lambda: lnb(weight=f32(9)), ValueError, "weight", "shape"),
    C("layer_norm_backward", "weight-2d", lambda: lnb(weight=f32(1, 8)), ValueError, "weight", "shape"),
    C("layer_norm_backward", "weight-int", lambda: lnb(weight=fc(8, dtype=I32)), TypeError, "weight", "dtype"),
    C("layer_norm_backward", "weight-on-cpu", lambda: lnb(weight=cpu(8, dtype=F32)), ValueError, "weight", "cpu"),
    C("layer_norm_backward", "weight-list", lambda: lnb(weight=[1.0] * 8), TypeError, "weight", "torch.Tensor"),
    C("layer_norm_backward", "bias-shape", lambda: lnb(bias=f32(4, 2)), ValueError, "bias", "shape"),
    C("layer_norm_backward", "bias-float64", lambda: lnb(bias=fc(8, dtype=F64)), TypeError, "bias", "dtype"),
    C("layer_norm_backward", "mean-fp16", lambda: lnb(mean=fc(4, dtype=F16)), TypeError, "mean", "float32"),
    C("layer_norm_backward", "mean-count", lambda: lnb(mean=f32(5)), ValueError, "mean", "one value per row"),
    C("layer_norm_backward", "mean-missing", lambda: lnb(mean=None), TypeError, "mean", "torch.Tensor"),
    C("layer_norm_backward", "rstd-count", lambda: lnb(rstd=f32(4, 2)), ValueError, "rstd", "one value per row"),
    C("layer_norm_backward", "rstd-on-cpu", lambda: lnb(rstd=cpu(4, dtype=F32)), ValueError, "rstd", "cpu"),
]

RMS_NORM_BACKWARD = [
    C("rms_norm_backward", "x-on-cpu", lambda: rnb(x=cpu(4, 8), grad_out=cpu(4, 8)), ValueError, "x", "CUDA"),
    C(
        "rms_norm_backward",
        "grad_out-float64",
        lambda: rnb(grad_out=fc(4, 8, dtype=F64)),
        TypeError,
        "grad_out",
        "dtype",
    ),
    C("rms_norm_backward", "weight-shape", lambda: rnb(weight=fc(4)), ValueError, "weight", "shape"),
    C("rms_norm_backward", "rstd-count", lambda: rnb(rstd=f32(3)), ValueError, "rstd", "one value per row"),
    C("rms_norm_backward", "rstd-bf16", lambda: rnb(rstd=fc(4)), TypeError, "rstd", "float32"),
    C("rms_norm_backward", "rstd-missing", lambda: rnb(rstd=None), TypeError, "rstd", "torch.Tensor"),
]

LAYER_NORM = [
    C("layer_norm", "x-on-cpu", lambda: ln(x=cpu(4, 8), weight=None, bias=None), ValueError, "x", "CUDA"),
    C("layer_norm", "x-int", lambda: ln(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C(
        "layer_norm",
        "x-0d",
        lambda: ln(x=fc(), normalized_shape=None, weight=None, bias=None),
        ValueError,
        "x",
        "at least one dimension",
    ),
    C("layer_norm", "x-not-a-tensor", lambda: ln(x=[1.0] * 8, normalized_shape=None), TypeError, "x", "torch.Tensor"),
    C(
        "layer_norm",
        "normalized_shape-mismatch",
        lambda: ln(normalized_shape=(4,)),
        ValueError,
        "normalized_shape",
        "does not end with",
    ),
    C(
        "layer_norm",
        "normalized_shape-float",
        lambda: ln(normalized_shape=8.0),
        TypeError,
        "normalized_shape",
        "sequence of ints",
    ),
    C(
        "layer_norm",
        "normalized_shape-empty",
        lambda: ln(normalized_shape=()),
        ValueError,
        "normalized_shape",
        "at least one dimension",
    ),
    C("layer_norm", "weight-shape", lambda: ln(weight=fc(4)), ValueError, "weight", "shape"),
    C("layer_norm", "weight-on-cpu", lambda: ln(weight=cpu(8)), ValueError, "weight", "cpu"),
    C("layer_norm", "weight-int", lambda: ln(weight=fc(8, dtype=I32)), TypeError, "weight", "dtype"),
    C("layer_norm", "bias-shape", lambda: ln(bias=fc(9)), ValueError, "bias", "shape"),
    C("layer_norm", "eps-nan", lambda: ln(eps=float("nan")), TypeError, "eps", "finite float"),
    C("layer_norm", "eps-str", lambda: ln(eps="1e-5"), TypeError, "eps", "finite float"),
    C("layer_norm", "eps-none", lambda: ln(eps=None), TypeError, "eps", "finite float"),
]

RMS_NORM = [
    C("rms_norm", "x-on-cpu", lambda: rn(x=cpu(4, 8), weight=None), ValueError, "x", "CUDA"),
    C("rms_norm", "x-int", lambda: rn(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C(
        "rms_norm",
        "x-0d",
        lambda: rn(x=fc(), normalized_shape=None, weight=None),
        ValueError,
        "x",
        "at least one dimension",
    ),
    C(
        "rms_norm",
        "normalized_shape-mismatch",
        lambda: rn(normalized_shape=(2, 4)),
        ValueError,
        "normalized_shape",
        "does not end with",
    ),
    C(
        "rms_norm",
        "normalized_shape-str",
        lambda: rn(normalized_shape="8"),
        TypeError,
        "normalized_shape",
        "sequence of ints",
    ),
    C("rms_norm", "weight-shape", lambda: rn(weight=fc(2, 4)), ValueError, "weight", "shape"),
    C("rms_norm", "eps-inf", lambda: rn(eps=float("inf")), TypeError, "eps", "finite float"),
]

NORM_MODULES = [
    C("LayerNorm", "x-last-dim", lambda: layer_norm_module(x=fc(4, 9)), ValueError, "x", "does not end with"),
    C("LayerNorm", "x-int", lambda: layer_norm_module(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C("LayerNorm", "parameters-on-cpu", lambda: layer_norm_module(device="cpu"), ValueError, "weight", "cpu"),
    C("LayerNorm", "parameters-float64", lambda: layer_norm_module(dtype=F64), TypeError, "weight", "dtype"),
    C("RMSNorm", "x-last-dim", lambda: rms_norm_module(x=fc(4, 9)), ValueError, "x", "does not end with"),
    C("RMSNorm", "x-int", lambda: rms_norm_module(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C("RMSNorm", "parameters-on-cpu", lambda: rms_norm_module(device="cpu"), ValueError, "weight", "cpu"),
    C("RMSNorm", "eps-str", lambda: rms_norm_module(eps="1e-6"), TypeError, "eps", "finite float"),
]

DAN, DARN = "dropout_add_layer_norm", "dropout_add_rms_norm"
DROPOUT_ADD_NORM = [
    C(DAN, "x-int", lambda: dan(x=fc(4, 8, dtype=I32)), TypeError, "x", "dtype"),
    C(DAN, "x-0d", lambda: dan(x=fc(), residual=None), ValueError, "x", "N >= 1"),
    C(
        DAN,
        "x-on-meta",
        lambda: dan(x=torch.empty(4, 8, device="meta"), residual=None, weight=None, bias=None),
        ValueError,
        "x",
        "CUDA or CPU",
    ),
    C(DAN, "residual-shape", lambda: dan(residual=fc(4, 9)), ValueError, "residual", "shape"),
    C(DAN, "residual-float64", lambda: dan(residual=fc(4, 8, dtype=F64)), TypeError, "residual", "dtype"),
    C(DAN, "residual-on-cpu", lambda: dan(residual=cpu(4, 8)), ValueError, "residual", "cpu"),
    C(DAN, "weight-shape", lambda: dan(weight=f32(9)), ValueError, "weight", "shape"),
    C(DAN, "bias-int", lambda: dan(bias=fc(8, dtype=I32)), TypeError, "bias", "dtype"),
    C(DAN, "x_bias-shape", lambda: dan(x_bias=fc(4, 8)), ValueError, "x_bias", "shape"),
    C(DAN, "x_bias-on-cpu", lambda: dan(x_bias=cpu(8)), ValueError, "x_bias", "cpu"),
    C(DAN, "p-one", lambda: dan(p=1.0), ValueError, "p", "[0, 1)"),
    C(DAN, "p-negative", lambda: dan(p=-0.1), ValueError, "p", "[0, 1)"),
    C(DAN, "p-str", lambda: dan(p="0.1"), TypeError, "p", "float"),
    C(DAN, "eps-nan", lambda: dan(eps=float("nan")), TypeError, "eps", "finite float"),
    C(DAN, "rowscale", lambda: dan(rowscale=f32(4)), NotImplementedError, "rowscale", "not supported"),
    C(DARN, "x-int", lambda: darn(x=fc(4, 8, dtype=I64)), TypeError, "x", "dtype"),
    C(DARN, "bias-given", lambda: darn(bias=fc(8)), NotImplementedError, "bias", "no bias"),
    C(DARN, "residual-shape", lambda: darn(residual=fc(2, 8)), ValueError, "residual", "shape"),
    C(DARN, "weight-on-cpu", lambda: darn(weight=cpu(8)), ValueError, "weight", "cpu"),
    C(DARN, "p-one", lambda: darn(p=1.0), ValueError, "p", "[0, 1)"),
]

DROPOUT_ADD_NORM_MODULES = [
    C(
        "DropoutAddLayerNorm",
        "p-one",
        lambda: dropout_add_norm_module(ops.DropoutAddLayerNorm, p=1.0),
        ValueError,
        "p",
        "[0, 1)",
    ),
    C(
        "DropoutAddLayerNorm",
        "x-last-dim",
        lambda: dropout_add_norm_module(ops.DropoutAddLayerNorm, x=fc(4, 9)),
        ValueError,
        "weight",
        "shape",
    ),
    C(
        "DropoutAddLayerNorm",
        "residual-shape",
        lambda: dropout_add_norm_module(ops.DropoutAddLayerNorm, residual=fc(4, 4)),
        ValueError,
        "residual",
        "shape",
    ),
    C(
        "DropoutAddLayerNorm",
        "x-int",
        lambda: dropout_add_norm_module(ops.DropoutAddLayerNorm, x=fc(4, 8, dtype=I32)),
        TypeError,
        "x",
        "dtype",
    ),
    C(
        "DropoutAddRMSNorm",
        "p-negative",
        lambda: dropout_add_norm_module(ops.DropoutAddRMSNorm, p=-0.5),
        ValueError,
        "p",
        "[0, 1)",
    ),
    C(
        "DropoutAddRMSNorm",
        "x-last-dim",
        lambda: dropout_add_norm_module(ops.DropoutAddRMSNorm, x=fc(4, 16)),
        ValueError,
        "weight",
        "shape",
    ),
    C(
        "DropoutAddRMSNorm",
        "residual-float64",
        lambda: dropout_add_norm_module(ops.DropoutAddRMSNorm, residual=fc(4, 8, dtype=F64)),
        TypeError,
        "residual",
        "dtype",
    ),
    C(
        "DropoutAddRMSNorm",
        "residual-on-cpu",
        lambda: dropout_add_norm_module(ops.DropoutAddRMSNorm, residual=cpu(4, 8)),
        ValueError,
        "residual",
        "cpu",
    ),
]

BAD = (
    LAYER_NORM_BACKWARD
    + RMS_NORM_BACKWARD
    + LAYER_NORM
    + RMS_NORM
    + NORM_MODULES
    + DROPOUT_ADD_NORM
    + DROPOUT_ADD_NORM_MODULES
)


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_before_launch(case: Case, monkeypatch):
    check_refused(case, monkeypatch)
