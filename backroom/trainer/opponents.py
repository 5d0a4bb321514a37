"""Who a learner plays besides itself: a fixed opponent pool, co-trained policies, PFSP weights.

A pool (``opponents:`` in the training config) replaces self-play and the
agent buffer for the whole run: every training match seats the learner's
adapter on one seat (alternating from group to group) and a pool member on
the other, and only the learner's seat is trained (``Request.trainable``), so
a pool member's decisions never enter the batch, whatever it traces.

Three kinds of member, each one ``Opponent``:

* an agent the run starts (scripted, ``llm`` on a server): its own id on the seat;
* frozen adapters of another run directory: announced by this trainer under
  their own policy name, played by this run's own player on that seat;
* a live policy (co-training): the latest checkpoint another trainer announced
  for it, read when the step is planned, played by this run's own player.

PFSP (``buffer.sample: pfsp``) weights a draw by the learner's record against
each candidate (``Records``): without a league, that record is the learner's
win rate in the training matches already used, a tie counting half.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from backroom.bus.wire import AdapterRef
from backroom.model.adapters import adapter_digest
from backroom.records import fallback_of
from backroom.trainer.config import PfspSpec, TrainConfig, frozen_versions
from backroom.trainer.store import Joined, Store

T = TypeVar("T")


@dataclass(frozen=True)
class Opponent:
    """A pool member as a match seats it. ``agent`` None: the learner's own player plays ``ref``."""

    label: str
    agent: str | None = None
    ref: AdapterRef | None = None
    live: str | None = None  # the co-trained policy whose current checkpoint ``ref`` is


def resolve_pool(config: TrainConfig) -> list[Opponent]:
    """The pool with frozen adapters' digests taken (blocking: it reads their files)."""
    pool: list[Opponent] = []
    for i, entry in enumerate(config.opponents):
        where = f"opponents[{i}]"
        if entry.agent is not None:
            pool.append(Opponent(label=f"agent {entry.agent.id}", agent=entry.agent.id))
        elif entry.run is not None:
            run, policy = Path(entry.run), entry.frozen_policy()
            for version in frozen_versions(run, entry.versions, where):
                folder = run / "adapters" / version
                sha, size = adapter_digest(folder)
                ref = AdapterRef(
                    policy=policy, version=version, uri=str(folder.resolve()), sha256=sha, size=size
                )
                pool.append(Opponent(label=f"frozen {policy} {version}", ref=ref))
        else:
            assert entry.policy is not None
            pool.append(Opponent(label=f"policy {entry.policy}", live=entry.policy))
    return pool


def live_policies(pool: Sequence[Opponent]) -> list[str]:
    return [o.live for o in pool if o.live is not None]


def with_current(pool: Sequence[Opponent], current: Mapping[str, AdapterRef]) -> list[Opponent]:
    """The pool with each live member's ``ref`` set to its policy's current checkpoint."""
    return [
        Opponent(o.label, o.agent, current[o.live], o.live) if o.live is not None else o
        for o in pool
    ]


@dataclass
class PoolOutcome:
    """How a learner fared against its pool, step by step: per step, its and its opponent's
    mean reward per round in the training matches with one trained seat; and how many of
    those matches did not end normally, and how many moves were not their agent's choice."""

    by_step: dict[int, tuple[float, float]]
    abnormal: int
    fallbacks: int

    @classmethod
    def from_store(cls, store: Store) -> PoolOutcome:
        sums: dict[int, list[tuple[float, float]]] = {}
        abnormal = fallbacks = 0
        for request, record in store.outcomes("train"):
            if len(request.trainable) != 1 or len(record.returns) != 2:
                continue  # self-play: no opponent to compare with
            abnormal += record.reason != "normal"  # voided, timed out, forfeited, failed
            fallbacks += sum(
                fallback_of(a.fallback, a.timed_out) is not None for a in record.actions
            )
            mine = request.trainable[0]
            rounds = len(record.round_rewards) or 1  # a match cut short: its own rounds
            pair = (record.returns[mine] / rounds, record.returns[1 - mine] / rounds)
            sums.setdefault(request.step, []).append(pair)
        by_step = {
            step: (sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs))
            for step, pairs in sorted(sums.items())
        }
        return cls(by_step, abnormal, fallbacks)


@dataclass
class Records:
    """The learner's results against each opponent label: wins (ties count half) and matches."""

    wins: dict[str, float] = field(default_factory=dict)
    matches: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, trainable: Sequence[int], returns: Sequence[float]) -> None:
        """One match; only those with one trained seat against one other (self-play says nothing)."""
        if len(trainable) != 1 or len(returns) != 2:
            return
        mine, theirs = returns[trainable[0]], returns[1 - trainable[0]]
        won = 1.0 if mine > theirs else 0.5 if mine == theirs else 0.0
        self.wins[label] = self.wins.get(label, 0.0) + won
        self.matches[label] = self.matches.get(label, 0) + 1

    def add_joined(self, episodes: Sequence[Joined]) -> None:
        for ep in episodes:
            self.add(ep.request.label, ep.request.trainable, ep.record.returns)

    def win_rate(self, label: str) -> float:
        """Beta(1, 1)-smoothed: an opponent never met counts as an even one (0.5)."""
        return (self.wins.get(label, 0.0) + 1.0) / (self.matches.get(label, 0) + 2.0)

    @classmethod
    def from_store(cls, store: Store, before_step: int) -> Records:
        """The record of the training matches used by the steps before ``before_step`` (resume)."""
        records = cls()
        for label, trainable, returns in store.used_outcomes(before_step):
            records.add(label, json.loads(trainable), json.loads(returns))
        return records


def pfsp_weights(rates: Sequence[float], spec: PfspSpec) -> list[float]:
    """AlphaStar's prioritized fictitious self-play weights from win rates ``p``.

    ``hard``: (1 - p)^exponent, most weight on who beats the learner;
    ``variance``: p (1 - p), most weight on the even matchups.
    """
    if spec.weighting == "hard":
        return [(1.0 - p) ** spec.exponent for p in rates]
    return [p * (1.0 - p) for p in rates]


def draw(
    rng: random.Random,
    candidates: Sequence[T],
    labels: Sequence[str],
    config: TrainConfig,
    records: Records | None,
) -> T:
    """One opponent: uniform (``rng.choice``, as the paper) or by PFSP weight of its record."""
    if config.buffer.sample == "uniform" or records is None:
        return rng.choice(list(candidates))
    weights = pfsp_weights([records.win_rate(label) for label in labels], config.buffer.pfsp)
    if not any(weights):  # every rate exactly 1 cannot happen with the prior; be safe anyway
        return rng.choice(list(candidates))
    return rng.choices(list(candidates), weights=weights)[0]
