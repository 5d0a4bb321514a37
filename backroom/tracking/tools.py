"""The three tools' clients behind one protocol (``Tracker``): MLflow's ``MlflowClient``, W&B's
``wandb.init`` run, TensorBoard's ``SummaryWriter``; each imported when its tracker opens."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

from backroom.tracking.specs import MlflowSpec, TensorboardSpec, WandbSpec


class Opening(NamedTuple):
    """Where a tracker opens: the run directory, the config to log, the run's name, the
    tracker's id of the run to continue (None: a new one), and the title the runs of one
    config share (the training run's or the league's name: MLflow's experiment, W&B's group)."""

    run_dir: Path
    config: Mapping[str, Any]
    name: str
    run_id: str | None
    title: str


#: One step's metrics and strings (``split_values``).
Record = tuple[int, Mapping[str, float], Mapping[str, str]]

#: How a run ended: ``close``'s error, as each tool says it.
Status = Literal["finished", "failed", "killed"]


class Tracker(Protocol):
    """One tool's client, opened on one run; ``Tracking`` guards and orders its calls."""

    run_id: str  # to continue the same run on --resume
    where: str  # for people: where to look

    def log(self, records: Sequence[Record]) -> None: ...

    def adapter(self, step: int, version: str, folder: Path, ref: Mapping[str, Any]) -> None: ...

    def files(self, step: int, group: str, refs: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self, status: Status) -> None: ...


def flat(data: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"hyper": {"lr": 1}}`` as ``{"hyper.lr": 1}`` (lists stay whole)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}{sep}", sep))
        else:
            out[f"{prefix}{key}"] = value
    return out


def split_values(row: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """A row's finite numbers (the metrics) and its strings (``version``).

    Not-a-number (``cooperation_rate`` outside the IPD, an evaluation without
    moves) is left out: a gap in the tool's curve, not a point at NaN.
    """
    numbers, texts = {}, {}
    for key, value in row.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            if math.isfinite(value):
                numbers[key] = float(value)
        elif isinstance(value, str):
            texts[key] = value
    return numbers, texts


def file_ref(path: Path) -> dict[str, Any]:
    """A file as a reference: where it is, its sha256 and size (what TensorBoard keeps of it)."""
    data = path.read_bytes()
    return {
        "name": path.name,
        "path": str(path.resolve()),
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }


class MlflowTracker:
    """MLflow's ``MlflowClient``: rows and evaluations as metrics, the config as params and
    ``config.json``, adapters under ``adapters/``; the version as the run's tag."""

    def __init__(self, spec: MlflowSpec, at: Opening) -> None:
        run_dir, config, name, run_id, title = at
        # a local store is nobody else's business: MLflow's usage telemetry stays off
        # unless the environment says otherwise
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # its log lines go where the trainer's go (RUN_DIR/logs/trainer.log), not to stderr
        os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param, RunTag

        self._metric, self._tag = Metric, RunTag
        self.spec = spec
        store = run_dir.resolve() / "mlflow"
        if spec.uri is None:
            store.mkdir(parents=True, exist_ok=True)
        uri = spec.uri or f"sqlite:///{store / 'mlflow.db'}"
        self.client = client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            experiment = spec.experiment or title
            found = client.get_experiment_by_name(experiment)
            exp_id = (
                found.experiment_id
                if found
                else client.create_experiment(
                    experiment, artifact_location=None if spec.uri else str(store / "artifacts")
                )
            )
            run = client.create_run(
                exp_id,
                run_name=spec.name or name,
                tags={"backroom.run_dir": str(run_dir.resolve())},
            )
            self.run_id = run.info.run_id
            params = [Param(k, _param(v)) for k, v in flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes 100 params a batch
                client.log_batch(self.run_id, params=params[i : i + 100])
            client.log_dict(self.run_id, dict(config), "config.json")
        self.where = f"MLflow {uri}, run {self.run_id}" + (
            f" (mlflow ui --backend-store-uri {uri})" if spec.uri is None else ""
        )

    def log(self, records: Sequence[Record]) -> None:
        now = int(time.time() * 1000)
        metrics = [
            self._metric(k, v, now, step)
            for step, numbers, _ in records
            for k, v in numbers.items()
        ]
        latest = {k: v for _, _, texts in records for k, v in texts.items()}  # a tag holds one
        for i in range(0, max(len(metrics), 1), 1000):  # and 1000 metrics
            tags = [self._tag(k, v) for k, v in latest.items()] if i == 0 else []
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000], tags=tags)

    def adapter(self, step: int, version: str, folder: Path, ref: Mapping[str, Any]) -> None:
        if self.spec.adapters == "files":
            self.client.log_artifacts(self.run_id, str(folder), f"adapters/{version}")
        self.client.log_dict(self.run_id, dict(ref), f"adapters/{version}.json")

    def files(self, step: int, group: str, refs: Sequence[Mapping[str, Any]]) -> None:
        for ref in refs:
            self.client.log_artifact(self.run_id, ref["path"], group)

    def close(self, status: Status) -> None:
        self.client.set_terminated(self.run_id, status=status.upper())


