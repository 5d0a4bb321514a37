"""The matches a referee runs now, and the tasks it started for them.

A job of its own because a match's life has edges that must hold whatever
happens inside it: its seats' outboxes are read before its first turn and
let go after its end, its id is remembered as finished (``referee.finished``)
once it leaves, the referee is ``idle`` exactly when none runs, and a task
that fails is logged, never lost, unless it was a publish cut short by the
referee's own shutdown. The requests side (``referee.requests``) starts
matches here; the connection side voids them all when the broker or the
referee goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from backroom.referee.finished import Finished
from backroom.referee.match import Match
from backroom.referee.outboxes import Outboxes


class Running:
    """Matches in flight here (``matches``), the tasks running them (``tasks``), ``idle``."""

    def __init__(
        self,
        outboxes: Outboxes,
        past: Finished,
        log: logging.Logger,
        closing: Callable[[], bool],
    ) -> None:
        """``closing``: whether the referee's connection is being closed (its failures are ours)."""
        self.outboxes = outboxes
        self.past = past
        self.log = log
        self.closing = closing
        self.matches: dict[str, Match] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    def __contains__(self, match_id: str) -> bool:
        return match_id in self.matches

    def start(self, match: Match) -> None:
        """Run ``match`` in a task of its own; the referee is busy until it ends."""
        self.matches[match.id] = match
        self.idle.clear()
        self.spawn(self._run(match))

    async def _run(self, match: Match) -> None:
        seats = match.agents  # the players and the observers: both may write
        try:
            try:
                await self.outboxes.seat(seats)
            except Exception as exc:  # the connection lost: subscribed again on the next one
                self.log.warning("match %s: reading its seats' outboxes: %r", match.id, exc)
            await match.run()
        finally:
            self.outboxes.unseat(seats)
            self.matches.pop(match.id, None)
            self.past.add(match.id)
            if not self.matches:
                self.idle.set()

    def seat_offline(self, agent: str) -> None:
        """``agent``'s status said offline: each match seating it starts its grace."""
        for match in self.matches.values():
            match.seat_offline(agent)

    def void(self, reason: str) -> None:
        """Void every match in flight, for ``reason`` (its episode says why)."""
        for match in list(self.matches.values()):
            match.void(reason)

    async def drain(self, limit_s: float) -> None:
        """Wait up to ``limit_s`` seconds for the tasks started here to end."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=limit_s)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in a task kept until it ends, its failure logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.closing():
            return  # a publish cut short by our own shutdown
        self.log.error("referee task failed: %r", task.exception())
