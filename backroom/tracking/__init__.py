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
use it (the league sits below the trainer). specs.py holds the ``tracking:``
block, tools.py the three clients; this module guards and orders their calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from backroom.tracking.specs import (
    MlflowSpec,
    TensorboardSpec,
    TrackingError,
    TrackingSpec,
    WandbSpec,
    require_client,
    required_modules,
)
from backroom.tracking.tools import (
    TRACKERS,
    Opening,
    Status,
    Tracker,
    file_ref,
    flat,
    split_values,
)

__all__ = [
    "STATE_FILE",
    "MlflowSpec",
    "TensorboardSpec",
    "Tracker",
    "Tracking",
    "TrackingError",
    "TrackingSpec",
    "WandbSpec",
    "flat",
    "open_tracking",
    "require_client",
    "required_modules",
    "split_values",
    "tracking_summary",
]

log = logging.getLogger("backroom.tracking")

STATE_FILE = "tracking.json"


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