class WandbTracker:
    """``wandb.init``'s run: rows and evaluations in its history (the version as a string
    there), the config as its config, each adapter version an artifact (alias = version)."""

    def __init__(self, spec: WandbSpec, at: Opening) -> None:
        run_dir, config, name, run_id, title = at
        mode = (
            spec.mode
            or os.environ.get("WANDB_MODE")
            or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        )
        if mode == "offline":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # offline is offline
        import wandb

        self._wandb, self.spec = wandb, spec
        folder = Path(spec.dir) if spec.dir else run_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            name=spec.name or name,
            group=title,
            dir=str(folder),
            config=dict(config),
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(mode=mode, silent=True, console="off"),  # type: ignore[arg-type]
        )
        self.run_id = self.run.id
        self.title = title
        sync_dir = Path(self.run.dir).parent
        self.where = (
            f"W&B offline run in {sync_dir} (upload: wandb sync {sync_dir})"
            if mode == "offline"
            else f"W&B {self.run.url}"
        )

    def log(self, records: Sequence[Record]) -> None:
        for step, numbers, texts in records:
            self.run.log({**numbers, **texts}, step=step)

    def adapter(self, step: int, version: str, folder: Path, ref: Mapping[str, Any]) -> None:
        art = self._wandb.Artifact(f"{self.title}-adapter", type="lora-adapter", metadata=dict(ref))
        if self.spec.adapters == "files":
            art.add_dir(str(folder))
        else:
            art.add_reference(folder.resolve().as_uri())
        self.run.log_artifact(art, aliases=[version])

    def files(self, step: int, group: str, refs: Sequence[Mapping[str, Any]]) -> None:
        """One artifact of the files (alias: the step), their references as its metadata."""
        meta = {"step": step, "files": list(refs)}
        art = self._wandb.Artifact(f"{self.title}-{group}", type=group, metadata=meta)
        for ref in refs:
            art.add_file(ref["path"], name=ref["name"])
        self.run.log_artifact(art, aliases=[f"step-{step}"])

    def close(self, status: Status) -> None:
        self.run.finish(exit_code={"finished": 0, "failed": 1, "killed": 130}[status])


class TensorboardTracker:
    """Event files through ``torch.utils.tensorboard.SummaryWriter``: scalars by step, the
    config and each adapter's or file's reference as text (TensorBoard keeps no files)."""

    def __init__(self, spec: TensorboardSpec, at: Opening) -> None:
        run_dir, config, _name, run_id, _title = at
        from torch.utils.tensorboard import SummaryWriter

        logdir = Path(spec.dir) if spec.dir else run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(logdir))
        self.run_id = str(logdir.resolve())
        self.where = f"TensorBoard event files in {logdir} (tensorboard --logdir {logdir})"
        if run_id is None:
            self.writer.add_text("config", _code(json.dumps(dict(config), indent=2)), 0)
            self.writer.flush()

    def log(self, records: Sequence[Record]) -> None:
        for step, numbers, texts in records:
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, step)
            for key, text in texts.items():
                self.writer.add_text(key, text, step)
        self.writer.flush()  # a killed run keeps what it logged

    def adapter(self, step: int, version: str, folder: Path, ref: Mapping[str, Any]) -> None:
        self.writer.add_text("adapters", _code(json.dumps(dict(ref), indent=2)), step)
        self.writer.flush()

    def files(self, step: int, group: str, refs: Sequence[Mapping[str, Any]]) -> None:
        self.writer.add_text(group, _code(json.dumps(list(refs), indent=2)), step)
        self.writer.flush()

    def close(self, status: Status) -> None:
        self.writer.close()


#: MLflow's longest param value (its store refuses a longer one, and the run with it).
PARAM_CHARS = 6000


def _param(value: Any) -> str:
    """A config value as an MLflow param; one too long for it (a league's entrants) is cut,
    saying so: the whole config is ``config.json`` beside it."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) <= PARAM_CHARS:
        return text
    note = f" ... ({len(text)} characters: config.json holds it whole)"
    return text[: PARAM_CHARS - len(note)] + note


def _code(text: str) -> str:
    """Markdown (TensorBoard's text plugin) that shows ``text`` as it is."""
    return "\n".join("    " + line for line in text.splitlines())


TRACKERS: dict[str, Any] = {
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
    "tensorboard": TensorboardTracker,
}
