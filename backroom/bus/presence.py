"""Whether an identity is online: a retained status that must be renewed, or it expires.

An identity's ``agents/{id}/status`` is retained, with a last will of
``offline``. The will does not cover every death: a process that closes its
connection normally without saying ``offline`` first (its offline publish
timed out), or whose broker was down when it died and came back from
persistence, leaves a retained ``online`` behind for good, and a reader that
believes it (``backroom web`` refuses seats of identities online elsewhere)
would believe it forever.

So a process that is online says so again every ``heartbeat_s`` seconds
(``Status.heartbeat_s`` declares the period; ``keep_announcing`` does it),
and a reader takes an ``online`` not renewed within ``STALE_AFTER_BEATS``
periods of its arrival as gone (``online_until``). A status that declares no
period (an older agent, a raw MQTT client) is held to ``STATUS_REFRESH_S``.
Arrival is measured on the reader's own monotonic clock, never against the
sender's ``ts``, so a sender's clock running late cannot make a live identity
look gone: a stale status delivered as retained when a reader starts still
blocks for one window, then expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from backroom.bus.wire import Status

log = logging.getLogger("backroom.bus")

#: How often an online identity says so again (seconds), unless it declares another period.
STATUS_REFRESH_S = 30.0
#: Missed renewals after which an ``online`` counts as gone: one late or lost message is not enough.
STALE_AFTER_BEATS = 3


def online_until(
    status: Status, received: float, default_heartbeat_s: float = STATUS_REFRESH_S
) -> float:
    """The ``time.monotonic()`` until which ``status``, received at ``received``, says online.

    An ``offline`` status says so until nothing: ``received`` itself, i.e. already past.
    """
    if status.state != "online":
        return received
    return received + STALE_AFTER_BEATS * (status.heartbeat_s or default_heartbeat_s)


def is_online(until: float, now: float | None = None) -> bool:
    """Whether an ``online_until`` deadline has not passed yet."""
    return (time.monotonic() if now is None else now) < until


async def keep_announcing(announce: Callable[[], Awaitable[object]], every_s: float) -> None:
    """Call ``announce`` every ``every_s`` seconds until cancelled; a failed call is retried next time.

    The caller announces at once when it connects (and after each reconnect);
    this only renews it. Cancel it before publishing ``offline``, so no renewal
    can follow that and undo it.
    """
    while True:
        await asyncio.sleep(every_s)
        try:
            await announce()
        except Exception as exc:  # the broker away: the next connect announces anyway
            log.debug("status renewal failed: %s", exc)


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a ``keep_announcing`` task and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
