"""The trainer's algorithms, one entry each: its credit, its config check and its doc line.

A training config's ``algorithm:`` names an entry of ``ALGORITHMS``. The entry
is all the rest of the trainer asks of an algorithm, so a new one is an entry
here (and its name in ``AlgorithmName``), not a branch in each module:

* ``pay`` and ``credit``, the two places the paper's algorithms differ, read
  by ``advantages.assign_credit`` (LoRA runs) and ``memory_one.credit``:
  ``pay`` is what each seat is paid per round, before its discounted return
  and the leave-one-out baseline every algorithm shares; ``credit`` turns the
  seat's advantage A^1 and its opponent's A^2 (same match) into what
  multiplies grad log pi. No ``credit``: the algorithm learns from a finished
  run, not from its own rollouts (DPO, ``dpo.py``);
* ``hyper``: its defaults over the preset, under the config's own ``hyper``;
* ``check``: what it refuses in a config, naming the field to fix
  (``config.TrainConfig`` calls it while validating);
* ``doc``: one line for people (the config field's description, docs/training.md).

Equations are those of "Learning Robust Social Strategies with Large Language
Models" (section 3), in its notation: r a reward, A an advantage, superscript
1 the learner, 2 its opponent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

import numpy as np

AlgorithmName = Literal["grpo", "grpo_sum", "adalign", "dpo"]

#: (seats, rounds) rewards of one match -> what each seat is paid, the same shape.
Pay = Callable[[np.ndarray], np.ndarray]
#: (A^1, A^2 or None when the game has not two seats, beta, gamma) -> credit per round.
Credit = Callable[[np.ndarray, np.ndarray | None, float, float], np.ndarray]


class Configured(Protocol):
    """What an algorithm's check reads of a training config (``config.TrainConfig``, which
    imports this module: the check cannot name it)."""

    @property
    def algorithm(self) -> str: ...
    @property
    def dpo(self) -> object | None: ...
    @property
    def tracking(self) -> object | None: ...


# --- what a seat is paid ---------------------------------------------------------------


def own_rewards(rewards: np.ndarray) -> np.ndarray:
    """r_t^i: every seat is paid its own reward."""
    return np.asarray(rewards, dtype=np.float64)


def sum_of_rewards(rewards: np.ndarray) -> np.ndarray:
    """The cooperative variant: every seat is paid r_t = sum_j r_t^j, both players' rewards."""
    r = np.asarray(rewards, dtype=np.float64)  # (seats, rounds)
    return np.broadcast_to(r.sum(axis=0), r.shape).copy()


# --- what multiplies grad log pi -------------------------------------------------------


def own_advantage(
    own: np.ndarray, opponent: np.ndarray | None, beta: float, gamma: float
) -> np.ndarray:
    """GRPO: the credit is the seat's own advantage A_t^1; the opponent's is not read."""
    return own


def advantage_alignment(
    own: Sequence[float] | np.ndarray,
    opponent: Sequence[float] | np.ndarray,
    beta: float,
    gamma: float,
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


def aligned_advantage(
    own: np.ndarray, opponent: np.ndarray | None, beta: float, gamma: float
) -> np.ndarray:
    """Advantage Alignment's credit: equation 1, which needs the one opponent's A^2."""
    if opponent is None:
        raise ValueError("Advantage Alignment is defined for two-player games")
    return advantage_alignment(own, opponent, beta, gamma)


# --- what each refuses in a config -----------------------------------------------------


def _check_rollouts(config: Configured) -> None:
    """An algorithm that learns from its own play reads no ``dpo:`` block."""
    if config.dpo is not None:
        raise ValueError(f"dpo: only algorithm: dpo reads it (algorithm is {config.algorithm})")


def _check_dpo(config: Configured) -> None:
    """DPO learns from a finished run (``dpo.source``) and writes no train_log.csv to track."""
    if config.dpo is None:
        raise ValueError("algorithm: dpo needs dpo: {source: RUN_DIR} (the run to learn from)")
    if config.tracking is not None:
        raise ValueError(
            "tracking: not for algorithm dpo (it writes no train_log.csv; TRL's "
            "statistics are in RUN_DIR/dpo_metrics.json); remove the tracking block"
        )


# --- the registry ----------------------------------------------------------------------


@dataclass(frozen=True)
class Algorithm:
    name: AlgorithmName
    doc: str
    check: Callable[[Configured], None]
    pay: Pay = own_rewards
    credit: Credit | None = None
    hyper: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rollouts(self) -> bool:
        """True: it learns from its own matches (the step loop); False: from a finished run."""
        return self.credit is not None


#: The paper's GRPO runs use no agent buffer ("it made no noticeable difference");
#: ``hyper: {rho: ...}`` turns it on all the same.
_NO_BUFFER: Mapping[str, Any] = {"rho": 0.0}

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "grpo",
            "multi-agent GRPO: a seat's own return against its CRN group's (the naive learner)",
            _check_rollouts,
            credit=own_advantage,
            hyper=_NO_BUFFER,
        ),
        Algorithm(
            "grpo_sum",
            "GRPO paid the sum of both players' rewards (the cooperative variant)",
            _check_rollouts,
            pay=sum_of_rewards,
            credit=own_advantage,
            hyper=_NO_BUFFER,
        ),
        Algorithm(
            "adalign",
            "Advantage Alignment (equation 1): GRPO's advantage shaped by the opponent's",
            _check_rollouts,
            credit=aligned_advantage,
        ),
        Algorithm(
            "dpo",
            "DPO on table talk (Loki's Algorithm 4) from a finished run, with TRL; no rollouts",
            _check_dpo,
        ),
    )
}
assert set(ALGORITHMS) == set(get_args(AlgorithmName)), "one entry per AlgorithmName"

#: The algorithms that learn from their own rollouts, in the registry's order.
CREDITED: tuple[str, ...] = tuple(name for name, a in ALGORITHMS.items() if a.rollouts)


def one_of(names: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``: the names an error offers."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def credited(name: str) -> Algorithm:
    """The entry of an algorithm that learns from rollouts; a ValueError names the others."""
    algorithm = ALGORITHMS.get(name)
    if algorithm is None or not algorithm.rollouts:
        raise ValueError(f"algorithm must be {one_of(CREDITED)}, got {name!r}")
    return algorithm
