"""Choices of the LayerNorm / RMSNorm backward that are not layouts: the persistent grid the op
launches. The tiles (and the table that picks them) are ``layouts/layer_norm.py``."""

from __future__ import annotations

from layouts.layer_norm import LnBwdTiles


def ctas_per_col(rows: int, t: LnBwdTiles, num_sms: int) -> int:
    """Persistent grid: CTAs along the rows (Apex ``ctas_per_col``), also the partials' count."""
    row_blocks = max(1, -(-rows // t.rows_per_cta))
    resident = max(1, num_sms * t.ctas_per_sm // t.ctas_per_row)
    return min(row_blocks, resident)
