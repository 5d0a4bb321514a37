"""Run a coroutine's first step now, in the caller, and make a task only if it suspends.

The agent runtime's scheduling of decisions (``AgentRunner._spawn``). A
message handler that answers at once (a scripted agent's ``act``) otherwise
pays for a task and one event-loop iteration before its answer is queued;
started here, the answer is queued inside the delivery callback and leaves
with the flush after the delivery (``bus.publish``), before the turn's
PUBACK: about 40 µs of a Kuhn move, measured again as worth keeping on
2026-11-23 (docs/speed.md, *One way out*). Python 3.12 has this
built in (``asyncio.Task(..., eager_start=True)``); 3.11, which backroom
supports, does not, so on 3.11 the first step is driven by hand and a
coroutine that suspends is wrapped so a task resumes it where it stopped.

The price on 3.11: until its first real wait the coroutine runs as part of
its caller, with no task of its own (in a delivery callback there is none at
all), so ``asyncio.timeout`` and ``asyncio.current_task()`` do not work
there. Callers opt in per agent (``Agent.inline``).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def start_eagerly(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
    """Step ``coro`` until it first awaits something that is not ready.

    Returns None when it finished in that step (its result is dropped; an
    exception propagates to the caller, as from a plain function call), or a
    task that runs the rest. Must be called from the event loop's thread.
    """
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):  # pragma: no cover - CI runs 3.11
        task = asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
        if task.done():
            task.result()  # raise as the 3.11 path does
            return None
        return task
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return loop.create_task(_resume(coro, waiting_on))


async def _resume(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    return await _Rest(coro, waiting_on)


class _Rest:
    """Awaitable that hands the future ``coro`` stopped on to the task, then keeps stepping ``coro``."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        yielded = self.waiting_on
        while True:
            try:
                sent = yield yielded  # the task waits on it, as it would have for ``coro``
            except BaseException as exc:  # cancellation or anything else thrown in
                try:
                    yielded = self.coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = self.coro.send(sent)
                except StopIteration as stop:
                    return stop.value
