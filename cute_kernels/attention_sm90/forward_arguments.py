"""What the sm90 forward's roles are handed, as frozen dataclasses read by field (the backward's
``arguments.py`` has its own): the kernel's global operands and their TMA atoms, a CTA's query
block, the runtime scalars, and the shared-memory operands with their pipelines. They are made
inside the kernel (the ``@cute.kernel`` boundary takes its arguments one by one)."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Globals:
    """Global operands: Q, K, V and O as TMA coordinate tensors (seq, d, heads, batch), O itself
    (varlen's row stores), the LSE [B, H, rows], the bias, the sinks and the Philox arguments
    (None where the configuration has none)."""

    gQ_tma: Any
    gK_tma: Any
    gV_tma: Any
    gO_tma: Any
    mO: Any
    mLSE: Any
    mBias: Any
    mSink: Any
    rng: Any


@dataclass(frozen=True)
class Atoms:
    """The TMA atoms of Q, K, V (loads) and O (store), the shared-memory layouts, the tiled MMAs of
    S = Q K^T and O += P V."""

    tma_Q: Any
    tma_K: Any
    tma_V: Any
    tma_O: Any
    sQ_layout: Any
    sK_layout: Any
    sV_layout: Any
    sO_layout: Any
    tiled_mma_qk: Any
    tiled_mma_pv: Any


@dataclass(frozen=True)
class QueryBlock:
    """A CTA's work: its query block of one head of one sequence, where that sequence's rows start
    (``Rows``) and its (used) lengths."""

    m_block: Any
    head: Any
    batch: Any
    rows: Any
    seqlen_q: Any
    seqlen_k: Any


@dataclass(frozen=True)
class Scalars:
    """Runtime scalars: query heads per key / value head, the softmax's log2 multiplier, tanh's
    argument scale (softcap), the sliding window."""

    group: Any
    scale_log2: Any
    tanh_scale: Any
    window_size: Any


@dataclass(frozen=True)
class Smem:
    """Shared memory: the Q, K / V ring, O staging and keep-flag buffers (``sKeep`` None without
    dropout), Q's mbarrier and the K / V pipelines."""

    sQ: Any
    sK: Any
    sV: Any
    sO: Any
    sKeep: Any
    mbar_q: Any
    pipe_k: Any
    pipe_v: Any
