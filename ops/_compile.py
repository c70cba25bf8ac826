"""Compile once per configuration, call through TVM-FFI.

Kernels are traced against fake tensors whose sizes and strides are symbolic, so a
configuration (dtypes, flags, vector width, arch) compiles once and serves every
shape. Compiled functions live in an in-process cache and on disk (``ops._disk_cache``:
the DSL's own disk cache does not serve ``cute.compile``), so a configuration compiles
once per machine (seconds; tens for attention) and later processes load it.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Dict, Hashable, Optional, Sequence

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from torch._C import _len_torch_dispatch_stack
from torch._subclasses.fake_tensor import is_fake

from . import _disk_cache

TORCH_TO_CUTE = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.uint8: cutlass.Uint8,
    torch.int32: cutlass.Int32,
    torch.int64: cutlass.Int64,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cute_dtype(dtype: torch.dtype):
    return TORCH_TO_CUTE[dtype]


def arch_of(capability: Sequence[int]) -> str:
    """The DSL target for a compute capability; sm_90 gets 'a' for wgmma/setmaxnreg."""
    major, minor = capability
    suffix = "a" if major in (9, 10) and minor == 0 else ""
    return f"sm_{major}{minor}{suffix}"


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> str:
    return arch_of(torch.cuda.get_device_capability(index))


def is_fake_tensor(t: torch.Tensor) -> bool:
    """torch's ``is_fake``, answered at once for a plain tensor (is_fake costs ~4 us a call:
    too much for every tensor of every launch). A plain-typed functional wrapper (a trace's
    functionalization) still takes the full test."""
    if type(t) is torch.Tensor and not torch._is_functional_tensor(t):
        return False
    return is_fake(t)


def tensor_arch(t: torch.Tensor) -> Optional[str]:
    """The DSL target of a real CUDA tensor's device; None for CPU, meta and fake tensors.

    A FakeTensor (torch.compile tracing, FakeTensorMode) reports device "cuda" without
    there being one: asking the driver then fails on a CPU-only machine."""
    if not t.is_cuda or is_fake_tensor(t):
        return None
    return device_arch(t.device.index)


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fake_tensor(dtype, shape, vec: int = 1, leading_dim: Optional[int] = -1):
    """A fake tensor of symbolic sizes/strides; strides divisible by ``vec`` elements.

    ``shape`` entries may be ints or ``cute.sym_int()``; the leading (contiguous) dim
    has stride 1, every other stride is a symbolic int64 (tensors over 2^31 elements).
    """
    rank = len(shape)
    if leading_dim is not None and leading_dim < 0:
        leading_dim += rank
    stride = tuple(1 if i == leading_dim else cute.sym_int64(divisibility=vec) for i in range(rank))
    align = max(1, vec * dtype.width // 8)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_stream():
    """The stream argument: at call time TVM-FFI passes torch's current stream."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def fake_rng_args(on_device: bool) -> tuple:
    """The dropout arguments of a compile: Philox seed and offset (Int64 values, or Int64 [1]
    device tensors with ``on_device``), p and 1 / (1 - p) (Float32), stream words per (batch, head)."""
    if on_device:
        seed, offset = (fake_tensor(cutlass.Int64, (1,), 1) for _ in range(2))
    else:
        seed, offset = cutlass.Int64(0), cutlass.Int64(0)
    return seed, offset, cutlass.Float32(0.5), cutlass.Float32(2.0), cutlass.Int64(1)


def rng_on_device(philox_seed, philox_offset) -> bool:
    """Whether a kernel reads the dropout seed and offset from device memory: where both live
    on the GPU (torch's forward under CUDA-graph capture; a host read would synchronise and
    end the capture)."""
    return philox_seed is not None and philox_seed.is_cuda and philox_offset.is_cuda


