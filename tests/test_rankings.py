"""Rankings that follow the payoffs (issue 39): Nash averaging and α-Rank of a league's meta-game."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backroom.league.config import parse_league
from backroom.league.play import run_league
from backroom.league.rankings import NASH, metagame, rankings
from backroom.league.ratings import Cells
from backroom.league.store import Result
from backroom.solvers.metagame import alpharank, maxent_nash, nash_averaging

RPS = np.array([[0.0, -1.0, 1.0], [1.0, 0.0, -1.0], [-1.0, 1.0, 0.0]])
# a beats b and c; b beats c: a dominates
DOMINATED = np.array([[0.0, 0.4, 0.7], [-0.4, 0.0, 0.2], [-0.7, -0.2, 0.0]])
# rock, paper, scissors and a second rock: the copies share rock's mass, no rating moves
RPS_COPY = np.array(
    [[0, -1, 1, 0], [1, 0, -1, 1], [-1, 1, 0, -1], [0, -1, 1, 0]],
    dtype=float,
)
CLASSIC = {"variant": "classic", "players": 2}
GENERAL_SUM = np.array([[3.0, 0.0, 1.0], [5.0, 1.0, 0.5], [2.0, 4.0, 2.0]])


def test_nash_averaging_of_rock_paper_scissors_is_uniform() -> None:
    rating, mass = nash_averaging(RPS)
    assert mass == pytest.approx([1 / 3] * 3, abs=1e-6)
    assert rating == pytest.approx([0.0] * 3, abs=1e-6)


def test_nash_averaging_puts_the_dominant_strategy_first() -> None:
    rating, mass = nash_averaging(DOMINATED)
    assert mass == pytest.approx([1.0, 0.0, 0.0], abs=1e-9)
    assert rating == pytest.approx([0.0, -0.4, -0.7])
    assert list(np.argsort(-rating)) == [0, 1, 2]


def test_the_maximum_entropy_equilibrium_splits_mass_between_copies() -> None:
    """Rock and its copy are each an equilibrium strategy; the max-entropy Nash gives each half
    of rock's third, and every rating stays 0 (adding a copy changes nobody's rating)."""
    mass = maxent_nash(RPS_COPY)
    assert mass == pytest.approx([1 / 6, 1 / 3, 1 / 3, 1 / 6], abs=1e-5)
    assert RPS_COPY @ mass == pytest.approx([0.0] * 4, abs=1e-6)


@pytest.mark.parametrize("matrix", [RPS, DOMINATED, RPS_COPY, GENERAL_SUM])
def test_alpharank_equals_openspiels(matrix: np.ndarray) -> None:
    from open_spiel.python.egt import alpharank as osp

    _, _, pi, _, _ = osp.compute([matrix], use_inf_alpha=True, inf_alpha_eps=0.01)
    assert alpharank(matrix) == pytest.approx(pi, abs=1e-12)


def results_from(matrix: np.ndarray, agents: list[str], groups: int, noise: float) -> Cells:
    """Two-seat zero-sum results: per pair and CRN group, both seat orders, payoffs around the
    matrix's entry with seeded noise shared by the group's two orders."""
    rng = np.random.default_rng(5)
    cells = Cells()
    seq = 0
    for i, a in enumerate(agents):
        for j in range(i + 1, len(agents)):
            b = agents[j]
            for k in range(groups):
                x = matrix[i, j] + noise * rng.standard_normal()
                for seats, returns in (((a, b), (x, -x)), ((b, a), (-x, x))):
                    seq += 1
                    cells.add(Result(seq, f"{a}|{b}|{k}", "g", f"{a}|{b}|{k}", seats, returns, ""))
    return cells


def test_league_rankings_of_a_noisy_dominated_meta_game_with_intervals() -> None:
    agents = ["c", "b", "a"]  # openskill's order (say), the reverse of the payoffs'
    m = DOMINATED[::-1, ::-1]
    cells = results_from(m, agents, groups=30, noise=0.3)
    game = metagame(cells, agents)
    assert not isinstance(game, str)
    out = rankings(cells, agents, seed=1, bootstrap=100, openskill_order=agents)
    assert out["ordered_by"] == NASH and out["zero_sum"]
    assert [r["agent"] for r in out["rows"]] == ["a", "b", "c"]
    top = out["rows"][0]
    assert top["nash"] == pytest.approx(0.0, abs=1e-6) and top["nash_mass"] == pytest.approx(1.0)
    for r in out["rows"]:
        lo, hi = r["nash_ci"]
        assert lo <= r["nash"] + 1e-9 and r["nash"] - 1e-9 <= hi
        assert r["alpharank_ci"][0] <= r["alpharank_ci"][1]
    assert out["disagreement"] and "openskill orders c, b, a" in out["disagreement"]
    # seeded: the same league shows the same intervals
    again = rankings(cells, agents, seed=1, bootstrap=100, openskill_order=agents)
    assert again == out


def test_an_incomplete_meta_game_says_which_pair_has_not_met() -> None:
    cells = results_from(DOMINATED[:2, :2], ["a", "b"], groups=2, noise=0.0)
    out = rankings(cells, ["a", "b", "c"], seed=0)
    assert out["ordered_by"] is not None  # c has no results at all: left out
    cells.add(Result(99, "k", "g", "x", ("c", "d"), (1.0, -1.0), ""))
    out = rankings(cells, ["a", "b", "c", "d"], seed=0)
    assert out["ordered_by"] is None and "have not met" in out["reason"]


async def test_classic_kuhn_league_ranks_the_equilibrium_first(tmp_path: Path) -> None:
    """The league of issue 39: CFR's equilibrium, always-bet and random, 40 deals in both seat
    orders. openskill (who finishes ahead) need not put the equilibrium first; the payoffs do."""
    config = parse_league(
        {
            "league": "kuhn-rank",
            "seed": 0,
            "games": [
                {"game": "kuhn", "params": {"variant": "classic", "players": 2}, "seeds": 40}
            ],
            "entrants": [
                {"id": "cfr", "kind": "cfr", "options": {"variant": "classic", "players": 2}},
                {"id": "always-bet", "kind": "always", "options": {"action": "bet"}},
                {"id": "random", "kind": "random"},
            ],
            "agent_processes": "single",
            "concurrency": 40,
        }
    )
    summary = await run_league(config, tmp_path / "league")
    assert summary.played == 240
    game = summary.standings["games"]["kuhn"]
    ranking = game["rankings"]
    assert ranking["ordered_by"] == NASH and ranking["zero_sum"]
    assert ranking["rows"][0]["agent"] == "cfr"
    assert ranking["rows"][0]["nash_mass"] > 0.5
    # every entrant's policy can be asked: exact numbers, none from the 240 matches' samples
    exploit = {e["agent"]: e for e in game["exploitability"]}
    assert {e["method"] for e in exploit.values()} == {"exact"}
    assert exploit["cfr"]["value"] <= 1e-3
    assert exploit["always-bet"]["value"] == pytest.approx(1 / 3)
    assert exploit["always-bet"]["openspiel"] == pytest.approx(1 / 3)
    gains = {r["agent"]: r for r in game["grounded"]}
    assert gains["random"]["gain"] < 0 and gains["random"]["ci"][1] < 0  # leaves chips
    lo, hi = gains["cfr"]["ci"]
    assert lo <= 0 <= hi  # the equilibrium earns what the equilibrium earns, within noise

    from typer.testing import CliRunner

    from backroom.cli import app

    shown = CliRunner().invoke(app, ["league", "show", str(tmp_path / "league"), "--no-plots"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.index("ranking by the payoffs") < shown.output.index("openskill")
    if [r["agent"] for r in game["ratings"]] != [r["agent"] for r in ranking["rows"]]:
        assert "openskill orders" in shown.output

    # the same records, read empirically: coverage, and an interval over CRN groups
    from backroom.league.exploit import league_exploitability
    from backroom.league.standings import STORE
    from backroom.league.store import LeagueStore

    with LeagueStore(tmp_path / "league" / STORE) as store:
        rows = league_exploitability("kuhn", CLASSIC, store.records("kuhn"), None, 0, 20)
    for e in rows:
        assert e.method == "empirical" and e.ci is not None and e.ci[0] <= e.ci[1]
    assert {e.agent: e.visited for e in rows}["cfr"] == 12


async def test_a_coalitions_gain_is_its_seats_return_less_the_team_games_value(
    tmp_path: Path,
) -> None:
    """Loki's two colluders on their channel against the CFR policy and random: the league's
    coalition gain is, per CRN group, their summed engine return less the value their seats
    guarantee in the team game, recomputed here from the records."""
    from collections import defaultdict

    from backroom.games import make_game
    from backroom.league.standings import STORE
    from backroom.league.store import LeagueStore
    from backroom.solvers.team import solve_team

    members = ["colluder-a", "colluder-b"]
    config = parse_league(
        {
            "league": "loki-team",
            "seed": 0,
            "games": [
                {
                    "game": "kuhn",
                    "params": {"variant": "loki"},
                    "seeds": 2,
                    "channels": [{"name": "team", "members": members, "opens": "before_act"}],
                }
            ],
            "entrants": [
                {"id": "cfr-loki", "kind": "cfr", "options": {"policy": "kuhn_loki_cfr"}},
                {"id": "colluder-a", "kind": "kuhn-colluder"},
                {"id": "colluder-b", "kind": "kuhn-colluder"},
                {"id": "random", "kind": "random"},
            ],
            "agent_processes": "single",
            "concurrency": 24,
        }
    )
    summary = await run_league(config, tmp_path / "league")
    assert summary.played == 4 * 6 * 2  # trios x seat orders x seeds
    game = summary.standings["games"]["kuhn"]
    assert game["rankings"]["ordered_by"] is None  # three entrants a match: no meta-game
    [row] = game["coalitions"]
    assert row["members"] == members and row["matches"] == 2 * 6 * 2
    loki = make_game("kuhn", variant="loki")
    per_group: dict[str, list[float]] = defaultdict(list)
    with LeagueStore(tmp_path / "league" / STORE) as store:
        for r in store.records("kuhn"):
            seats = tuple(i for i, a in enumerate(r.seats) if a in members)
            if len(seats) == 2:
                value = row["team_values"][",".join(map(str, seats))]
                per_group[str(r.crn_group)].append(sum(r.raw_returns[i] for i in seats) - value)
    assert row["gain"] == pytest.approx(
        float(np.mean([np.mean(v) for v in per_group.values()])), abs=1e-12
    )
    value = solve_team(loki, (0, 1), 5_000).guaranteed_value()
    assert row["team_values"]["0,1"] == pytest.approx(value, abs=1e-12)
    lo, hi = row["ci"]
    assert lo <= row["gain"] <= hi
