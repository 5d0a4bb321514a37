"""Experiment tracking (``tracking:`` in a training config, backroom/trainer/tracking.py).

Each tool gets a real training run and its own reader finds the numbers of
``train_log.csv`` and ``evaluations.jsonl``: MLflow's client on the SQLite store
in the run directory, W&B's ``wandb leet inspect --json`` on the offline
``.wandb`` log, TensorBoard's ``EventAccumulator`` on the event files. The
memory-one run (seconds) goes through ``backroom train``; a LoRA run of the tiny
Qwen2 over a real broker checks the adapters and evaluations of the loop.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backroom.agents.base import Agent
from backroom.agents.local_model import LocalAgent
from backroom.bus.broker import Broker
from backroom.bus.client import BusConfig
from backroom.model.adapters import adapter_digest
from backroom.runner.config import ConfigError
from backroom.tracking import MlflowSpec, WandbSpec
from backroom.trainer.config import load_train_config, parse_train_config
from backroom.trainer.loop import TrainError, train
from backroom.trainer.tracking import (
    TrackingError,
    open_tracking,
    read_evaluations,
    read_rows,
    tracking_summary,
)

from .conftest import TEST_DEVICE, agents, identity, load_factor, stack
from .test_trainer import tiny_config_data

ROOT = Path(__file__).resolve().parent.parent
MEMORY_ONE = ROOT / "examples" / "ipd_memory_one.yaml"
#: nothing here may reach a server: no key, and W&B told so
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))},
    "HF_HUB_OFFLINE": "1",
}


def train_memory_one(
    run_dir: Path, tracking: str, steps: int = 40
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "backroom",
            "train",
            MEMORY_ONE,
            "--run-dir",
            run_dir,
            "--steps",
            str(steps),
            "--set",
            f"tracking={tracking}",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180 * load_factor(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def expected(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """``train_log.csv`` as {column: {step: value}} and the evaluation's numbers as eval/... keys."""
    rows = read_rows(run_dir / "train_log.csv")
    columns = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, int | float)}
    series = {c: {int(r["step"]): float(r[c]) for r in rows if c in r} for c in columns}
    series = {c: {s: v for s, v in by.items() if np.isfinite(v)} for c, by in series.items()}
    (evaluation,) = read_evaluations(run_dir / "evaluations.jsonl")
    evals = {
        f"eval/{label}/{k}": float(v)
        for label, res in evaluation["against"].items()
        for k, v in res.items()
        if v is not None
    }
    evals["eval/missing"] = float(evaluation["missing"])
    return series, evals


