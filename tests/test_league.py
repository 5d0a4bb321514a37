"""Leagues (issue 24): real broker, referee and agent processes started by the league itself.

Each league here is played by ``run_league`` as ``backroom league`` plays it:
a Mosquitto of its own, a referee process and the agents in one host process.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.bus.broker import Broker
from backroom.league.config import LeagueConfig, parse_league
from backroom.league.exploit import empirical_counts, league_exploitability, policy_exploitability
from backroom.league.play import League, LeagueError, run_league
from backroom.league.ratings import Cells, entrant_scores, rate
from backroom.league.schedule import Slot, adaptive_pick, match_spec, players_of, round_robin
from backroom.league.standings import STORE
from backroom.league.store import LeagueStore, Result
from backroom.runner.config import ConfigError

from .conftest import eventually, identity, load_factor

IPD_ROUNDS = 5


def defect_from(round_: int) -> dict[str, Any]:
    """A table policy for the IPD: A (cooperate) before round ``round_``, B from it on.

    The IPD's information state is the history (``"AB,BB"``), so every
    history of each length is listed; the move depends on the length only.
    """
    table: dict[str, dict[str, float]] = {}
    for k in range(IPD_ROUNDS):
        for history in itertools.product(["AA", "AB", "BA", "BB"], repeat=k):
            table[",".join(history)] = {json.dumps("B" if k + 1 >= round_ else "A"): 1.0}
    return {"policy": table}


def ipd_league(tmp_path: Path, name: str = "ipd6", seeds: int = 1) -> dict[str, Any]:
    entrants: list[dict[str, Any]] = [{"id": "d1", "kind": "always", "options": {"action": "B"}}]
    for r in (2, 3, 4, 5):
        path = tmp_path / f"d{r}.json"
        path.write_text(json.dumps(defect_from(r)))
        entrants.append({"id": f"d{r}", "kind": "table", "options": {"policy": str(path)}})
    entrants.append({"id": "allc", "kind": "always", "options": {"action": "A"}})
    return {
        "league": name,
        "games": [{"game": "ipd", "params": {"rounds": IPD_ROUNDS}, "seeds": seeds}],
        "entrants": entrants,
        "agent_processes": "single",
        "concurrency": 20,
    }


# Hand-checked: dR cooperates before round R and defects from it (d1 always defects,
# allc never does), 5 rounds, payoffs C/C 3, D/C 5, C/D 0, D/D 1. Against dS with R < S,
# dR gets 3(R-1) + 5(S-R) + 1(6-S) and dS gets 3(R-1) + 0 + 1(6-S); allc is "d6".
# Row's total against column:
PAYOFFS = {
    "d1": {"d2": 9, "d3": 13, "d4": 17, "d5": 21, "allc": 25},  # mean 17.0
    "d2": {"d1": 4, "d3": 11, "d4": 15, "d5": 19, "allc": 23},  # mean 14.4
    "d3": {"d1": 3, "d2": 6, "d4": 13, "d5": 17, "allc": 21},  # mean 12.0
    "d4": {"d1": 2, "d2": 5, "d3": 8, "d5": 15, "allc": 19},  # mean 9.8
    "d5": {"d1": 1, "d2": 4, "d3": 7, "d4": 10, "allc": 17},  # mean 7.8
    "allc": {"d1": 0, "d2": 3, "d3": 6, "d4": 9, "d5": 12},  # mean 6.0
}
PAYOFF_ORDER = ["d1", "d2", "d3", "d4", "d5", "allc"]


async def test_six_ipd_agents_rank_in_round_robin_payoff_order(tmp_path: Path) -> None:
    config = parse_league(ipd_league(tmp_path, seeds=2))
    summary = await run_league(config, tmp_path / "league")
    assert summary.played == 15 * 2 * 2  # pairings x seat orders x seeds
    game = summary.standings["games"]["ipd"]
    h2h = game["head_to_head"]
    for i, a in enumerate(h2h["agents"]):
        for j, b in enumerate(h2h["agents"]):
            if a != b:
                assert h2h["mean"][i][j] == PAYOFFS[a][b], (a, b)
    means = {a: sum(row.values()) / 5 for a, row in PAYOFFS.items()}
    assert sorted(means, key=lambda a: -means[a]) == PAYOFF_ORDER  # the table's own order
    assert [r["agent"] for r in game["ratings"]] == PAYOFF_ORDER
    assert {r["agent"]: r["mean_return"] for r in game["ratings"]} == pytest.approx(means)

    # The store-to-rating path adds nothing: openskill by hand on the stored results.
    from openskill.models import PlackettLuce

    model = PlackettLuce()
    state = {a: model.rating(name=a) for a in PAYOFF_ORDER}
    with LeagueStore(tmp_path / "league" / STORE) as store:
        results = store.results()
    assert len(results) == summary.played
    for r in results:
        names = list(dict.fromkeys(r.seats))
        teams = model.rate(
            [[state[a]] for a in names], scores=[r.returns[r.seats.index(a)] for a in names]
        )
        for a, team in zip(names, teams, strict=True):
            state[a] = team[0]
    for row in game["ratings"]:
        assert row["mu"] == state[row["agent"]].mu
        assert row["sigma"] == state[row["agent"]].sigma
    assert [r.agent for r in rate(results)] == PAYOFF_ORDER

    # `backroom league show DIR`: the leaderboard in order, and the two plots
    from typer.testing import CliRunner

    from backroom.cli import app

    shown = CliRunner().invoke(app, ["league", "show", str(tmp_path / "league")])
    assert shown.exit_code == 0, shown.output
    lines = [line for line in shown.output.splitlines() if any(a in line for a in PAYOFF_ORDER)]
    ranked = [next(a for a in PAYOFF_ORDER if f" {a} " in line) for line in lines[:6]]
    assert ranked == PAYOFF_ORDER
    for plot in ("ipd_ratings.png", "ipd_h2h.png"):
        assert (tmp_path / "league" / "plots" / plot).stat().st_size > 10_000


async def test_crn_seat_swaps_cancel_chance_and_always_bet_exploitability(tmp_path: Path) -> None:
    """Two copies of the random policy in Kuhn (chance deals the cards): equal within
    uncertainty, head to head 0 within its SE; always-bet's empirical exploitability is
    OpenSpiel's for the always-bet policy."""
    config = parse_league(
        {
            "league": "kuhn-crn",
            "seed": 3,
            "games": [
                {"game": "kuhn", "params": {"variant": "classic", "players": 2}, "seeds": 40}
            ],
            "entrants": [
                {"id": "rnd-a", "kind": "random"},
                {"id": "rnd-b", "kind": "random"},
                {"id": "bet", "kind": "always", "options": {"action": "bet"}},
            ],
            "agent_processes": "single",
            "concurrency": 40,
        }
    )
    summary = await run_league(config, tmp_path / "league")
    game = summary.standings["games"]["kuhn"]
    ratings = {r["agent"]: r for r in game["ratings"]}
    a, b = ratings["rnd-a"], ratings["rnd-b"]
    assert abs(a["mu"] - b["mu"]) <= a["sigma"] + b["sigma"]
    h2h = game["head_to_head"]
    i, j = h2h["agents"].index("rnd-a"), h2h["agents"].index("rnd-b")
    assert h2h["groups"][i][j] == 40
    assert abs(h2h["mean"][i][j]) <= 2 * (h2h["se"][i][j] or 0.0)
    # The copies met in 80 matches whose returns did vary: chance was there to cancel.
    with LeagueStore(tmp_path / "league" / STORE) as store:
        copies = [r for r in store.results() if set(r.seats) == {"rnd-a", "rnd-b"}]
        records = list(store.records("kuhn"))
    assert len(copies) == 80 and len({r.returns for r in copies}) > 1

    import pyspiel
    from open_spiel.python import policy as os_policy
    from open_spiel.python.algorithms.exploitability import exploitability

    spiel = pyspiel.load_game("kuhn_poker")
    always_bet = os_policy.TabularPolicy(spiel)
    always_bet.action_probability_array[:] = [0.0, 1.0]
    expected = exploitability(spiel, always_bet)
    found = {e["agent"]: e for e in game["exploitability"]}
    assert found["bet"]["value"] == pytest.approx(expected, abs=1e-12)
    # the same number from the records, through the documented path
    rows = {e.agent: e for e in league_exploitability("kuhn", {"variant": "classic"}, records)}
    assert rows["bet"].value == pytest.approx(expected, abs=1e-12)
    assert rows["bet"].visited == 9  # never its own pass: the three "pb" states are unvisited


