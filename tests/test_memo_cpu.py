"""The ops' host memos (ops._memo.Memo) stay bounded."""

from __future__ import annotations

import torch

from ops import _validate as V
from ops import attention_bwd_prepost as P
from ops import attention_sm90 as S
from ops import dropout_bias as D
from ops import norm as N
from ops._memo import Memo


def test_memo_starts_over_once_full():
    memo = Memo(limit=3)
    assert memo.put("a", 1) == 1 and memo.put("b", None) is None and memo.put("c", 3) == 3
    assert dict(memo) == {"a": 1, "b": None, "c": 3}
    assert memo.put("d", 4) == 4 and dict(memo) == {"d": 4}  # full: emptied, then stored
    memo.put("d", 5)
    assert dict(memo) == {"d": 5}


def test_the_ops_memos_are_bounded(monkeypatch):
    """Packed variable lengths give a new metadata key nearly every batch: the validation
    memo (here) and every launch-plan memo hold at most their limit."""
    for memo in (V._validated, P._plans, N._plans, N._fronts, D._plans, S._verdicts, S._call_plans):
        assert isinstance(memo, Memo) and memo.limit > 0
    monkeypatch.setattr(V, "_validated", Memo(limit=8))
    checks = []
    for total in range(20):  # one packed length per batch
        x = torch.zeros(total, 4)
        V.validate_once(("packed", x), lambda: checks.append(total))
        V.validate_once(("packed", x), lambda: checks.append(-1))  # a repeat: remembered
    assert checks == list(range(20)) and len(V._validated) <= 8
