"""One batch being played: the loop that asks for its matches, on a session someone holds.

A ``Batch`` is the part of playing a batch that does not care whose MQTT
connection carries it: the ``MatchLedger`` (the fault rules), the window
(``PlayOptions.concurrency`` matches in flight), the first asks in plan
order, the clocks that resend and ask ``again``, the referees watched, the
stop. It sends through a ``Session`` (``me``, ``send``, ``connected``) and is
told what arrives by whoever reads that session:

* ``play.batch.play`` opens a connection of its own (``play.wiring.Wiring``:
  its subscriptions feed the batch);
* the trainer plays on its persistent session (``trainer.bus.TrainerBus``):
  its receive callbacks hand the batch each episode, and the batch's sink
  (the trainer's store) commits the kept ones in that callback, before the
  PUBACK.

Either way ``episode``, ``acks``, ``referee`` and ``agent`` are the doors in,
``await play()`` the loop. A batch played in part before (a resumed trainer's
step) starts from its ``Earlier`` attempts: a match with a kept episode is
done, the others are asked for again under their last id, or under a new
one where a stop voided it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Protocol

from backroom.bus.wire import EpisodeRecord, MatchRequest
from backroom.play.ledger import MatchLedger, feed_acks
from backroom.play.plan import MatchPlan, PlayOptions, Sink

#: Seconds between two looks at the referees (and at a submitter that failed) while the batch plays.
TICK_S = 0.2


class Session(Protocol):
    """The connection a batch is played on: its requests go out there, replies come to ``me``."""

    @property
    def me(self) -> str:
        """The identity whose inbox gets the referees' replies (``reply_to``)."""
        ...

    def send(self, request: MatchRequest) -> None:
        """One request out (first asks, resends, asks ``again``); never waits."""
        ...

    def connected(self) -> bool: ...


class Referees(Protocol):
    """What the caller knows of referees that the bus does not say, and its rule when none is left.

    ``backroom run`` and the league watch the referee processes they started
    and fail after ``Waits.ready_s`` (``play.wiring.OwnReferees``); the trainer
    is told of its stack's dead referees and fails ``NO_REFEREE_S`` after one
    was lost (``trainer.batch``).
    """

    def dead(self) -> list[tuple[str, str]]:
        """Referee identities whose process exited, with why: lost at once."""
        ...

    def none_left(self, gap_s: float, ledger: MatchLedger) -> None:
        """No live referee for ``gap_s`` seconds (0 at the first look): raise to end the batch, or say so."""
        ...


@dataclass(frozen=True)
class Earlier:
    """A planned match asked for before this batch began (a resumed trainer's step).

    ``attempts`` are the ids it went out under, its own first; ``kept`` the
    episode that is its result, under any of them (the match is done);
    ``stopped``: its last attempt was voided by a stop, so it is asked for
    under a new id, else under its last (its episode may still come).
    """

    attempts: tuple[str, ...]
    kept: EpisodeRecord | None = None
    stopped: bool = False


