"""The one MQTT client every backroom process uses: ``async with Bus(config) as bus``.

``Bus`` is the front of four small modules, each with its reasons:

* ``bus.connection``: connect, reconnect with backoff, resubscribe, hooks;
* ``bus.publish``: the one way out (``Bus.publish``) and its one batching rule,
  what is queued between two flushes (after each delivery's handlers, once
  per event-loop iteration) leaves together;
* ``bus.subscriptions``: which handler gets which message;
* ``bus.paho_fixes``: where aiomqtt is bypassed for paho, and why (aiomqtt
  drops the PUBACK's reason code, among others).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from types import TracebackType
from typing import Any

import aiomqtt
import msgspec
from pydantic import BaseModel

from backroom import metrics
from backroom.bus.connection import BusConfig, Connection, Hook, Will
from backroom.bus.errors import BusError, LoginRefused, NotAuthorizedError
from backroom.bus.publish import BATCH_MAX_BYTES, Outbox, Sent
from backroom.bus.subscriptions import Handler, Subscriptions

__all__ = [
    "BATCH_MAX_BYTES",
    "Bus",
    "BusConfig",
    "BusError",
    "Handler",
    "Hook",
    "LoginRefused",
    "NotAuthorizedError",
    "Sent",
    "Will",
    "install_uvloop",
    "run",
]


class Bus:
    """An MQTT 5 connection that stays up. Use ``async with Bus(config) as bus``."""

    def __init__(
        self,
        config: BusConfig,
        *,
        will: Will | None = None,
        on_connect: list[Hook] | None = None,
        on_disconnect: list[Hook] | None = None,
        role: str = "process",
        persistent: bool = False,
    ) -> None:
        self.config = config
        self.role = role
        self.subscriptions = Subscriptions(metrics.BUS_MESSAGES.labels(direction="in", role=role))
        self.outbox = Outbox(
            config.username, metrics.BUS_MESSAGES.labels(direction="out", role=role)
        )
        #: ``persistent``: keep the broker-side session of an earlier process with this
        #: identity, so what was queued for it while it was down (QoS 1, within the
        #: session expiry) is delivered now. Subscribe before entering, so the backlog
        #: finds its handlers.
        self.connection = Connection(
            config,
            self.subscriptions,
            self.outbox,
            will=will,
            on_connect=list(on_connect or []),
            on_disconnect=list(on_disconnect or []),
            role=role,
            persistent=persistent,
        )

    async def __aenter__(self) -> Bus:
        return await self.open()

    async def open(self) -> Bus:
        """Connect (``async with`` does it for you): for owners that open the bus in their own
        ``open``/``__aenter__`` and close it in their ``close``."""
        await self.connection.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Send what is queued, disconnect; awaited publishes not yet acknowledged raise ``BusError``."""
        await self.connection.close()

    @property
    def connected(self) -> asyncio.Event:
        return self.connection.connected

    @property
    def closing(self) -> bool:
        return self.connection.closing

    @property
    def reconnects(self) -> int:
        return self.connection.reconnects

    async def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Route messages matching ``topic_filter`` to ``handler(topic, payload)``, now and after reconnects.

        Handlers run on the receive path and must not block: hand work to a task.
        """
        await self.subscribe_many([topic_filter], handler, qos)

    async def subscribe_many(self, filters: list[str], handler: Handler, qos: int = 1) -> None:
        """``subscribe`` for each of ``filters``, in one SUBSCRIBE (one round trip)."""
        for topic_filter in filters:
            self.subscriptions.add(topic_filter, handler)
        # While a connection subscribes every filter (``subscribe_all``) it is not yet
        # "connected", and a handler may subscribe meanwhile (a retained record naming a
        # topic to follow): sent now, or the connection's list may already be past it.
        client = self.connection.client
        if client is not None and filters:  # no topic at all: a protocol error
            await self.subscriptions.subscribe_many(client, filters, qos)

    def follow(self, filters: list[str], handler: Handler) -> None:
        """``subscribe_many`` from a handler, which must not wait: routed from now on, the
        SUBSCRIBE sent in the background (its SUBACK not awaited). A refusal or a connection
        lost on the way is logged; the filters stay, and the next connection subscribes them."""
        if filters:
            self.connection.background(self.subscribe_many(filters, handler))

    async def unsubscribe_many(self, filters: list[str]) -> None:
        """``unsubscribe`` each of ``filters``, in one UNSUBSCRIBE."""
        for topic_filter in filters:
            self.subscriptions.remove(topic_filter)
        client = self.connection.client
        if client is not None and filters:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.unsubscribe(filters)

    async def unsubscribe(self, topic_filter: str) -> None:
        """Stop routing ``topic_filter`` (every handler given for it), now and after reconnects.

        A connection lost meanwhile is no error: the next one never subscribes it.
        """
        self.subscriptions.remove(topic_filter)
        client = self.connection.client
        if client is not None:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.unsubscribe(topic_filter)

    def publish(
        self,
        topic: str,
        payload: bytes | BaseModel | msgspec.Struct,
        *,
        qos: int = 1,
        retain: bool = False,
        batch: bool = False,
    ) -> Sent:
        """Queue ``payload`` for ``topic``: it leaves at the next flush (``bus.publish``), with
        what else was queued since the last one: when the handler publishing it returns, or
        at the start of the next loop iteration.

        ``await`` the result to wait for the broker's PUBACK (``NotAuthorizedError``
        if the ACL refused it); drop it not to wait (the hot path: a referee's
        turns, an agent's answers). Without a connection it waits for the next
        one. With ``batch``, the messages to ``topic`` that leave together share
        one MQTT message (a JSON array): only for readers that split arrays
        (``wire.parse_all``).
        """
        if isinstance(payload, bytes):
            data = payload
        elif isinstance(payload, BaseModel):
            data = payload.model_dump_json().encode()
        else:
            data = msgspec.json.encode(payload)  # the move path's structs (``bus.structs``)
        return self.outbox.put(topic, data, qos, retain, batch)


def install_uvloop() -> bool:
    """Use uvloop when installed (faster event loop); returns whether it is active."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def run(main: Awaitable[Any]) -> Any:
    """``asyncio.run`` on uvloop when available: the entry point of every backroom process."""
    install_uvloop()
    return asyncio.run(main)  # type: ignore[arg-type]
