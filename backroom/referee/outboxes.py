"""Which identities a referee reads: the agents seated in its matches, outbox and status.

An agent's moves go to the outbox of the referee that runs the match
(``agents/{agent}/outbox/{referee}``, named in its ``MatchStart``), and a
referee subscribes only to its own, ``agents/{agent}/outbox/{itself}``: with
one shared ``agents/{agent}/outbox`` each of K referees received and parsed
every move of every agent it seated, its peers' matches' too, and K = 4 on 2
cores spent 2.2 times the referees' CPU per match of one referee.

Reading ``agents/+/outbox`` made every identity's payload the referee's
work: a flat-out flood of small malformed payloads from an agent seated
nowhere was received, parsed by paho and dropped by the budget in Python,
tens of microseconds each, and cut the referee's matches per second to 0.40
of what the same flood cost the machine by itself (``bench/abuse.py``,
``flood_small``). Reading ``agents/+/status`` did the same for status flips
and 60 KB statuses. Subscribed to the outbox and the status of the agents
it seats, the referee never sees an unseated identity's payloads: the broker
drops messages nobody subscribed to. An agent is read from before its first
match here starts (``seat``; its retained status comes with the
subscription) until ``LINGER_S`` after its last one ended (late moves still
get their ``late``, and an agent in match after match is not subscribed
again each time); the subscriptions and unsubscriptions of one moment leave
as one SUBSCRIBE or UNSUBSCRIBE.

A seated identity is read within its input budget (``referee.budgets``).
Dropping a payload over budget unread still cost its receipt (some 100 µs
of the socket and paho, as much as judging it), so a seated agent's flat-out
flood took half the referee's matches while the budget said 10%: an
identity over budget is now not read at all (``mute``: its outbox and status
unsubscribed) until its budget is full again. Its moves meanwhile are lost,
so its seats time out to their defaults; every other agent's matches go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from backroom import metrics
from backroom.bus import topics
from backroom.bus.client import Bus, Handler

#: Seconds an agent's outbox and status are still read after its last match here ended.
LINGER_S = 5.0

log = logging.getLogger("backroom.referee")


def _topics(agents: Iterable[str], referee: str) -> list[str]:
    return [t for a in agents for t in (topics.outbox(a, referee), topics.status(a))]


class Outboxes:
    """The agents whose outbox and status this referee reads, by the matches that seat them here."""

    def __init__(
        self,
        on_outbox: Handler,
        on_status: Handler,
        linger_s: float = LINGER_S,
        forget: Callable[[str], None] | None = None,
        referee: str = "referee",
    ) -> None:
        """``referee``: this referee's identity, the last level of the outboxes it reads."""
        self.referee = referee
        self.on_outbox = on_outbox
        self.on_status = on_status
        #: Told each agent let go: what its status said is not followed any more, so it
        #: must not be believed when the agent is seated again (its status is read anew).
        self.forget = forget
        self.linger_s = linger_s
        self.bus: Bus | None = None
        self.seats: Counter[str] = Counter()  # agent -> its matches here
        self.reading: set[str] = set()  # agents seated here or lingering: to be read
        #: Agents over their input budget, not read until the handle fires (``mute``).
        self.muted: dict[str, asyncio.TimerHandle] = {}
        self._idle: dict[str, float] = {}  # agent -> when its last match here ended
        self._sweep: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def changing(self) -> bool:
        """Whether a SUBSCRIBE or UNSUBSCRIBE made here is still on its way."""
        return bool(self._tasks)

    def _route(self, topic: str, payload: bytes) -> None:
        """One handler for both topics of an agent: one SUBSCRIBE for both."""
        (self.on_status if topic.endswith("/status") else self.on_outbox)(topic, payload)

    async def seat(self, agents: Iterable[str]) -> None:
        """Read ``agents``' outboxes and statuses from now on (one SUBSCRIBE for those not
        read yet, unless muted).

        Awaited before the match sends anything: the broker then routes the
        agents' answers to this referee. A match seating an agent whose SUBSCRIBE
        is still on its way need not wait for it: paho writes packets in the order
        they are made, and the broker handles a client's packets in order."""
        new = []
        for agent in agents:
            self.seats[agent] += 1
            self._idle.pop(agent, None)
            if agent not in self.reading:
                self.reading.add(agent)
                if agent not in self.muted:
                    new.append(agent)
        if new and self.bus is not None:
            try:
                await self.bus.subscribe_many(_topics(new, self.referee), self._route)
            except BaseException:
                # Refused (a broker whose ACL does not let referees read outboxes) or cut
                # off: not read, and out of the bus's list (a next connection would
                # subscribe them for good), so the next match seating them tries again.
                self.reading.difference_update(new)
                self._spawn(self._unsubscribe(new))
                raise

    def unseat(self, agents: Iterable[str]) -> None:
        """A match of ``agents`` ended: those in no other match here are let go after the linger."""
        now = time.monotonic()
        for agent in agents:
            self.seats[agent] -= 1
            if self.seats[agent] <= 0:
                del self.seats[agent]
                self._idle[agent] = now
        if self._idle and self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.linger_s, self._let_go)

    def mute(self, agent: str, seconds: float) -> None:
        """``agent`` went over its input budget: read nothing of it for ``seconds``.

        Called for each payload dropped over budget, so also for those already on
        their way when the UNSUBSCRIBE left: those change nothing. Once the time
        is up the agent is read again if it is still seated or lingering here,
        and a payload still over budget mutes it again."""
        if agent in self.muted:
            return
        self.muted[agent] = asyncio.get_running_loop().call_later(seconds, self._unmute, agent)
        metrics.INPUTS_MUTED.inc()
        log.warning(
            "%s is over its input budget: not read for %.1fs (its seats here get their defaults)",
            agent,
            seconds,
        )
        if agent in self.reading:
            self._spawn(self._unsubscribe([agent]))

    def _unmute(self, agent: str) -> None:
        del self.muted[agent]
        if agent in self.reading:
            self._spawn(self._resubscribe(agent))

    async def _resubscribe(self, agent: str) -> None:
        # Let go or muted again since: not read.
        if agent in self.reading and agent not in self.muted and self.bus is not None:
            await self.bus.subscribe_many(_topics([agent], self.referee), self._route)

    def close(self) -> None:
        """Stop letting agents go and muting them (the connection closes next)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for handle in self.muted.values():
            handle.cancel()
        self.muted.clear()

    def _let_go(self) -> None:
        """Unsubscribe, in one UNSUBSCRIBE, every agent idle here for the linger."""
        self._sweep = None
        now = time.monotonic()
        due = [a for a, t in self._idle.items() if now - t >= self.linger_s]
        for agent in due:
            del self._idle[agent]
        gone = [a for a in due if a in self.reading]
        self.reading.difference_update(gone)
        if self.forget is not None:
            for agent in gone:
                self.forget(agent)
        gone = [a for a in gone if a not in self.muted]  # not subscribed now
        if gone:
            self._spawn(self._unsubscribe(gone))
        if self._idle:
            first = min(self._idle.values())
            wait = max(0.0, first + self.linger_s - now)
            self._sweep = asyncio.get_running_loop().call_later(wait, self._let_go)

    async def _unsubscribe(self, agents: list[str]) -> None:
        # Seated again since (``seat`` ran first): still read, unless muted.
        gone = [a for a in agents if a not in self.reading or a in self.muted]
        if gone and self.bus is not None:
            await self.bus.unsubscribe_many(_topics(gone, self.referee))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            with contextlib.suppress(Exception):
                log.warning("outbox subscription change failed: %r", task.exception())
