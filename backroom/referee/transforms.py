"""Reward transforms applied to a finished match's returns."""

from __future__ import annotations

from backroom.bus.wire import RewardTransform


def apply_transform(transform: RewardTransform, raw: list[float]) -> list[float]:
    """``coalition``: R_collusion(A, B) = (R(A) + R(B)) / 2 for each member (Loki eq. 1)."""
    out = list(raw)
    if transform.kind == "coalition" and transform.members:
        mean = sum(raw[m] for m in transform.members) / len(transform.members)
        for m in transform.members:
            out[m] = mean
    return out