def dropout_args(dropout_p, philox_seed, philox_offset, rows_q, rows_k) -> tuple:
    """(seed, offset, p, 1 / (1 - p), Mq * Mk) as the attention backwards take them: p as the
    float torch's kernels compare with, the scale computed in double from it, as theirs. A
    seed and offset on the device stay there, as [1] views the kernel reads (``rng_on_device``);
    host ones are passed as values."""
    p32 = float(np.float32(dropout_p))
    scale = float(np.float32(1.0 / (1.0 - p32)))
    if rng_on_device(philox_seed, philox_offset):
        return philox_seed.reshape(1), philox_offset.reshape(1), p32, scale, rows_q * rows_k
    return int(philox_seed.item()), int(philox_offset.item()), p32, scale, rows_q * rows_k


def eager(t: torch.Tensor) -> bool:
    """True when a call may skip the torch.library dispatch (about 40 us of host time).

    Only plain tensors outside torch.compile tracing and outside any dispatch mode
    (FakeTensorMode, make_fx, ...) take the direct path; everything else goes through
    the registered custom op, so graphs still see it.
    """
    return type(t) is torch.Tensor and not torch.compiler.is_compiling() and _len_torch_dispatch_stack() == 0


def eager_autograd(name: str, forward, setup_context, backward) -> type:
    """A custom op's eager path: an ``autograd.Function`` with the op's own ``setup_context`` and
    ``backward`` around ``forward`` (its body, called with the op's inputs), without the
    torch.library boundary whose dispatch, default filling and aliasing checks cost more host
    time than a short kernel takes. For calls that ``eager`` admits; graphs keep the op. Callers
    pass every input (no defaults are filled in): ``setup_context`` runs inside the Function's
    own ``forward``, since a Function that defines ``setup_context`` has ``apply`` bind its
    arguments to the forward's signature on every call (``inspect.signature``: about 13 us)."""

    def _forward(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(_forward), "backward": staticmethod(backward)}
    )


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a CPU-only build)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capturing_on(t: torch.Tensor) -> bool:
    """``capturing()`` for a call on ``t``: a CUDA tensor implies a CUDA build and device, so only
    the stream is asked (``torch.cuda.is_available`` reads the environment on every call)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def compile_kernel(fn: Callable, *args, arch: str):
    return cute.compile(fn, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


class CompileCache:
    """Compiled functions by configuration: in the process, and on disk across processes
    (``ops._disk_cache``)."""

    def __init__(self, name: str, build: Callable[..., Callable]):
        self.name = name
        self._build = build
        self._fns: Dict[Hashable, Callable] = {}
        self._lock = threading.Lock()

    def __call__(self, *key):
        fn = self._fns.get(key)
        if fn is None:
            with self._lock:
                fn = self._fns.get(key)
                if fn is None:
                    fn = _disk_cache.load_or_build(self.name, key, lambda: self._build(*key))
                    self._fns[key] = fn
        return fn

    def __len__(self):
        return len(self._fns)

    def clear(self):
        self._fns.clear()


_counters: Dict[tuple, torch.Tensor] = {}


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters that kernels take tickets from and leave zeroed.

    One buffer per (device, stream): launches on one stream run in order, so each
    finds the counters zero again. During CUDA-graph capture a fresh zeroed buffer is
    made instead, its memset captured with the graph.
    """
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    buf = _counters.get(key)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


def max_vector_elems(max_bits: int, *operands) -> int:
    """Widest vector (elements, power of two, <= max_bits) that every operand allows.

    Each operand is ``(tensor, elems)``: a vector of v elements of this tensor is legal
    when its row length, every non-unit stride and its address are multiples of v.
    The element counts of all operands move together (the kernel uses one vector
    length), so v is limited by the widest element type.
    """
    widest = max(t.element_size() for t, _ in operands)
    v = max(1, max_bits // (8 * widest))
    while v > 1:
        ok = True
        for t, n in operands:
            if n % v or t.data_ptr() % (v * t.element_size()):
                ok = False
                break
            if any(s % v for s, d in zip(t.stride()[:-1], t.shape[:-1]) if d > 1):
                ok = False
                break
        if ok:
            break
        v //= 2
    return v


def narrow_vector_for_params(vec: int, *params) -> int:
    """``vec`` halved until every parameter vector (None skipped), read as vec-element chunks,
    starts at an address those chunks allow (a row kernel's gamma / beta)."""
    for t in params:
        while t is not None and vec > 1 and t.data_ptr() % (vec * t.element_size()):
            vec //= 2
    return vec
