"""The trainer's record of a run: requests, episodes, traces, steps and counters in one SQLite file.

Why SQLite in WAL mode: transactions for free (a step's log row and the
marking of its episodes happen together or not at all), one file per run
directory, and readers (analysis, a second process) do not block the writer.
A row is durable when ``commit()`` returns, and the MQTT receive callback
commits before it returns: paho acknowledges a QoS 1 message only after
``on_message`` returns, so the broker's PUBACK goes out only once the row is
on disk. A SIGKILLed trainer loses nothing, and the broker's redelivery of a
message it never saw acknowledged is deduplicated by the primary keys.

``synchronous=FULL``, not NORMAL: in WAL mode NORMAL survives a killed process
(the WAL frames are already in the OS page cache) but not a power cut or a
kernel crash, which may roll back the last commits. Once the broker has our
PUBACK it forgets the message, so the store is the only copy left; FULL
fsyncs the WAL at every commit so that "committed" means "on disk". The price
is one fsync per message, small beside the match that produced it.

Nothing here trusts a payload: a trace counts only for the agent its topic
names, and only if the match the trainer requested seats that agent where the
trace says, for a decision the referee's episode records (once the episode is
in; traces that came first for turns it does not record are deleted with its
arrival), within the agent's byte budget for the step (``trace_budget_bytes``);
what is missing is dropped and counted, never guessed.

What is refused costs no write. An agent may publish anything on its own
``traces/{agent}``, as fast as it likes: if each refusal were a committed
counter row, each would be an fsync inside the receive callback, and one
array of junk would block the trainer's loop for minutes (its keepalive
lapses, the broker redelivers, the junk is counted twice). So refusals are
counted in memory and written with the next step's row (``log_step``) or at
``close``; a SIGKILL loses at most the refusals counted since the last step,
never a stored row.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from backroom import wal
from backroom.bus.wire import ActionRecord, EpisodeRecord, MatchSpec, Trace

#: What ``add_traces`` returns for each trace it stored (the other keys are reasons it refused).
STORED = "stored"

#: Bytes of traces the store takes from one agent for the matches of one step (stored
#: traces' JSON); past it, its traces are refused and counted (``trace_over_budget``).
TRACE_BUDGET_BYTES = 256 * 1024**2

#: Matches whose recorded decisions ``add_traces`` keeps at hand (each a small set).
_DECISIONS_CACHED = 4096

#: ``PRAGMA user_version`` of the schema below; a newer file is refused, not guessed at.
SCHEMA_VERSION = 1


KINDS = ("train", "eval")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    match     TEXT PRIMARY KEY,
    step      INTEGER NOT NULL,
    crn_group TEXT NOT NULL,
    kind      TEXT NOT NULL CHECK (kind IN ('train', 'eval')),
    spec      TEXT NOT NULL,
    trainable TEXT NOT NULL,
    label     TEXT NOT NULL,
    created   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_step_kind ON requests (step, kind);

CREATE TABLE IF NOT EXISTS episodes (
    match     TEXT PRIMARY KEY REFERENCES requests (match),
    record    TEXT NOT NULL,
    received  REAL NOT NULL,
    used_step INTEGER
);
CREATE INDEX IF NOT EXISTS episodes_used_step ON episodes (used_step);

CREATE TABLE IF NOT EXISTS traces (
    match    TEXT NOT NULL REFERENCES requests (match),
    turn     INTEGER NOT NULL,
    seat     INTEGER NOT NULL,
    agent    TEXT NOT NULL,
    phase    TEXT NOT NULL,
    trace    TEXT NOT NULL,
    received REAL NOT NULL,
    PRIMARY KEY (match, turn, seat)
);

CREATE TABLE IF NOT EXISTS steps (
    step    INTEGER PRIMARY KEY,
    version TEXT NOT NULL,
    metrics TEXT NOT NULL,
    time    REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    n    INTEGER NOT NULL
);
"""


#: A stored match's traces by (turn, seat): the agent that sent each (its topic's), and it.
Traced = dict[tuple[int, int], tuple[str, Trace]]


@dataclass(frozen=True)
class Request:
    """A match the trainer asked for; only requested matches are stored, so strays cannot feed it."""

    match: str
    step: int  # training step the match was requested for
    group: str  # CRN group id
    kind: str  # "train" or "eval"
    spec: MatchSpec
    trainable: tuple[int, ...]  # seats whose decisions are trained on (their traces are needed)
    label: str = ""  # free text, e.g. "self-play", "buffer v3", "eval tit-for-tat"


