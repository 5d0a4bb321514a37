"""Claiming an identity at start: one process per name, and the one that comes second stops.

No process can look whether its identity is online without logging in under
it, which throws off whoever is (the MQTT client id is the username, and
Mosquitto closes the older connection without a word). So a process
starting under a name that may be held stays ready, for a window, to be
thrown off in turn: a process still logged in under the name reconnects at
once (the bus's first backoff, about 0.1 s), and the newcomer then stops
without reconnecting (``IdentityInUse``) instead of taking the name back
again and again, round and round (a referee voiding its matches each time,
an agent missing its turns). The holder loses its connection once.

A connection lost while the broker does not even accept a TCP connection
is the broker going away, not another process: the bus reconnects as ever.

Agents, referees and runners claim alike (``IdentityClaim``), with one
error message per role. Each knows on its own whether its name was used
before (an agent reads its first ``online`` back, a referee reads its own
retained status, a runner cannot tell), which is when the window is waited;
a name never used costs no wait, but a takeover during the claim still counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

import aiomqtt

from backroom.bus.auth import Role
from backroom.bus.client import Bus
from backroom.bus.connection import BusConfig, broker_reachable
from backroom.bus.errors import BusError, IdentityInUse, LoginRefused, NotAuthorizedError
from backroom.bus.wire import IDENTITY_WINDOW_S

__all__ = ["IDENTITY_WINDOW_S", "IdentityClaim", "IdentityInUse", "in_use"]

T = TypeVar("T")

#: What a process of each role is called in the error, and a guess at who the other one is.
_WHO: dict[Role, tuple[str, str]] = {
    "agent": ("agent", ""),
    "referee": ("referee", ""),
    "runner": ("run", " (another `backroom run` on this broker?)"),
    "trainer": ("trainer", ""),
    "observer": ("process", ""),
}


def in_use(role: Role, name: str) -> IdentityInUse:
    """The one error every role gives when its name is held, saying both ways out."""
    what, guess = _WHO[role]
    return IdentityInUse(
        f"{role} identity {name!r} is in use: another process logged in as {name!r} took the "
        f"connection back while this {what} was starting{guess}. Stop that process, or start "
        f"this {what} under an identity of its own (`backroom credentials add NAME --role {role}`)."
    )


class IdentityClaim:
    """One process's claim of its identity, from its first connection until it has started.

    The bus must run ``thrown_off`` on every lost connection (its
    ``on_disconnect`` hook), so the claim is made before the ``Bus``; the
    claim lasts for ``async with claim.on(bus):`` around what the process does
    before it counts as started (its first subscriptions, joining a group,
    its first ``online``), with ``hold`` where it waits out the window.
    """

    def __init__(
        self,
        config: BusConfig,
        role: Role,
        *,
        window_s: float = IDENTITY_WINDOW_S,
        used_before: bool = False,
    ) -> None:
        """``used_before``: a process may hold the name now, so ``hold`` waits the window;
        set it later when the caller learns so (a retained status of its own), or from
        the start when it cannot tell (a runner has no status; a name pool is contested)."""
        self.config = config
        self.role = role
        self.name = config.username or role
        self.window_s = window_s
        self.used_before = used_before
        #: Between ``on``'s entry and exit: a connection lost then may be a takeover.
        self.claiming = False
        #: Thrown off while claiming, the broker up: another process holds the name.
        self.taken = asyncio.Event()
        #: When the claim began (monotonic): the first connection, for ``hold(since=...)``.
        self.started = 0.0
        self._bus: Bus | None = None

    def error(self) -> IdentityInUse:
        return in_use(self.role, self.name)

    async def thrown_off(self) -> None:
        """The bus's ``on_disconnect`` hook: a takeover while claiming closes the bus for good.

        The bus waits for its hooks before it tries again, so a process thrown
        off stays off rather than throwing the holder off in turn.
        """
        if self.claiming and await broker_reachable(self.config):
            self.taken.set()
            if self._bus is not None:
                await self._bus.close()

    @asynccontextmanager
    async def on(self, bus: Bus) -> AsyncIterator[IdentityClaim]:
        """Claim over ``bus`` (open, built with ``thrown_off`` as a hook) while the body runs.

        ``IdentityInUse`` when the name was taken meanwhile, also when that
        cut a subscription or an awaited publish short (a raw ``MqttError``
        traceback was all such a clash once said). A refusal by the ACL, or a
        broker that went away, is raised as it is.
        """
        self._bus = bus
        self.started = time.monotonic()
        self.claiming = True
        try:
            yield self
        except (BusError, aiomqtt.MqttError) as exc:
            if isinstance(exc, IdentityInUse):
                raise
            if not self.taken.is_set():
                refused = isinstance(exc, (NotAuthorizedError, LoginRefused))
                if refused or not await broker_reachable(self.config):
                    raise
                self.taken.set()
                await bus.close()
            raise self.error() from None
        finally:
            self.claiming = False
        if self.taken.is_set():
            raise self.error()

    async def unless_taken(self, step: Awaitable[T]) -> T:
        """``step``'s result, unless the name is taken first: then ``IdentityInUse``."""
        work = asyncio.ensure_future(step)
        taken = asyncio.ensure_future(self.taken.wait())
        try:
            await asyncio.wait({work, taken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, taken):
                if not task.done():
                    task.cancel()
        if self.taken.is_set():
            raise self.error()
        return work.result()

    async def hold(self, since: float | None = None) -> None:
        """Stay ``window_s`` from ``since`` (monotonic; default now) to be thrown off, if the
        name was used before; ``IdentityInUse`` if it was taken (by then, or meanwhile)."""
        if self.used_before:
            left = (time.monotonic() if since is None else since) + self.window_s - time.monotonic()
            if left > 0:
                await self.unless_taken(asyncio.sleep(left))
        if self.taken.is_set():
            raise self.error()
