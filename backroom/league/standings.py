"""The league's standings: ratings, head to head and exploitability, from its store.

One JSON document (``standings.json`` in the league directory, replaced
atomically) is what every reader shows: ``backroom league show``, the
``/league`` page of ``backroom web`` (which reads the file, so the web server
needs nothing of the league's code) and the Prometheus gauges. The league
rewrites it as results come in, with ``running: true`` until it ends.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backroom.league.config import LeagueConfig
from backroom.league.exploit import league_exploitability, solvable
from backroom.league.rankings import BOOTSTRAP, rankings
from backroom.league.ratings import Cells, Rating, Ratings
from backroom.league.store import LeagueStore
from backroom.records import count_fallbacks, fallback_of, warning_lines

STANDINGS = "standings.json"
STORE = "league.sqlite"
CONFIG = "league.yaml"
#: The ratings over every game together, beside the per-game ones (leagues of several games).
ALL_GAMES = "all"


def rating_json(r: Rating) -> dict[str, Any]:
    return {
        "agent": r.agent,
        "mu": r.mu,
        "sigma": r.sigma,
        "ordinal": r.ordinal,
        "matches": r.matches,
        "mean_return": None if math.isnan(r.mean) else r.mean,
    }


def exploitability_json(
    store: LeagueStore,
    key: str,
    engine: str,
    params: dict[str, Any],
    entrants: Sequence[tuple[str, str, dict[str, Any]]] = (),
    seed: object = 0,
    policies: dict[str, Any] | None = None,
    models: bool = False,
) -> list[dict[str, Any]]:
    """Exact for the entrants whose policy the league asks (``policies.SCRIPTED`` kinds, and
    with ``models`` the ``local`` ones: each model loaded once, here), empirical with coverage
    and a bootstrap interval for the rest. ``policies``, if given, is filled with each
    entrant's policy: asked, else its empirical counts."""
    from backroom.league.exploit import BOOTSTRAP as DRAWS
    from backroom.league.policies import MODELS, SCRIPTED, exact_for

    kinds = (*SCRIPTED, *MODELS) if models else SCRIPTED
    asked = exact_for([e for e in entrants if e[1] in kinds], engine, params)
    exact = {a: (e.value, e.openspiel) for a, e in asked.items()}
    played: dict[str, Any] = {}
    rows = league_exploitability(
        engine, params, store.records(key), exact, (seed, key), DRAWS, played
    )
    if policies is not None:
        policies.update(played)
        policies.update({a: e.policy for a, e in asked.items()})
    return [
        {
            "agent": e.agent,
            "value": e.value,
            "shown": e.shown,
            "method": e.method,
            "ci": list(e.ci) if e.ci else None,
            "coverage": e.coverage,
            "openspiel": e.openspiel,
            "visited": e.visited,
            "states": e.states,
            "decisions": e.decisions,
        }
        for e in rows
    ]


