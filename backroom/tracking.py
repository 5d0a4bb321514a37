"""Experiment tracking: a run's figures, config and files, sent to MLflow, Weights & Biases
or TensorBoard through each tool's own client; shared by ``backroom train``
(trainer/tracking.py: ``train_log.csv`` rows, evaluations, adapter versions) and
``backroom league`` (league/tracking.py: ratings per standings flush, the final standings).

Off unless the config asks (``tracking: {kind: mlflow | wandb | tensorboard, ...}``).
The files of the run directory stay the record; a tracker is a copy for people
who live in that tool. So a tracking call that fails neither stops the work nor
passes unseen: it is logged as a warning naming what failed, counted
(``Tracking.failures``, and ``failures`` in ``RUN_DIR/tracking.json``), and
the records it did not take are sent again with the next call's. Opening the
tracker is different: it happens before the work starts, so a bad URI or a
missing client library stops it at once (``TrackingError``).

``RUN_DIR/tracking.json`` says which tracker run this directory logs to and how
far each stream of records got (``rows_through``: the last step sent).
Opening it again with the same spec continues that run (``--resume``).

Low in the layers: it imports nothing of backroom, so every package above may
use it (the league sits below the trainer).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("backroom.tracking")

STATE_FILE = "tracking.json"


class MlflowSpec(BaseModel):
    """``tracking: {kind: mlflow}`` (backroom/tracking.py; docs/training.md says what goes where)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["mlflow"]
    uri: str | None = Field(
        default=None,
        description="tracking URI (http://host:5000, sqlite:///path.db, databricks); "
        "default: a SQLite store in RUN_DIR/mlflow/",
    )
    experiment: str | None = Field(
        default=None, description="default: the config's run (league: its league)"
    )
    name: str | None = Field(default=None, description="the run's name; default RUN_DIR's name")
    adapters: Literal["reference", "files"] = Field(
        default="reference",
        description="each adapter version as a reference (path, sha256) or its files",
    )


class WandbSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["wandb"]
    project: str = "backroom"
    entity: str | None = None
    mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="default: WANDB_MODE, else online with WANDB_API_KEY set, else offline",
    )
    dir: str | None = Field(default=None, description="where wandb/ goes; default RUN_DIR")
    name: str | None = Field(default=None, description="the run's name; default RUN_DIR's name")
    adapters: Literal["reference", "files"] = "reference"


class TensorboardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["tensorboard"]
    dir: str | None = Field(
        default=None, description="event files' folder; default RUN_DIR/tensorboard"
    )


TrackingSpec = Annotated[MlflowSpec | WandbSpec | TensorboardSpec, Field(discriminator="kind")]


class TrackingError(RuntimeError):
    """The tracker could not be opened (the work has not started)."""


def required_modules(spec: TrackingSpec) -> tuple[str, ...]:
    """What the tool's client needs, for ``require_extra`` (the extra is named after the kind)."""
    if isinstance(spec, MlflowSpec):
        # mlflow-skinny has no SQL store of its own; the default store is SQLite
        local = spec.uri is None or spec.uri.startswith(("sqlite", "postgresql", "mysql", "mssql"))
        return ("mlflow", "sqlalchemy", "alembic") if local else ("mlflow",)
    if isinstance(spec, WandbSpec):
        return ("wandb",)
    return ("tensorboard", "torch")


def require_client(spec: TrackingSpec | None) -> None:
    """Refuse before anything is written when the tool's client is not installed (find_spec,
    not import: the clients take seconds to import)."""
    if spec is None:
        return
    missing = [m for m in required_modules(spec) if importlib.util.find_spec(m) is None]
    if missing:
        raise TrackingError(
            f'tracking: {{kind: {spec.kind}}} needs the "{spec.kind}" extra '
            f"({', '.join(missing)} not installed): pip install 'backroom[{spec.kind}]' "
            "(or backroom[tracking] for all three)"
        )


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


T = TypeVar("T", bound="Tracking")


