"""Credit for every decision: returns, group baselines, and each algorithm's credit.

Read top to bottom: ``discounted_returns`` -> ``loo_advantages`` (multi-agent
GRPO, with the paper's per-seat baseline or the pooled one), and
``assign_credit`` applies them to joined episodes with the algorithm's own
``pay`` and ``credit`` (``algorithms.py``: sum-of-rewards, the paper's
equation 1 ``advantage_alignment``). Equations are those of "Learning Robust
Social Strategies with Large Language Models" (section 3), with its notation:
G is a discounted return, A an advantage, superscript 1 the learner, 2 its
opponent.

Everything here is pure numpy on small arrays (rounds x trajectories), so
each function is tested against hand-computed cases (tests/test_trainer_advantages.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from backroom.trainer.algorithms import AlgorithmName, credited
from backroom.trainer.algorithms import (  # the algorithms' own equations, read beside their entries
    advantage_alignment as advantage_alignment,
)
from backroom.trainer.algorithms import sum_of_rewards as sum_of_rewards
from backroom.trainer.store import Joined


def discounted_returns(rewards: Sequence[float], gamma: float, norm: float = 1.0) -> np.ndarray:
    """G_t = sum_{k>=t} gamma^(k-t) r_k / c, with c the paper's reward normalisation constant."""
    r = np.asarray(rewards, dtype=np.float64) / norm
    g = np.zeros_like(r)
    running = 0.0
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running  # G_t = r_t / c + gamma * G_{t+1}
        g[t] = running
    return g


Baseline = Literal["per_seat", "pooled_other_matches"]
BASELINES: tuple[Baseline, ...] = ("per_seat", "pooled_other_matches")


@dataclass(frozen=True)
class Trajectory:
    """Who played one row of returns: its CRN group, its match, its seat, and whether it is trained.

    A frozen seat (a buffer adapter, a fixed opponent) is played but not
    trained; its advantage is still needed, as the A^2 of Advantage Alignment.
    """

    group: Hashable
    match: Hashable
    seat: int
    trained: bool = True


def loo_advantages(
    returns: np.ndarray, who: Sequence[Trajectory], baseline: Baseline = "per_seat"
) -> np.ndarray:
    """Multi-agent GRPO: A_t^(i) = G_t^(i) - 1/|P_i| sum_{j in P_i} G_t^(j), a leave-one-out baseline.

    P_i, the trajectories i is compared with, are those of i's CRN group
    (the same chance; a group of one match, k = 1 or a group that lost the
    rest to drops, is compared with the whole batch) that are in another match
    and, like i, trained or frozen, and:

    * ``per_seat`` (the paper's, and its authors' code, which keys the
      baseline by agent id): in i's own seat. With k = 1 in the IPD, a seat's
      returns in the other games of the batch.
    * ``pooled_other_matches``: in either seat. Twice the samples in a
      symmetric game; in an asymmetric one it mixes the seats' scales.

    Never i's own match: there the opponent's return depends on i's action,
    which biases the credit (by -G_opp/(2B-1) toward defecting in the IPD at
    batch B, when the opponent was pooled). A frozen seat is never in a
    trained one's baseline. A frozen seat with no frozen peer (one buffer
    match in its seat: often at batch 8) is compared with the others of any
    kind, so that its advantage, Advantage Alignment's A^2, stays centred.
    An empty P_i leaves A = G.
    """
    g = np.asarray(returns, dtype=np.float64)
    if g.ndim != 2 or len(who) != len(g):
        raise ValueError(
            f"returns must be (trajectories, rounds) with one Trajectory each; got {g.shape}, {len(who)}"
        )
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    matches_of: dict[Hashable, set[Hashable]] = defaultdict(set)
    for t in who:
        matches_of[t.group].add(t.match)

    def seat_of(t: Trajectory) -> tuple[int, ...]:
        return (t.seat,) if baseline == "per_seat" else ()

    def where(t: Trajectory) -> tuple[Hashable, ...]:
        return ("group", t.group) if len(matches_of[t.group]) > 1 else ("batch",)

    # Sums and counts of returns by (where, kind, seat) and by (own match, kind, seat):
    # each trajectory adds itself under its own kind and under "any" (the frozen fallback).
    sums: dict[tuple[Hashable, ...], np.ndarray] = defaultdict(lambda: np.zeros(g.shape[1]))
    counts: dict[tuple[Hashable, ...], int] = defaultdict(int)
    for i, t in enumerate(who):
        for kind in (t.trained, "any"):
            for key in (
                ("group", t.group, kind, *seat_of(t)),
                ("batch", kind, *seat_of(t)),
                ("match", t.match, kind, *seat_of(t)),
            ):
                sums[key] = sums[key] + g[i]
                counts[key] += 1

    def others(t: Trajectory, kind: Hashable) -> np.ndarray | None:
        """1/|P_i| sum_{j in P_i} G_t^(j): the pool of ``kind`` less i's own match."""
        pool, own = (*where(t), kind, *seat_of(t)), ("match", t.match, kind, *seat_of(t))
        n = counts[pool] - counts[own]
        return (sums[pool] - sums[own]) / n if n else None

    adv = np.empty_like(g)
    for i, t in enumerate(who):
        b = others(t, t.trained)
        if b is None and not t.trained:
            b = others(t, "any")
        adv[i] = g[i] - (b if b is not None else 0.0)  # A_t^(i) = G_t^(i) - baseline_t
    return adv


