"""Solver-grounded scores: each entrant's gain over the equilibrium against the field it met.

A rating says who did well in *this* field; exploitability says how badly the
worst opponent could punish an entrant. Between the two: what did the entrant
earn from the opponents it actually met, compared with what the game's Nash
equilibrium would have earned from the same opponents? For a two-player
zero-sum game whose tree the solvers hold,

``gain_i = mean_j ( M[i][j] − u(σ*, π_j) )``

over the opponents j that i met: ``M[i][j]`` is i's measured mean payoff
against j (the head-to-head cell), ``σ*`` the equilibrium (CFR+,
``policies.equilibrium``), and ``π_j`` j's policy: asked at every state where
it can be (``policies.py``), else the empirical policy it played (unvisited
states uniform, as for exploitability). ``u(σ*, π_j)`` is computed exactly on
the tree, the mean of both seats. Positive: the entrant took more from this
field than the equilibrium would (it exploited weak opponents); negative: it
left chips on the table or was exploited. The equilibrium itself scores about
0 (its measured payoffs are samples of the exact ones). The 95% interval is a
bootstrap over each pair's CRN groups (the ``u(σ*, π_j)`` terms are held fixed:
exact for asked policies).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from backroom.bus.wire import EpisodeRecord
from backroom.league.ratings import Cells
from backroom.seeds import derive_seed

#: Bootstrap draws behind a gain's interval.
BOOTSTRAP = 200


def equilibrium_gains(
    cells: Cells,
    agents: Sequence[str],
    tree: Any,
    policies: dict[str, dict[str, dict[str, float]]],
    seed: object,
    bootstrap: int = BOOTSTRAP,
) -> list[dict[str, Any]]:
    """One row per agent with results: its gain over the equilibrium, interval, opponents met."""
    from backroom.league.policies import equilibrium, pair_value

    star = equilibrium(tree)
    eq_value = {j: pair_value(tree, star, tree.sigma_from_policy(p)) for j, p in policies.items()}
    rng = np.random.default_rng(derive_seed("backroom", "league", "gain-bootstrap", seed))
    rows = []
    for i in agents:
        pairs = []
        for j in agents:
            groups = cells.cells.get((i, j))
            if j == i or not groups or j not in eq_value:
                continue
            pairs.append((np.array([t / c for t, c in groups.values()]), eq_value[j]))
        if not pairs:
            continue
        gain = float(np.mean([s.mean() - v for s, v in pairs]))
        draws = [
            np.mean([s[rng.integers(0, len(s), len(s))].mean() - v for s, v in pairs])
            for _ in range(bootstrap)
        ]
        ci = (
            [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))] if draws else None
        )
        rows.append(
            {
                "agent": i,
                "gain": gain,
                "ci": ci,
                "equilibrium_vs_field": float(np.mean([v for _, v in pairs])),
                "opponents": len(pairs),
            }
        )
    return sorted(rows, key=lambda r: (-r["gain"], r["agent"]))


#: CFR+ iterations of each team-game solve behind a coalition's gain (Loki: about 2 s each).
TEAM_ITERATIONS = 5_000


def coalition_gains(
    game_name: str,
    params: dict[str, Any],
    records: Iterable[EpisodeRecord],
    coalitions: Sequence[tuple[str, Sequence[str]]],
    seed: object,
    bootstrap: int = BOOTSTRAP,
    values: TeamValues | None = None,
) -> list[dict[str, Any]]:
    """Each coalition's gain over the team game's value, in the matches that seat all of it.

    A coalition is a league channel's members (by agent id). In a match that seats every
    member, its return is the sum of its seats' engine returns (``raw_returns``), and the
    yardstick is the value the team of those seats guarantees in the team game (the Loki
    construction: the seats merged into one player that sees all their cards, CFR+ against
    the rest, ``solvers.team``; ``min_C u_team``, the other seat best-responding). The gain
    is the mean over CRN groups of the matches' (return − value); positive: the coalition
    took more than its guaranteed value from the opponents it met (who did not best-respond).
    Only games whose team game has one opponent have that value; others are left out.
    ``values``: the team games already solved (the league shares them with its exact
    coalition entries, ``coalition.py``); ``seatings`` counts the matches at each seat set.
    """
    from backroom.games import make_game

    values = values or TeamValues(make_game(game_name, **params))
    records = list(records)
    rows = []
    for name, members in coalitions:
        per_group, seatings = _coalition_groups(records, members, values)
        if not per_group:
            continue
        samples = np.array([sum(v) / len(v) for v in per_group.values()])
        draws = [
            samples[rng_idx].mean() for rng_idx in _indices(len(samples), bootstrap, (seed, name))
        ]
        ci = [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]
        rows.append(
            {
                "coalition": name,
                "members": list(members),
                "gain": float(samples.mean()),
                "ci": ci if draws else None,
                "groups": len(samples),
                "matches": sum(len(v) for v in per_group.values()),
                "team_values": values.known(),
                "seatings": seatings,
            }
        )
    return rows


class TeamValues:
    """The team game's guaranteed value by the coalition's seats, each solved once."""

    def __init__(self, game: Any) -> None:
        self.game = game
        self.values: dict[tuple[int, ...], float] = {}

    def __call__(self, seats: tuple[int, ...]) -> float:
        from backroom.solvers.team import solve_team

        if seats not in self.values:
            solved = solve_team(self.game, seats, TEAM_ITERATIONS)
            self.values[seats] = solved.guaranteed_value()
        return self.values[seats]

    def known(self) -> dict[str, float]:
        """The values solved so far, by seats ("0,2"): NaN (no single opponent) left out."""
        return {
            ",".join(map(str, k)): v for k, v in sorted(self.values.items()) if not math.isnan(v)
        }


def _coalition_groups(
    records: Sequence[EpisodeRecord], members: Sequence[str], values: TeamValues
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """The coalition's gains (return − team value), by CRN group, in the matches that seat
    every member once; and how many of them sat at each seat set ("0,1")."""
    per_group: dict[str, list[float]] = defaultdict(list)
    seatings: dict[str, int] = defaultdict(int)
    for r in records:
        seats = tuple(i for i, a in enumerate(r.seats) if a in members)
        if {r.seats[i] for i in seats} != set(members) or len(seats) != len(members):
            continue  # not every member seated, or one holds several seats
        value = values(seats)
        if math.isnan(value):
            continue
        gain = sum(r.raw_returns[i] for i in seats) - value
        per_group[r.crn_group or r.match].append(gain)
        seatings[",".join(map(str, seats))] += 1
    return per_group, dict(sorted(seatings.items()))


def _indices(n: int, draws: int, seed: object) -> list[np.ndarray]:
    rng = np.random.default_rng(derive_seed("backroom", "league", "coalition-bootstrap", seed))
    return [rng.integers(0, n, n) for _ in range(draws if n > 1 else 0)]
