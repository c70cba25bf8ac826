"""Philox seed and offset from torch's default CUDA generator, as torch's own kernels take them
(``CUDAGeneratorImpl::philox_cuda_state(increment)``): the generator's seed, its offset, and
the offset advanced by the increment rounded up to 4, so ``torch.manual_seed`` reproduces a
draw and the next op draws other words.

Outside CUDA-graph capture they are host values. Under capture torch keeps them in device
memory, filled at each replay (``at::cuda::philox::unpack``), and no Python API reads them:
``philox_state_captured`` takes them from a torch op that returns them (the memory-efficient
attention forward on one element), so each replay draws new bits.
"""

from __future__ import annotations

import threading
from typing import Tuple

import torch
from torch import Tensor

_lock = threading.Lock()


def _generator(device: torch.device):
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def philox_seed_offset(device: torch.device, words: int) -> Tuple[int, int]:
    """(seed, offset) as Python ints for a draw of ``words`` stream words; the generator's
    offset advances by ``words`` rounded up to 4. Not under capture (``philox_state_captured``).
    A torch op drawing on another thread between the read and the advance is not locked out
    (torch's own lock is the C++ generator's)."""
    gen = _generator(device)
    with _lock:
        seed = gen.initial_seed()
        offset = gen.get_offset()
        gen.set_offset(offset + (words + 3) // 4 * 4)
    return (seed - (1 << 64) if seed >= 1 << 63 else seed), offset  # torch's int64 view of the seed


def philox_state(device: torch.device, words: int) -> Tuple[Tensor, Tensor]:
    """``philox_seed_offset`` as int64 CPU scalar tensors (what torch's attention forward returns
    outside CUDA-graph capture)."""
    seed, offset = philox_seed_offset(device, words)
    return (torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64))


def philox_state_captured(device: torch.device) -> Tuple[Tensor, Tensor]:
    """(seed, offset) as int64 [1] tensors on ``device`` during CUDA-graph capture, for a draw
    that advances the offset by 4 (as ``philox_seed_offset(device, 4)`` outside capture, so a
    replay draws what an eager call from the same generator state draws). torch's
    memory-efficient attention forward with dropout on one query, one key and one head takes
    exactly that increment and writes the unpacked pair into the tensors it returns."""
    q = torch.zeros(1, 1, 1, 8, dtype=torch.float16, device=device)
    out = torch.ops.aten._efficient_attention_forward(q, q, q, None, None, None, None, None, 0.5, 0, False)
    seed, offset = out[2], out[3]
    if not (seed.is_cuda and offset.is_cuda):
        raise RuntimeError(
            "torch's attention forward returned its philox seed and offset on the host during CUDA-graph "
            "capture; dropout cannot take a graph-safe draw with this torch build"
        )
    return seed.reshape(1), offset.reshape(1)