@dataclass(frozen=True)
class Decision:
    """One trained decision: the episode's view of it (round, phase) beside the agent's trace."""

    match: str
    seat: int
    turn: int
    round: int  # from the episode's ActionRecord.round (1-based)
    phase: str
    trace: Trace


@dataclass(frozen=True)
class Joined:
    """An episode with the traced decisions of its trainable seats, ready for credit assignment."""

    request: Request
    record: EpisodeRecord
    decisions: list[Decision]  # sorted by (turn, seat)


class Store:
    """``with Store(run_dir / "store.sqlite") as store``: one connection, one thread, WAL mode.

    Every public method that writes commits before it returns, so a caller
    (the MQTT callback) may acknowledge what it handed over as soon as the
    call is back.
    """

    def __init__(self, path: str | Path, trace_budget_bytes: int = TRACE_BUDGET_BYTES) -> None:
        self.path = Path(path)
        # FULL: see the module docstring.
        self._db = wal.connect(self.path, "FULL")
        #: Counted since the last commit of the counters (see the module docstring).
        self._pending: dict[str, int] = {}
        self.trace_budget_bytes = trace_budget_bytes
        #: (step, agent) -> bytes of its traces this store took for the step's matches
        #: (read from the file at the first trace of the pair: what a restart had taken).
        self._taken: dict[tuple[int, str], int] = {}
        #: step -> agent -> its traces refused for being past its budget (this process's).
        self.over_budget: dict[int, Counter[str]] = {}
        #: match -> the (turn, seat) its stored episode records; None: no episode yet.
        self._decisions: dict[str, frozenset[tuple[int, int]]] = {}
        try:
            self._open()
        except BaseException:
            self._db.close()
            raise

    def _open(self) -> None:
        self._db.execute("PRAGMA foreign_keys = ON")
        wal.create_schema(self._db, self.path, _SCHEMA, SCHEMA_VERSION)

    def close(self) -> None:
        try:
            pending = dict(self._pending)
            if pending:
                with self._tx():
                    self._write_counts(pending)
                self._forget(pending)
        finally:
            self._db.close()

    def __enter__(self) -> Store:
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

    # --- what the trainer asked for ---------------------------------------------------

    def add_requests(self, requests: Sequence[Request]) -> None:
        """Stored before they are sent (one transaction), so a restarted trainer resends, never forgets."""
        now = time.time()
        with self._tx() as db:
            for r in requests:
                if r.kind not in KINDS:
                    raise ValueError(f"request {r.match}: kind {r.kind!r} is not one of {KINDS}")
                bad = [s for s in r.trainable if not 0 <= s < len(r.spec.seats)]
                if bad:
                    raise ValueError(
                        f"request {r.match}: trainable seats {bad} outside {len(r.spec.seats)} seats"
                    )
                try:
                    db.execute(
                        "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            r.match,
                            r.step,
                            r.group,
                            r.kind,
                            r.spec.model_dump_json(),
                            json.dumps(list(r.trainable)),
                            r.label,
                            now,
                        ),
                    )
                except sqlite3.IntegrityError:
                    raise ValueError(f"match {r.match} was already requested") from None

    def request(self, match: str) -> Request | None:
        row = self._db.execute(
            "SELECT match, step, crn_group, kind, spec, trainable, label FROM requests WHERE match = ?",
            (match,),
        ).fetchone()
        return _request(row) if row else None

    def requests(self, step: int | None = None, kind: str | None = None) -> list[Request]:
        """In the order they were added: a resumed step replays its plan in the same order."""
        rows = self._db.execute(
            "SELECT match, step, crn_group, kind, spec, trainable, label FROM requests"
            " WHERE (?1 IS NULL OR step = ?1) AND (?2 IS NULL OR kind = ?2) ORDER BY rowid",
            (step, kind),
        ).fetchall()
        return [_request(row) for row in rows]

    def outstanding(self, step: int | None = None) -> list[str]:
        """Requested matches with no episode yet (in request order): what a restart must resend."""
        rows = self._db.execute(
            "SELECT r.match FROM requests r LEFT JOIN episodes e ON e.match = r.match"
            " WHERE e.match IS NULL AND (?1 IS NULL OR r.step = ?1) ORDER BY r.rowid",
            (step,),
        ).fetchall()
        return [row[0] for row in rows]

    def missing_episodes(self, matches: Sequence[str]) -> list[str]:
        """Those of ``matches`` (in their order) with no episode stored: what a waiter waits for."""
        have = self._present("episodes", matches)
        return [m for m in matches if m not in have]

    def missing_traces(self, matches: Sequence[str]) -> list[tuple[str, int, int]]:
        """(match, turn, seat) of each untimed-out action of a trainable seat with no trace stored yet.

        Traces travel on the agents' own connections and may trail their
        episode; a waiter polls this until it is empty or a grace period ends.
        Matches without an episode are not looked at (nothing says which turns to expect).
        """
        out: list[tuple[str, int, int]] = []
        for match in matches:
            loaded = self._load(match)
            if loaded is None:
                continue
            request, record, traces = loaded
            for a in record.actions:
                if (
                    a.seat in request.trainable
                    and not a.timed_out
                    and (a.turn, a.seat) not in traces
                ):
                    out.append((match, a.turn, a.seat))
        return out

    def _present(self, table: str, matches: Sequence[str]) -> set[str]:
        present: set[str] = set()
        chunk = 500  # below SQLite's limit on bound parameters
        for i in range(0, len(matches), chunk):
            part = list(matches[i : i + chunk])
            marks = ",".join("?" * len(part))
            rows = self._db.execute(f"SELECT match FROM {table} WHERE match IN ({marks})", part)
            present.update(row[0] for row in rows)
        return present

    # --- ingest (from the MQTT receive callback; each call commits before returning) ----------

    def add_episode(self, record: EpisodeRecord) -> bool:
        """True if stored; an unrequested or repeated episode is refused and counted, the stored row kept.

        With it, the traces that came first for decisions it does not record
        (turns that never happened, seats no decision was asked of) are
        deleted in the same transaction and counted (``trace_no_decision``):
        an agent cannot fill the store with them.
        """
        if not self._requested(record.match):
            self.count("episode_unrequested")
            return False
        decisions = frozenset((a.turn, a.seat) for a in record.actions)
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO episodes (match, record, received) VALUES (?, ?, ?)"
                " ON CONFLICT (match) DO NOTHING",
                (record.match, record.model_dump_json(), time.time()),
            )
            stray = []
            if cur.rowcount:
                stray = [
                    (turn, seat)
                    for turn, seat in db.execute(
                        "SELECT turn, seat FROM traces WHERE match = ?", (record.match,)
                    )
                    if (turn, seat) not in decisions
                ]
                db.executemany(
                    "DELETE FROM traces WHERE match = ? AND turn = ? AND seat = ?",
                    [(record.match, turn, seat) for turn, seat in stray],
                )
        if cur.rowcount == 0:
            self.count("episode_duplicate")
            return False
        self._remember(record.match, decisions)
        if stray:
            self.count("trace_no_decision", len(stray))
        return True

    def add_trace(self, topic_agent: str, trace: Trace) -> bool:
        """True if stored (``add_traces`` of one trace)."""
        return self.add_traces(topic_agent, [trace]).get(STORED, 0) == 1

    def add_traces(self, topic_agent: str, traces: Sequence[Trace]) -> dict[str, int]:
        """Store what ``topic_agent`` (the sender, by the broker's ACL) traced for its own seat.

        Returns how many were stored (``STORED``) and how many refused, by
        reason. A trace counts only if it names its sender, a requested match,
        and a seat where that match's request seats the sender: the request
        is the trainer's own word on who plays where (the referee seats
        ``spec.seats`` as asked), so it is known before the episode, and an
        agent that is not seated there is refused at once. Once the episode
        is in, only a (turn, seat) it records is taken (``trace_no_decision``);
        and an agent's traces for one step's matches take at most
        ``trace_budget_bytes`` (``trace_over_budget``, named per agent in
        ``over_budget``): a seated agent may write valid traces without end.
        First-come per (match, turn, seat) is then safe: only the seated
        agent can come first. Refusals are counted in memory; the stored ones
        share one transaction (one fsync per message, however many traces it holds).
        """
        counts: dict[str, int] = {}
        rows: list[tuple[tuple[Any, ...], int, int]] = []  # (row, its step, its bytes)
        known: dict[str, tuple[list[str], int] | None] = {}
        now = time.time()
        for trace in traces:
            text = trace.model_dump_json()
            size = len(text.encode())
            reason, step = self._admit(topic_agent, trace, known, size)
            if reason is not None:
                counts[reason] = counts.get(reason, 0) + 1
                if reason == "trace_over_budget":
                    self.over_budget.setdefault(step, Counter())[topic_agent] += 1
                continue
            row = (trace.match, trace.turn, trace.seat, topic_agent, trace.phase, text, now)
            rows.append((row, step, size))
        inserted: list[bool] = []
        if rows:
            try:
                with self._tx() as db:
                    for row, _step, _size in rows:
                        cur = db.execute(
                            "INSERT INTO traces VALUES (?, ?, ?, ?, ?, ?, ?)"
                            " ON CONFLICT (match, turn, seat) DO NOTHING",
                            row,
                        )
                        inserted.append(cur.rowcount == 1)
            except BaseException:
                inserted = [False] * len(rows)
                raise
            finally:
                for (_row, step, size), ok in zip(rows, inserted, strict=False):
                    if not ok:  # a repeat, or not committed: not taken after all
                        self._taken[(step, topic_agent)] -= size
        stored = sum(inserted)
        if len(rows) > stored:
            counts["trace_duplicate"] = len(rows) - stored
        for reason, n in counts.items():
            self.count(reason, n)
        if stored:
            counts[STORED] = stored
        return counts

    def _admit(
        self,
        agent: str,
        trace: Trace,
        known: dict[str, tuple[list[str], int] | None],
        size: int,
    ) -> tuple[str | None, int]:
        """Why ``trace`` is refused (a counter's name) or None, and its match's step (-1: none).

        An admitted trace's ``size`` is taken from its agent's budget for the step."""
        if trace.agent != agent:
            return "trace_forged", -1
        if trace.match is None:
            return "trace_unrequested", -1
        if trace.seat is None:
            return "trace_no_seat", -1
        if trace.match not in known:
            known[trace.match] = self._seats_and_step(trace.match)
        found = known[trace.match]
        if found is None:
            return "trace_unrequested", -1
        seats, step = found
        if not 0 <= trace.seat < len(seats) or seats[trace.seat] != agent:
            return "trace_not_seated", step
        decisions = self._recorded(trace.match)
        if decisions is not None and (trace.turn, trace.seat) not in decisions:
            return "trace_no_decision", step
        taken = self._taken_by(step, agent)
        if taken + size > self.trace_budget_bytes:
            return "trace_over_budget", step
        self._taken[(step, agent)] = taken + size
        return None, step

    def _seats_and_step(self, match: str) -> tuple[list[str], int] | None:
        """The agents a requested match seats, by seat, and its step; None if never requested."""
        row = self._db.execute(
            "SELECT spec, step FROM requests WHERE match = ?", (match,)
        ).fetchone()
        return None if row is None else (MatchSpec.model_validate_json(row[0]).seats, row[1])

    def _recorded(self, match: str) -> frozenset[tuple[int, int]] | None:
        """The (turn, seat) of the decisions ``match``'s stored episode records; None: no episode."""
        if match in self._decisions:
            return self._decisions[match]
        row = self._db.execute("SELECT record FROM episodes WHERE match = ?", (match,)).fetchone()
        if row is None:
            return None
        record = EpisodeRecord.model_validate_json(row[0])
        decisions = frozenset((a.turn, a.seat) for a in record.actions)
        self._remember(match, decisions)
        return decisions

    def _remember(self, match: str, decisions: frozenset[tuple[int, int]]) -> None:
        if len(self._decisions) >= _DECISIONS_CACHED:
            self._decisions.clear()  # a run's traces come for its recent matches
        self._decisions[match] = decisions

    def _taken_by(self, step: int, agent: str) -> int:
        """Bytes of ``agent``'s traces taken for ``step``'s matches (the file's, at first ask)."""
        key = (step, agent)
        if key not in self._taken:
            row = self._db.execute(
                "SELECT coalesce(sum(length(CAST(t.trace AS BLOB))), 0) FROM traces t"
                " JOIN requests r ON r.match = t.match WHERE r.step = ? AND t.agent = ?",
                (step, agent),
            ).fetchone()
            self._taken[key] = int(row[0])
        return self._taken[key]

    def over_budget_text(self, step: int) -> str:
        """``agent=n`` for each agent whose traces for ``step`` went past its budget
        (train_log.csv's ``traces_over_budget``); empty when none did."""
        over = self.over_budget.get(step, Counter())
        return " ".join(f"{agent}={n}" for agent, n in sorted(over.items()))

    def _requested(self, match: str) -> bool:
        return (
            self._db.execute("SELECT 1 FROM requests WHERE match = ?", (match,)).fetchone()
            is not None
        )

    # --- joining, for a training batch --------------------------------------------------

    def join(self, matches: Sequence[str]) -> tuple[list[Joined], dict[str, int]]:
        """Episodes with their trainable seats' traced decisions; what cannot be joined is counted.

        A decision is kept only with a trace from the agent the episode seats
        there: the trace's topic proves who sent it, the episode proves who
        played. Nothing is guessed: no trace, no decision. A match in which a
        seat refused its adapter (``adapter_refused``), or that was voided, is
        dropped whole. Returns the episodes in the order of ``matches`` and
        this call's counts (which are also added to the persistent counters).
        """
        if twice := [match for match, n in Counter(matches).items() if n > 1]:
            raise ValueError(f"match {twice[0]} is listed twice: it would be trained on twice")
        counts: Counter[str] = Counter()
        joined: list[Joined] = []
        with self._tx():  # one snapshot for the reads, and the counters written with them
            for match in matches:
                loaded = self._load(match)
                if loaded is None:
                    counts["episode_missing"] += 1
                    continue
                request, record, traces = loaded
                if whole := _dropped_whole(record):
                    counts[whole] += 1
                    continue
                decisions: list[Decision] = []
                for a in (a for a in record.actions if a.seat in request.trainable):
                    found = _decision(match, a, record, traces)
                    if isinstance(found, str):
                        counts[found] += 1
                    else:
                        decisions.append(found)
                decisions.sort(key=lambda d: (d.turn, d.seat))
                joined.append(Joined(request, record, decisions))
            for reason, n in counts.items():
                self._count(reason, n)
        return joined, dict(counts)

    def _load(self, match: str) -> tuple[Request, EpisodeRecord, Traced] | None:
        row = self._db.execute(
            "SELECT r.match, r.step, r.crn_group, r.kind, r.spec, r.trainable, r.label, e.record"
            " FROM episodes e JOIN requests r ON r.match = e.match WHERE e.match = ?",
            (match,),
        ).fetchone()
        if row is None:
            return None
        request = _request(row[:7])
        record = EpisodeRecord.model_validate_json(row[7])
        traces = {
            (turn, seat): (agent, Trace.model_validate_json(text))
            for turn, seat, agent, text in self._db.execute(
                "SELECT turn, seat, agent, trace FROM traces WHERE match = ?", (match,)
            )
        }
        return request, record, traces

    def mark_used(self, matches: Sequence[str], step: int) -> None:
        """Records that these episodes fed step ``step``; all or none, and never an episode twice."""
        with self._tx():
            self._mark_used(matches, step)

    def _mark_used(self, matches: Sequence[str], step: int) -> None:
        for match in matches:
            cur = self._db.execute(
                "UPDATE episodes SET used_step = ? WHERE match = ? AND used_step IS NULL",
                (step, match),
            )
            if cur.rowcount == 1:
                continue
            used = self._db.execute(
                "SELECT used_step FROM episodes WHERE match = ?", (match,)
            ).fetchone()
            if used is None:
                raise ValueError(f"match {match} has no episode to mark used")
            raise ValueError(f"episode {match} already fed step {used[0]}")

    def used_in(self, match: str) -> int | None:
        row = self._db.execute(
            "SELECT used_step FROM episodes WHERE match = ?", (match,)
        ).fetchone()
        return None if row is None else row[0]

    def used_outcomes(self, before_step: int) -> list[tuple[str, str, str]]:
        """(label, trainable JSON, returns JSON) of the training matches that fed a step before
        ``before_step``, in match order: the learner's record against its opponents (PFSP)."""
        return self._db.execute(
            "SELECT r.label, r.trainable, json_extract(e.record, '$.returns')"
            " FROM episodes e JOIN requests r ON r.match = e.match"
            " WHERE r.kind = 'train' AND e.used_step IS NOT NULL AND e.used_step < ?"
            " ORDER BY r.match",
            (before_step,),
        ).fetchall()

    def outcomes(self, kind: str = "train") -> list[tuple[Request, EpisodeRecord]]:
        """Every stored match of ``kind`` with its episode, in request order: who got what
        against whom, step by step (``opponents.PoolOutcome``)."""
        rows = self._db.execute(
            "SELECT r.match, r.step, r.crn_group, r.kind, r.spec, r.trainable, r.label, e.record"
            " FROM episodes e JOIN requests r ON r.match = e.match WHERE r.kind = ?"
            " ORDER BY r.rowid",
            (kind,),
        ).fetchall()
        return [(_request(row[:7]), EpisodeRecord.model_validate_json(row[7])) for row in rows]

    # --- training log -----------------------------------------------------------------

    def log_step(
        self, step: int, version: str, metrics: Mapping[str, float], matches: Sequence[str]
    ) -> None:
        """The step and the episodes it consumed in ONE transaction: a crash leaves both or neither,
        so a resumed run neither repeats a logged step nor reuses its episodes. The counts made
        in memory since the last step are written with it."""
        pending = dict(self._pending)
        with self._tx() as db:
            try:
                db.execute(
                    "INSERT INTO steps VALUES (?, ?, ?, ?)",
                    (
                        step,
                        version,
                        json.dumps({k: float(v) for k, v in metrics.items()}),
                        time.time(),
                    ),
                )
            except sqlite3.IntegrityError:
                raise ValueError(f"step {step} is already logged") from None
            self._mark_used(matches, step)
            self._write_counts(pending)
        self._forget(pending)

    def last_step(self) -> tuple[int, str] | None:
        row = self._db.execute(
            "SELECT step, version FROM steps ORDER BY step DESC LIMIT 1"
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def steps(self) -> list[tuple[int, str, dict[str, float]]]:
        rows = self._db.execute("SELECT step, version, metrics FROM steps ORDER BY step").fetchall()
        return [(step, version, json.loads(metrics)) for step, version, metrics in rows]

    # --- counters (persisted; survive restarts) -----------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """In memory until the next step (or ``close``) writes it: a count never costs an fsync."""
        self._pending[name] = self._pending.get(name, 0) + n

    def _write_counts(self, counts: Mapping[str, int]) -> None:
        for name, n in counts.items():
            self._count(name, n)

    def _forget(self, counts: Mapping[str, int]) -> None:
        """Once ``counts`` are committed: a rolled-back step leaves them in memory."""
        for name, n in counts.items():
            left = self._pending.get(name, 0) - n
            if left:
                self._pending[name] = left
            else:
                self._pending.pop(name, None)

    def _count(self, name: str, n: int) -> None:
        self._db.execute(
            "INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET n = n + excluded.n",
            (name, n),
        )

    def counters(self) -> dict[str, int]:
        """The written counts plus those still in memory."""
        out = dict(self._db.execute("SELECT name, n FROM counters ORDER BY name").fetchall())
        for name, n in self._pending.items():
            out[name] = out.get(name, 0) + n
        return dict(sorted(out.items()))


def _request(row: Sequence[Any]) -> Request:
    match, step, group, kind, spec, trainable, label = row
    return Request(
        match=match,
        step=step,
        group=group,
        kind=kind,
        spec=MatchSpec.model_validate_json(spec),
        trainable=tuple(json.loads(trainable)),
        label=label,
    )


def _dropped_whole(record: EpisodeRecord) -> str | None:
    """Why a match is dropped whole (``Store.join``), or None."""
    if record.reason == "voided":  # stopped unplayed (its referee shut down: with several
        # trainers on one bus, a finished run's referee voids the others' matches in its hands)
        return "episode_voided"
    if any(a.fallback == "adapter_refused" for a in record.actions):  # a seat played no policy
        # (its adapter was never announced): the others' returns say nothing of what they faced
        return "adapter_refused"
    return None


def _decision(
    match: str, action: ActionRecord, record: EpisodeRecord, traces: Traced
) -> Decision | str:
    """A trained seat's action with the trace of the agent seated there, or why it has none."""
    if action.timed_out:
        return "decision_timed_out"
    found = traces.get((action.turn, action.seat))
    if found is None:
        return "decision_missing_trace"
    agent, trace = found
    if not 0 <= action.seat < len(record.seats) or agent != record.seats[action.seat]:
        return "trace_not_seated"
    if trace.phase != action.phase:
        return "trace_phase_mismatch"
    return Decision(match, action.seat, action.turn, action.round, action.phase, trace)