class Standings:
    """Ratings and head-to-head samples kept up to date result by result (``update`` reads
    only the new rows).

    A running league rewrites its standings every second; rating every result
    again each time, or building the head-to-head table from every result,
    would cost the league its pace as it grows (both are O(n)). So the ratings
    are updated in counted order with each new result, which is the same
    sequence of openskill calls as rating them all at once, and the table's
    samples (``ratings.Cells``) the same sums in the same order.
    """

    def __init__(self, store: LeagueStore, config: LeagueConfig) -> None:
        self.store = store
        self.config = config
        self.agents = [a.id for a in config.agents()]
        self.games = {g.key: g for g in config.games}
        self.ratings = {g.key: Ratings(config.game_agents(g)) for g in config.games}
        self.overall = Ratings(list(self.agents))
        self.counts: dict[str, int] = {g.key: 0 for g in config.games}
        self.cells = {g.key: Cells() for g in config.games}
        self.counted = 0
        self.seq = 0

    def update(self) -> Standings:
        for r in self.store.results(after=self.seq):
            self.seq = r.seq
            self.counted += 1
            if r.game not in self.games:
                continue  # a game no longer in the config: counted, not shown
            self.counts[r.game] += 1
            self.cells[r.game].add(r)
            self.ratings[r.game].add(r)
            if len(self.games) > 1:  # the all-games rating is shown only then
                self.overall.add(r)
        return self

    def game(self, key: str, exploit: bool) -> dict[str, Any]:
        g = self.games[key]
        table = self.ratings[key].table()
        results = self.counts[key]
        out: dict[str, Any] = {
            "game": g.game,
            "params": g.params,
            "results": results,
            "ratings": [rating_json(r) for r in table],
            "head_to_head": self.cells[key].table([r.agent for r in table]).to_json(),
        }
        if results:  # the bootstrap intervals at the end only: the point estimates are cheap
            out["rankings"] = rankings(
                self.cells[key],
                [r.agent for r in table],
                (self.config.seed, key),
                BOOTSTRAP if exploit else 0,
                [r.agent for r in table],
            )
        if exploit and solvable(g.game, g.params) and results:
            out.update(self.solved(key))
        return out

    def solved(self, key: str) -> dict[str, Any]:
        """What a solvable game adds at the league's end: exploitability, the gains over the
        equilibrium (two-seat zero-sum) and the coalitions' gains over their team value."""
        g = self.games[key]
        kinds = {a.id: (a.id, a.kind, a.options) for a in self.config.agents()}
        playing = [kinds[a] for a in self.config.game_agents(g) if a in kinds]
        policies: dict[str, Any] = {}
        out: dict[str, Any] = {
            "exploitability": exploitability_json(
                self.store,
                key,
                g.game,
                g.params,
                playing,
                self.config.seed,
                policies,
                models=self.config.exact_models,
            )
        }
        cells = self.cells[key]
        if cells.most_entrants == 2 and cells.constant_sum:
            out["grounded"] = self.grounded(key, policies)
        if any(len(c.members) > 1 for c in g.channels):
            out["coalitions"] = self.coalitions(key)
        return out

    def coalitions(self, key: str) -> list[dict[str, Any]]:
        """Each channel's coalition: its gain over the team value (``grounded.py``) and, where
        its joint policy can be asked, its exact exploitability (``coalition.py``)."""
        from backroom.games import make_game
        from backroom.league.coalition import exact_coalition
        from backroom.league.grounded import TeamValues, coalition_gains

        g = self.games[key]
        engine = make_game(g.game, **g.params)
        values = TeamValues(engine)
        teams = [(c.name, [str(m) for m in c.members]) for c in g.channels]
        records = self.store.records(key)
        rows = coalition_gains(
            g.game, g.params, records, teams, (self.config.seed, key), values=values
        )
        agents = {a.id: a for a in self.config.agents()}
        opens = {c.name: c.opens for c in g.channels}
        for row in rows:
            members = [(agents[m].kind, agents[m].options) for m in row["members"] if m in agents]
            exact = exact_coalition(engine, members, opens[row["coalition"]], values)
            if "seats" in exact:
                exact["matches"] = row["seatings"].get(",".join(map(str, exact["seats"])), 0)
            row["exact"] = exact
        return rows

    def grounded(self, key: str, policies: dict[str, Any]) -> list[dict[str, Any]]:
        """Each entrant's gain over the equilibrium against the field it met (``grounded.py``)."""
        from backroom.games import make_game
        from backroom.league.grounded import equilibrium_gains
        from backroom.solvers.tree import build_tree

        g = self.games[key]
        tree = build_tree(make_game(g.game, **g.params))
        if tree.num_players != 2:
            return []
        agents = self.config.game_agents(g)
        return equilibrium_gains(self.cells[key], agents, tree, policies, (self.config.seed, key))

    def doc(self, running: bool, exploit: bool = True) -> dict[str, Any]:
        """The whole document; ``exploit``: with exploitability and fallbacks (they read every
        record, so a running league leaves them to its end)."""
        doc: dict[str, Any] = {
            "league": self.config.league,
            "updated": time.time(),
            "running": running,
            "scheduled": self.store.scheduled_count(),
            "counted": self.counted,
            "counters": self.store.counters(),
            "agents": self.agents,
            "games": {key: self.game(key, exploit) for key in self.games},
        }
        if exploit:
            counts = count_fallbacks(
                (a.agent, fallback_of(a.fallback, a.timed_out))
                for record in self.store.records()
                for a in record.actions
            )
            doc["fallbacks"] = counts
            doc["warnings"] = warning_lines(counts)
        if len(self.games) > 1:
            doc["overall"] = [rating_json(r) for r in self.overall.table()]
        return doc


def standings(
    store: LeagueStore, config: LeagueConfig, running: bool, exploit: bool = True
) -> dict[str, Any]:
    """The standings of everything in ``store``, computed afresh."""
    return Standings(store, config).update().doc(running, exploit)


def write_standings(directory: Path, doc: dict[str, Any]) -> Path:
    path = directory / STANDINGS
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def read_standings(directory: Path) -> dict[str, Any]:
    path = Path(directory) / STANDINGS
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {directory} a league directory?")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def refresh_standings(directory: Path, running: bool = False) -> dict[str, Any]:
    """Recompute standings.json from the store (with exploitability) and return it."""
    path = Path(directory) / STORE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {directory} a league directory?")
    with LeagueStore(path) as store:
        text = store.get_meta("config")
        if text is None:
            raise FileNotFoundError(f"{path} holds no league config")
        from pydantic import ValidationError

        try:  # the store is a file anyone may have sent: its config is checked like a config
            config = LeagueConfig.model_validate_json(text)
        except ValidationError as exc:  # the first error, in one line
            first = " ".join(str(exc.errors()[0]["msg"]).split())
            raise ValueError(f"{path}: its league config is refused: {first}") from None
        doc = standings(store, config, running)
    write_standings(Path(directory), doc)
    return doc