class Batch:
    """One batch: the ledger, the window, the asks, the clocks and the stop, over a ``Session``.

    What arrives is told through ``episode`` (in the receive callback: a kept
    one goes to ``sink.episode`` there), ``acks``, ``referee`` and ``agent``;
    ``play`` asks for the matches and returns once every one has its episode,
    the batch failed (``ledger.failure``, the caller's to raise), or
    ``options.stop`` was set.
    """

    def __init__(
        self,
        plan: MatchPlan,
        session: Session,
        sink: Sink,
        options: PlayOptions,
        referees: Referees,
        earlier: Mapping[str, Earlier] | None = None,
    ) -> None:
        self.plan = plan
        self.session = session
        self.sink = sink
        self.options = options
        self.referees = referees
        self.specs = {m.match: m.spec for m in plan.matches}
        self.ledger = MatchLedger(
            plan.ids,
            session.send,
            options.faults,
            sink.fault,
            agents=plan.agents,
            on_timeout=plan.on_timeout,
            referee_grace_s=options.waits.referee_grace_s,
            episode_wait_s=options.waits.episode_s,
        )
        #: Matches to ask for under a new id first: a stop voided their last attempt.
        self.stopped: set[str] = set()
        #: Matches asked for in this batch: a kept episode of one frees its place in the window.
        self.asked: set[str] = set()
        self.window = asyncio.Semaphore(options.concurrency)
        self.all_done = asyncio.Event()
        for match, before in (earlier or {}).items():
            self._restore(match, before)
        sink.attempts(self.ledger.slot_of)

    def request(self, match: str, attempt: str | None = None) -> MatchRequest:
        """The request for planned ``match`` under ``attempt`` (its own id by default).

        Replies come batched (``reply_batches``): every session's inbox reader
        splits arrays (``ledger.feed_acks``).
        """
        return MatchRequest(
            match=attempt or match,
            spec=self.specs[match],
            reply_to=self.session.me,
            reply_batches=True,
            run_key=self.plan.run_key,
        )

    def _restore(self, match: str, before: Earlier) -> None:
        attempts = list(before.attempts) or [match]
        if before.kept is not None:
            self.ledger.slot_of.update(dict.fromkeys(attempts, match))
            self.ledger.episodes[match] = before.kept
            return
        self.ledger.restore(match, attempts, self.request(match, attempts[-1]))
        if before.stopped:
            self.stopped.add(match)

    # --- what arrives (from the session's receive callbacks) --------------------------

    def episode(self, record: EpisodeRecord) -> bool:
        """An episode arrived; True when the ledger keeps it, and then the sink has it (``sink.episode``)."""
        if not self.ledger.episode(record):
            return False
        if self.ledger.slot_of[record.match] in self.asked:
            self.window.release()
        self.sink.episode(record)
        self.options.clock.ended = time.perf_counter()  # the last one so far: a stop ends here
        if self.ledger.done:
            self.all_done.set()
        return True

    def acks(self, payload: bytes) -> None:
        """What referees answer in ``session.me``'s inbox (accepted, running, forgotten)."""
        feed_acks(self.ledger, payload)

    def referee(self, name: str, online: bool) -> None:
        """A rostered referee's status said online or offline."""
        (self.ledger.referee_online if online else self.ledger.referee_offline)(name)

    def agent(self, name: str, online: bool) -> None:
        """A seated agent's status: a departure while the batch plays is counted and said."""
        self.ledger.agent_status(name, online)

    def reconnected(self) -> None:
        """The session is back on the broker: every referee's grace starts over."""
        self.ledger.reconnected()

    # --- the loop ----------------------------------------------------------------------

    async def play(self) -> None:
        """Ask for the matches (``concurrency`` in flight) and watch the referees until all are in.

        A submitting task fills the window and this one watches the referees,
        so a submit waiting on a full window never keeps a dead referee from
        being noticed. Returns at once when every match was kept before.
        """
        self.ledger.playing = True
        self.options.clock.started = time.perf_counter()
        if self.ledger.done:
            self.all_done.set()
        submitter = asyncio.create_task(self._submit())
        tasks = [submitter, asyncio.create_task(self._resubmit())]
        tasks.append(asyncio.create_task(self._stop_early()))
        for watch in self.options.watchers:  # a slow run says how it goes (runner.heartbeat)
            tasks.append(asyncio.create_task(_watching(watch(self.ledger.episodes.values))))
        try:
            while not self.all_done.is_set():
                if submitter.done() and (error := submitter.exception()) is not None:
                    raise error
                self.watch_referees()
                # not ``wait_for``: on 3.11 it can swallow a cancel (Ctrl-C) that comes as
                # the event is set
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK_S):
                        await self.all_done.wait()
        finally:
            for task in tasks:
                task.cancel()

    async def _submit(self) -> None:
        """Ask for each match without an episode, in plan order, once the window has room."""
        for match in self.plan.ids:
            await self.window.acquire()
            if (
                match in self.ledger.episodes
            ):  # kept before, or came in meanwhile (a resumed session)
                self.window.release()
                continue
            self.asked.add(match)
            self._start(match)

    def _start(self, match: str) -> None:
        if match in self.stopped:
            self.ledger.ask_again(match, "voided by a stop")
        elif match in self.ledger.current:  # asked for before: again, under its last id
            self.ledger.send(match)
        else:
            # Built when it is first sent, not before: bench/chaos_soak.py times a match
            # from its request's construction.
            self.ledger.ask(self.request(match))

    async def _resubmit(self) -> None:
        """Resend what no referee acknowledged, and ask again for what went silent (the ledger's rules)."""
        ack_s = self.options.waits.ack_s
        while True:
            await asyncio.sleep(ack_s / 2)
            self.ledger.resend(ack_s)
            if self.session.connected():
                self.ledger.ask_silent_again()

    async def _stop_early(self) -> None:
        if self.options.stop is not None:
            await self.options.stop.wait()
            self.all_done.set()  # the matches finished so far are the batch's result

    def watch_referees(self) -> None:
        """Lose referees that died or went away; when none is left, the caller's rule (``Referees``)."""
        ledger = self.ledger
        for name, why in self.referees.dead():
            ledger.lose(name, why)
        ledger.expire(self.session.connected())
        gap = ledger.without_referee()
        if gap is not None:
            self.referees.none_left(gap, ledger)


async def _watching(watch: Awaitable[None]) -> None:
    await watch
