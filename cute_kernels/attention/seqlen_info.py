"""Where a sequence's rows start in the tensors and how long it is: fixed lengths (the batch
index selects the sequence) or variable lengths packed along the rows (``cu_seqlens``)."""

from dataclasses import dataclass
from typing import Any

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
    def create(batch, seqlen_q, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None) -> "SeqlenInfo":
        """With ``cu_seqlens_q / _k`` (int32 [sequences + 1]: sequence b is rows cu[b] .. cu[b + 1])
        the lengths are read there; else ``seqlen_q / _k`` are every sequence's."""
        if cu_seqlens_q is None:
            return SeqlenInfo(Int32(0), Int32(0), seqlen_q, seqlen_k)
        offset_q = cu_seqlens_q[batch]
        offset_k = cu_seqlens_k[batch]
        return SeqlenInfo(offset_q, offset_k, cu_seqlens_q[batch + 1] - offset_q, cu_seqlens_k[batch + 1] - offset_k)