class Tracking:
    """A tracker's calls, guarded: a failure is logged and counted, never raised.

    Records go in streams (the trainer's ``rows`` and ``evaluations``, the
    league's ``standings``), each sent in step order, each step at most once:
    those at or before the last step sent are skipped, and those a failed call
    did not take go again with the next call (``tracking.json`` keeps the marks).
    """

    def __init__(self, tracker: Tracker | None, kind: str, state_path: Path, work: str) -> None:
        self.tracker, self.kind, self.state_path = tracker, kind, state_path
        self.work = work  # what goes on when a call fails ("training", "the league")
        self.state: dict[str, Any] = {"failures": 0}
        #: per stream, what a failed call did not take, sent again (first) with the next one
        self._queues: dict[str, list[Mapping[str, Any]]] = {}

    @property
    def failures(self) -> int:
        return int(self.state["failures"])

    @contextmanager
    def attempt(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # any client's error: the work goes on, said and counted
            self.state["failures"] = self.failures + 1
            log.warning(
                "tracking (%s): %s failed: %s: %s; %s goes on, the run directory's files "
                "keep it (%d tracking failure(s) in this run)",
                self.kind,
                what,
                type(exc).__name__,
                exc,
                self.work,
                self.failures,
            )
        self._save()

    def _save(self) -> None:
        if self.tracker is None:
            return
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.replace(self.state_path)

    def send(
        self,
        stream: str,
        records: Sequence[Mapping[str, Any]],
        values: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda r: r,
    ) -> list[Mapping[str, Any]]:
        """Queue the records (each with its ``step``) past the stream's mark, send the queue in
        one call (``values`` of each: its finite numbers as metrics); what was sent.

        One call for many records: MLflow writes them in one transaction (a
        memory-one run's 400 rows take a second, not twenty).
        """
        if self.tracker is None:
            return []
        queue = self._queues.setdefault(stream, [])
        mark = int(self.state.get(f"{stream}_through", -1))
        last = max([int(r["step"]) for r in queue], default=mark)
        queue += [r for r in records if int(r["step"]) > last]
        if not queue:
            return []
        batch = [
            (int(r["step"]), *split_values({k: v for k, v in values(r).items() if k != "step"}))
            for r in queue
        ]
        steps = f"step {batch[0][0]}" + (f" to {batch[-1][0]}" if len(batch) > 1 else "")
        with self.attempt(f"logging {stream} of {steps}"):
            self.tracker.log(batch)
            self.state[f"{stream}_through"] = batch[-1][0]
            sent, queue[:] = list(queue), []
            return sent
        return []  # kept for the next call, in order

    def files(self, step: int, group: str, paths: Sequence[Path]) -> None:
        """Files of the run directory (those that exist) as artifacts under ``group``, or as
        references where the tool keeps no files (TensorBoard)."""
        if self.tracker is None:
            return
        with self.attempt(f"logging {group} ({len(paths)} file(s))"):
            refs = [file_ref(p) for p in paths if p.is_file()]
            if refs:
                self.tracker.files(step, group, refs)

    def close(self, error: BaseException | None = None) -> None:
        """End the tracker's run (failed on ``error``, killed on Ctrl-C); say what tracking did."""
        if self.tracker is None:
            return
        status: Status = "finished"
        if isinstance(error, KeyboardInterrupt | asyncio.CancelledError):
            status = "killed"
        elif error is not None:
            status = "failed"
        with self.attempt("closing the run"):
            self.tracker.close(status)
        left = sum(len(q) for q in self._queues.values())
        if self.failures or left:
            log.warning(
                "tracking (%s): %d call(s) failed, %d record(s) not sent; %s",
                self.kind,
                self.failures,
                left,
                self.state.get("where", ""),
            )
        else:
            log.info("tracking (%s): %s", self.kind, self.state.get("where", ""))


def open_tracking(
    spec: TrackingSpec | None,
    run_dir: Path,
    config: Mapping[str, Any],
    make: type[T],
    name: str | None = None,
    title: str = "backroom",
    work: str = "training",
) -> T:
    """A ``make`` (``Tracking`` or a subclass) on the tracker of ``spec`` in ``run_dir``
    (continuing the run its ``tracking.json`` names), with ``config`` logged once; no
    tracker (every call a no-op) when ``spec`` is None.

    Blocking (clients start, stores open): call it in a worker thread from async code.
    """
    state_path = run_dir / STATE_FILE
    if spec is None:
        return make(None, "off", state_path, work)
    previous: dict[str, Any] = {}
    if state_path.exists():
        try:
            previous = json.loads(state_path.read_text())
        except (OSError, ValueError):
            previous = {}
    same = previous.get("kind") == spec.kind and previous.get("spec") == spec.model_dump()
    try:
        run_id = previous.get("run_id") if same else None
        at = Opening(run_dir, config, name or run_dir.resolve().name, run_id, title)
        tracker: Tracker = TRACKERS[spec.kind](spec, at)
    except ImportError as exc:
        modules = ", ".join(required_modules(spec))
        raise TrackingError(
            f"tracking: {{kind: {spec.kind}}} needs {modules} ({exc}): pip install 'backroom[{spec.kind}]' "
            "(or backroom[tracking] for all three)"
        ) from None
    except Exception as exc:
        raise TrackingError(
            f"tracking: {{kind: {spec.kind}}} could not start: {type(exc).__name__}: {exc}"
        ) from None
    tracking = make(tracker, spec.kind, state_path, work)
    if same:
        kept = [k for k in previous if k.endswith("_through") or k == "failures"]
        tracking.state.update({k: previous[k] for k in kept})
    tracking.state.update(
        kind=spec.kind, spec=spec.model_dump(), run_id=tracker.run_id, where=tracker.where
    )
    tracking._save()
    log.info("tracking (%s): %s", spec.kind, tracker.where)
    return tracking


def tracking_summary(run_dir: Path, logs: str = "logs/trainer.log") -> str | None:
    """One line for the terminal at the end of a run: where tracking went and what failed."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    failures = int(state.get("failures", 0))
    return f"tracking: {state.get('where', '?')}" + (
        f"; {failures} tracking call(s) failed (see {logs})" if failures else ""
    )
