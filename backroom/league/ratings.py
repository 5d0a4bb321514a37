"""Ratings and the head-to-head matrix from a league's results.

**Ratings**: openskill's Plackett-Luce model, one update per counted result,
in the order the store counted them: each match is one ``model.rate`` call
with one team per entrant seated (in seat order of first appearance) and
``scores`` = the entrant's return (the mean over its seats when it holds
several: the beauty contest's blocks). Ties (equal returns) are ties. The
store-to-rating path adds nothing to this (tests/test_league.py calls
openskill directly on the same results and compares). ``ordinal`` is
openskill's conservative ``mu - 3 sigma``, the leaderboard's sort key.

**Head to head**: ``mean[i][j]`` is entrant i's mean return in the matches
where it met j (2-player games: its payoff against j). Its standard error
is taken over CRN groups, not matches: the seat orders of one group share
the deal and are not independent draws, so each group's mean is one sample
(``se`` = sample std / sqrt(groups); NaN below two groups).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backroom.league.store import Result


@dataclass
class Rating:
    agent: str
    mu: float
    sigma: float
    matches: int = 0
    total: float = 0.0  # sum of the agent's per-match returns

    @property
    def ordinal(self) -> float:
        return self.mu - 3.0 * self.sigma

    @property
    def mean(self) -> float:
        return self.total / self.matches if self.matches else math.nan


def model() -> Any:
    from openskill.models import PlackettLuce

    return PlackettLuce()


def entrant_scores(seats: Sequence[str], returns: Sequence[float]) -> dict[str, float]:
    """Each entrant's score in a match: its return, the mean over its seats if it holds several."""
    sums: dict[str, list[float]] = {}
    for agent, r in zip(seats, returns, strict=True):
        sums.setdefault(agent, []).append(float(r))
    return {a: sum(v) / len(v) for a, v in sums.items()}


@dataclass
class Ratings:
    """Ratings updated result by result (``add``), so a running league rates incrementally."""

    agents: list[str] = field(default_factory=list)
    _model: Any = None
    _state: dict[str, Any] = field(default_factory=dict)
    _stats: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._model = self._model or model()
        for a in self.agents:
            self._ensure(a)

    def _ensure(self, agent: str) -> Any:
        if agent not in self._state:
            self._state[agent] = self._model.rating(name=agent)
            self._stats[agent] = [0, 0.0]
            if agent not in self.agents:
                self.agents.append(agent)
        return self._state[agent]

    def add(self, result: Result) -> None:
        scores = entrant_scores(result.seats, result.returns)
        names = list(scores)
        teams = [[self._ensure(a)] for a in names]
        rated = self._model.rate(teams, scores=[scores[a] for a in names])
        for a, team in zip(names, rated, strict=True):
            self._state[a] = team[0]
            self._stats[a][0] += 1
            self._stats[a][1] += scores[a]

    def table(self) -> list[Rating]:
        """Every agent's rating, best conservative ordinal first."""
        out = [
            Rating(a, float(r.mu), float(r.sigma), int(self._stats[a][0]), float(self._stats[a][1]))
            for a, r in self._state.items()
        ]
        return sorted(out, key=lambda r: (-r.ordinal, r.agent))


def rate(results: Iterable[Result], agents: Sequence[str] = ()) -> list[Rating]:
    ratings = Ratings(list(agents))
    for r in results:
        ratings.add(r)
    return ratings.table()


@dataclass
class HeadToHead:
    agents: list[str]
    mean: list[list[float]]  # mean[i][j]: agents[i]'s mean return against agents[j]
    se: list[list[float]]
    groups: list[list[int]]  # CRN groups behind each cell

    def to_json(self) -> dict[str, Any]:
        def clean(rows: list[list[float]]) -> list[list[float | None]]:
            return [[None if math.isnan(x) else x for x in row] for row in rows]

        return {
            "agents": self.agents,
            "mean": clean(self.mean),
            "se": clean(self.se),
            "groups": self.groups,
        }


class Cells:
    """The head-to-head table's samples, added result by result: for each ordered pair of
    entrants, each CRN group's returns of the first against the second.

    A running league shows the table every second; building it from every result each
    time took about a second at 100,000 results (``bench/league.py``): half the pace.
    """

    def __init__(self) -> None:
        # (i, j) -> CRN group -> [sum, count] of i's returns in that group's matches
        self.cells: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(dict)
        # the range of the matches' summed returns (equal ends: a constant-sum game) and the
        # most entrants one match seated (2: the table is a two-player meta-game)
        self.sum_range: tuple[float, float] | None = None
        self.most_entrants = 0

    def add(self, result: Result) -> None:
        scores = entrant_scores(result.seats, result.returns)
        total = float(sum(result.returns))
        lo, hi = self.sum_range or (total, total)
        self.sum_range = (min(lo, total), max(hi, total))
        self.most_entrants = max(self.most_entrants, len(scores))
        for i, si in scores.items():
            for j in scores:
                if i != j:
                    cell = self.cells[(i, j)].setdefault(result.group, [0.0, 0])
                    cell[0] += si
                    cell[1] += 1

    @property
    def constant_sum(self) -> bool:
        """Every counted match's returns summed to the same total (Kuhn: 0)."""
        return self.sum_range is not None and self.sum_range[1] - self.sum_range[0] < 1e-9

    def table(self, agents: Sequence[str]) -> HeadToHead:
        """Each cell's mean over its CRN groups (a group: its matches' mean), with the
        standard error over groups: the seat orders of one deal are one sample."""
        n = len(agents)
        mean = [[math.nan] * n for _ in range(n)]
        se = [[math.nan] * n for _ in range(n)]
        counts = [[0] * n for _ in range(n)]
        for a, i in enumerate(agents):
            for b, j in enumerate(agents):
                groups = self.cells.get((i, j))
                if not groups:
                    continue
                samples = [total / count for total, count in groups.values()]
                k = len(samples)
                m = sum(samples) / k
                mean[a][b], counts[a][b] = m, k
                if k > 1:
                    var = sum((x - m) ** 2 for x in samples) / (k - 1)
                    se[a][b] = math.sqrt(var / k)
        return HeadToHead(list(agents), mean, se, counts)


def head_to_head(results: Iterable[Result], agents: Sequence[str]) -> HeadToHead:
    cells = Cells()
    for r in results:
        cells.add(r)
    return cells.table(agents)