@pytest.mark.parametrize("players", [2, 3])
def test_exploitability_of_known_kuhn_policies_equals_openspiel(players: int) -> None:
    import pyspiel
    from open_spiel.python import policy as os_policy
    from open_spiel.python.algorithms import cfr
    from open_spiel.python.algorithms.exploitability import nash_conv

    from backroom.games import make_game

    def exploitability(game: Any, policy: Any) -> float:
        # OpenSpiel's `exploitability` takes two players only; for zero-sum Kuhn it is
        # NashConv / n at any n, which is what ours computes.
        return float(nash_conv(game, policy)) / players

    spiel = pyspiel.load_game("kuhn_poker", {"players": players})
    game = make_game("kuhn", variant="classic", players=players)
    always_bet = os_policy.TabularPolicy(spiel)
    always_bet.action_probability_array[:] = [0.0, 1.0]
    bet_counts = {k: {json.dumps(1): 7.0} for k in always_bet.state_lookup}  # counts, not probs
    assert policy_exploitability(game, bet_counts) == pytest.approx(
        exploitability(spiel, always_bet), abs=1e-12
    )
    solver = cfr.CFRPlusSolver(spiel)
    for _ in range(300):
        solver.evaluate_and_update_policy()
    average = solver.average_policy()
    counts = {
        key: {json.dumps(a): float(p) * 1000 for a, p in enumerate(average.policy_for_key(key))}
        for key in average.state_lookup
    }
    ours, theirs = policy_exploitability(game, counts), exploitability(spiel, average)
    assert ours == pytest.approx(theirs, abs=1e-9)
    assert theirs < 0.02  # an equilibrium, nearly


