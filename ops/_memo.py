"""Bounded host-side memos: launch plans and check verdicts by tensor metadata."""

from __future__ import annotations

# a training run with packed variable lengths meets a new total length nearly every batch; an
# unbounded memo would keep every one of them for the whole run
MEMO_LIMIT = 4096


class Memo(dict):
    """A dict of results by metadata key that starts over once it holds ``limit`` entries
    (recomputing an entry costs one slow call; keeping all of them costs memory for good)."""

    def __init__(self, limit: int = MEMO_LIMIT):
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        """``value`` under ``key`` (emptying the memo first when it is full); returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value
