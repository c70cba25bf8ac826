"""Where a sequence's rows start in the tensors and how long it is: fixed lengths (the batch
index selects the sequence) or variable lengths packed along the rows (``cu_seqlens``), either
bounded by used lengths (``seqused``: only the first rows of each sequence's buffer are real)."""

from dataclasses import dataclass
from typing import Any

import cutlass
from cutlass import Int32


@dataclass(frozen=True)
class Rows:
    """The first packed row of a sequence's queries and keys (0 for fixed lengths)."""

    offset_q: Any
    offset_k: Any


@dataclass(frozen=True)
class SeqlenInfo:
    """Sequence ``batch``'s first packed row of queries / keys (0 for fixed lengths) and its
    lengths."""

    offset_q: Any
    offset_k: Any
    seqlen_q: Any
    seqlen_k: Any

    @staticmethod
    def create(
        batch, seqlen_q, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None
    ) -> "SeqlenInfo":
        """With ``cu_seqlens_q / _k`` (int32 [sequences + 1]: sequence b is rows cu[b] .. cu[b + 1])
        the lengths are read there; else ``seqlen_q / _k`` are every sequence's. ``seqused_q /
        _k`` (int32 [sequences], both or neither): the first seqused[b] rows of sequence b are its
        sequence, the rest padding (clamped to [0, length]: a value out of range reads no row
        outside the sequence's buffer)."""
        offset_q, offset_k = Int32(0), Int32(0)
        if cu_seqlens_q is not None:
            offset_q, offset_k = cu_seqlens_q[batch], cu_seqlens_k[batch]
            seqlen_q = cu_seqlens_q[batch + 1] - offset_q
            seqlen_k = cu_seqlens_k[batch + 1] - offset_k
        if seqused_q is not None:
            seqlen_q = used_length(seqused_q[batch], seqlen_q)
            seqlen_k = used_length(seqused_k[batch], seqlen_k)
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k)


def used_length(used, length):
    """``used`` clamped to [0, ``length``]."""
    return cutlass.max(cutlass.min(used, length), Int32(0))