def test_empirical_policy_counts_each_decision_at_its_information_state() -> None:
    from backroom.bus.wire import EpisodeRecord, MatchSpec
    from backroom.games import make_game

    game = make_game("kuhn", variant="classic", players=2)
    state = game.new_initial_state(11)
    deal = (state.information_state(0), state.information_state(1))
    moves = [(0, 0, "pass"), (1, 1, "bet"), (2, 0, "bet")]  # pass, bet, call
    record = EpisodeRecord(
        match="m",
        run="r",
        referee="x",
        spec=MatchSpec(game="kuhn", seats=["p", "q"], seed=11),
        game="kuhn",
        params={"variant": "classic", "players": 2},
        seed=11,
        crn_group=None,
        seats=["p", "q"],
        actions=[
            {"turn": t, "t": 0.0, "seat": s, "agent": "pq"[s], "phase": "act", "action": a}
            for t, s, a in moves
        ],
        deliveries=[],
        round_rewards=[],
        raw_returns=[0, 0],
        returns=[0, 0],
        reason="normal",
        started_at=0,
        ended_at=0,
    )
    counts = empirical_counts(game, [record, record])
    assert counts["p"] == {deal[0]: {"0": 2.0}, deal[0] + "pb": {"1": 2.0}}
    assert counts["q"] == {deal[1] + "p": {"1": 2.0}}


def league_file(tmp_path: Path, data: dict[str, Any], name: str) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


