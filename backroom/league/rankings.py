"""Rankings that follow the payoffs: Nash averaging and α-Rank of the head-to-head meta-game.

openskill (``ratings.py``) rates the *order* of each match's returns: who tends
to finish ahead. In a zero-sum betting game that can rank the wrong way: in
classic Kuhn, always-bet wins most hands by a chip and loses the few a caller
holds the king in by two, so it finishes ahead more often than the equilibrium
and earns less. The meta-game (``mean[i][j]``, the row's mean payoff against the
column, ``ratings.Cells``) keeps the chips, and two measures read it
(``backroom.solvers.metagame``):

* **Nash averaging**: each agent's payoff against the meta-game's maximum-entropy
  Nash mixture (0 for the agents the mixture plays, below 0 for the others),
  for zero-sum (constant-sum) leagues of two entrants per match. This orders
  such a league's headline table.
* **α-Rank**: OpenSpiel's stationary mass (infinite α) of the same meta-game;
  defined for general-sum games too, where it orders the headline table.

Each comes with a **bootstrap interval over CRN groups**: for every pair of
agents its CRN groups are drawn again with replacement (the seat orders of one
deal stay together, as for the head-to-head SE), the meta-game rebuilt, both
measures recomputed; the interval is the 2.5th and 97.5th percentiles of
``BOOTSTRAP`` draws, from a generator seeded by the league's seed and the game
(the same league shows the same intervals).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backroom.league.ratings import Cells
from backroom.seeds import derive_seed

#: Bootstrap draws behind each interval (the league's end; 0 while it runs).
BOOTSTRAP = 200

NASH = "nash_averaging"
ALPHARANK = "alpharank"

WHY_DISAGREE = (
    "openskill rates the order of each match's returns (who finishes ahead, however "
    "narrowly); Nash averaging rates the payoffs against the strongest mix of the field "
    "(how much is won or lost): an agent that wins small pots often and loses big ones "
    "rarely ranks higher by openskill than by the payoffs"
)

WHY_ALPHARANK = (
    "openskill rates the order of each match's returns (who finishes ahead); α-Rank which "
    "agents survive invasion by the others, each pair judged by who out-earns whom head to "
    "head (the signs of the payoff differences, not the sizes)"
)


@dataclass
class MetaGame:
    """The meta-game's mean payoffs and, per unordered pair, each CRN group's two means."""

    agents: list[str]
    mean: np.ndarray  # mean[i][j]: i's mean payoff against j (NaN on the diagonal)
    samples: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]  # (i<j): (i's, j's) per group

    def resample(self, rng: np.random.Generator) -> np.ndarray:
        out = self.mean.copy()
        for (i, j), (si, sj) in self.samples.items():
            idx = rng.integers(0, len(si), size=len(si))
            out[i, j], out[j, i] = si[idx].mean(), sj[idx].mean()
        return out


def metagame(cells: Cells, agents: Sequence[str]) -> MetaGame | str:
    """The meta-game of ``agents``, or why there is none (a pair that has not met)."""
    n = len(agents)
    mean = np.full((n, n), np.nan)
    samples = {}
    for i in range(n):
        for j in range(i + 1, n):
            a, b = agents[i], agents[j]
            ab, ba = cells.cells.get((a, b), {}), cells.cells.get((b, a), {})
            groups = sorted(set(ab) & set(ba))
            if not groups:
                return f"{a} and {b} have not met: the meta-game is incomplete"
            si = np.array([ab[g][0] / ab[g][1] for g in groups])
            sj = np.array([ba[g][0] / ba[g][1] for g in groups])
            mean[i, j], mean[j, i] = si.mean(), sj.mean()
            samples[(i, j)] = (si, sj)
    return MetaGame(list(agents), mean, samples)


def _interval(draws: list[np.ndarray], k: int) -> list[float | None]:
    if not draws:
        return [None, None]
    col = np.array([d[k] for d in draws])
    return [float(np.percentile(col, 2.5)), float(np.percentile(col, 97.5))]


def _no_metagame(cells: Cells, agents: Sequence[str]) -> MetaGame | str:
    """The meta-game of ``agents``, or why there is none to rank by."""
    if len(agents) < 2:
        return "fewer than two agents have results"
    if cells.most_entrants != 2:
        return (
            f"matches seat {cells.most_entrants} entrants: the head-to-head table "
            "is no two-player meta-game"
        )
    game = metagame(cells, agents)
    if isinstance(game, str):
        return game
    try:
        import scipy  # noqa: F401
    except ImportError:
        return "Nash averaging needs scipy (the league extra)"
    return game


@dataclass
class _Measures:
    """Both measures of the meta-game and their bootstrap draws (α-Rank's: none without it)."""

    nash: np.ndarray
    mass: np.ndarray
    alpha: np.ndarray | None
    nash_draws: list[np.ndarray]
    alpha_draws: list[np.ndarray]


def _measures(game: MetaGame, seed: object, bootstrap: int, with_alpha: bool) -> _Measures:
    from backroom.solvers.metagame import alpharank, nash_averaging

    nash, mass = nash_averaging(game.mean)
    out = _Measures(nash, mass, alpharank(game.mean) if with_alpha else None, [], [])
    rng = np.random.default_rng(derive_seed("backroom", "league", "bootstrap", seed))
    for _ in range(bootstrap):
        m = game.resample(rng)
        out.nash_draws.append(nash_averaging(m)[0])
        if with_alpha:
            out.alpha_draws.append(alpharank(m))
    return out


def _rows(
    game: MetaGame, measures: _Measures, openskill_order: Sequence[str], ordered_by: str
) -> list[dict[str, Any]]:
    """One row per agent, in the headline order of ``ordered_by``."""
    alpha = measures.alpha
    rows: list[dict[str, Any]] = [
        {
            "agent": a,
            "nash": float(measures.nash[k]),
            "nash_ci": _interval(measures.nash_draws, k),
            "nash_mass": float(measures.mass[k]),
            "alpharank": None if alpha is None else float(alpha[k]),
            "alpharank_ci": _interval(measures.alpha_draws, k),
            "openskill_rank": (openskill_order.index(a) + 1 if a in openskill_order else None),
        }
        for k, a in enumerate(game.agents)
    ]
    if ordered_by == NASH:
        rows.sort(key=lambda r: (-round(r["nash"], 9), -r["nash_mass"], r["agent"]))
    else:
        rows.sort(key=lambda r: (-round(r["alpharank"], 9), -round(r["nash"], 9), r["agent"]))
    return rows


def rankings(
    cells: Cells,
    agents: Sequence[str],
    seed: object,
    bootstrap: int = BOOTSTRAP,
    openskill_order: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``rankings`` entry of a game's standings: rows in the headline order, which measure
    orders them, and a line when openskill's order differs."""
    from backroom.solvers.metagame import alpharank_available

    agents = [a for a in agents if any(a in pair for pair in cells.cells)]
    game = _no_metagame(cells, agents)
    if isinstance(game, str):
        return {"ordered_by": None, "reason": game}
    zero_sum = cells.constant_sum
    no_alpha = alpharank_available()
    measures = _measures(game, seed, bootstrap, with_alpha=no_alpha is None)
    ordered_by = NASH if zero_sum or measures.alpha is None else ALPHARANK
    rows = _rows(game, measures, openskill_order, ordered_by)
    out: dict[str, Any] = {
        "ordered_by": ordered_by,
        "zero_sum": zero_sum,
        "bootstrap": bootstrap,
        "rows": rows,
        "disagreement": disagreement(rows, openskill_order, ordered_by),
    }
    if no_alpha is not None:
        out["alpharank_missing"] = no_alpha
    if not zero_sum:
        out["note"] = (
            "general-sum: ordered by α-Rank; Nash averaging is of the meta-game's zero-sum "
            "part (M - M^T) / 2, who out-earns whom head to head"
        )
    return out


def disagreement(
    rows: Sequence[dict[str, Any]], openskill_order: Sequence[str], by: str
) -> str | None:
    """A line naming both orders when they differ, else None: differ means some pair that
    openskill puts one way the measure puts strictly the other way (its ties are no
    disagreement, whatever order the tie-break gave them)."""
    field = "nash" if by == NASH else "alpharank"
    value = {r["agent"]: r[field] for r in rows}
    both = [a for a in openskill_order if a in value]
    crossed = any(value[b] - value[a] > 1e-9 for i, a in enumerate(both) for b in both[i + 1 :])
    if not crossed:
        return None
    order = [r["agent"] for r in rows if r["agent"] in both]
    name, why = ("Nash averaging", WHY_DISAGREE) if by == NASH else ("α-Rank", WHY_ALPHARANK)
    return f"openskill orders {', '.join(both)}; {name} orders {', '.join(order)}. {why}"
