"""Experiment tracking of leagues (``tracking:`` in a league config, backroom/league/tracking.py).

Short leagues of scripted IPD agents over their own broker, as tests/test_league.py
plays them, with each tool on; each tool's own reader (those of tests/test_tracking.py)
finds the final ratings of ``standings.json`` at the step of the results counted.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from backroom.analysis.league import plot_standings
from backroom.league.config import parse_league
from backroom.league.play import LeagueError, run_league
from backroom.league.standings import read_standings
from backroom.runner.config import ConfigError

from .conftest import load_factor
from .test_league import ipd_league
from .test_tracking import ENV, wandb_records

#: d1 (always defects), d2, d3 (table policies) and allc: 6 pairings x 2 seat orders
MATCHES = 12


def short_league(tmp_path: Path, tracking: dict[str, Any], entrants: int = 3) -> dict[str, Any]:
    data = ipd_league(tmp_path, name="tracked")
    data["entrants"] = [*data["entrants"][:entrants], data["entrants"][-1]]
    data["tracking"] = tracking
    return data


def final_figures(doc: dict[str, Any]) -> dict[str, float]:
    """standings.json's ratings and counts, as the league names them in the tracker."""
    out = {
        f"ipd/{r['agent']}/{k}": float(r[k])
        for r in doc["games"]["ipd"]["ratings"]
        for k in ("mu", "sigma", "ordinal", "matches")
    }
    fallbacks = sum(c["fallbacks"] for c in doc["fallbacks"].values())
    counters = doc["counters"]
    out |= {
        "league/results": float(doc["counted"]),
        "league/voided": float(counters.get("voided", 0)),
        "league/duplicates": float(counters.get("duplicates", 0)),
        "league/fallbacks": float(fallbacks),
    }
    return out


