"""The league's record: scheduled matches and their results in one SQLite file (WAL).

The trainer store's discipline (backroom/trainer/store.py): WAL mode, so
``backroom league show`` and the web page read while the league writes; one
connection, explicit ``BEGIN IMMEDIATE`` transactions. Each scheduled match
has a key (``schedule.Slot.key``) and its result is a row under that key,
inserted with ``INSERT OR IGNORE``: a match is counted once however many
episodes of it arrive (a rerun after a referee died, the same match played
again after a SIGKILL and ``--resume``). Duplicates are counted, not stored.

Results are committed in groups (``flush``, every ``FLUSH_S`` while the league
plays) rather than one fsync per match: a result lost to a SIGKILL is a match
without a row, which ``--resume`` plays again, so losing one costs a replay,
never a double count. The referee's episodes.jsonl keeps every episode.

A voided or errored match is no result: it is counted in ``voids`` and stays
pending, so a resumed league plays it again.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from backroom import wal
from backroom.bus.wire import EpisodeRecord, MatchSpec

SCHEMA_VERSION = 1
#: Seconds between group commits of results while a league plays.
FLUSH_S = 0.25
#: Episode reasons that are no result (the match did not really happen).
NO_RESULT = ("voided", "error")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS scheduled (
    key     TEXT PRIMARY KEY,
    game    TEXT NOT NULL,
    grp     TEXT NOT NULL,
    spec    TEXT NOT NULL,  -- the MatchSpec as scheduled (seats, seed, CRN index): kept for
                            -- inspection (a resumed league rebuilds a spec from its key and config)
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    key      TEXT NOT NULL UNIQUE REFERENCES scheduled (key),
    game     TEXT NOT NULL,
    grp      TEXT NOT NULL,
    seats    TEXT NOT NULL,
    returns  TEXT NOT NULL,
    reason   TEXT NOT NULL,
    record   TEXT NOT NULL,
    received REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS voids (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    key      TEXT NOT NULL,
    reason   TEXT NOT NULL,
    detail   TEXT NOT NULL,
    received REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    n    INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class Result:
    """One counted match: who sat where and what each seat got (after the transform)."""

    seq: int
    key: str
    game: str
    group: str  # the CRN group
    seats: tuple[str, ...]
    returns: tuple[float, ...]
    reason: str


class LeagueStore:
    """``with LeagueStore(dir / "league.sqlite") as store``: one connection, one thread."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        self.path = Path(path)
        # NORMAL: a result lost to a power cut is replayed, never doubled.
        self._db = wal.connect(self.path, "NORMAL", readonly)
        self._pending: list[tuple[object, ...]] = []
        self._voids: list[tuple[object, ...]] = []
        self._counts: dict[str, int] = {}
        self._known: set[str] = set()
        try:
            self._open(readonly)
        except BaseException:
            self._db.close()
            raise

    def _open(self, readonly: bool) -> None:
        if readonly:
            return
        wal.create_schema(self._db, self.path, _SCHEMA, SCHEMA_VERSION)
        self._known = {r[0] for r in self._db.execute("SELECT key FROM results")}

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._db.close()

    def __enter__(self) -> LeagueStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return wal.transaction(self._db)

    # --- meta -------------------------------------------------------------------------

    def get_meta(self, name: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return str(row[0]) if row else None

    def set_meta(self, name: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    # --- the schedule -----------------------------------------------------------------

    def schedule(self, matches: Sequence[tuple[str, str, str, MatchSpec]]) -> int:
        """Add (key, game, CRN group, spec) rows not scheduled yet; return how many were new."""
        now = time.time()
        with self._tx() as db:
            before = db.total_changes
            db.executemany(
                "INSERT OR IGNORE INTO scheduled VALUES (?, ?, ?, ?, ?)",
                [(k, g, grp, spec.model_dump_json(), now) for k, g, grp, spec in matches],
            )
            return db.total_changes - before

    def scheduled_keys(self) -> list[str]:
        """Every scheduled key, in the order scheduled (no spec parsed)."""
        return [k for (k,) in self._db.execute("SELECT key FROM scheduled ORDER BY rowid")]

    def scheduled_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM scheduled").fetchone()[0])

    def done(self) -> set[str]:
        """Keys with a result (stored or waiting for the next flush)."""
        return set(self._known)

    # --- results ----------------------------------------------------------------------

    def add(self, key: str, record: EpisodeRecord) -> bool:
        """Count ``record`` as the result of ``key``: True if it is the first; ``flush`` writes it."""
        if record.reason in NO_RESULT:
            self._voids.append((key, record.reason, record.detail, time.time()))
            self._counts["voided"] = self._counts.get("voided", 0) + 1
            return False
        if key in self._known:
            self._counts["duplicates"] = self._counts.get("duplicates", 0) + 1
            return False
        self._known.add(key)
        self._pending.append(
            (
                key,
                key.split("|", 1)[0],  # the league's game key (two games may share an engine)
                record.crn_group or "",
                json.dumps(record.seats),
                json.dumps(record.returns),
                record.reason,
                record.model_dump_json(),
                time.time(),
            )
        )
        return True

    def flush(self) -> int:
        """Commit the results added since the last flush (one transaction); return how many."""
        rows, voids, counts = self._pending, self._voids, self._counts
        if not (rows or voids or counts):
            return 0
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO results (key, game, grp, seats, returns, reason, record,"
                " received) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.executemany(
                "INSERT INTO voids (key, reason, detail, received) VALUES (?, ?, ?, ?)", voids
            )
            for name, n in counts.items():
                db.execute(
                    "INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET n = n + ?",
                    (name, n, n),
                )
        self._pending, self._voids, self._counts = [], [], {}
        return len(rows)

    def results(self, after: int = 0, as_scheduled: bool = False) -> list[Result]:
        """Every counted result (``seq`` past ``after``) in the order it was counted (what
        ratings replay), or ``as_scheduled``: in the order their matches were scheduled,
        which does not depend on which episode came back first."""
        columns = "seq, results.key, results.game, results.grp, seats, returns, reason"
        query = (
            f"SELECT {columns} FROM results LEFT JOIN scheduled USING (key) WHERE seq > ?"
            " ORDER BY scheduled.rowid IS NULL, scheduled.rowid, seq"  # unscheduled: last
            if as_scheduled
            else f"SELECT {columns} FROM results WHERE seq > ? ORDER BY seq"
        )
        rows = self._db.execute(query, (after,)).fetchall()
        return [
            Result(s, k, g, grp, tuple(json.loads(seats)), tuple(json.loads(rets)), reason)
            for s, k, g, grp, seats, rets, reason in rows
        ]

    def records(self, game: str | None = None) -> Iterator[EpisodeRecord]:
        """The full episode records of ``game``'s results (all: None), in counted order."""
        for (text,) in self._db.execute(
            "SELECT record FROM results WHERE ?1 IS NULL OR game = ?1 ORDER BY seq", (game,)
        ):
            yield EpisodeRecord.model_validate_json(text)

    def counters(self) -> dict[str, int]:
        return {str(k): int(n) for k, n in self._db.execute("SELECT name, n FROM counters")}
