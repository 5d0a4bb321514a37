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

Every process that reads statuses reads them through ``read`` (one parse,
one rule for which topic names whom); those that ask "is it online?" ask a
``Roster``, which applies the expiry. docs/architecture.md ("Presence") says
which readers ask a roster and which act only on an explicit ``offline``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from backroom.bus import topics
from backroom.bus.wire import Status, WireError, parse_status

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


@dataclass(frozen=True)
class Presence:
    """One status as read: whose it is (the topic's identity, which the ACL makes the sender)."""

    name: str
    status: Status

    @property
    def online(self) -> bool:
        """What the status says, heartbeat aside (a ``Roster`` applies the expiry)."""
        return self.status.state == "online"


def read(
    topic: str, payload: bytes, dropped: Callable[[WireError], None] | None = None
) -> Presence | None:
    """The status on ``agents/{id}/status``, or None: a topic naming no identity, or a bad payload.

    ``dropped`` hears why a payload was not a status (``WireError.reason``),
    for a reader that counts them.
    """
    name = topics.agent_of(topic)
    if name is None:
        return None
    try:
        status = parse_status(payload)
    except WireError as exc:
        if dropped is not None:
            dropped(exc)
        return None
    return Presence(name, status)


class Roster:
    """Who is online now: each identity's last status, its ``online`` good until it expires.

    The expiry is computed when asked (``online_until`` of the status and its
    arrival on ``clock``), so a ``default_heartbeat_s`` changed later applies
    to statuses already held.
    """

    def __init__(
        self,
        default_heartbeat_s: float | None = STATUS_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: The period assumed of a status that declares none; None: such a status never
        #: expires (for a reader of identities that do not renew, such as referees).
        self.default_heartbeat_s = default_heartbeat_s
        self.clock = clock
        self._last: dict[str, tuple[Status, float]] = {}

    def see(self, topic: str, payload: bytes) -> Presence | None:
        """Read a status message (``read``) and hold it; return what it said, or None."""
        seen = read(topic, payload)
        if seen is not None:
            self.hold(seen)
        return seen

    def hold(self, seen: Presence) -> None:
        """Hold ``seen`` as its identity's latest status, arrived now."""
        self._last[seen.name] = (seen.status, self.clock())

    def forget(self, name: str) -> None:
        """Drop what is held of ``name``: it counts as never seen."""
        self._last.pop(name, None)

    def is_online(self, name: str) -> bool:
        """Whether ``name``'s latest status says online and has not expired."""
        held = self._last.get(name)
        if held is None:
            return False
        status, received = held
        if (
            status.state == "online"
            and status.heartbeat_s is None
            and self.default_heartbeat_s is None
        ):
            return True
        until = online_until(status, received, self.default_heartbeat_s or STATUS_REFRESH_S)
        return is_online(until, self.clock())

    def kind(self, name: str) -> str:
        """The kind ``name``'s latest status declared ("" if none, or never seen)."""
        held = self._last.get(name)
        return held[0].kind if held is not None else ""

    def names(self) -> set[str]:
        """Every identity whose status was seen, online or not."""
        return set(self._last)

    def online(self, names: Iterable[str] | None = None) -> set[str]:
        """Those of ``names`` (default: every identity seen) online now."""
        return {n for n in (self._last if names is None else names) if self.is_online(n)}

    def missing(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` not online now, sorted."""
        return sorted(n for n in set(names) if not self.is_online(n))


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
