"""The connection: connect, stay connected, come back after a drop.

aiomqtt 2.x does not reconnect by itself, so ``Connection`` runs a supervisor
task: connect; subscribe every filter again (``bus.subscriptions``); send what
the outbox holds (``bus.publish``); run the ``on_connect`` hooks (an agent
announces itself); read until the connection drops; run the ``on_disconnect``
hooks (a referee voids what was in flight) and let them finish, since one may
close the bus; wait with exponential backoff and jitter; again.

Sockets get TCP_NODELAY: without it a QoS 1 round trip costs 44-88 ms
instead of about 0.5 ms. Sessions have an expiry interval, so QoS 1 messages
sent while a client is briefly away are kept for it; a new process first
drops what an earlier one with its identity left (``persistent`` keeps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from backroom import metrics
from backroom.bus.errors import ConnectTimeout, LoginRefused, NotAuthorizedError
from backroom.bus.paho_fixes import PahoLink
from backroom.bus.publish import Outbox
from backroom.bus.subscriptions import Subscriptions

log = logging.getLogger("backroom.bus")

Hook = Callable[[], Awaitable[None]]

#: Seconds between the watchdog's looks at paho's connection state; two misses end it.
WATCHDOG_S = 0.2


@dataclass(frozen=True)
class BusConfig:
    """Where and as whom to connect. Frozen: one process's settings are shared by its parts
    (a runner's stack, the trainer), so each change is a copy (``dataclasses.replace``)."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    keepalive: int = 10
    session_expiry_s: int = 300
    connect_timeout_s: float = 10.0

    @classmethod
    def from_url(
        cls, url: str, username: str | None = None, password: str | None = None
    ) -> BusConfig:
        """``mqtt://[user[:password]@]host[:port]``; explicit arguments win over the URL."""
        u = urlparse(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "tcp"):
            raise ValueError(f"broker URL must start with mqtt://, not {url!r}")
        return cls(
            host=u.hostname or "127.0.0.1",
            port=u.port or 1883,
            username=username or (unquote(u.username) if u.username else None),
            password=password or (unquote(u.password) if u.password else None),
        )


@dataclass
class Will:
    topic: str
    payload: bytes
    retain: bool = True


class Connection:
    """One MQTT 5 session that stays up, feeding ``subscriptions`` and sending ``outbox``."""

    def __init__(
        self,
        config: BusConfig,
        subscriptions: Subscriptions,
        outbox: Outbox,
        *,
        will: Will | None,
        on_connect: list[Hook],
        on_disconnect: list[Hook],
        role: str,
        persistent: bool,
    ) -> None:
        self.config = config
        self.subscriptions = subscriptions
        self.outbox = outbox
        self.will = will
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self.role = role
        self.persistent = persistent
        self.connected = asyncio.Event()
        self.client: aiomqtt.Client | None = None  # while connected
        self.reconnects = 0
        self.closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._supervisor: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._backoff_s = 0.05  # the next wait after a drop; back to this once connected

    async def open(self) -> None:
        """Connect for the first time; raise ``BusError`` if that fails within the timeout."""
        self._first = asyncio.get_running_loop().create_future()
        self._supervisor = asyncio.create_task(
            self._supervise(), name=f"bus-{self.config.username}"
        )
        try:
            await asyncio.wait_for(asyncio.shield(self._first), self.config.connect_timeout_s)
        except TimeoutError:
            await self.close()
            raise ConnectTimeout(
                f"could not connect to the broker at {self.config.host}:{self.config.port} "
                f"within {self.config.connect_timeout_s}s; is it running?"
            ) from None
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self.connected.is_set():
            self.outbox.flush()  # what was queued this iteration still leaves
        self.closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
            self._supervisor = None
        self.outbox.close()

    def _make_client(self, clean_start: bool, expiry_s: int | None = None) -> aiomqtt.Client:
        # paho's Properties has no annotations (paho-mqtt 2.1).
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self.config.session_expiry_s if expiry_s is None else expiry_s
        will = None
        if self.will is not None and not clean_start:
            will = aiomqtt.Will(self.will.topic, self.will.payload, qos=1, retain=self.will.retain)
        return aiomqtt.Client(
            self.config.host,
            self.config.port,
            username=self.config.username,
            password=self.config.password,
            identifier=self.config.username,
            protocol=aiomqtt.ProtocolVersion.V5,
            will=will,
            keepalive=self.config.keepalive,
            properties=props,
            clean_start=clean_start,
            # No cap of paho's own: at any cap paho walks every unacknowledged packet on
            # each PUBACK (``_update_inflight``), as many as a busy referee has out
            # (docs/speed.md, *In flight without a scan*); Mosquitto counts no QoS 1 publish
            # against a receive maximum, and paho reads none.
            max_inflight_messages=0,
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            timeout=self.config.connect_timeout_s,
        )

    async def _discard_stale_session(self) -> None:
        """Drop what a previous process with this identity left queued.

        Every real connection uses clean start 0 with a session expiry, so QoS 1
        messages sent while we are away (a broker restart, a network cut) are
        kept for us — Mosquitto 2.0 persists a session across its own restart
        only when the client connected with clean start 0. A fresh process must
        not inherit its predecessor's queue, so it first connects once with
        clean start 1 and expiry 0, which deletes any old session.
        """
        try:
            async with self._make_client(clean_start=True, expiry_s=0):
                pass
        except aiomqtt.MqttError as exc:
            log.debug("bus %s: could not pre-clean the session: %s", self.config.username, exc)

    async def _supervise(self) -> None:
        self._backoff_s = 0.05
        if not self.persistent:
            await self._discard_stale_session()
        while not self.closing:
            client = self._make_client(clean_start=False)
            try:
                await self._session(client)
            except aiomqtt.MqttCodeError as exc:
                if _is_auth_failure(exc) and self._fail_first(
                    LoginRefused(f"broker refused login for {self.config.username!r}: {exc}")
                ):
                    return
                log.warning("bus %s: %s; reconnecting", self.config.username, exc)
            except (aiomqtt.MqttError, OSError) as exc:
                log.info("bus %s: %s; reconnecting", self.config.username, exc)
            except NotAuthorizedError as exc:
                if self._fail_first(exc):
                    return
                raise
            if self.closing:
                return
            await self._after_drop()

    async def _session(self, client: aiomqtt.Client) -> None:
        """One connection, from its CONNECT to its drop (raised): subscribe, send, hooks, read."""
        try:
            async with client:
                link = PahoLink(client, self._deliver, self.outbox.acked)
                self.client = client
                await self.subscriptions.subscribe_all(client)
                self.outbox.attach(link)
                self.connected.set()
                if self._first is not None and not self._first.done():
                    self._first.set_result(None)
                else:
                    self.reconnects += 1
                    metrics.RECONNECTS.labels(role=self.role).inc()
                self._backoff_s = 0.05
                for hook in self.on_connect:
                    self._background(hook())
                await self._read(client, link)
        finally:
            self.connected.clear()
            self.client = None
            self.outbox.detach()

    def _fail_first(self, exc: BaseException) -> bool:
        """Whether ``open`` still waits for the first connection: then it raises ``exc``.

        A refusal while starting is final (a wrong password, an identity not
        allowed); once connected, the same refusal is one more drop to come back from.
        """
        if self._first is None or self._first.done():
            return False
        self._first.set_exception(exc)
        return True

    async def _after_drop(self) -> None:
        """The ``on_disconnect`` hooks, then the backoff (doubling, with jitter) before the next try.

        The hooks decide before the next try whether there is one: a process
        thrown off its identity while starting closes its bus (``IdentityInUse``).
        Had it reconnected meanwhile, it would throw the new holder off in turn,
        and both would give the name up (seen on a loaded machine, where a hook
        took longer than the first backoff).
        """
        hooks = [self._background(hook()) for hook in self.on_disconnect]
        if hooks:
            await asyncio.wait(hooks, timeout=self.config.connect_timeout_s)
        await asyncio.sleep(self._backoff_s * (0.5 + random.random()))
        self._backoff_s = min(self._backoff_s * 2, 2.0)

    async def _read(self, client: aiomqtt.Client, link: PahoLink) -> None:
        """Return (by raising) when the connection drops.

        Deliveries reach the handlers straight from paho (``PahoLink``); the
        iterator only carries what arrived before that was installed (a
        resumed session's backlog) and ends when the connection does. A
        watchdog reads paho's own connection state: when the socket dies in
        the middle of a write, aiomqtt can miss the disconnect and only the
        keepalive would notice, seconds later.
        """

        async def backlog() -> None:
            async for message in client.messages:
                payload = message.payload
                self._deliver(
                    message.topic.value,
                    payload if isinstance(payload, bytes) else str(payload).encode(),
                )

        async def watchdog() -> None:
            misses = 0
            while True:
                await asyncio.sleep(WATCHDOG_S)
                misses = 0 if link.is_connected() else misses + 1
                if misses >= 2:
                    raise aiomqtt.MqttError("connection lost (watchdog)")

        tasks = {asyncio.create_task(backlog()), asyncio.create_task(watchdog())}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()

    def _deliver(self, topic: str, payload: bytes) -> None:
        """A message from paho: its handlers run, then what they queued leaves (``bus.publish``)."""
        self.subscriptions.deliver(topic, payload)
        self.outbox.flush()

    def _background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def background(self, coro: Any) -> None:
        """Run ``coro`` as a task of this connection's; its failure is logged, not raised."""
        self._background(coro).add_done_callback(self._log_failure)

    def _log_failure(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.info("bus %s: background %r", self.config.username, exc)


def _is_auth_failure(exc: aiomqtt.MqttCodeError) -> bool:
    """Whether a refused CONNECT means bad credentials (MQTT 3.1.1: 4, 5; MQTT 5: 0x86, 0x87).

    Only a CONNACK's code says so. Other errors carry paho's own codes, where 4
    is "not connected": a subscribe cut short because another process took the
    identity right after the login read as a refused password (and ended a
    referee of a name pool that had only lost a race for a name).
    """
    if not isinstance(exc, MqttConnectError):
        return False
    rc = exc.rc
    value = getattr(rc, "value", rc)
    return value in (4, 5, 0x86, 0x87)


async def broker_reachable(config: BusConfig, timeout_s: float = 1.0) -> bool:
    """Whether the broker accepts a TCP connection now (no MQTT: nobody is logged in or out).

    Tells why a connection just dropped: with the broker gone (restarting,
    unreachable) this is False; with the broker there, another client most
    likely logged in under this identity (Mosquitto closes the older connection
    without a DISCONNECT saying why).
    """
    try:
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection(config.host, config.port), timeout_s
        )
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
