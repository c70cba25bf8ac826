"""The activations LightSeq fuses with dropout (``ls_dropout_act_bias_fwd`` / ``_bwd``) and
their derivatives.

Each takes and returns an fp32 ``TensorSSA`` (registers), evaluated elementwise.
"""

import math

import cutlass.cute as cute
from cutlass import Float32

ACTIVATIONS = ("relu", "gelu", "gelu_erf")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation(name: str, z):
    """act(z): relu, gelu (tanh approximation, as ``F.gelu(approximate="tanh")``) or gelu_erf."""
    if name == "relu":
        return cute.where(z > Float32(0.0), z, cute.full_like(z, 0.0))
    if name == "gelu":
        t = cute.math.tanh(z * (z * z * _GELU_CUBIC + 1.0) * _SQRT_2_OVER_PI)
        return z * (t + 1.0) * 0.5
    if name == "gelu_erf":
        return z * (cute.math.erf(z * _INV_SQRT_2) + 1.0) * 0.5
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")


def relu_grad(z):
    """d/dz max(z, 0): 1 where z > 0 (torch's convention: 0 at z == 0)."""
    return cute.where(z > Float32(0.0), cute.full_like(z, 1.0), cute.full_like(z, 0.0))


def gelu_tanh_grad(z):
    """d/dz of 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))."""
    z2 = z * z
    t = cute.math.tanh(z * (z2 * _GELU_CUBIC + 1.0) * _SQRT_2_OVER_PI)
    dinner = (z2 * (3.0 * _GELU_CUBIC) + 1.0) * _SQRT_2_OVER_PI
    return (t + 1.0) * 0.5 + z * (1.0 - t * t) * dinner * 0.5


def gelu_erf_grad(z):
    """d/dz of z Phi(z) = Phi(z) + z phi(z)."""
    cdf = (cute.math.erf(z * _INV_SQRT_2) + 1.0) * 0.5
    pdf = cute.math.exp(z * z * -0.5) * _INV_SQRT_2PI
    return cdf + z * pdf


def activation_grad(name: str, z):
    if name == "relu":
        return relu_grad(z)
    if name == "gelu":
        return gelu_tanh_grad(z)
    if name == "gelu_erf":
        return gelu_erf_grad(z)
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")