def mlflow_client(directory: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{directory.resolve() / 'mlflow' / 'mlflow.db'}")


async def test_mlflow_holds_the_final_standings_and_resume_continues_its_run(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "league"
    data = short_league(tmp_path, {"kind": "mlflow"})
    summary = await run_league(parse_league(data), directory, plots=plot_standings)
    assert summary.played == MATCHES
    doc = read_standings(directory)
    client = mlflow_client(directory)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.info.run_name == "league"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"  # the league's name
    assert run.data.params["league"] == "tracked" and run.data.params["tracking.kind"] == "mlflow"
    figures = final_figures(doc)
    for key, value in figures.items():
        history = client.get_metric_history(run.info.run_id, key)
        steps = [m.step for m in history]
        assert steps == sorted(set(steps)) and steps[-1] == MATCHES, key  # each step once
        assert history[-1].value == value, key
    results = client.get_metric_history(run.info.run_id, "league/results")
    assert all(m.value == m.step for m in results)  # step = results counted
    artifacts = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "standings")}
    assert artifacts == {"standings.json", "ipd_ratings.png", "ipd_h2h.png"}
    got = client.download_artifacts(run.info.run_id, "standings/standings.json", str(tmp_path))
    assert json.loads(Path(got).read_text()) == doc

    # --resume with a new entrant: the same tracker run, steps going on from 12
    data["entrants"].append(ipd_league(tmp_path)["entrants"][3])  # d4: 4 pairings x 2 orders
    more = await run_league(parse_league(data), directory, resume=True, plots=plot_standings)
    assert more.played == 8
    (again,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    doc = read_standings(directory)
    for key, value in final_figures(doc).items():
        history = client.get_metric_history(run.info.run_id, key)
        assert history[-1].step == MATCHES + 8 and history[-1].value == value, key
    d4 = [m.step for m in client.get_metric_history(run.info.run_id, "ipd/d4/mu")]
    assert min(d4) >= MATCHES  # an entrant of the second session only
    state = json.loads((directory / "tracking.json").read_text())
    assert state["standings_through"] == MATCHES + 8 and state["failures"] == 0


async def test_wandb_offline_holds_the_final_standings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("WANDB_API_KEY", "WANDB_MODE"):  # no key: offline, nothing reaches a server
        monkeypatch.delenv(key, raising=False)
    directory = tmp_path / "league"
    data = short_league(tmp_path, {"kind": "wandb", "project": "tests"})
    summary = await run_league(parse_league(data), directory)
    assert summary.played == MATCHES
    doc = read_standings(directory)
    (log_file,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(log_file)
    history = {
        int(r["history"]["step"]["num"]): r["history"]["item"]
        for r in records
        if r["type"] == "history"
    }
    assert max(history) == MATCHES
    figures = final_figures(doc)
    assert {k: history[MATCHES][k] for k in figures} == figures
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "tests" and run["run_group"] == "tracked"
    assert run["telemetry"]["feature"]["offline"] is True
    assert run["config"]["update"]["league"] == "tracked"
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert artifact["type"] == "standings" and f"step-{MATCHES}" in artifact["aliases"]
    assert {Path(c["path"]).name for c in artifact["manifest"]["contents"]} == {"standings.json"}


def test_tensorboard_through_the_cli_holds_the_final_standings_and_plots(tmp_path: Path) -> None:
    """``backroom league CONFIG`` with tracking: the plots are drawn and referenced, and the
    last line says where the tracking went."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = tmp_path / "tracked.yaml"
    path.write_text(yaml.safe_dump(short_league(tmp_path, {"kind": "tensorboard"})))
    directory = tmp_path / "league"
    done = subprocess.run(
        [sys.executable, "-m", "backroom", "league", str(path), "--dir", str(directory)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180 * load_factor(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"tracking: TensorBoard event files in {directory}" in done.stdout
    doc = read_standings(directory)
    events = EventAccumulator(str(directory / "tensorboard"))
    events.Reload()
    for key, value in final_figures(doc).items():
        last = events.Scalars(key)[-1]
        assert (last.step, last.value) == (MATCHES, float(np.float32(value))), key
    (refs,) = events.Tensors("standings/text_summary")
    text = refs.tensor_proto.string_val[0].decode()
    listed = json.loads("\n".join(line[4:] for line in text.splitlines()))
    assert {r["name"] for r in listed} == {"standings.json", "ipd_ratings.png", "ipd_h2h.png"}
    for ref in listed:  # the files it names, as they are on disk
        assert Path(ref["path"]).stat().st_size == ref["size"]
        assert Path(ref["path"]).parent in (directory, directory / "plots")


async def test_a_failing_tracker_is_said_and_counted_and_the_league_plays_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The MLflow run is deleted after the first result: every later call fails, each is
    warned of and counted, and the league plays all its matches."""
    directory = tmp_path / "league"
    data = short_league(tmp_path, {"kind": "mlflow"})

    def delete_run(n: int) -> None:
        if n == 1:
            run_id = json.loads((directory / "tracking.json").read_text())["run_id"]
            mlflow_client(directory).delete_run(run_id)

    with caplog.at_level(logging.WARNING, logger="backroom.tracking"):
        summary = await run_league(parse_league(data), directory, on_result=delete_run)
    assert summary.played == MATCHES and summary.pending == 0
    state = json.loads((directory / "tracking.json").read_text())
    assert state["failures"] >= 2  # the last standings and the files, at least
    assert "logging standings of step" in caplog.text and "the league goes on" in caplog.text
    assert f"{state['failures']} tracking failure(s) in this run" in caplog.text


async def test_a_missing_client_library_names_the_extra_before_the_league_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    data = short_league(tmp_path, {"kind": "wandb"})
    with pytest.raises(LeagueError, match=r'needs the "wandb" extra \(wandb not installed\)'):
        await run_league(parse_league(data), tmp_path / "league")
    assert not (tmp_path / "league").exists()


async def test_a_tracker_that_cannot_open_stops_the_league_before_it_plays(
    tmp_path: Path,
) -> None:
    data = short_league(tmp_path, {"kind": "mlflow", "uri": "nosuchscheme://x"})
    with pytest.raises(LeagueError, match=r"tracking: \{kind: mlflow\} could not start"):
        await run_league(parse_league(data), tmp_path / "league")
    assert not (tmp_path / "league" / "standings.json").exists()


@pytest.mark.parametrize(
    ("tracking", "words"),
    [
        ({"kind": "mlfow"}, "tracking: Input tag 'mlfow' found using 'kind' does not match"),
        ({"kind": "tensorboard", "uri": "x"}, "tracking.tensorboard.uri: Extra inputs"),
        ({"kind": "wandb", "mode": "away"}, "tracking.wandb.mode: Input should be 'online'"),
        ("mlflow", "tracking: Input should be a valid dictionary"),
    ],
)
def test_bad_tracking_block_names_the_field(tmp_path: Path, tracking: Any, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_league(short_league(tmp_path, tracking), source="l.yaml")
    assert words in str(info.value)


def test_a_config_value_too_long_for_an_mlflow_param_is_cut_and_kept_whole_in_config_json(
    tmp_path: Path,
) -> None:
    """A league of many entrants has a long ``entrants`` list: the run still opens."""
    from backroom.tracking import MlflowSpec, Tracking, open_tracking
    from backroom.tracking.tools import PARAM_CHARS

    entrants = [{"id": f"e{i}", "kind": "always", "options": {"action": "A"}} for i in range(200)]
    config = {"league": "big", "entrants": entrants}
    tracking = open_tracking(MlflowSpec(kind="mlflow"), tmp_path, config, Tracking, title="big")
    tracking.close()
    assert tracking.failures == 0
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    param = run.data.params["entrants"]
    whole = json.dumps(entrants)
    assert len(whole) > PARAM_CHARS and len(param) == PARAM_CHARS
    assert param.endswith(f"({len(whole)} characters: config.json holds it whole)")
    assert whole.startswith(param[:1000])
    got = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path / "dl"))
    assert json.loads(Path(got).read_text()) == config
