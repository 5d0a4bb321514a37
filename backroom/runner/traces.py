"""A run's ``traces.jsonl``: what trainable agents said they decided, kept only from their seats.

A ``TraceLog`` is a context manager: the file is closed however the run
ends, a failed or stopped run's too. The run's bound is shared out among its
seated agents, so one agent's flood costs only its own traces; a write that
fails (a full disk) leaves the file at its last whole trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from backroom import metrics
from backroom.bus.wire import MAX_TRACE_BYTES, EpisodeRecord, Trace, WireError, parse
from backroom.runs import RecordFile

#: Bytes of traces one run records in its traces.jsonl, shared out equally among its seated
#: agents; past its share, an agent's traces are counted, not written.
TRACES_MAX_BYTES = 1024**3
#: How long a run waits, after its last episode, for the traces of decisions it has not
#: seen yet (``TraceLog.wait_for``); it stops waiting as soon as they are all in.
TRACE_WAIT_S = 5.0

#: A decision: (attempt id, agent, seat, turn). The seat too: one agent may hold several
#: seats of a match, and in a simultaneous game they move on the same turn.
Decision = tuple[str, str, int, int]


class TraceLog:
    """Appends to ``path`` the traces of this run's matches, each decision once, up to ``max_bytes``.

    ``seats_of`` maps an attempt id of the run to the seats of its match
    (None: not this run's). ``agents``: the run's seated agents, among whom
    ``max_bytes`` is shared out equally (none given: one share, the whole
    bound). ``notice`` hears once for each agent that reaches its share, and
    once if a write fails.
    """

    def __init__(
        self,
        path: Path,
        seats_of: Callable[[str], Sequence[str] | None],
        max_bytes: int = TRACES_MAX_BYTES,
        notice: Callable[[str], None] | None = None,
        agents: Collection[str] = (),
    ) -> None:
        self.path = path
        self.seats_of = seats_of
        self.max_bytes = max_bytes
        self.agents = len(set(agents))
        #: Bytes each agent may write: an honest agent's traces never wait on another's flood.
        self.share = max_bytes // max(1, self.agents)
        self.notice = notice or (lambda _msg: None)
        self.file: RecordFile | None = None
        self.last_turn: dict[
            tuple[str, str, int | None], int
        ] = {}  # (attempt, agent, seat) -> turn
        self.written: Counter[str] = Counter()  # agent -> bytes of its traces written
        #: agent -> its traces not written for being past its share (or the run's bound).
        self.over: Counter[str] = Counter()
        #: The decisions whose trace was refused for the bound: never written after.
        self.cut: set[Decision] = set()
        self.write_failed = 0
        #: Every decision whose trace came from its seat (written, or a repeat, or past the
        #: bound); the agents whose decisions ``wait_for`` awaits (the runner adds those
        #: whose status says they trace, ``on_trace`` those that sent one).
        self.decided: set[Decision] = set()
        self.tracers: set[str] = set()
        self._arrived = asyncio.Event()

    def __enter__(self) -> TraceLog:
        self.file = RecordFile(self.path, fsync=False, shared=False)  # the run's alone
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.file is not None:
            self.file.close()

    def on_trace(self, topic: str, payload: bytes) -> None:
        """Record a trace of this run, only as the agent its topic names and only from its seat.

        Any identity may publish on its own ``traces/{agent}`` topic (the ACL
        proves that much), and what it writes inside is its own word: an
        unseated agent could sign its traces "alice". So the sender is the
        topic's agent, the trace must say the same, and the match must seat
        that agent (at ``trace.seat``, when given); anything else is dropped
        and counted in ``backroom_traces_rejected_total``.

        A seated agent's word is bounded too (it could write gigabytes of
        valid traces): a trace over ``MAX_TRACE_BYTES`` is dropped unread;
        each decision is written once: a seat decides its turns in order and
        its traces come in order on one connection, so a turn not after the
        last one written for that seat is a repeat (a redelivery, a replay);
        and each agent writes at most its share of ``max_bytes``, then is
        told of once (``agent_bound``). A write that fails leaves the file at
        its last whole trace; the trace is counted (``write_failed``), said
        once, and the run goes on.
        """
        if self.file is None:
            return
        msg, seats = self._of_this_run(payload)
        if msg is None or seats is None:
            return
        sender = topic.rsplit("/", 1)[-1]
        line = payload.rstrip(b"\n") + b"\n"
        reason = self._refusal(msg, sender, seats, len(line))
        if reason not in ("forged", "not_seated"):  # the seat's own word: its decision is in
            self._decided(msg, sender, seats, cut=reason in ("agent_bound", "run_bound"))
        if reason is None:
            reason = self._write(line)
        if reason is not None:
            metrics.TRACES_REJECTED.labels(reason=reason).inc()
            return
        self.last_turn[(msg.match or "", sender, msg.seat)] = msg.turn
        self.written[sender] += len(line)

    def _of_this_run(self, payload: bytes) -> tuple[Trace | None, Sequence[str] | None]:
        """The trace in ``payload`` and its match's seats; (None, None) when it is not a trace
        of this run (an oversized one counted as refused, unread)."""
        if len(payload) > MAX_TRACE_BYTES:
            metrics.TRACES_REJECTED.labels(reason="oversized").inc()
            return None, None
        try:
            msg = parse(payload, MAX_TRACE_BYTES)
        except WireError:
            return None, None
        if not isinstance(msg, Trace):
            return None, None
        return msg, self.seats_of(msg.match or "")

    def _decided(self, msg: Trace, sender: str, seats: Sequence[str], cut: bool) -> None:
        """The seat's decision is in (its trace ``cut`` when past a budget): no seat said, it
        counts for any seat of the sender's."""
        held = (
            [msg.seat] if msg.seat is not None else [i for i, a in enumerate(seats) if a == sender]
        )
        keys = [(msg.match or "", sender, seat, msg.turn) for seat in held]
        self.decided.update(keys)
        if cut:
            self.over[sender] += 1
            self.cut.update(keys)
        self.tracers.add(sender)
        self._arrived.set()

    def _write(self, line: bytes) -> str | None:
        """Append one trace; ``write_failed`` (said once) when the disk refuses it."""
        assert self.file is not None
        try:
            self.file.append(line)
        except OSError as exc:
            self.write_failed += 1
            if self.write_failed == 1:
                self.notice(
                    f"{self.path}: a trace could not be written ({exc!r}); the file ends at its "
                    "last whole trace, and each trace not written is counted in "
                    'backroom_traces_rejected_total{reason="write_failed"}'
                )
            return "write_failed"
        return None

    def overflow(self, episodes: Iterable[EpisodeRecord]) -> dict[str, tuple[int, int]]:
        """Per agent past its share: (its traces not written, the decisions in ``episodes``
        left without a trace for that): who flooded, and who lost traces by it."""
        lost: Counter[str] = Counter(
            a.agent
            for ep in episodes
            for a in ep.actions
            if (ep.match, a.agent, a.seat, a.turn) in self.cut
        )
        return {agent: (n, lost[agent]) for agent, n in sorted(self.over.items())}

    def missing(self, episodes: Iterable[EpisodeRecord]) -> list[Decision]:
        """The decisions in ``episodes`` of agents that trace whose trace has not come.

        An agent traces if its status says so (``Status.traces``: ``local`` and
        ``llm`` trace every decision, a fallback included; scripted kinds none)
        or if one trace of its own came in this run. A move the referee
        defaulted (``timed_out``) was no decision of the agent.
        """
        return [
            (ep.match, a.agent, a.seat, a.turn)
            for ep in episodes
            for a in ep.actions
            if a.agent in self.tracers
            and not a.timed_out
            and (ep.match, a.agent, a.seat, a.turn) not in self.decided
        ]

    async def wait_for(
        self, episodes: Sequence[EpisodeRecord], timeout_s: float = TRACE_WAIT_S
    ) -> list[Decision]:
        """Wait until every decision in ``episodes`` has its trace; return those still missing.

        Why: a trace and the move it explains travel to different readers (the
        runner, the referee), so the last episode can arrive before the last
        traces. The run waits for exactly those, not for a fixed time, and says
        how many never came (``Faults.traces_missing``).
        """
        deadline = time.monotonic() + timeout_s
        tracers = len(self.tracers)
        missing = self.missing(episodes)  # once, and again only when a new tracer speaks up
        while missing:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
            if len(self.tracers) != tracers:  # its decisions are due too
                tracers = len(self.tracers)
                missing = self.missing(episodes)
            else:
                missing = [d for d in missing if d not in self.decided]
        return missing

    def _refusal(self, msg: Trace, sender: str, seats: Sequence[str], size: int) -> str | None:
        """Why ``msg`` is not written (a ``backroom_traces_rejected_total`` reason), or None."""
        key = (msg.match or "", sender, msg.seat)
        if msg.agent != sender:
            return "forged"
        if sender not in seats or (
            msg.seat is not None and not (0 <= msg.seat < len(seats) and seats[msg.seat] == sender)
        ):
            return "not_seated"
        if key in self.last_turn and msg.turn <= self.last_turn[key]:
            return "duplicate"
        if self.written[sender] + size > self.share:
            if not self.over[sender]:
                self._tell_share(sender)
            return "agent_bound"
        if self.written.total() + size > self.max_bytes:  # only with no agents to share among
            if not self.over[sender]:
                self._tell_share(sender)
            return "run_bound"
        return None

    def _tell_share(self, agent: str) -> None:
        among = f", shared among {self.agents} seated agents" if self.agents > 1 else ""
        self.notice(
            f"traces.jsonl: agent {agent} reached its share of this run's trace bound "
            f"({self.share:,} of {self.max_bytes:,} bytes{among}): its later traces are not "
            'recorded (backroom_traces_rejected_total{reason="agent_bound"}); '
            "the other agents' traces still are"
        )


def overflow_lines(overflow: Mapping[str, tuple[int, int]]) -> list[str]:
    """What a run says of ``TraceLog.overflow``: one line naming every agent past its share."""
    if not overflow:
        return []
    named = "; ".join(
        f"{agent}: {over:,} traces not recorded, {lost} of its decisions left without a trace"
        for agent, (over, lost) in overflow.items()
    )
    return [f"traces past an agent's share of the run's bound: {named}"]


def seats_by_attempt(
    slot_of: Mapping[str, str], seats: Mapping[str, Sequence[str]]
) -> Callable[[str], Sequence[str] | None]:
    """``TraceLog.seats_of`` for a run: an attempt's match, then that match's seats."""

    def seats_of(attempt: str) -> Sequence[str] | None:
        match = slot_of.get(attempt)
        return None if match is None else seats[match]

    return seats_of