async def test_sigkill_then_resume_counts_every_match_once_and_a_new_entrant_plays_only_its_pairings(
    tmp_path: Path,
) -> None:
    """Exactly once, checked three ways: the results table holds one row per scheduled key
    and no other (the keys as sets, and their counts), however many episodes of a match the
    referees wrote across the two sessions (the killed session's in-flight matches are
    played again); and the ratings count each entrant's matches once."""
    data = ipd_league(tmp_path, name="kill", seeds=12)
    data["entrants"] = data["entrants"][:4]  # d1..d4: 6 pairings x 2 orders x 12 seeds
    data["concurrency"] = 4
    cfg = league_file(tmp_path, data, "kill.yaml")
    directory = tmp_path / "league"
    proc = subprocess.Popen(
        [sys.executable, "-m", "backroom", "league", str(cfg), "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def counted() -> int:
        try:
            with sqlite3.connect(directory / STORE) as db:
                return int(db.execute("SELECT count(*) FROM results").fetchone()[0])
        except sqlite3.Error:
            return 0

    try:
        await eventually(lambda: counted() >= 20, 60 * load_factor(), lambda: f"{counted()}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = counted()
    assert killed_at < 144, "the league finished before it was killed: nothing was tested"

    with pytest.raises(LeagueError, match="--resume"):
        await run_league(parse_league(data), directory)
    summary = await run_league(parse_league(data), directory, resume=True)
    config = parse_league(data)
    scheduled = {s.key for s in round_robin(config)}
    with LeagueStore(directory / STORE) as store:
        keys = [r.key for r in store.results()]
    assert len(scheduled) == 144 and len(keys) == 144 and set(keys) == scheduled
    assert summary.played == 144 - killed_at and summary.pending == 0
    ratings = {r["agent"]: r["matches"] for r in summary.standings["games"]["ipd"]["ratings"]}
    assert ratings == {a: 3 * 2 * 12 for a in ("d1", "d2", "d3", "d4")}
    on_disk = sum(
        len(p.read_text().splitlines()) for p in (directory / "runs").rglob("episodes.jsonl")
    )
    assert on_disk >= 144  # every match's episode, and any played twice, are on disk

    # An entrant added later plays only its new pairings: 4 pairings x 2 orders x 12 seeds.
    data["entrants"].append({"id": "allc", "kind": "always", "options": {"action": "A"}})
    more = await run_league(parse_league(data), directory, resume=True)
    assert more.played == 4 * 2 * 12
    with LeagueStore(directory / STORE) as store:
        new = store.results()[144:]
    assert len(new) == 96 and all("allc" in r.seats for r in new)
    assert {r.key for r in new} == {s.key for s in round_robin(parse_league(data))} - scheduled


def test_adaptive_picks_whole_crn_groups_where_sigma_is_largest(tmp_path: Path) -> None:
    config = parse_league(
        {
            **ipd_league(tmp_path),
            "schedule": {"kind": "adaptive", "budget": 10, "batch": 2},
        }
    )
    agents = [a.id for a in config.agents()]
    sigma = dict.fromkeys(agents, 1.0) | {"d3": 5.0, "d5": 4.0}
    picked = adaptive_pick(config, agents, sigma, {}, budget_left=10, batch=2)
    assert [s.pairing for s in picked] == [("d3", "d5")] * 2 + [("allc", "d3")] * 2  # ties: by name
    assert {s.order for s in picked[:2]} == {("d3", "d5"), ("d5", "d3")}
    # a pairing played before is discounted and plays its next seed index
    again = adaptive_pick(config, agents, sigma, {("ipd", ("d3", "d5")): 3}, 10, 1)
    assert again[0].pairing != ("d3", "d5")
    assert adaptive_pick(config, agents, sigma, {}, budget_left=1, batch=2) == []


async def test_adaptive_league_stops_at_its_budget(tmp_path: Path) -> None:
    data = {**ipd_league(tmp_path, name="adaptive"), "schedule": {"kind": "adaptive", "budget": 24}}
    summary = await run_league(parse_league(data), tmp_path / "league")
    assert summary.played == 24
    with LeagueStore(tmp_path / "league" / STORE) as store:
        groups: dict[str, int] = {}
        for r in store.results():
            groups[r.group] = groups.get(r.group, 0) + 1
    assert set(groups.values()) == {2}  # whole CRN groups: both seat orders of each seed


async def test_an_adaptive_league_picks_the_same_rounds_whatever_order_episodes_come_back(
    tmp_path: Path,
) -> None:
    """Same config and seed, same matches: the schedule rated each round's results in the
    order their episodes came back, so two plays of one league of scripted agents played
    different matches (3,000 of six IPD agents, rounds of 16). It rates them in the order
    scheduled; shown here with two stores that counted the same results in opposite orders,
    whose counted-order ratings differ, and with two plays of one league."""
    data = {
        **ipd_league(tmp_path, name="adaptive", seeds=4),
        "schedule": {"kind": "adaptive", "budget": 40, "batch": 2},
    }
    config = parse_league(data)
    for d in ("a", "b"):
        await run_league(config, tmp_path / d)
    keys = []
    for d in ("a", "b"):
        with LeagueStore(tmp_path / d / STORE) as store:
            keys.append(store.scheduled_keys())
    assert keys[0] == keys[1] and len(keys[0]) == 40

    with LeagueStore(tmp_path / "a" / STORE) as store:
        counted = [r.key for r in store.results()]
        records = dict(zip(counted, store.records(), strict=True))
    games = {g.key: g for g in config.games}
    rows = []
    for key in keys[0]:  # the schedule, rebuilt from its keys as a resumed league does
        game, pairing, k, order = key.split("|")
        slot = Slot(game, tuple(pairing.split(",")), int(k), tuple(order.split(",")))
        spec = match_spec(config, games[game], slot, players_of(games[game]))
        rows.append((key, game, slot.group, spec))
    agents = [a.id for a in config.agents()]
    tallies, shown = [], []
    for n, order in enumerate((keys[0], keys[0][::-1])):
        with LeagueStore(tmp_path / f"counted{n}.sqlite") as store:
            store.schedule(rows)
            for key in order:
                assert store.add(key, records[key])
            store.flush()
            assert [r.key for r in store.results()] == order
            assert [r.key for r in store.results(as_scheduled=True)] == keys[0]
            tallies.append(League(config, tmp_path, store, lambda _: None).tally(agents))
            shown.append(rate(store.results(), agents))
    assert shown[0] != shown[1]  # in counted order the two stores rate apart
    assert tallies[0].sigma() == tallies[1].sigma()
    assert tallies[0].played == tallies[1].played and sum(tallies[0].played.values()) == 20


def test_from_run_versions_become_local_entrants(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "adalign"
    for v in range(0, 26):
        (run / "adapters" / f"v{v}").mkdir(parents=True)
    base = {"league": "l", "games": [{"game": "ipd"}]}
    other = {"id": "tft", "kind": "tit-for-tat"}
    entrant = {"id": "aa", "kind": "local", "from_run": str(run), "versions": "every 10"}
    config = parse_league({**base, "entrants": [entrant, other]})
    ids = [a.id for a in config.agents()]
    assert ids == ["aa.v0", "aa.v10", "aa.v20", "aa.v25", "tft"]
    assert config.agents()[1].options["adapter"] == str((run / "adapters" / "v10").resolve())
    last = parse_league({**base, "entrants": [{**entrant, "versions": "last"}, other]})
    assert [a.id for a in last.agents()] == ["aa.v25", "tft"]


BAD_CONFIGS = [
    ({"games": [{"game": "chess"}]}, "games.0.game: unknown game 'chess'"),
    ({"games": [{"game": "ipd", "params": {"roundz": 3}}]}, "games.0.params.roundz"),
    ({"games": [{"game": "ipd", "seeds": 0}]}, "games.0.seeds"),
    (
        {
            "entrants": [
                {"id": "a", "kind": "always", "options": {"action": "C"}},
                {"id": "b", "kind": "random"},
            ]
        },
        "entrants.0.options.action: ipd: ipd has no action 'C'",
    ),
    (
        {"entrants": [{"id": "a", "kind": "nope"}, {"id": "b", "kind": "random"}]},
        "entrants.0.kind: unknown agent kind 'nope'",
    ),
    (
        {"entrants": [{"id": "a", "kind": "random"}, {"id": "a", "kind": "random"}]},
        "entrants: agent ids must be unique",
    ),
    (
        {
            "entrants": [
                {"id": "a", "kind": "local", "from_run": "/nonexistent"},
                {"id": "b", "kind": "random"},
            ]
        },
        "entrants.0.from_run: /nonexistent/adapters is no directory",
    ),
    (
        {
            "entrants": [
                {"id": "a", "kind": "random", "from_run": "x"},
                {"id": "b", "kind": "random"},
            ]
        },
        "`from_run` gives adapters to a `local` model",
    ),
    (
        {
            "entrants": [
                {"id": "a", "kind": "local", "from_run": "x", "versions": "some"},
                {"id": "b", "kind": "random"},
            ]
        },
        "versions 'some'",
    ),
    (
        {"schedule": {"kind": "adaptive"}},
        "schedule: Value error, an adaptive schedule needs `budget`",
    ),
    ({"schedule": {"kind": "round_robin", "budget": 3}}, "`budget` is for kind: adaptive"),
    (
        {"games": [{"game": "kuhn", "params": {"players": 3}}]},
        "games.0: a match seats 3 entrants, and 2 play it",
    ),
    (
        {"games": [{"game": "ipd", "entrants": ["a", "zed"]}]},
        "games.0.entrants: 'zed' is no entrant",
    ),
    (
        {"games": [{"game": "ipd", "channels": [{"name": "c", "members": [0, 1]}]}]},
        "games.0.channels.0.members: [0, 1]: name agents that play ipd",
    ),
    (
        {"games": [{"game": "beauty_contest", "params": {"players": 5}, "group": 2}]},
        "games.0.group",
    ),
    ({"league": "a b"}, "league: String should match pattern"),
    (
        {"entrants": [{"id": "a", "kind": "human"}, {"id": "b", "kind": "random"}]},
        "entrants.0: a person plays an `external` entrant",
    ),
    ({"entrants": [{"id": "a", "kind": "random"}]}, "entrants: List should have at least 2 items"),
]


@pytest.mark.parametrize(("change", "message"), BAD_CONFIGS)
def test_bad_league_configs_name_the_field(change: dict[str, Any], message: str) -> None:
    base = {
        "league": "l",
        "games": [{"game": "ipd"}],
        "entrants": [{"id": "a", "kind": "random"}, {"id": "b", "kind": "tit-for-tat"}],
    }
    with pytest.raises(ConfigError) as err:
        parse_league({**base, **change}, source="l.yaml")
    assert message.replace("Value error, ", "") in str(err.value)


def test_channels_follow_their_members_to_whatever_seats_they_hold(tmp_path: Path) -> None:
    from backroom.league.schedule import channels

    config = parse_league(
        {
            "league": "loki",
            "games": [
                {
                    "game": "kuhn",
                    "params": {"variant": "loki"},
                    "entrants": ["x", "y", "z", "w"],
                    "channels": [{"name": "team", "members": ["x", "y"], "eavesdroppers": ["z"]}],
                }
            ],
            "entrants": [{"id": n, "kind": "random"} for n in ("x", "y", "z", "w", "solo")],
        }
    )
    game = config.games[0]
    (spec,) = channels(game, ["z", "y", "x"])
    assert (spec.members, spec.eavesdroppers) == ([1, 2], [0])
    assert channels(game, ["x", "z", "w"]) == []  # one member seated: no channel
    slots = round_robin(config)
    assert all("solo" not in s.pairing for s in slots)  # not an entrant of this game
    assert len(slots) == 4 * 6  # C(4, 3) pairings x 3! seat orders


def test_entrant_scores_average_the_seats_an_entrant_holds() -> None:
    assert entrant_scores(["a", "b", "a", "b"], [1, 2, 3, 6]) == {"a": 2.0, "b": 4.0}
    assert math.isclose(entrant_scores(["x"], [0.5])["x"], 0.5)


def lists_head_to_head(results: list[Result], agents: list[str]) -> dict[str, Any]:
    """The table as the league built it before ``Cells``, kept here as the oracle: every
    group's returns in a list, summed at the end."""
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in results:
        scores = entrant_scores(r.seats, r.returns)
        for i, si in scores.items():
            for j in scores:
                if i != j:
                    cells.setdefault((i, j), {}).setdefault(r.group, []).append(si)
    n = len(agents)
    mean: list[list[float | None]] = [[None] * n for _ in range(n)]
    se: list[list[float | None]] = [[None] * n for _ in range(n)]
    counts = [[0] * n for _ in range(n)]
    for a, i in enumerate(agents):
        for b, j in enumerate(agents):
            if not (groups := cells.get((i, j))):
                continue
            samples = [sum(v) / len(v) for v in groups.values()]
            k, m = len(samples), sum(samples) / len(samples)
            mean[a][b], counts[a][b] = m, k
            if k > 1:
                se[a][b] = math.sqrt(sum((x - m) ** 2 for x in samples) / (k - 1) / k)
    return {"agents": agents, "mean": mean, "se": se, "groups": counts}


def test_the_head_to_head_table_kept_as_results_come_equals_the_one_built_from_them_all() -> None:
    """A running league shows the table every second from samples it adds to as results
    come (``Cells``), not from every result again: the same numbers, to the bit, at every
    point; a cell's mean and standard error are over CRN groups (hand-checked)."""
    rng = random.Random(3)
    agents = ["a", "b", "c"]
    results = []
    for k in range(30):
        pair = tuple(sorted(rng.sample(agents, 2)))
        group = f"ipd|{','.join(pair)}|{k}"
        for order in (pair, pair[::-1]):
            x = rng.choice([0.0, 1.0, 3.0, 5.0, 0.1])
            results.append(
                Result(
                    len(results) + 1,
                    f"{group}|{','.join(order)}",
                    "ipd",
                    group,
                    order,
                    (x, rng.choice([0.0, 1.0, 0.7])),
                    "normal",
                )
            )
    results.append(
        Result(
            999,
            "beauty|a,b,c|0|a,b,c",
            "beauty",
            "beauty|a,b,c|0",
            ("a", "b", "c", "a"),
            (1.0, 0.0, 0.5, 0.0),
            "normal",
        )
    )
    cells = Cells()
    for n, r in enumerate(results, 1):
        cells.add(r)
        if n % 7 == 0 or n == len(results):
            assert cells.table(agents).to_json() == lists_head_to_head(results[:n], agents)
    # hand-checked: a against b, one sample per CRN group (the mean of its seat orders)
    samples = []
    for group in dict.fromkeys(r.group for r in results if {"a", "b"} <= set(r.seats)):
        mine = [entrant_scores(r.seats, r.returns)["a"] for r in results if r.group == group]
        samples.append(sum(mine) / len(mine))
    table = cells.table(agents)
    m = sum(samples) / len(samples)
    se = math.sqrt(sum((x - m) ** 2 for x in samples) / (len(samples) - 1) / len(samples))
    assert table.groups[0][1] == len(samples) > 2
    assert math.isclose(table.mean[0][1], m) and math.isclose(table.se[0][1], se)


def test_league_config_round_trips_through_its_store(tmp_path: Path) -> None:
    config = parse_league(ipd_league(tmp_path))
    assert LeagueConfig.model_validate_json(config.model_dump_json()) == config


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_league_examples_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from backroom.league.config import load_league

    for run in ("ipd-quick", "ipd-quick-grpo"):  # what examples/league_ipd.yaml reads
        for v in range(4):
            (tmp_path / "runs" / run / "adapters" / f"v{v}").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    ipd = load_league(EXAMPLES / "league_ipd.yaml")
    assert [a.id for a in ipd.agents()][-4:] == ["aa.v0", "aa.v3", "grpo.v0", "grpo.v3"]
    assert len(load_league(EXAMPLES / "league_compose.yaml").agents()) == 3
    kuhn = load_league(EXAMPLES / "league_kuhn.yaml")
    assert {a.id: a.kind for a in kuhn.agents()}["llm"] == "local"


async def test_kuhn_example_league_plays_with_its_llm_seat_scripted(tmp_path: Path) -> None:
    """examples/league_kuhn.yaml as shipped, one deal per pairing, the LLM seat played by the
    `random` kind (tests/test_llm_examples.py covers model seats): both games, the colluders'
    channel, each game's ratings and exploitability among its own entrants."""
    data = yaml.safe_load((EXAMPLES / "league_kuhn.yaml").read_text())
    data["model"] = {"kind": "random"}
    for game in data["games"]:
        game["seeds"] = 1
    summary = await run_league(parse_league(data), tmp_path / "league")
    assert summary.played == 6 * 2 + 10 * 6 and summary.pending == 0
    games = summary.standings["games"]
    classic = {e["agent"] for e in games["classic"]["exploitability"]}
    assert classic == {r["agent"] for r in games["classic"]["ratings"]}
    assert classic == {"cfr", "always-bet", "random", "llm"}
    loki = {e["agent"] for e in games["loki"]["exploitability"]}
    assert loki == {"cfr-loki", "colluder-a", "colluder-b", "random", "llm"}
    assert len(summary.standings["overall"]) == 7
    fallbacks = summary.standings["fallbacks"]  # counted and shown, none for scripted play
    assert set(fallbacks) == {a.id for a in parse_league(data).agents()}
    assert all(c["fallbacks"] == 0 and c["moves"] > 0 for c in fallbacks.values())
    with LeagueStore(tmp_path / "league" / STORE) as store:
        both = [r for r in store.records("loki") if {"colluder-a", "colluder-b"} <= set(r.seats)]
    # the colluders' channel carried their cards in every match that seated both
    assert both and all(any(d.channel == "colluders" for d in r.deliveries) for r in both)


async def test_an_optional_entrant_plays_its_pairings_once_it_is_online(
    broker: Broker, tmp_path: Path
) -> None:
    """A person's seat in shape: `alice` is external and optional. Offline when the first
    session starts, her matches stay pending while the others play; online (here a
    tit-for-tat process of the test's own, where a browser would hold the seat) when the
    league resumes, she plays exactly them. The league runs on a broker it did not start."""
    from backroom.agents import make_agent
    from backroom.agents.runtime import AgentRunner

    data = {
        "league": "people",
        "games": [{"game": "ipd", "params": {"rounds": 2}, "seeds": 2}],
        "entrants": [
            {"id": "tft", "kind": "tit-for-tat"},
            {"id": "defector", "kind": "always", "options": {"action": "B"}},
            {"id": "alice", "kind": "external", "optional": True},
        ],
        "agent_processes": "single",
    }
    url = f"mqtt://{broker.host}:{broker.port}"
    where = {"broker_url": url, "credentials_dir": broker.credentials.dir}
    first = await run_league(parse_league(data), tmp_path / "league", **where)
    assert first.skipped == ["alice"]
    assert first.played == 1 * 2 * 2 and first.pending == 2 * 2 * 2
    assert first.standings["scheduled"] == 12 and first.standings["counted"] == 4

    alice = AgentRunner(make_agent("tit-for-tat", "alice"), identity(broker, "alice"))
    async with alice:
        second = await run_league(parse_league(data), tmp_path / "league", resume=True, **where)
        # an entrant the league would start is online already: refused, nobody thrown off
        taken = {**data, "entrants": [*data["entrants"][:2], {"id": "alice", "kind": "random"}]}
        with pytest.raises(LeagueError, match=r"already online on .*: alice"):
            await run_league(parse_league(taken), tmp_path / "league", resume=True, **where)
    assert second.skipped == [] and second.played == 8 and second.pending == 0
    with LeagueStore(tmp_path / "league" / STORE) as store:
        assert all("alice" in r.seats for r in store.results()[4:])


@pytest.mark.slow
async def test_adapter_versions_of_a_training_run_play_as_entrants(
    tmp_path: Path, tiny_qwen: tuple[Path, Path]
) -> None:
    """`from_run`: two adapter versions of a (made-up) training run directory, each a `local`
    entrant on the tiny random Qwen2, against tit-for-tat. Every decision's trace names the
    version its entrant stands for: the league seated the run's adapters, not the base model."""
    from .conftest import perturbed_adapter

    model, adapter = tiny_qwen
    run = tmp_path / "runs" / "made-up"
    perturbed_adapter(adapter, run / "adapters" / "v0", seed=1)
    perturbed_adapter(adapter, run / "adapters" / "v5", seed=2)
    data = {
        "league": "versions",
        "games": [{"game": "ipd", "params": {"rounds": 2}}],
        "entrants": [
            {"id": "tft", "kind": "tit-for-tat"},
            {
                "id": "learner",
                "kind": "local",
                "from_run": str(run),
                "options": {"model": str(model), "device": "cpu", "temperature": 1.0},
            },
        ],
        "agent_processes": "single",
        "turn_timeout_s": 60,
    }
    summary = await run_league(parse_league(data), tmp_path / "league", ready_timeout_s=300)
    assert summary.played == 3 * 2 and summary.pending == 0  # 3 pairings x 2 seat orders
    assert all(c["fallbacks"] == 0 for c in summary.standings["fallbacks"].values())
    traces = [
        json.loads(line)
        for path in (tmp_path / "league" / "runs").rglob("traces.jsonl")
        for line in path.read_text().splitlines()
    ]
    by_agent: dict[str, set[str]] = {}
    for t in traces:
        by_agent.setdefault(t["agent"], set()).add(t["adapter_version"])
    assert by_agent == {"learner.v0": {"v0"}, "learner.v5": {"v5"}}


def test_the_ipd_league_example_says_how_to_make_what_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh clone the league's `from_run` runs do not exist yet: its header's train
    commands name shipped configs that train exactly those runs, and loading the league
    before training names the command to run."""
    from backroom.league.config import load_league
    from backroom.trainer.config import load_train_config

    header = (EXAMPLES / "league_ipd.yaml").read_text().split("\nleague:")[0]
    commands = [line.split("#   ", 1)[1] for line in header.splitlines() if "#   " in line]
    trains = [command.split("#")[0].split() for command in commands]
    trains = [argv for argv in trains if argv[:2] == ["backroom", "train"]]
    from_runs = {
        e["from_run"]
        for e in yaml.safe_load((EXAMPLES / "league_ipd.yaml").read_text())["entrants"]
        if "from_run" in e
    }
    assert {argv[argv.index("--run-dir") + 1] for argv in trains} == from_runs
    root = EXAMPLES.parent
    algorithms = {load_train_config(root / argv[2]).algorithm for argv in trains}
    assert algorithms == {"adalign", "grpo"}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=r"train it first \(backroom train CONFIG --run-dir runs/ipd-quick"
    ):
        load_league(EXAMPLES / "league_ipd.yaml")


def test_leagues_are_not_committed() -> None:
    ignored = (EXAMPLES.parent / ".gitignore").read_text().split()
    assert "leagues/" in ignored and "runs/" in ignored
