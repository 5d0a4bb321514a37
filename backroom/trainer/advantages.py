"""Credit for every decision: returns, group baselines and Advantage Alignment.

Read top to bottom: ``discounted_returns`` -> ``loo_advantages`` (multi-agent
GRPO) -> ``advantage_alignment`` (the paper's equation 1), and ``assign_credit``
applies them to joined episodes. Equations are those of "Learning Robust Social
Strategies with Large Language Models" (section 3), with its notation: G is a
discounted return, A an advantage, superscript 1 the learner, 2 its opponent.

Everything here is pure numpy on small arrays (rounds x trajectories), so
each function is tested against hand-computed cases (tests/test_trainer_advantages.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from backroom.trainer.store import Joined

Algorithm = Literal["grpo", "grpo_sum", "adalign"]


def discounted_returns(rewards: Sequence[float], gamma: float, norm: float = 1.0) -> np.ndarray:
    """G_t = sum_{k>=t} gamma^(k-t) r_k / c, with c the paper's reward normalisation constant."""
    r = np.asarray(rewards, dtype=np.float64) / norm
    g = np.zeros_like(r)
    running = 0.0
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running  # G_t = r_t / c + gamma * G_{t+1}
        g[t] = running
    return g


def loo_advantages(returns: np.ndarray, groups: Sequence[Hashable]) -> np.ndarray:
    """Multi-agent GRPO: A_t^(i) = G_t^(i) - 1/(k-1) sum_{j != i} G_t^(j) over i's CRN group.

    ``returns`` is (trajectories, rounds); ``groups[i]`` names trajectory i's
    CRN group. A trajectory alone in its group (k = 1, the paper's IPD setting)
    is compared with every other trajectory of the batch instead; alone in the
    whole batch, it has no baseline (A = G).
    """
    g = np.asarray(returns, dtype=np.float64)
    if g.ndim != 2 or len(groups) != len(g):
        raise ValueError(
            f"returns must be (trajectories, rounds) with one group each; got {g.shape}, {len(groups)} groups"
        )
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, key in enumerate(groups):
        members[key].append(i)
    adv = np.empty_like(g)
    total, n = g.sum(axis=0), len(g)
    for i, key in enumerate(groups):
        mates = members[key]
        if len(mates) > 1:
            others_sum, others = g[mates].sum(axis=0) - g[i], len(mates) - 1
        else:  # k = 1: the rest of the batch is the baseline
            others_sum, others = total - g[i], n - 1
        baseline = others_sum / others if others else 0.0
        adv[i] = g[i] - baseline  # A_t^(i) = G_t^(i) - 1/(k-1) sum_{j!=i} G_t^(j)
    return adv


def sum_of_rewards(rewards: np.ndarray) -> np.ndarray:
    """The cooperative variant: every seat is paid r_t = sum_j r_t^j, both players' rewards."""
    r = np.asarray(rewards, dtype=np.float64)  # (seats, rounds)
    return np.broadcast_to(r.sum(axis=0), r.shape).copy()


def advantage_alignment(
    own: Sequence[float], opponent: Sequence[float], beta: float, gamma: float
) -> np.ndarray:
    """Equation 1: A_t^1 + beta * gamma * (sum_{k<t} gamma^(t-k) A_k^1) * A_t^2.

    ``own`` is the learner's advantages A^1 in one match, ``opponent`` the
    other seat's A^2 in the same match (also when that seat is a frozen buffer
    adapter). The past-advantage sum is empty at t = 0, so round 0 keeps A_0^1.
    """
    a1 = np.asarray(own, dtype=np.float64)
    a2 = np.asarray(opponent, dtype=np.float64)
    out = np.empty_like(a1)
    past = 0.0  # sum_{k<t} gamma^(t-k) A_k^1
    for t in range(len(a1)):
        out[t] = (
            a1[t] + beta * gamma * past * a2[t]
        )  # A_t^1 + beta gamma (sum_{k<t} gamma^(t-k) A_k^1) A_t^2
        past = gamma * (past + a1[t])  # shift the sum by one round: gamma^(t+1-k)
    return out


# --- from episodes to a credit per (match, seat, round) -----------------------------


@dataclass(frozen=True)
class Hyper:
    """The advantage-side hyperparameters of the paper's table (section 11)."""

    discount: float
    reward_norm: float
    beta: float = 0.0
    aa_gamma: float = 0.0


def round_rewards(joined: Joined) -> np.ndarray:
    """(seats, rounds) rewards of a match; a game that pays only at the end is one round."""
    record = joined.record
    if record.round_rewards:
        return np.asarray(record.round_rewards, dtype=np.float64).T
    return np.asarray(record.returns, dtype=np.float64)[:, None]


def assign_credit(
    episodes: Sequence[Joined], algorithm: Algorithm, hp: Hyper
) -> dict[tuple[str, int], np.ndarray]:
    """Credit per round for every trainable (match, seat): what multiplies grad log pi.

    Baselines group trajectories by (CRN group, seat): within a group chance is
    identical, and seats of asymmetric games (who starts, which hand) are not
    pooled. Advantage Alignment needs the opponent's advantage, so every seat's
    LOO advantage is computed, trainable or not.
    """
    keys: list[tuple[str, int]] = []
    groups: list[Hashable] = []
    returns: list[np.ndarray] = []
    for ep in episodes:
        r = round_rewards(ep)
        if algorithm == "grpo_sum":
            r = sum_of_rewards(r)
        for seat in range(r.shape[0]):
            keys.append((ep.record.match, seat))
            groups.append((ep.request.group, seat))
            returns.append(discounted_returns(r[seat], hp.discount, hp.reward_norm))
    lengths = {len(g) for g in returns}
    if len(lengths) > 1:
        raise ValueError(
            f"matches of one batch must have the same number of rounds, got {sorted(lengths)}"
        )
    adv = dict(zip(keys, loo_advantages(np.stack(returns), groups), strict=True)) if returns else {}
    credit: dict[tuple[str, int], np.ndarray] = {}
    for ep in episodes:
        seats = ep.record.seats
        for seat in ep.request.trainable:
            own = adv[(ep.record.match, seat)]
            if algorithm == "adalign":
                if len(seats) != 2:
                    raise ValueError("Advantage Alignment is defined for two-player games")
                credit[(ep.record.match, seat)] = advantage_alignment(
                    own, adv[(ep.record.match, 1 - seat)], hp.beta, hp.aa_gamma
                )
            else:
                credit[(ep.record.match, seat)] = own
    return credit
