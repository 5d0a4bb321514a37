"""Solver-grounded scores of a run, as the league has them: exploitability, gains, a coalition.

For a game backroom's solvers hold (``league.exploit.solvable``: Kuhn, small OpenSpiel
games), ``backroom analyze`` gives each agent of the run what docs/league.md describes:

* its exploitability, from the decisions it made in the run (a run's records do not say
  which policy an agent could be asked for: ``backroom eval`` computes the exact number),
  with the states it visited, a bootstrap interval, and n/a below the coverage the
  league states (``league.exploit.MIN_COVERAGE``);
* for a two-player game, its gain over the equilibrium against the opponents it met
  (``league.grounded.equilibrium_gains``);
* for a coalition the reward transform names, its gain over the team game's value
  (``league.grounded.coalition_gains``).

The run is read as a league of one game: its matches' CRN groups (a match alone when
it has none) are the groups the intervals resample.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from backroom.analysis.episodes import Episode
from backroom.analysis.generic import coalition_seats
from backroom.bus.wire import EpisodeRecord

#: Bootstrap draws behind an exploitability interval here (each one a best response).
DRAWS = 50
#: Parameters that fix what chance deals: not part of the game the solvers solve.
DEAL = "deal"


def grounded(episodes: list[Episode]) -> dict[str, Any] | None:
    """The run's solver-grounded scores, or None for a game the solvers do not hold."""
    from backroom.league.exploit import league_exploitability, solvable

    if not episodes:
        return None
    game = str(episodes[0].get("game"))
    params = {k: v for k, v in (episodes[0].get("params") or {}).items() if k != DEAL}
    if not solvable(game, params):
        return None
    try:
        records = [EpisodeRecord.model_validate(e) for e in episodes]
    except ValidationError:
        return None  # hand-made or foreign records: the measures above still stand
    played: dict[str, Any] = {}
    rows = league_exploitability(game, params, records, None, "analyze", DRAWS, played)
    out: dict[str, Any] = {
        "exploitability": [
            {
                "agent": e.agent,
                "value": e.value,
                "shown": e.shown,
                "ci": list(e.ci) if e.ci else None,
                "coverage": e.coverage,
                "visited": e.visited,
                "states": e.states,
                "decisions": e.decisions,
            }
            for e in rows
        ],
        "gains": _gains(game, params, records, played),
        "coalitions": _coalitions(game, params, records, episodes),
    }
    return out


def _gains(
    game: str, params: dict[str, Any], records: list[EpisodeRecord], played: dict[str, Any]
) -> list[dict[str, Any]]:
    from backroom.games import make_game
    from backroom.league.grounded import equilibrium_gains
    from backroom.league.ratings import Cells
    from backroom.league.store import Result
    from backroom.solvers.tree import build_tree

    tree = build_tree(make_game(game, **params))
    if tree.num_players != 2:
        return []
    cells = Cells()
    for i, r in enumerate(records):
        group = r.crn_group or r.match
        cells.add(Result(i, game, game, group, tuple(r.seats), tuple(r.raw_returns), r.reason))
    agents = sorted({a for r in records for a in r.seats})
    return equilibrium_gains(cells, agents, tree, played, "analyze")


def _coalitions(
    game: str, params: dict[str, Any], records: list[EpisodeRecord], episodes: list[Episode]
) -> list[dict[str, Any]]:
    from backroom.league.grounded import coalition_gains

    members: set[tuple[str, ...]] = set()
    for e in episodes:
        seats = coalition_seats(e)
        if seats:
            members.add(tuple(sorted(str(e["seats"][s]) for s in seats)))
    named = [(" + ".join(m), list(m)) for m in sorted(members)]
    return coalition_gains(game, params, records, named, "analyze") if named else []