def mlflow_values(run_dir: Path) -> tuple[Any, dict[str, dict[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
    }
    return run, history


def test_mlflow_run_holds_train_log_numbers(tmp_path: Path) -> None:
    run_dir = tmp_path / "m1"
    done = train_memory_one(run_dir, "{kind: mlflow}")
    series, evals = expected(run_dir)
    run, history = mlflow_values(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "m1"
    for column, by_step in series.items():
        assert history[column] == by_step, column  # every step, the same float
    assert len(series["loss"]) == 40 and "p_first" in series
    last = max(series["loss"])
    assert {k: history[k] for k in evals} == {k: {last: v} for k, v in evals.items()}
    assert run.data.params["hyper.lr"] == "0.2" and run.data.params["hp.lr"] == "0.2"
    assert run.data.params["memory_one.init_coop"] == "0.97"
    assert run.data.tags["eval/version"] == "final"
    assert f"tracking: MLflow sqlite:///{run_dir.resolve()}" in done.stdout


def test_wandb_offline_run_holds_train_log_numbers(tmp_path: Path) -> None:
    run_dir = tmp_path / "m1"
    done = train_memory_one(run_dir, "{kind: wandb, project: tests}")
    series, evals = expected(run_dir)
    (log_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(log_file)
    history = [r["history"] for r in records if r["type"] == "history"]
    got = {int(h["step"]["num"]): h["item"] for h in history}
    assert sorted(got) == sorted(series["loss"])
    for column, by_step in series.items():
        assert {s: got[s][column] for s in by_step} == by_step, column
    last = max(got)
    assert {k: got[last][k] for k in evals} == evals
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "tests" and run["display_name"] == "m1"
    assert run["telemetry"]["feature"]["offline"] is True  # no key: nothing went to a server
    assert run["config"]["update"]["hyper"] == {"lr": 0.2, "batch_size": 8}
    assert "W&B offline run in" in done.stdout and "wandb sync" in done.stdout


def wandb_records(log_file: Path) -> list[dict[str, Any]]:
    """The records of a ``.wandb`` log, read by W&B's own reader (offline)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)],
        env={**ENV, "WANDB_MODE": "offline"},
        capture_output=True,
        text=True,
        timeout=60 * load_factor(),
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_tensorboard_event_files_hold_train_log_numbers(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "m1"
    done = train_memory_one(run_dir, "{kind: tensorboard}")
    series, evals = expected(run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for column, by_step in series.items():
        got = {e.step: e.value for e in events.Scalars(column)}
        # the event files keep float32: the CSV's number rounded to float32, exactly
        assert got == {s: float(np.float32(v)) for s, v in by_step.items()}, column
    last = max(series["loss"])
    for key, value in evals.items():
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (last, float(np.float32(value)))
        ]
    (config_text,) = events.Tensors("config/text_summary")
    assert '"init_coop": 0.97' in config_text.tensor_proto.string_val[0].decode()
    assert "tensorboard --logdir" in done.stdout


async def test_lora_run_logs_steps_evaluations_and_adapter_versions_to_mlflow(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """The loop: each step's row, the evaluation, and each adapter version's files and digest."""
    data = tiny_config_data(tiny_qwen_model, tracking={"kind": "mlflow", "adapters": "files"})
    config = parse_train_config(data)
    learners = [
        LocalAgent(p, model=str(tiny_qwen_model), device=TEST_DEVICE, policy="pol", seed=i)
        for i, p in enumerate(config.players)
    ]
    players: list[Agent] = [*learners, *agents(("tft", "tit-for-tat"))]
    run_dir = tmp_path / "run"
    async with stack(broker, tmp_path / "runs", players):
        result = await train(config, run_dir, identity(broker, "trainer-t", "trainer"))
    assert result.version == "v2"
    series, evals = expected(run_dir)
    run, history = mlflow_values(run_dir)
    assert run.info.status == "FINISHED"
    for column, by_step in series.items():
        assert history[column] == by_step, column
    assert {k: history[k] for k in evals} == {k: {1: v} for k, v in evals.items()}
    assert set(evals) >= {"eval/tft/learner", "eval/self/opponent", "eval/tft/cooperation_rate"}
    assert run.data.tags["version"] == "v2" and run.data.params["lora.rank"] == "4"
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    for step, version in ((0, "v1"), (1, "v2")):
        got = client.download_artifacts(run.info.run_id, f"adapters/{version}.json", str(tmp_path))
        ref = json.loads(Path(got).read_text())
        sha, size = adapter_digest(run_dir / "adapters" / version)
        assert ref == {
            "version": version,
            "step": step,
            "path": str((run_dir / "adapters" / version).resolve()),
            "sha256": sha,
            "size": size,
        }
        files = {
            Path(f.path).name for f in client.list_artifacts(run.info.run_id, f"adapters/{version}")
        }
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    state = json.loads((run_dir / "tracking.json").read_text())
    assert (
        state["rows_through"] == 1 and state["evaluations_through"] == 1 and state["failures"] == 0
    )


# --- failures, resume, missing libraries, bad config ---


async def test_the_loop_stops_before_the_bus_when_its_tracker_cannot_open(
    tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """No broker here: the tracker's error comes first, as the trainer's own, and no step runs."""
    tracking = {"kind": "mlflow", "uri": "nosuchscheme://x"}
    config = parse_train_config(tiny_config_data(tiny_qwen_model, tracking=tracking))
    nowhere = BusConfig(host="127.0.0.1", port=9, username="trainer-t", password="x")
    with pytest.raises(TrainError, match=r"tracking: \{kind: mlflow\} could not start"):
        await train(config, tmp_path / "run", nowhere)
    assert not (tmp_path / "run" / "train_log.csv").exists()


def rows(steps: range) -> list[dict[str, Any]]:
    return [
        {"step": s, "loss": 1.0 / (s + 1), "version": f"v{s + 1}", "cooperation_rate": float("nan")}
        for s in steps
    ]


def test_a_failing_tracker_is_said_counted_and_retried_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow refuses to log to a deleted run: the rows wait, the failure is logged and
    counted, and once the run is restored they arrive, each step once."""
    tracking = open_tracking(MlflowSpec(kind="mlflow"), tmp_path, {"run": "t"})
    tracker: Any = tracking.tracker
    tracking.rows(rows(range(0, 2)))
    tracker.client.delete_run(tracker.run_id)
    with caplog.at_level(logging.WARNING, logger="backroom.tracking"):
        tracking.rows(rows(range(2, 4)))  # no exception: training goes on
    assert tracking.failures == 1
    assert (
        "logging rows of step 2 to 3 failed" in caplog.text
        and "1 tracking failure(s)" in caplog.text
    )
    tracker.client.restore_run(tracker.run_id)
    tracking.rows(rows(range(4, 5)))  # the queue first, in order, then this one
    tracking.close()
    history = tracker.client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert (
        "cooperation_rate" not in tracker.client.get_run(tracker.run_id).data.metrics
    )  # NaN: a gap
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert state["failures"] == 1 and state["rows_through"] == 4
    assert "1 tracking call(s) failed" in (tracking_summary(tmp_path) or "")


def test_resume_continues_the_same_run_and_sends_only_what_it_lacks(tmp_path: Path) -> None:
    """A resumed run logs to the run ``tracking.json`` names, from the rows the files hold past its mark."""
    log = tmp_path / "train_log.csv"
    log.write_text(
        "step,loss,version\n" + "".join(f"{s},{1.0 / (s + 1)},v{s + 1}\n" for s in range(3))
    )
    first = open_tracking(MlflowSpec(kind="mlflow"), tmp_path, {"run": "t"})
    first.catch_up(tmp_path)
    first.close(KeyboardInterrupt())
    run_id: Any = getattr(first.tracker, "run_id", None)
    client: Any = getattr(first.tracker, "client", None)
    assert client.get_run(run_id).info.status == "KILLED"  # Ctrl-C, as MLflow says it
    with log.open("a") as f:  # steps the killed trainer logged to its files, not to the tracker
        f.write("".join(f"{s},{1.0 / (s + 1)},v{s + 1}\n" for s in range(3, 5)))
    again = open_tracking(MlflowSpec(kind="mlflow"), tmp_path, {"run": "t"})
    assert getattr(again.tracker, "run_id", None) == run_id
    again.catch_up(tmp_path)
    again.close()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2, 3, 4]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.tags["version"] == "v5"


def test_wandb_adapter_versions_are_artifacts_with_their_digest(tmp_path: Path) -> None:
    folder = tmp_path / "adapters" / "v1"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    os.environ.pop("WANDB_API_KEY", None)
    tracking = open_tracking(
        WandbSpec(kind="wandb", project="tests"),
        tmp_path,
        {"run": "t"},
        adapters_dir=tmp_path / "adapters",
    )
    tracking.rows(rows(range(1)))
    tracking.close()
    assert tracking.failures == 0
    (log_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    (artifact,) = [r["artifact"] for r in wandb_records(log_file) if r["type"] == "artifact"]
    sha, size = adapter_digest(folder)
    assert artifact["type"] == "lora-adapter" and "v1" in artifact["aliases"]
    assert json.loads(artifact["metadata"]) == {
        "version": "v1",
        "step": 0,
        "path": str(folder.resolve()),
        "sha256": sha,
        "size": size,
    }
    refs = {Path(c["path"]).name: c["ref"] for c in artifact["manifest"]["contents"]}
    assert (
        refs["adapter_model.safetensors"]
        == (folder / "adapter_model.safetensors").resolve().as_uri()
    )


@pytest.mark.parametrize(
    ("kind", "module", "extra"),
    [
        ("mlflow", "sqlalchemy", "mlflow"),
        ("wandb", "wandb", "wandb"),
        ("tensorboard", "tensorboard", "tensorboard"),
    ],
)
def test_a_missing_client_library_names_the_extra_before_training(
    tmp_path: Path, kind: str, module: str, extra: str
) -> None:
    """``backroom train`` with the library's import blocked: one line naming the extra, no run."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; "
        "from backroom.cli import app; sys.argv = ['backroom', *sys.argv[1:]]; app()"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "train",
            str(MEMORY_ONE),
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            f"tracking={{kind: {kind}}}",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120 * load_factor(),
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert (
        f'tracking: {{kind: {kind}}} needs the "{extra}" extra ({module} not installed)' in said
    ), said
    assert f"[{extra}]" in said and "Traceback" not in said
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_open_tracking_without_the_library_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API (a league's loop) gets the same advice as the CLI."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TrackingError, match=r"pip install 'backroom\[wandb\]'"):
        open_tracking(WandbSpec(kind="wandb"), tmp_path, {"run": "t"})


def test_a_tracker_that_cannot_open_stops_the_run_before_it_trains(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "backroom",
            "train",
            MEMORY_ONE,
            "--run-dir",
            tmp_path / "r",
            "--set",
            "tracking={kind: mlflow, uri: 'nosuchscheme://x'}",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120 * load_factor(),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: tracking: {kind: mlflow} could not start" in done.stdout, done.stdout
    assert not (tmp_path / "r" / "train_log.csv").exists()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ("tracking={kind: mlfow}", "tracking: Input tag 'mlfow' found using 'kind' does not match"),
        (
            "tracking={kind: tensorboard, uri: x}",
            "tracking.tensorboard.uri: Extra inputs are not permitted",
        ),
        (
            "tracking={kind: wandb, mode: away}",
            "tracking.wandb.mode: Input should be 'online' or 'offline'",
        ),
        (
            "tracking={kind: mlflow, adapters: all}",
            "tracking.mlflow.adapters: Input should be 'reference' or 'files'",
        ),
        ("tracking=mlflow", "tracking: Input should be a valid dictionary"),
    ],
)
def test_bad_tracking_config_names_the_field(edit: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_train_config(MEMORY_ONE, [edit])
    assert words in str(info.value)


def test_tracking_is_refused_for_dpo() -> None:
    with pytest.raises(ConfigError, match="tracking: not for algorithm dpo"):
        parse_train_config(
            {
                "game": "ipd",
                "algorithm": "dpo",
                "dpo": {"source": "runs/x"},  # the block dpo needs, so tracking is what is refused
                "tracking": {"kind": "tensorboard"},
            }
        )
