"""How the trainer plays a batch of its requests: the runner's fault rules over its store.

A step's matches (or an evaluation's) are asked for through the runner's
``MatchLedger`` (``play.ledger``, docs/architecture.md "One batch, three
callers"): a request no referee took is sent again, a silent match is asked
``again``, a lost referee's matches are asked for elsewhere, and a match voided
because its referee stopped (``SHUTTING_DOWN``: a Ctrl-C, a referee restarted)
is *not played*, so it is asked for again under a new id (``<match>.r<n>``)
with the same spec, seed and seats. Each new id is stored as a request
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

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from backroom.bus.wire import SHUTTING_DOWN, EpisodeRecord, MatchRequest
from backroom.play.faults import Faults
from backroom.play.ledger import MatchLedger
from backroom.trainer.bus import TrainerBus
from backroom.trainer.store import Request, Store

log = logging.getLogger("backroom.trainer")

#: A request's id under which it was asked for again: ``<match>.r<n>`` (``MatchLedger.ask_again``).
_ATTEMPT = re.compile(r"\.r(\d+)$")
#: Seconds a request may go unacknowledged before it is sent again.
ACK_TIMEOUT_S = 2.0
#: Seconds without a live referee, once one was lost, before the batch fails with the reason.
NO_REFEREE_S = 15.0
#: How often the ledger's clocks are looked at while the batch waits.
TICK_S = 0.25


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


def _restore(
    tb: TrainerBus, store: Store, planned: Sequence[Request], ledger: MatchLedger
) -> list[tuple[str, bool]]:
    """Read a step's earlier attempts back into the ledger; what to send: (match, under a new id)."""
    steps = {(r.step, r.kind) for r in planned}
    stored = [a for step, kind in steps for a in store.requests(step=step, kind=kind)]
    kinds = {kind for _, kind in steps}
    records = {req.match: rec for kind in kinds for req, rec in store.outcomes(kind)}
    attempts: dict[str, list[str]] = {r.match: [] for r in planned}
    for a in stored:
        base = _ATTEMPT.sub("", a.match)
        if base in attempts:
            attempts[base].append(a.match)
    todo: list[tuple[str, bool]] = []
    for r in planned:
        tried = sorted(attempts[r.match], key=_attempt_number) or [r.match]
        kept = next((records[a] for a in tried if a in records and not stopped(records[a])), None)
        if kept is not None:
            ledger.slot_of.update(dict.fromkeys(tried, r.match))
            ledger.episodes[r.match] = kept
            continue
        last = tried[-1]
        ledger.restore(r.match, tried, MatchRequest(match=last, spec=r.spec, reply_to=tb.me))
        todo.append((r.match, last in records))
    return todo


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

    Requests are stored before they are sent. ``dead_referees`` names the
    referees of the trainer's own stack whose process exited, with why: their
    matches are asked for elsewhere at once. Raises ``BatchError`` when no
    referee is left for ``NO_REFEREE_S`` after one was lost; after
    ``timeout_s`` returns what came (the rest ``missing``).
    """
    by_match = {r.match: r for r in planned}
    fresh = [r for r in planned if store.request(r.match) is None]
    if fresh:
        store.add_requests(fresh)  # stored before sent: a crash after this resends, never forgets

    def publish(request: MatchRequest) -> None:
        base = by_match[ledger.slot_of[request.match]]
        if store.request(request.match) is None:  # a new id: stored first, so its episode counts
            store.add_requests([replace(base, match=request.match)])
        tb.send(request)

    ledger = MatchLedger(
        [r.match for r in planned], publish, Faults(), lambda text: log.warning("%s", text)
    )
    # resumed (some were stored before): read the earlier attempts back; else ask for each
    todo = (
        _restore(tb, store, planned, ledger)
        if len(fresh) < len(planned)
        else [(r.match, False) for r in planned]
    )
    for name, online in tb.referees.items():
        if online:
            ledger.referee_online(name)
    asked: set[str] = set(ledger.episodes)
    deadline = time.monotonic() + timeout_s
    tb.ledger = ledger
    try:
        while not ledger.done and time.monotonic() < deadline:
            while todo and len(asked - ledger.episodes.keys()) < window:
                match, again = todo.pop(0)
                asked.add(match)
                if again:
                    ledger.ask_again(match, "voided by a stop")
                elif match in ledger.current:
                    ledger.send(match)
                else:
                    ledger.ask(MatchRequest(match=match, spec=by_match[match].spec, reply_to=tb.me))
            _tick(tb, ledger, dead_referees, ack_timeout_s)
            await tb.changed(TICK_S)
    finally:
        tb.ledger = None  # a stop's voided episodes are stored, not asked for again: --resume does
    if ledger.failure is not None:
        raise BatchError(ledger.failure)
    return _played(planned, ledger)


def _tick(
    tb: TrainerBus,
    ledger: MatchLedger,
    dead_referees: Callable[[], list[tuple[str, str]]] | None,
    ack_timeout_s: float,
) -> None:
    """The ledger's clocks: resend, ask silent matches again, lose dead or gone referees."""
    connected = tb.connected()
    ledger.resend(ack_timeout_s)
    if connected:
        ledger.ask_silent_again()
    for name, why in dead_referees() if dead_referees is not None else []:
        ledger.lose(name, why)
    ledger.expire(connected)
    gap = ledger.without_referee()
    if gap is not None and ledger.faults.referees_lost and gap > NO_REFEREE_S:
        lost = ", ".join(ledger.faults.referees_lost)
        raise BatchError(
            f"referee {lost} is gone and no referee was online for {NO_REFEREE_S:.0f} s with "
            f"{ledger.unfinished} matches unfinished"
        )


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