# --- from episodes to a credit per (match, seat, round) -----------------------------


@dataclass(frozen=True)
class Hyper:
    """The advantage-side hyperparameters of the paper's table (section 11)."""

    discount: float
    reward_norm: float
    beta: float = 0.0
    aa_gamma: float = 0.0
    baseline: Baseline = "per_seat"


def round_rewards(joined: Joined) -> np.ndarray:
    """(seats, rounds) rewards of a match; a game that pays only at the end is one round."""
    record = joined.record
    if record.round_rewards:
        return np.asarray(record.round_rewards, dtype=np.float64).T
    return np.asarray(record.returns, dtype=np.float64)[:, None]


def assign_credit(
    episodes: Sequence[Joined], algorithm: AlgorithmName, hp: Hyper
) -> dict[tuple[str, int], np.ndarray]:
    """Credit per round for every trainable (match, seat): what multiplies grad log pi.

    Baselines compare a trajectory with others of its CRN group (the same
    chance) in other matches (``loo_advantages``; ``hp.baseline`` says which
    seats). Advantage Alignment needs the opponent's advantage, so every
    seat's is computed, trained or not.
    """
    method = credited(algorithm)
    assert method.credit is not None
    keys: list[tuple[str, int]] = []
    who: list[Trajectory] = []
    returns: list[np.ndarray] = []
    for ep in episodes:
        r = method.pay(round_rewards(ep))  # r_t^i, or what the algorithm pays instead
        for seat in range(r.shape[0]):
            keys.append((ep.record.match, seat))
            who.append(
                Trajectory(ep.request.group, ep.record.match, seat, seat in ep.request.trainable)
            )
            returns.append(discounted_returns(r[seat], hp.discount, hp.reward_norm))
    lengths = {len(g) for g in returns}
    if len(lengths) > 1:
        raise ValueError(
            f"matches of one batch must have the same number of rounds, got {sorted(lengths)}"
        )
    adv = (
        dict(zip(keys, loo_advantages(np.stack(returns), who, hp.baseline), strict=True))
        if returns
        else {}
    )
    credit: dict[tuple[str, int], np.ndarray] = {}
    for ep in episodes:
        two = len(ep.record.seats) == 2
        for seat in ep.request.trainable:
            own, opponent = adv[(ep.record.match, seat)], adv.get((ep.record.match, 1 - seat))
            credit[(ep.record.match, seat)] = method.credit(
                own, opponent if two else None, hp.beta, hp.aa_gamma
            )
    return credit
