"""Experiment tracking of ``backroom train``: ``train_log.csv`` rows, evaluations and adapter
versions, through the tool-generic tracking of ``backroom/tracking/`` (which says
what a failure does, and how ``tracking.json`` continues a run on ``--resume``).

``Tracking.catch_up`` sends what the files hold beyond the marks (the rows of a
trainer killed before it logged them; all of them when tracking is turned on for
a resumed run). Reusable by any loop that writes rows: ``open_tracking(spec,
run_dir, config, name)`` and then ``rows(...)``, ``evaluations(...)``, ``close()``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from backroom import tracking as generic
from backroom.model.adapters import adapter_digest
from backroom.tracking import TrackingError, TrackingSpec, flat, required_modules, tracking_summary

__all__ = [
    "Tracking",
    "TrackingError",
    "open_tracking",
    "read_evaluations",
    "read_rows",
    "required_modules",
    "tracking_summary",
]


class Tracking(generic.Tracking):
    """The generic tracking plus the trainer's streams: ``rows`` (``train_log.csv``) with the
    adapter version each names, and ``evaluations`` (``evaluations.jsonl``)."""

    adapters_dir: Path | None = None

    def rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """``train_log.csv`` rows (each with its ``step``) as metrics, and the adapter of
        each row's ``version`` found under ``adapters_dir``."""
        sent = self.send("rows", rows)
        for row in sent:
            with self.attempt(f"logging adapter {row.get('version')} of step {row['step']}"):
                self._adapter(int(row["step"]), row.get("version"))

    def evaluations(self, results: Sequence[Mapping[str, Any]]) -> None:
        """``evaluations.jsonl`` records, every number under ``eval/`` (``eval/tft/learner``),
        at the step they follow."""

        def values(result: Mapping[str, Any]) -> dict[str, Any]:
            flat_ = flat({k: v for k, v in result.items() if k != "step"}, sep="/")
            return {f"eval/{k.removeprefix('against/')}": v for k, v in flat_.items()}

        self.send("evaluations", results, values)

    def _adapter(self, step: int, version: Any) -> None:
        """The adapter a row names, when its folder is here: a reference (path, sha256, size),
        and its files where the spec asks."""
        if self.tracker is None or not isinstance(version, str) or self.adapters_dir is None:
            return
        folder = self.adapters_dir / version
        if not folder.is_dir():
            return
        sha, size = adapter_digest(folder)
        ref = {
            "version": version,
            "step": step,
            "path": str(folder.resolve()),
            "sha256": sha,
            "size": size,
        }
        self.tracker.adapter(step, version, folder, ref)

    def catch_up(self, run_dir: Path) -> None:
        """Send what ``train_log.csv`` and ``evaluations.jsonl`` hold past the marks."""
        if self.tracker is None:
            return
        self.rows(read_rows(run_dir / "train_log.csv"))
        self.evaluations(read_evaluations(run_dir / "evaluations.jsonl"))


def open_tracking(
    spec: TrackingSpec | None,
    run_dir: Path,
    config: Mapping[str, Any],
    name: str | None = None,
    adapters_dir: Path | None = None,
) -> Tracking:
    """The tracker of ``spec`` on ``run_dir`` (continuing the run its ``tracking.json``
    names), with ``config`` logged once; no tracker (every call a no-op) when ``spec`` is None.

    Blocking (clients start, stores open): call it in a worker thread from async code.
    """
    title = str(config.get("run", "backroom"))
    tracking = generic.open_tracking(spec, run_dir, config, Tracking, name, title, "training")
    tracking.adapters_dir = adapters_dir
    return tracking


def _number(text: str) -> Any:
    """A CSV cell as the value written (Python's float repr reads back exactly)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def read_rows(path: Path) -> list[dict[str, Any]]:
    """``train_log.csv``'s rows with numbers as numbers (rows without a step are skipped)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [
            {k: _number(v) for k, v in r.items() if v not in ("", None)}
            for r in csv.DictReader(f)
            if (r.get("step") or "").isdigit()
        ]


def read_evaluations(path: Path) -> list[dict[str, Any]]:
    """``evaluations.jsonl``'s records (a torn last line is skipped, as the loop skips it)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in out if isinstance(r, dict) and isinstance(r.get("step"), int)]
