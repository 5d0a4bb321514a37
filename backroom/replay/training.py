"""A training run, read for the replay: the trainer's store and its ``train_log.csv``.

``backroom train`` keeps every match it asked for in ``store.sqlite``
(``backroom.trainer.store``): the request (its step, CRN group and kind,
``train`` or ``eval``), the episode record, and the traces of its trained
seats. The replay reads that file read-only (SQLite's ``mode=ro``), never
through the trainer's own classes: the trainer sits above this layer, and a
viewer must not take the write lock a running trainer needs. The tables and
columns read here are the store's schema of ``backroom/trainer/store.py``.

Each step's row of ``train_log.csv`` lists the matches requested for that step
(``requests.step``) and, where the store says so, the step whose update used
them (``episodes.used_step``).
"""

from __future__ import annotations

import csv
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def connect_ro(store: Path) -> sqlite3.Connection:
    """The store, read-only: a replay never blocks or changes a trainer writing it."""
    return sqlite3.connect(f"file:{store}?mode=ro", uri=True, check_same_thread=False)


def store_episodes(
    store: Path, after: int
) -> Iterator[tuple[int, dict[str, Any], int | None, str | None]]:
    """(rowid, record, step, kind) of each stored episode past ``after``, in arrival order."""
    db = connect_ro(store)
    try:
        rows = db.execute(
            "SELECT e.rowid, e.record, r.step, r.kind FROM episodes e"
            " LEFT JOIN requests r ON r.match = e.match WHERE e.rowid > ? ORDER BY e.rowid",
            (after,),
        )
        for rowid, text, step, kind in rows:
            try:
                record = json.loads(text)
            except ValueError:
                record = None
            if isinstance(record, dict):
                yield rowid, record, step, kind
    finally:
        db.close()


def store_trace_keys(store: Path, after: float) -> list[tuple[str, int, int, str, float]]:
    """(match, turn, seat, agent, received) of traces stored after time ``after``."""
    db = connect_ro(store)
    try:
        return list(
            db.execute(
                "SELECT match, turn, seat, agent, received FROM traces WHERE received > ?"
                " ORDER BY received",
                (after,),
            )
        )
    finally:
        db.close()


def store_record(store: Path, match: str) -> dict[str, Any] | None:
    db = connect_ro(store)
    try:
        row = db.execute("SELECT record FROM episodes WHERE match = ?", (match,)).fetchone()
    finally:
        db.close()
    if row is None:
        return None
    record = json.loads(row[0])
    return record if isinstance(record, dict) else None


def store_traces(store: Path, match: str) -> dict[tuple[int, int], dict[str, Any]]:
    db = connect_ro(store)
    try:
        rows = db.execute("SELECT turn, seat, trace FROM traces WHERE match = ?", (match,))
        return {(turn, seat): json.loads(text) for turn, seat, text in rows}
    finally:
        db.close()


def used_steps(store: Path) -> dict[int, int]:
    """Per requested step, how many of its episodes fed an update (``episodes.used_step``)."""
    db = connect_ro(store)
    try:
        rows = db.execute(
            "SELECT r.step, count(e.used_step) FROM requests r"
            " JOIN episodes e ON e.match = r.match GROUP BY r.step"
        )
        return {step: n for step, n in rows}
    finally:
        db.close()


def train_log(run_dir: Path) -> list[dict[str, str]]:
    """The rows of ``train_log.csv`` (empty when the run has logged no step yet)."""
    path = run_dir / "train_log.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [dict(r) for r in csv.DictReader(f)]
