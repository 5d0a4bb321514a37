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

from backroom.bus.wire import AdapterRef
from backroom.league.config import parse_league
from backroom.league.handoff import handed_entrants, with_handed_entrants
from backroom.runner.config import ConfigError
from backroom.trainer.config import parse_train_config
from backroom.trainer.entrants import league_progress, send_entrant

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
