"""How the trainer plays a batch of its requests: the runner's fault rules over its store.

A step's matches (or an evaluation's) are played by the loop ``backroom run``
and the league play through (``play.loop.Batch``, docs/architecture.md "One
batch, three callers"), on the trainer's own session (``TrainerBus``: the
episodes are in its store before their PUBACK, ``StoreSink``). So the fault
rules are the runner's ``MatchLedger``'s (``play.ledger``): a request no
referee took is sent again, a silent match is asked ``again``, a lost
referee's matches are asked for elsewhere, and a match voided because its
referee stopped (``SHUTTING_DOWN``: a Ctrl-C, a referee restarted) is *not
played*, so it is asked for again under a new id (``<match>.r<n>``) with the
same spec, seed and seats. Each new id is stored as a request
before it is sent, so its episode and traces are taken and a resumed trainer
knows it.

Resumed, a step's earlier attempts are read back from the store: a match
with a kept episode under any attempt is done, one whose last attempt was
voided by a stop is asked for again under a new id, one whose last attempt
has no episode yet is asked for again under that id (its episode may wait in
the trainer's MQTT session). So a run stopped during its rollouts and
resumed trains on the same matches as one that ran through.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from backroom.bus.wire import SHUTTING_DOWN, EpisodeRecord, MatchRequest
from backroom.play.faults import Faults
from backroom.play.ledger import MatchLedger
from backroom.play.loop import Batch, Earlier
from backroom.play.plan import Collect, MatchPlan, PlayOptions, Waits
from backroom.trainer.bus import TrainerBus
from backroom.trainer.store import Request, Store

log = logging.getLogger("backroom.trainer")

#: A request's id under which it was asked for again: ``<match>.r<n>`` (``MatchLedger.ask_again``).
_ATTEMPT = re.compile(r"\.r(\d+)$")
#: Seconds a request may go unacknowledged before it is sent again.
ACK_TIMEOUT_S = 2.0
#: Seconds without a live referee, once one was lost, before the batch fails with the reason.
NO_REFEREE_S = 15.0


class BatchError(RuntimeError):
    """The batch cannot go on (every referee gone, a referee that cannot write its file)."""


def is_attempt(match: str) -> bool:
    """Whether ``match`` is a request asked for again under a new id (not a planned one)."""
    return _ATTEMPT.search(match) is not None


def planned_only(requests: Sequence[Request]) -> list[Request]:
    """The planned requests of a stored step, without the ids they were asked for again under."""
    return [r for r in requests if not is_attempt(r.match)]


def stopped(record: EpisodeRecord) -> bool:
    """Voided because its referee stopped: not played, and to be played again."""
    return record.reason == "voided" and record.detail == SHUTTING_DOWN


@dataclass
class Played:
    """What a batch came to: per planned match, the attempt whose episode is its result."""

    planned: int
    #: The attempt to join for each planned match (its kept episode's, else its last), in plan order.
    matches: list[str]
    #: Planned matches with no episode at the end.
    missing: list[str]
    #: Planned match -> why its result is no play (a void that stands: its detail).
    voided: dict[str, str] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)

    @property
    def played(self) -> int:
        return self.planned - len(self.missing) - len(self.voided)

    def summary(self) -> str:
        """``3 of 4 matches (1 voided: reason)``; ``4 of 4 matches`` when every one was played."""
        text = f"{self.played} of {self.planned} matches"
        why: list[str] = []
        if self.voided:
            reasons = sorted(set(self.voided.values()))
            why.append(f"{len(self.voided)} voided: {'; '.join(reasons)}")
        if self.missing:
            why.append(f"{len(self.missing)} without an episode")
        return text + (f" ({', '.join(why)})" if why else "")


class _Asks:
    """The trainer's session as a batch sends on it (``loop.Session``): a request under a new
    id is stored before it goes out, so its episode and traces are taken (the store takes
    them only for requested matches) and a resumed trainer knows it."""

    def __init__(self, tb: TrainerBus, store: Store, planned: Sequence[Request]) -> None:
        self.tb = tb
        self.store = store
        self.by_match = {r.match: r for r in planned}

    @property
    def me(self) -> str:
        return self.tb.me

    def send(self, request: MatchRequest) -> None:
        if self.store.request(request.match) is None:
            base = self.by_match[_ATTEMPT.sub("", request.match)]
            self.store.add_requests([replace(base, match=request.match)])
        self.tb.send(request)

    def connected(self) -> bool:
        return self.tb.connected()


class StoreSink(Collect):
    """The trainer's store as a batch's sink: each kept episode is committed in the session's
    receive callback (``TrainerBus.keep``), before its PUBACK; each fault line is logged (the
    counts are the batch's ``Faults``). Traces are the session's own, so none come here."""

    def __init__(self, tb: TrainerBus) -> None:
        super().__init__(lambda text: log.warning("%s", text))
        self.tb = tb

    def episode(self, record: EpisodeRecord) -> None:
        self.tb.keep(record)


class _Referees:
    """The trainer's referee rule (``loop.Referees``): its stack's dead referees are lost at
    once; with none left ``NO_REFEREE_S`` after one was lost, the batch fails with the reason."""

    def __init__(self, dead_referees: Callable[[], list[tuple[str, str]]] | None) -> None:
        self.dead_referees = dead_referees

    def dead(self) -> list[tuple[str, str]]:
        return self.dead_referees() if self.dead_referees is not None else []

    def none_left(self, gap_s: float, ledger: MatchLedger) -> None:
        if ledger.faults.referees_lost and gap_s > NO_REFEREE_S:
            lost = ", ".join(ledger.faults.referees_lost)
            raise BatchError(
                f"referee {lost} is gone and no referee was online for {NO_REFEREE_S:.0f} s with "
                f"{ledger.unfinished} matches unfinished"
            )


def _restore(store: Store, planned: Sequence[Request]) -> dict[str, Earlier]:
    """A step's earlier attempts, read back from the store: where its batch starts."""
    steps = {(r.step, r.kind) for r in planned}
    attempts: dict[str, list[str]] = {r.match: [] for r in planned}
    for step, kind in steps:
        for a in store.requests(step=step, kind=kind):
            attempts.get(_ATTEMPT.sub("", a.match), []).append(a.match)
    kinds = {kind for _, kind in steps}
    records = {req.match: rec for kind in kinds for req, rec in store.outcomes(kind)}
    return {
        match: _earlier(sorted(tried, key=_attempt_number) or [match], records)
        for match, tried in attempts.items()
    }


def _earlier(tried: list[str], records: Mapping[str, EpisodeRecord]) -> Earlier:
    """A match's attempts (its own id first): its kept episode, else whether a stop voided the last."""
    kept = next((records[a] for a in tried if a in records and not stopped(records[a])), None)
    return Earlier(tuple(tried), kept, stopped=kept is None and tried[-1] in records)


def _attempt_number(match: str) -> int:
    found = _ATTEMPT.search(match)
    return int(found.group(1)) if found else 0


async def play_batch(
    tb: TrainerBus,
    store: Store,
    planned: Sequence[Request],
    timeout_s: float,
    window: int,
    dead_referees: Callable[[], list[tuple[str, str]]] | None = None,
    ack_timeout_s: float = ACK_TIMEOUT_S,
) -> Played:
    """Ask for ``planned`` (at most ``window`` in flight) and wait for one result per match.

    Played as a ``play.loop.Batch`` on the trainer's session, its store the
    sink. Requests are stored before they are sent. ``dead_referees`` names the
    referees of the trainer's own stack whose process exited, with why: their
    matches are asked for elsewhere at once. Raises ``BatchError`` when no
    referee is left for ``NO_REFEREE_S`` after one was lost; after
    ``timeout_s`` returns what came (the rest ``missing``).
    """
    fresh = [r for r in planned if store.request(r.match) is None]
    if fresh:
        store.add_requests(fresh)  # stored before sent: a crash after this resends, never forgets
    # resumed (some were stored before): read the earlier attempts back; else ask for each
    earlier = _restore(store, planned) if len(fresh) < len(planned) else {}
    stop = asyncio.Event()  # set after ``timeout_s``: what came by then is the result
    options = PlayOptions(concurrency=window, waits=Waits(ack_s=ack_timeout_s), stop=stop)
    batch = Batch(
        MatchPlan.of(tb.game, [(r.match, r.spec) for r in planned]),
        _Asks(tb, store, planned),
        StoreSink(tb),
        options,
        _Referees(dead_referees),
        earlier,
    )
    for name, online in tb.referees.items():
        if online:
            batch.referee(name, True)
    timeout = asyncio.get_running_loop().call_later(timeout_s, stop.set)
    tb.batch = batch
    try:
        await batch.play()
    finally:
        timeout.cancel()
        tb.batch = None  # a stop's voided episodes are stored, not asked for again: --resume does
    if batch.ledger.failure is not None:
        raise BatchError(batch.ledger.failure)
    return _played(planned, batch.ledger)


def _played(planned: Sequence[Request], ledger: MatchLedger) -> Played:
    matches, missing, voided = [], [], {}
    for r in planned:
        record = ledger.episodes.get(r.match)
        matches.append(record.match if record is not None else ledger.current.get(r.match, r.match))
        if record is None:
            missing.append(r.match)
        elif record.reason == "voided":
            voided[r.match] = record.detail or "voided"
    return Played(len(planned), matches, missing, voided, ledger.faults)
