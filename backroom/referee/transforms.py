"""Reward transforms applied to a finished match's returns."""

from __future__ import annotations

from collections.abc import Sequence

from backroom.bus.wire import FlagRecord, RewardTransform


def apply_transform(
    transform: RewardTransform, raw: list[float], flags: Sequence[FlagRecord] = ()
) -> list[float]:
    """``coalition``: R_collusion(A, B) = (R(A) + R(B)) / 2 for each member (Loki eq. 1);
    then ``penalty_if_flagged`` off each seat a flag accused with at least
    ``flag_threshold`` suspicion (once, however many flags name it)."""
    out = list(raw)
    if transform.kind == "coalition" and transform.members:
        mean = sum(raw[m] for m in transform.members) / len(transform.members)
        for m in transform.members:
            out[m] = mean
    if transform.penalty_if_flagged:
        caught = {
            s
            for f in flags
            if f.suspicion >= transform.flag_threshold
            for s in f.accused
            if 0 <= s < len(out)
        }
        for s in caught:
            out[s] -= transform.penalty_if_flagged
    return out
