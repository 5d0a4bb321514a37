"""The trainer's hand-off to a league and back: entrant files in, the ratings' progress out.

``backroom train`` with ``league:`` writes ``<dir>/entrants.d/<name>.vN.yaml``
(``trainer.entrants``); a league played into ``<dir>`` adds them
(``league.handoff``); each later evaluation of the run reports the ratings
the league's ``standings.json`` gives its entrants (``league_progress``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backroom.agents.base import Agent
from backroom.bus.broker import Broker
from backroom.bus.wire import AdapterRef
from backroom.league.config import parse_league
from backroom.league.handoff import handed_entrants, with_handed_entrants
from backroom.league.play import run_league
from backroom.runner.config import ConfigError
from backroom.trainer.config import parse_train_config
from backroom.trainer.entrants import league_progress, send_entrant
from backroom.trainer.loop import train

from .conftest import identity, stack
from .test_trainer_cotrain import cotrain_data, learners
from .test_trainer_opponents import data, fake_adapter


def league_data() -> dict[str, Any]:
    return {
        "league": "ipd",
        "games": [{"game": "ipd", "params": {"rounds": 3}, "seeds": 2}],
        "entrants": [
            {"id": "tft", "kind": "tit-for-tat"},
            {"id": "always-b", "kind": "always", "options": {"action": "B"}},
        ],
    }


def hand_over(tmp_path: Path, league: Path, versions: list[str]) -> None:
    config = parse_train_config(data(league={"dir": str(league), "every": 1, "name": "grpo"}))
    run_dir = tmp_path / "run"
    for v in versions:
        fake_adapter(run_dir / "adapters" / v, v)
        ref = AdapterRef(policy="p", version=v, uri="/x", sha256="0" * 64, size=1)
        send_entrant(config, run_dir, int(v[1:]) - 1, ref)


def test_a_league_adds_the_checkpoints_training_runs_handed_over_once(tmp_path: Path) -> None:
    league = tmp_path / "league"
    config = parse_league(league_data())
    assert with_handed_entrants(config, league) == (config, [])  # nothing handed over yet
    hand_over(tmp_path, league, ["v1", "v2"])
    merged, added = with_handed_entrants(config, league)
    assert added == ["grpo.v1", "grpo.v2"]
    assert [e.id for e in merged.entrants] == ["tft", "always-b", "grpo.v1", "grpo.v2"]
    v2 = merged.entrants[-1]
    assert v2.kind == "local" and "policy" not in v2.options
    assert v2.options["adapter"] == str((tmp_path / "run" / "adapters" / "v2").resolve())
    # a league that has them (a resumed one, or a config naming them) adds nothing twice
    assert with_handed_entrants(merged, league) == (merged, [])
    hand_over(tmp_path, league, ["v3"])
    assert with_handed_entrants(merged, league)[1] == ["grpo.v3"]


def test_a_bad_handed_over_file_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "league" / "entrants.d"
    folder.mkdir(parents=True)
    bad = folder / "x.v1.yaml"
    for text, words in (
        ("format: 2\nagent: {id: x.v1, kind: local}\n", "format 2 is newer than 1"),
        ("format: 1\n", "agent"),
        ("format: 1\nagent: {id: x.v1, kind: nope}\n", "unknown agent kind"),
        (": : :\n", "not an entrant"),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"x\.v1\.yaml: .*{words}"):
            handed_entrants(tmp_path / "league")


def test_evaluation_reports_the_ratings_the_league_gave_this_runs_entrants(
    tmp_path: Path,
) -> None:
    league = tmp_path / "league"
    config = parse_train_config(data(league={"dir": str(league), "name": "grpo"}))
    assert league_progress(config) is None  # no standings yet
    assert league_progress(parse_train_config(data())) is None  # no league at all
    league.mkdir()
    (league / "standings.json").write_text('{"games": {')  # torn: as none
    assert league_progress(config) is None

    def rating(agent: str, mu: float) -> dict[str, Any]:
        return {"agent": agent, "mu": mu, "sigma": 2.0, "ordinal": mu - 6, "matches": 8}

    standings = {
        "league": "ipd",
        "updated": 1.0,
        "running": True,
        "games": {
            "ipd": {
                "ratings": [rating("tft", 27.0), rating("grpo.v2", 25.0), rating("grpo.v1", 20.0)]
            },
            "kuhn": {"ratings": [rating("cfr", 30.0)]},
        },
    }
    (league / "standings.json").write_text(json.dumps(standings))
    progress = league_progress(config)
    assert progress == {
        "league": "ipd",
        "updated": 1.0,
        "running": True,
        "entrants": {"ipd": [rating("grpo.v2", 25.0), rating("grpo.v1", 20.0)]},
    }


@pytest.mark.slow  # two short training runs and a league session, about two minutes
async def test_checkpoints_go_to_a_league_and_come_back_as_ratings(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """The whole loop with the tiny random Qwen2: a run hands v1 and v2 over, a league rates
    them against tit-for-tat, and the run's next evaluation (after --resume) reports those
    ratings from the league's standings."""
    league = tmp_path / "league"
    train_data = cotrain_data(tiny_qwen_model, "hand", "x", "grpo")
    train_data.update(opponents=[], league={"dir": str(league), "every": 1})
    run_dir = tmp_path / "hand"
    players: list[Agent] = [*learners(tiny_qwen_model, "hand")]
    async with stack(broker, tmp_path / "runs", players):
        await train(
            parse_train_config(train_data), run_dir, identity(broker, "trainer-hand", "trainer")
        )
    config, added = with_handed_entrants(
        parse_league({**league_data(), "agent_processes": "single", "turn_timeout_s": 60}), league
    )
    assert added == ["hand.v1", "hand.v2"]
    summary = await run_league(config, league, ready_timeout_s=300)
    assert summary.pending == 0 and summary.played > 0
    rated = {r["agent"] for r in summary.standings["games"]["ipd"]["ratings"]}
    assert {"hand.v1", "hand.v2"} <= rated
    # one more step: its evaluation reads the standings the league wrote
    more = parse_train_config({**train_data, "steps": 3, "evaluation": {"every": 1, "matches": 1}})
    async with stack(broker, tmp_path / "runs", [*learners(tiny_qwen_model, "hand")]):
        result = await train(
            more, run_dir, identity(broker, "trainer-hand", "trainer"), resume=True
        )
    progress = result.evaluations[-1]["league"]
    assert progress["league"] == "ipd" and progress["running"] is False
    assert {r["agent"] for r in progress["entrants"]["ipd"]} == {"hand.v1", "hand.v2"}
    for r in progress["entrants"]["ipd"]:
        assert r["matches"] > 0 and r["sigma"] > 0
    assert (league / "entrants.d" / "hand.v3.yaml").exists()  # and v3 is handed over in turn
