"""The replay index: one SQLite file beside a run, so a list of 100,000 matches pages in milliseconds.

A run's ``episodes.jsonl`` and ``traces.jsonl`` are append-only; the index
keeps, per match, where its record starts and ends in the file and the few
fields a list filters and sorts by (one row per seat for agent, seat, reward
and outcome), and per decision where its trace lies. Building it reads each
file once; afterwards ``refresh`` reads only what was appended since (a
running run's list grows), and a record is read back from disk by its offset
when a match is opened. Nothing is ever loaded whole, in the server or the browser.

What cannot be read is kept as a marked gap, never skipped silently: a line
that is not one JSON object (a writer died mid-line and the next append
continued it) is a row of ``gaps``; bytes after the last newline (torn, or
being written right now) are reported as the file's tail and read again at
the next refresh.

A training run directory (``store.sqlite``, ``train_log.csv``) is indexed from
the trainer's store, which holds every match's record, its step, its CRN group
and its traces; the store is opened read-only and never written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backroom.records import fallback_of
from backroom.replay import training
from backroom.replay.query import Query, ReplayError, outcome_of, where_clause
from backroom.runs import RUN_KEY_FILE, resolve_run_dir

#: The index file, in the run directory. Delete it to rebuild; it is rebuilt by itself
#: when the file it indexes shrinks (replaced) or when its schema version changes.
INDEX_FILE = ".replay-index.sqlite"
SCHEMA_VERSION = "2"
#: The trainer's store (``backroom.trainer.store``): a run directory holding it is a training run.
STORE_FILE = "store.sqlite"
TRAIN_LOG = "train_log.csv"
_CHUNK = 4 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS matches (
    id INTEGER PRIMARY KEY, match TEXT NOT NULL, pos INTEGER, len INTEGER,
    game TEXT, seats TEXT, returns TEXT, reason TEXT, detail TEXT, crn_group TEXT,
    seed INTEGER, started REAL, ended REAL, turns INTEGER, timeouts INTEGER,
    fallbacks INTEGER, invalid INTEGER, version TEXT, step INTEGER, kind TEXT
);
CREATE TABLE IF NOT EXISTS seats (
    id INTEGER NOT NULL, seat INTEGER NOT NULL, agent TEXT NOT NULL,
    reward REAL, outcome TEXT, PRIMARY KEY (id, seat)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS traces (
    match TEXT NOT NULL, turn INTEGER NOT NULL, seat INTEGER NOT NULL, agent TEXT,
    pos INTEGER, len INTEGER, PRIMARY KEY (match, turn, seat)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY, file TEXT NOT NULL, pos INTEGER NOT NULL, len INTEGER NOT NULL,
    why TEXT NOT NULL
);
"""

_INDEXES = """
CREATE INDEX IF NOT EXISTS matches_match ON matches (match);
CREATE INDEX IF NOT EXISTS matches_crn ON matches (crn_group);
CREATE INDEX IF NOT EXISTS matches_reason ON matches (reason, id);
CREATE INDEX IF NOT EXISTS matches_step ON matches (step, id);
CREATE INDEX IF NOT EXISTS seats_agent ON seats (agent, reward);
CREATE INDEX IF NOT EXISTS seats_seat ON seats (seat, reward);
CREATE INDEX IF NOT EXISTS seats_agent_outcome ON seats (agent, outcome, reward);
CREATE INDEX IF NOT EXISTS seats_seat_outcome ON seats (seat, outcome, reward);
CREATE INDEX IF NOT EXISTS traces_agent ON traces (agent);
"""


