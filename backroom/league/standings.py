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
from pathlib import Path
from typing import Any

from backroom.league.config import LeagueConfig
from backroom.league.exploit import league_exploitability, solvable
from backroom.league.ratings import Rating, Ratings, head_to_head
from backroom.league.store import LeagueStore, Result
from backroom.referee.fallbacks import count_fallbacks, fallback_of, warning_lines

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


def game_standings(
    store: LeagueStore,
    game: str,
    engine: str,
    params: dict[str, Any],
    results: list[Result],
    agents: list[str],
    exploit: bool,
) -> dict[str, Any]:
    ratings = Ratings(list(agents))
    for r in results:
        ratings.add(r)
    table = ratings.table()
    order = [r.agent for r in table]
    out: dict[str, Any] = {
        "game": engine,
        "params": params,
        "results": len(results),
        "ratings": [rating_json(r) for r in table],
        "head_to_head": head_to_head(results, order).to_json(),
    }
    if exploit and solvable(engine, params) and results:
        out["exploitability"] = [
            {
                "agent": e.agent,
                "value": e.value,
                "visited": e.visited,
                "states": e.states,
                "decisions": e.decisions,
            }
            for e in league_exploitability(engine, params, store.records(game))
        ]
    return out


def standings(
    store: LeagueStore, config: LeagueConfig, running: bool, exploit: bool = True
) -> dict[str, Any]:
    """The whole document: each game's standings among the agents that play it."""
    results = store.results()
    agents = [a.id for a in config.agents()]
    per_game = {
        g.key: game_standings(
            store,
            g.key,
            g.game,
            g.params,
            [r for r in results if r.game == g.key],
            config.game_agents(g),
            exploit,
        )
        for g in config.games
    }
    doc: dict[str, Any] = {
        "league": config.league,
        "updated": time.time(),
        "running": running,
        "scheduled": store.scheduled_count(),
        "counted": len(results),
        "counters": store.counters(),
        "agents": agents,
        "games": per_game,
    }
    if exploit:  # the end of a session: every record read once more
        counts = count_fallbacks(
            (a.agent, fallback_of(a.fallback, a.timed_out))
            for record in store.records()
            for a in record.actions
        )
        doc["fallbacks"] = counts
        doc["warnings"] = warning_lines(counts)
    if len(config.games) > 1:
        overall = Ratings(list(agents))
        for r in results:
            overall.add(r)
        doc["overall"] = [rating_json(r) for r in overall.table()]
    return doc


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
        config = LeagueConfig.model_validate_json(text)
        doc = standings(store, config, running)
    write_standings(Path(directory), doc)
    return doc
