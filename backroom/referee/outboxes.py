"""Which outboxes a referee reads: those of the agents seated in its matches.

Reading ``agents/+/outbox`` made every identity's payload the referee's
work: a flat-out flood of small malformed payloads from an agent seated
nowhere was received, parsed by paho and dropped by the budget in Python,
tens of microseconds each, and cut the referee's matches per second to 0.40
of what the same flood cost the machine by itself (``bench/abuse.py``,
``flood_small``). Subscribed to the outboxes of the agents it seats, the
referee never sees an unseated identity's payloads: the broker drops
messages nobody subscribed to. An agent is read from before its first
match here starts (``seat``) until ``LINGER_S`` after its last one ended
(late moves still get their ``late``, and an agent in match after match is
not subscribed again each time); the subscriptions and unsubscriptions of
one moment leave as one SUBSCRIBE or UNSUBSCRIBE.

A seated identity's flood is still read, within its input budget
(``referee.budgets``). Unsubscribing it while over budget was tried and did
not pay: a flat-out flood of small payloads stays within its 10% share most
of the time (docs/operations.md, *Limits*).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Coroutine, Iterable
from typing import Any

from backroom.bus import topics
from backroom.bus.client import Bus, Handler

#: Seconds an agent's outbox is still read after its last match here ended.
LINGER_S = 5.0

log = logging.getLogger("backroom.referee")


class Outboxes:
    """The agents whose outbox this referee reads, by the matches that seat them here."""

    def __init__(self, handler: Handler, linger_s: float = LINGER_S) -> None:
        self.handler = handler
        self.linger_s = linger_s
        self.bus: Bus | None = None
        self.seats: Counter[str] = Counter()  # agent -> its matches here
        self.reading: set[str] = set()  # agents whose outbox is subscribed
        self._idle: dict[str, float] = {}  # agent -> when its last match here ended
        self._sweep: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def seat(self, agents: Iterable[str]) -> None:
        """Read ``agents``' outboxes from now on (one SUBSCRIBE for those not read yet).

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
                new.append(agent)
        if new and self.bus is not None:
            await self.bus.subscribe_many([topics.outbox(a) for a in new], self.handler)

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

    def close(self) -> None:
        """Stop letting agents go (the connection closes next)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _let_go(self) -> None:
        """Unsubscribe, in one UNSUBSCRIBE, every agent idle here for the linger."""
        self._sweep = None
        now = time.monotonic()
        due = [a for a, t in self._idle.items() if now - t >= self.linger_s]
        for agent in due:
            del self._idle[agent]
        gone = [a for a in due if a in self.reading]
        self.reading.difference_update(gone)
        if gone:
            self._spawn(self._unsubscribe(gone))
        if self._idle:
            first = min(self._idle.values())
            wait = max(0.0, first + self.linger_s - now)
            self._sweep = asyncio.get_running_loop().call_later(wait, self._let_go)

    async def _unsubscribe(self, agents: list[str]) -> None:
        # Seated again since (``seat`` ran first): still read.
        gone = [a for a in agents if a not in self.reading]
        if gone and self.bus is not None:
            await self.bus.unsubscribe_many([topics.outbox(a) for a in gone])

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            with contextlib.suppress(Exception):
                log.warning("outbox subscription change failed: %r", task.exception())