def summary_row(record: dict[str, Any]) -> tuple[list[Any], list[tuple[int, str, float, str]]]:
    """The list's columns of one episode record, and its seats (seat, agent, reward, outcome)."""
    seats = [str(s) for s in record.get("seats") or []]
    returns = [float(r) for r in record.get("returns") or []]
    actions = record.get("actions") or []
    turns = len({a.get("turn") for a in actions if isinstance(a, dict)})
    # the one count of moves not an agent's own (``backroom.records``): a record from before
    # ``fallback`` existed marks its timeout defaults ``timed_out``
    fallbacks = sum(
        1
        for a in actions
        if isinstance(a, dict)
        and fallback_of(a.get("fallback"), bool(a.get("timed_out"))) is not None
    )
    row = [
        str(record.get("match", "")),
        record.get("game"),
        json.dumps(seats),
        json.dumps(returns),
        record.get("reason"),
        record.get("detail", ""),
        record.get("crn_group"),
        record.get("seed"),
        record.get("started_at"),
        record.get("ended_at"),
        turns,
        len(record.get("timeouts") or []),
        fallbacks,
        record.get("invalid_inputs", 0),
        adapter_versions(record),
    ]
    by_seat = [
        (i, agent, returns[i] if i < len(returns) else 0.0, outcome_of(returns[i]))
        for i, agent in enumerate(seats)
        if i < len(returns)
    ]
    return row, by_seat


def adapter_versions(record: dict[str, Any]) -> str | None:
    """The adapter versions the match's request named for its seats (``MatchSpec.adapters``).

    What the traces say really played is shown per decision; this is the list's
    column, and a training run's grouping: ``base`` for a seat the request left
    on the base model while another seat had an adapter.
    """
    spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
    refs = spec.get("adapters") or [] if isinstance(spec, dict) else []
    if not any(isinstance(r, dict) for r in refs):
        return None
    names = {str(r.get("version")) if isinstance(r, dict) else "base" for r in refs}
    return ",".join(sorted(names))


def gap_reason(line: bytes) -> str:
    """Why a line of a run's file is a gap: cut off, or whole but not a record."""
    if not line.rstrip(b"\n").strip():
        return "empty line"
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return "torn or unreadable line (a writer died mid-line, and the next record continued it)"
    return "not a record (a JSON value without the fields of one)"


@dataclass
class _Batch:
    """Rows parsed from one chunk of a file, written in one transaction."""

    matches: list[tuple[Any, ...]] = field(default_factory=list)
    seats: list[tuple[Any, ...]] = field(default_factory=list)
    traces: list[tuple[Any, ...]] = field(default_factory=list)
    gaps: list[tuple[Any, ...]] = field(default_factory=list)

    def write(self, db: sqlite3.Connection) -> None:
        db.executemany(f"INSERT INTO matches VALUES ({', '.join('?' * 20)})", self.matches)
        db.executemany("INSERT OR REPLACE INTO seats VALUES (?, ?, ?, ?, ?)", self.seats)
        db.executemany("INSERT OR REPLACE INTO traces VALUES (?, ?, ?, ?, ?, ?)", self.traces)
        db.executemany("INSERT INTO gaps (file, pos, len, why) VALUES (?, ?, ?, ?)", self.gaps)


def split_lines(data: bytes, base: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line with its newline) of every whole line of ``data`` read at ``base``."""
    start = 0
    while (end := data.find(b"\n", start)) != -1:
        yield base + start, data[start : end + 1]
        start = end + 1


def parse_line(line: bytes) -> dict[str, Any] | None:
    """A line's JSON object, or None when it is not one (torn, not JSON, not UTF-8)."""
    with contextlib.suppress(ValueError, RecursionError):
        value = json.loads(line)
        if isinstance(value, dict):
            return value
    return None


