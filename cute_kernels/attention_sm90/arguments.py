"""What the sm90 backward's roles are handed, as frozen dataclasses read by field: the kernel's
grouped arguments (``DqFirst``, ``DkvTma``, ``GradBiasTma``: they cross the ``@cute.kernel``
boundary as ``TileSchedulerParams`` does, field by field), a tile's work, and each
role's operands (``LoadArgs``, ``StoreArgs``, ``MmaArgs``)."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DqFirst:
    """The dQ accumulator's per-block flags and what writes them: the flags ((query blocks,
    heads, batch) int32: store_first's claims or zero_ahead's zeroing, else None), the TMA atom
    of store_first's plain store (else None) and the accumulator itself (zero_ahead's zeros)."""

    flags: Any
    tma_store: Any
    accum: Any


@dataclass(frozen=True)
class DkvTma:
    """dK / dV's TMA stores: the atoms and their coordinate tensors."""

    tma_dK: Any
    gdK: Any
    tma_dV: Any
    gdV: Any


@dataclass(frozen=True)
class DkvOut:
    """Where dK / dV go: the tensors and, with ``tiles.dkv_by_tma``, their ``DkvTma`` (else None)."""

    mdK: Any
    mdV: Any
    tma: Any


@dataclass(frozen=True)
class GradBiasTma:
    """The bias gradient's TMA store: the atom and its (Sq, Sk, H, B) coordinate tensor (one
    batch's (Sq, Sk, H) once the CTA's batch is known); None fields without grad_bias."""

    atom: Any
    coords: Any


@dataclass(frozen=True)
class Features:
    """What the consumers need of bias and dropout, per CTA (None where unused): the batch's
    bias (H, Sq, Sk), its gradient's ``GradBiasTma``, the keep-flag buffers in shared memory and
    the batch's ``PhiloxStream``."""

    bias: Any
    grad_bias: Any
    keep: Any
    philox: Any


@dataclass(frozen=True)
class ScoreCap:
    """softcap: tanh's argument scale (the softmax scale / c) and 1 / (c log2 e), the inverse of the
    softmax's log2 multiplier (the steps recover tanh from P with it: ``attention/softcap.py``)."""

    tanh_scale: Any
    inv_scale_log2: Any


@dataclass(frozen=True)
class Work:
    """A key block's steps: its key head, the query heads of the group, the query blocks
    [m_min, m_max) every query head walks and the rotation they start at (``work_item``)."""

    head_kv: Any
    group: Any
    m_min: Any
    m_max: Any
    rot: Any

    @property
    def steps(self):
        """(query head, query block) steps of the key block."""
        return self.group * (self.m_max - self.m_min)


@dataclass(frozen=True)
class LoadArgs:
    """The producer warp's TMA sources (coordinate tensors), shared-memory destinations, atoms and
    pipelines. K / V's arrival: ``mbar_kv`` (a CTA per tile) or ``pipe_kv`` (persistent CTAs'
    two buffers; None otherwise)."""

    gQ_tma: Any
    gdO_tma: Any
    gK_tma: Any
    gV_tma: Any
    gLSE_tma: Any
    gDelta_tma: Any
    sQ: Any
    sdO: Any
    sK: Any
    sV: Any
    sLSE: Any
    sDelta: Any
    tma_Q: Any
    tma_dO: Any
    tma_K: Any
    tma_V: Any
    tma_LSE: Any
    tma_Delta: Any
    pipe_q: Any
    pipe_do: Any
    mbar_kv: Any
    pipe_kv: Any


@dataclass(frozen=True)
class StoreArgs:
    """The dQ-store warp's accumulator (coordinate tensor), staging buffers, reduce-add atom,
    deterministic mode's semaphores, the ``DqFirst`` and dq_ready's counters (None where unused)."""

    gdQ_tma: Any
    sdQ: Any
    tma_dQ: Any
    mSemaphore: Any
    dq_first: Any
    mDqReady: Any


@dataclass(frozen=True)
class MmaArgs:
    """The consumers' shared-memory operands, dK / dV's ``DkvOut``, the tiled MMAs of S^T / dP^T,
    dK, dV and dQ, the Q / dO pipelines and K / V's arrival (as ``LoadArgs``'), the softcap."""

    sQ: Any
    sdO: Any
    sK: Any
    sV: Any
    sdS: Any
    sdQ: Any
    sLSE: Any
    sDelta: Any
    dkv_out: Any
    tiled_mma_sdp: Any
    tiled_mma_dkv: Any
    tiled_mma_dv: Any
    tiled_mma_dq: Any
    pipe_q: Any
    pipe_do: Any
    mbar_kv: Any
    pipe_kv: Any
    softcap: Any  # the cap c (Float32; unused without softcap)


@dataclass(frozen=True)
class Carry:
    """carry_dq: the steps of the CTA's tiles before this one, both K buffers and dK's staging
    view over the dS buffers."""

    done: Any
    sK_both: Any
    sdK_both: Any