class ReplayIndex:
    """The index of one run directory; thread-safe (the web server refreshes it off its loop)."""

    def __init__(self, run_dir: str | Path, index_path: str | Path | None = None) -> None:
        self.run_dir = resolve_run_dir(run_dir)
        if not self.run_dir.is_dir():
            raise ReplayError(f"{run_dir} is not a run directory (one with episodes.jsonl)")
        self.store = self._find_store()
        self.episodes = self._find_episodes()
        self.traces_path = self.run_dir / "traces.jsonl"
        if self.store is None and self.episodes is None:
            raise ReplayError(
                f"{self.run_dir} has no episodes.jsonl (a run of `backroom run`) and no "
                f"{STORE_FILE} (a run of `backroom train`): pass the directory of a run"
            )
        self.path = Path(index_path) if index_path else self.run_dir / INDEX_FILE
        self.lock = threading.Lock()  # the connection's: one statement at a time
        self.refreshing = threading.Lock()  # one refresh at a time
        self.progress: dict[
            str, tuple[int, int]
        ] = {}  # file -> (bytes indexed, size), while indexing
        self._next_id = 1
        if index_path is None and not os.access(self.run_dir, os.W_OK):
            self.path = cache_path(self.run_dir)  # a run someone else wrote, or a read-only copy
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        if self._meta("schema") != SCHEMA_VERSION:
            self._reset()
        self.tail: dict[str, int] = {}  # file -> bytes after its last newline, at the last refresh

    def _find_store(self) -> Path | None:
        path = self.run_dir / STORE_FILE
        return path if path.is_file() else None

    def _find_episodes(self) -> Path | None:
        """The run's episodes.jsonl; also before it exists, in a run directory a runner made
        (it holds the run's key), so a run is opened the moment it starts."""
        path = self.run_dir / "episodes.jsonl"
        return path if path.is_file() or (self.run_dir / RUN_KEY_FILE).is_file() else None

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # --- building -------------------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        with contextlib.suppress(sqlite3.OperationalError):
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            return None if row is None else str(row[0])
        return None

    def _set_meta(self, key: str, value: object) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, str(value)))

    def _reset(self) -> None:
        for table in ("meta", "matches", "seats", "traces", "gaps"):
            self.db.execute(f"DROP TABLE IF EXISTS {table}")
        self.db.executescript(_SCHEMA)
        self._set_meta("schema", SCHEMA_VERSION)
        self.db.commit()

    def refresh(self) -> int:
        """Index what was appended since the last refresh; how many matches were added.

        One refresh at a time; the file is parsed a chunk at a time outside the
        read lock and each chunk committed, so the list answers (with what is
        indexed so far) while a big run's first build goes on.
        """
        with self.refreshing:
            if self.store is not None:
                with self.lock:
                    added = self._ingest_store(self.store)
                    self.db.commit()
            else:
                self._reset_if_cut()
                added = self._ingest("episodes", self.episodes, self._episode_rows)
                if self.traces_path.is_file():
                    self._ingest("traces", self.traces_path, self._trace_rows)
            with self.lock:
                self.db.executescript(_INDEXES)  # after a first build: faster than row by row
            return added

    def _reset_if_cut(self) -> None:
        """Start over when a file is shorter than what was indexed of it (replaced, or cut).

        Both files are read again: an index of one file kept beside a new copy
        of the other could mix two versions of a run.
        """
        with self.lock:
            for name, path in (("episodes", self.episodes), ("traces", self.traces_path)):
                done = int(self._meta(f"{name}_pos") or 0)
                size = path.stat().st_size if path is not None and path.is_file() else 0
                if size < done:
                    self._reset()
                    return

    def _ingest(self, name: str, path: Path | None, rows: Any) -> int:
        if path is None or not path.is_file():
            return 0
        size = path.stat().st_size
        with self.lock:
            done = int(self._meta(f"{name}_pos") or 0)
            self._next_id = self.db.execute(
                "SELECT coalesce(max(id), 0) + 1 FROM matches"
            ).fetchone()[0]
        added = 0
        with path.open("rb") as f:
            while done < size:
                self.progress[name] = (done, size)
                f.seek(done)
                data = f.read(min(_CHUNK, size - done))
                end = data.rfind(b"\n")
                if end == -1 and len(data) == _CHUNK:  # a line longer than a chunk: read it whole
                    data += f.readline()
                    end = data.rfind(b"\n")
                if end == -1:
                    break  # no whole line left: the tail
                batch = _Batch()
                for pos, line in split_lines(data[: end + 1], done):
                    rows(batch, pos, line)
                done += end + 1
                with self.lock:
                    batch.write(self.db)
                    self._set_meta(f"{name}_pos", done)
                    self.db.commit()
                added += len(batch.matches)
        self.progress.pop(name, None)
        self.tail[name] = size - done
        return added

    def _ingest_store(self, store: Path) -> int:
        """A training run: the episodes and trace keys the trainer's store holds past the last refresh."""
        last = int(self._meta("store_rowid") or 0)
        self._next_id = self.db.execute("SELECT coalesce(max(id), 0) + 1 FROM matches").fetchone()[
            0
        ]
        batch = _Batch()
        for rowid, record, step, kind in training.store_episodes(store, last):
            self._match_rows(batch, record, None, None, step, kind)
            last = rowid
        batch.traces = [(*k[:4], None, None) for k in training.store_trace_keys(store, 0.0)]
        batch.write(self.db)
        self._set_meta("store_rowid", last)
        return len(batch.matches)

    def _episode_rows(self, batch: _Batch, pos: int, line: bytes) -> None:
        if not line.strip():
            return
        record = parse_line(line)
        if record is None or "match" not in record:
            batch.gaps.append(("episodes", pos, len(line), gap_reason(line)))
        else:
            self._match_rows(batch, record, pos, len(line))

    def _match_rows(
        self,
        batch: _Batch,
        record: dict[str, Any],
        pos: int | None,
        length: int | None,
        step: int | None = None,
        kind: str | None = None,
    ) -> None:
        row, seats = summary_row(record)
        mid = self._next_id
        self._next_id += 1
        batch.matches.append((mid, row[0], pos, length, *row[1:], step, kind))
        batch.seats += [(mid, *s) for s in seats]

    @staticmethod
    def _trace_rows(batch: _Batch, pos: int, line: bytes) -> None:
        if not line.strip():
            return
        trace = parse_line(line)
        if trace is None or not isinstance(trace.get("turn"), int):
            batch.gaps.append(("traces", pos, len(line), gap_reason(line)))
            return
        seat = trace.get("seat")
        batch.traces.append(
            (
                str(trace.get("match")),
                trace["turn"],
                seat if isinstance(seat, int) else -1,
                trace.get("agent"),
                pos,
                len(line),
            )
        )

    # --- reading ---------------------------------------------------------------------------------

    def matches(self, q: Query) -> dict[str, Any]:
        """One page of the list, the count of all that pass the filters, and the marked gaps."""
        where, args, join = where_clause(q)
        cols = (
            "m.id, m.match, m.game, m.seats, m.returns, m.reason, m.detail, m.crn_group, m.turns,"
            " m.timeouts, m.fallbacks, m.invalid, m.step, m.kind, m.version, m.pos, m.ended"
        )
        seat_cols = ", s.seat, s.agent, s.reward, s.outcome" if join else ""
        order = {
            "position": "m.id",
            "reward": "s.reward" if join else "m.id",
            "turns": "m.turns",
            "match": "m.match",
            "ended": "m.ended",
        }[q.sort]
        direction = "DESC" if q.descending else "ASC"
        sql_from = f"FROM matches m {join} {where}"
        with self.lock:
            total = self.db.execute(f"SELECT count(*) {sql_from}", args).fetchone()[0]
            rows = self.db.execute(
                f"SELECT {cols}{seat_cols},"
                " (SELECT count(*) FROM traces t WHERE t.match = m.match)"
                f" {sql_from} ORDER BY {order} {direction}, m.id {direction} LIMIT ? OFFSET ?",
                [*args, q.per_page, q.page * q.per_page],
            ).fetchall()
            gaps = self.db.execute("SELECT file, pos, len, why FROM gaps ORDER BY id").fetchall()
        out = [self._row(r, join) for r in rows]
        return {
            "total": total,
            "page": q.page,
            "per_page": q.per_page,
            "rows": out,
            "gaps": [{"file": g[0], "pos": g[1], "len": g[2], "why": g[3]} for g in gaps],
            "tail": {k: v for k, v in self.tail.items() if v},
        }

    @staticmethod
    def _row(r: tuple[Any, ...], join: str) -> dict[str, Any]:
        row = {
            "id": r[0],
            "match": r[1],
            "game": r[2],
            "seats": json.loads(r[3] or "[]"),
            "returns": json.loads(r[4] or "[]"),
            "reason": r[5],
            "detail": r[6],
            "crn_group": r[7],
            "turns": r[8],
            "timeouts": r[9],
            "fallbacks": r[10],
            "invalid": r[11],
            "step": r[12],
            "kind": r[13],
            "version": r[14],
            "pos": r[15],
            "ended": r[16],
            "traces": r[-1],
        }
        if join:
            row.update(seat=r[17], agent=r[18], reward=r[19], outcome=r[20])
        return row

    def facets(self) -> dict[str, Any]:
        """What the filters can choose from: agents, seats, reasons (with counts), steps."""
        with self.lock:
            agents = self.db.execute(
                "SELECT agent, count(*) FROM seats GROUP BY agent ORDER BY agent"
            ).fetchall()
            reasons = self.db.execute(
                "SELECT reason, count(*) FROM matches GROUP BY reason ORDER BY reason"
            ).fetchall()
            seats = self.db.execute("SELECT max(seat) FROM seats").fetchone()[0]
            traced = self.db.execute("SELECT DISTINCT agent FROM traces").fetchall()
            fallbacks = self.db.execute(
                "SELECT count(*) FROM matches WHERE fallbacks > 0"
            ).fetchone()
        return {
            "run_dir": str(self.run_dir),
            "training": self.store is not None,
            "agents": {a: n for a, n in agents},
            "reasons": {r: n for r, n in reasons},
            "with_fallbacks": fallbacks[0],
            "seats": -1 if seats is None else seats,
            "traced_agents": sorted(a for (a,) in traced if a),
        }

    def locate(self, match: str) -> tuple[int, int | None, int | None, int | None] | None:
        """(id, offset, length, step) of a match's last record, or None if it is not indexed."""
        with self.lock:
            row = self.db.execute(
                "SELECT id, pos, len, step FROM matches WHERE match = ? ORDER BY id DESC LIMIT 1",
                (match,),
            ).fetchone()
        return None if row is None else (row[0], row[1], row[2], row[3])

    def record(self, match: str) -> dict[str, Any] | None:
        """A match's episode record, read from disk by its offset (or from the trainer's store)."""
        found = self.locate(match)
        if found is None:
            return None
        if self.store is not None:
            return training.store_record(self.store, match)
        _, pos, length, _ = found
        assert self.episodes is not None and pos is not None and length is not None
        with self.episodes.open("rb") as f:
            f.seek(pos)
            return parse_line(f.read(length))

    def traces(self, match: str) -> tuple[dict[tuple[int, int], dict[str, Any]], list[str]]:
        """A match's traces by (turn, seat), and the trace lines that could not be read."""
        if self.store is not None:
            return training.store_traces(self.store, match), []
        with self.lock:
            rows = self.db.execute(
                "SELECT turn, seat, pos, len FROM traces WHERE match = ?", (match,)
            ).fetchall()
        found: dict[tuple[int, int], dict[str, Any]] = {}
        bad: list[str] = []
        if not rows:
            return found, bad
        with self.traces_path.open("rb") as f:
            for turn, seat, pos, length in rows:
                f.seek(pos)
                trace = parse_line(f.read(length))
                if trace is None:
                    bad.append(f"trace of turn {turn}, seat {seat} at byte {pos} is unreadable")
                else:
                    found[(turn, seat)] = trace
        return found, bad

    def traced_agents(self) -> set[str]:
        with self.lock:
            return {a for (a,) in self.db.execute("SELECT DISTINCT agent FROM traces") if a}

    def group(self, crn_group: str) -> list[dict[str, Any]]:
        """The matches of one CRN group (for the side-by-side), at most 100."""
        return self.matches(Query(crn_group=crn_group, per_page=100))["rows"]


def cache_path(run_dir: Path) -> Path:
    """Where the index of a run directory this user may not write goes: the user's cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "backroom" / "replay"
    base.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return base / f"{run_dir.name}-{digest}.sqlite"
