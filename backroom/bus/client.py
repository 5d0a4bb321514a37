"""The one MQTT client every backroom process uses: aiomqtt (MQTT 5) plus what it lacks.

aiomqtt 2.x does not reconnect by itself and does not report a v5 PUBACK's
reason code, so ``Bus`` adds both:

* a supervisor task reconnects with exponential backoff and jitter after any
  disconnect (a broker restart, a network cut), resubscribes every filter and
  calls ``on_connect`` hooks (an agent re-announces itself, a referee voids
  what was in flight);
* ``publish`` waits for the connection, retries after a reconnect (at least
  once delivery: receivers dedupe by ``seq``/``turn``) and raises
  ``NotAuthorizedError`` when the broker answers a QoS 1 publish with a failure
  reason such as 0x87 "not authorized";
* ``publish_batched`` coalesces what one event-loop iteration writes to the
  same topic into one MQTT message (a JSON array, see ``wire.parse_all``).
  One match at a time sends batches of one, so latency is unchanged; a hundred
  matches in flight share packets, and the per-packet cost of the pure-Python
  MQTT client (which dominated at high concurrency) is paid once per batch.

Sockets get TCP_NODELAY: without it a QoS 1 round trip costs 44-88 ms instead
of about 0.5 ms. Sessions use a session-expiry interval so QoS 1 messages sent
while a client is briefly away are queued for it (clean start only on the
first connect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlparse

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel

from backroom import metrics

log = logging.getLogger("backroom.bus")

Handler = Callable[[str, bytes], None]
Hook = Callable[[], Awaitable[None]]


#: Largest batch ``publish_batched`` builds: half the referee's limit on what an
#: agent may send (``wire.MAX_PAYLOAD_BYTES``), so an agent's batch is never refused.
BATCH_MAX_BYTES = 32 * 1024


#: How long a busy process lets a topic's next batch fill (``Bus.set_busy``).
LINGER_S = 0.002
#: Matches in flight from which a process counts as busy and lingers.
BUSY_MATCHES = 4


class BusError(RuntimeError):
    pass


class NotAuthorizedError(BusError):
    """The broker refused a publish; the ACL does not let this identity write there."""


@dataclass
class BusConfig:
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

    @classmethod
    def from_env(cls, username: str | None = None) -> BusConfig:
        """``BACKROOM_BROKER``, ``BACKROOM_USERNAME``, ``BACKROOM_PASSWORD`` (what ``backroom run`` passes its children)."""
        from backroom.bus.broker import DEFAULT_URL  # `backroom broker`'s default, not MQTT's 1883

        url = os.environ.get("BACKROOM_BROKER", DEFAULT_URL)
        return cls.from_url(
            url,
            username=username or os.environ.get("BACKROOM_USERNAME"),
            password=os.environ.get("BACKROOM_PASSWORD"),
        )


@dataclass
class Will:
    topic: str
    payload: bytes
    retain: bool = True


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
        #: Keep the broker-side session of an earlier process with this identity: what
        #: was queued for it while it was down (QoS 1, within the session expiry) is
        #: delivered now. Subscribe before entering, so the backlog finds its handlers.
        self.persistent = persistent
        self.will = will
        self.on_connect = list(on_connect or [])
        self.on_disconnect = list(on_disconnect or [])
        self.role = role
        self._in_count = metrics.BUS_MESSAGES.labels(direction="in", role=role)
        self._out_count = metrics.BUS_MESSAGES.labels(direction="out", role=role)
        self.handlers: list[tuple[str, Handler]] = []
        self.reconnects = 0
        self.connected = asyncio.Event()
        self._client: aiomqtt.Client | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._supervisor: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._closing = False
        self._routes: dict[str, list[tuple[str, Handler]]] = {}  # topic -> matching handlers
        self._batches: dict[str, list[bytes]] = {}
        self._batch_bytes: dict[str, int] = {}
        self._batch_unacked: dict[str, int] = {}  # topic -> batches awaiting their PUBACK
        self._busy_until: dict[str, float] = {}  # topic -> loop time before which it lingers
        self._lingering: set[str] = set()
        self.linger_s = 0.0
        self._flush_handle: asyncio.Handle | None = None
        self._drain: Callable[[], None] | None = None
        self.batch_max_bytes = BATCH_MAX_BYTES

    # --- lifecycle -----------------------------------------------------------

    async def __aenter__(self) -> Bus:
        loop = asyncio.get_running_loop()
        self._first = loop.create_future()
        self._supervisor = asyncio.create_task(
            self._supervise(), name=f"bus-{self.config.username}"
        )
        try:
            await asyncio.wait_for(asyncio.shield(self._first), self.config.connect_timeout_s)
        except TimeoutError:
            await self.close()
            raise BusError(
                f"could not connect to the broker at {self.config.host}:{self.config.port} "
                f"within {self.config.connect_timeout_s}s; is it running?"
            ) from None
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def closing(self) -> bool:
        return self._closing

    async def close(self) -> None:
        if self._batches and self.connected.is_set():
            for topic in list(self._batches):
                self._flush_topic(topic)
            await asyncio.sleep(0)
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
            self._supervisor = None

    # --- subscribe / publish ---------------------------------------------------

    async def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Route messages matching ``topic_filter`` to ``handler(topic, payload)``, now and after reconnects.

        Handlers run on the receive loop and must not block: hand work to a task.
        """
        self.handlers.append((topic_filter, handler))
        self._routes.clear()
        if self._client is not None and self.connected.is_set():
            await self._subscribe_one(self._client, topic_filter, qos)

    async def publish(
        self, topic: str, payload: bytes | BaseModel, qos: int = 1, retain: bool = False
    ) -> None:
        data = payload if isinstance(payload, bytes) else payload.model_dump_json().encode()
        if topic in self._batches:
            self._flush_topic(topic)  # what was batched for this topic goes first
        while True:
            await self.connected.wait()
            client = self._client
            assert client is not None
            try:
                await self._publish_once(client, topic, data, qos, retain)
                self._out_count.inc()
                return
            except (aiomqtt.MqttError, ConnectionError):
                # Lost the connection mid-publish: wait for the supervisor to
                # reconnect and send again (receivers dedupe).
                if self._closing:
                    raise
                self.connected.clear()
                await asyncio.sleep(0.01)

    def publish_nowait(
        self, topic: str, payload: bytes | BaseModel, qos: int = 1, retain: bool = False
    ) -> None:
        """Write now and return: the hot path (a referee's turns) must not wait on PUBACKs.

        Delivery is still at least once: if the connection drops before the
        broker acknowledges, the message is sent again after the reconnect.
        """
        data = payload if isinstance(payload, bytes) else payload.model_dump_json().encode()
        if topic in self._batches:
            self._flush_topic(topic)
        self._write(topic, data, qos, retain)

    def publish_batched(self, topic: str, payload: bytes | BaseModel) -> None:
        """Like ``publish_nowait`` (QoS 1), but when the process is busy
        (``set_busy``), messages for the same ``topic`` share MQTT messages.

        Not busy (``linger_s`` 0, a few matches in flight): the message is
        written to the socket in this call, so an answer leaves before the
        handler that made it returns. Busy: a batch goes out once the loop
        has run what is ready now, except

        * while the previous batch to this topic waits for its PUBACK:
          messages gather until it arrives (Nagle's algorithm, clocked by the
          broker's acknowledgements);
        * at most one batch per topic leaves every ``linger_s`` (a throttle
          like Kafka's ``linger.ms``; the first one goes at once).

        A hundred matches in flight pay the per-packet cost of the
        pure-Python MQTT client once per batch instead of once per message.
        Order per topic is kept, a batch never grows past ``batch_max_bytes``,
        and readers split batches with ``wire.parse_all``.
        """
        data = payload if isinstance(payload, bytes) else payload.model_dump_json().encode()
        parts = self._batches.get(topic)
        if parts is None and self.linger_s == 0 and topic not in self._batch_unacked:
            self._write(topic, data, 1, False)
            if self._drain is not None and self.connected.is_set():
                self._drain()  # the socket now, not one loop iteration later
            return
        if parts is None:
            self._batches[topic] = [data]
            self._batch_bytes[topic] = len(data)
            if topic not in self._batch_unacked:
                self._schedule_flush(topic)
            return
        if self._batch_bytes[topic] + len(data) + 2 > self.batch_max_bytes:
            self._flush_topic(topic)  # full: out now, acknowledged or not
            self._batches[topic] = [data]
            self._batch_bytes[topic] = len(data)
            return
        parts.append(data)
        self._batch_bytes[topic] += len(data) + 1

    def set_busy(self, busy: bool) -> None:
        """Many matches in flight (throughput matters): let batches linger; else send at once."""
        self.linger_s = LINGER_S if busy else 0.0

    def _schedule_flush(self, topic: str) -> None:
        loop = asyncio.get_running_loop()
        busy_until = self._busy_until.get(topic)
        if busy_until is not None and busy_until > loop.time():
            if topic not in self._lingering:
                self._lingering.add(topic)
                loop.call_at(busy_until, self._flush_lingering, topic)
        elif self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        for topic in list(self._batches):
            if topic not in self._batch_unacked and topic not in self._lingering:
                self._flush_topic(topic)
        if self._drain is not None and self.connected.is_set():
            self._drain()  # already deferred once: write now, not one more iteration later

    def _flush_lingering(self, topic: str) -> None:
        self._lingering.discard(topic)
        if topic in self._batches and topic not in self._batch_unacked:
            self._flush_topic(topic)

    def _flush_topic(self, topic: str) -> None:
        parts = self._batches.pop(topic)
        self._batch_bytes.pop(topic, None)
        if self.linger_s > 0:
            self._busy_until[topic] = asyncio.get_running_loop().time() + self.linger_s
        elif self._busy_until:
            self._busy_until.clear()
        data = parts[0] if len(parts) == 1 else b"[" + b",".join(parts) + b"]"
        if self._write(topic, data, 1, False, on_ack=self._batch_acked):
            self._batch_unacked[topic] = self._batch_unacked.get(topic, 0) + 1

    def _batch_acked(self, topic: str) -> None:
        n = self._batch_unacked.pop(topic, 0) - 1
        if n > 0:
            self._batch_unacked[topic] = n
        elif topic in self._batches:
            self._schedule_flush(topic)

    def _write(
        self,
        topic: str,
        data: bytes,
        qos: int,
        retain: bool,
        on_ack: Callable[[str], None] | None = None,
    ) -> bool:
        """Hand ``data`` to paho now; True when ``on_ack(topic)`` will be called once the
        broker answers (or the connection drops). Without a connection, publish when back."""
        client = self._client
        if client is not None and self.connected.is_set():
            info = client._client.publish(topic, data, qos, retain)
            if info.rc == paho.MQTT_ERR_SUCCESS:
                self._out_count.inc()
                if qos and not info.is_published():
                    fut = asyncio.get_running_loop().create_future()
                    self._pending[info.mid] = fut
                    mid = info.mid

                    def done(f: asyncio.Future[Any]) -> None:
                        self._acked(mid, f, topic, data, qos, retain)
                        if on_ack is not None:
                            on_ack(topic)

                    fut.add_done_callback(done)
                    return on_ack is not None
                return False
        self._background(self.publish(topic, data, qos, retain))
        return False

    def _acked(
        self, mid: int, fut: asyncio.Future[Any], topic: str, data: bytes, qos: int, retain: bool
    ) -> None:
        self._pending.pop(mid, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            if not self._closing:
                self._background(self.publish(topic, data, qos, retain))
            return
        reason = fut.result()
        if reason is not None and reason.is_failure:
            log.error("broker refused publish to %s by %s: %s", topic, self.config.username, reason)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish_once(
        self, client: aiomqtt.Client, topic: str, data: bytes, qos: int, retain: bool
    ) -> None:
        # aiomqtt's publish() drops the PUBACK reason code, so publish through
        # its paho client and track the acknowledgement ourselves.
        paho_client: paho.Client = client._client
        info = paho_client.publish(topic, data, qos, retain)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "could not publish")
        if qos == 0 or info.is_published():
            return
        fut = asyncio.get_running_loop().create_future()
        self._pending[info.mid] = fut
        try:
            reason = await asyncio.wait_for(fut, 30)
        except TimeoutError:
            raise aiomqtt.MqttError("no PUBACK within 30s") from None
        finally:
            self._pending.pop(info.mid, None)
        if reason is not None and reason.is_failure:
            raise NotAuthorizedError(
                f"broker refused publish to {topic!r} by {self.config.username!r}: {reason}; "
                "an identity may write only its own outbox, status and traces"
            )

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        fut = self._pending.get(mid)
        if fut is not None and not fut.done():
            fut.set_result(reason)

    async def _subscribe_one(self, client: aiomqtt.Client, topic_filter: str, qos: int) -> None:
        codes = await client.subscribe(topic_filter, qos=qos)
        for code in codes:
            if getattr(code, "is_failure", False):
                raise NotAuthorizedError(f"broker refused subscription to {topic_filter!r}: {code}")

    # --- the connection loop ---------------------------------------------------

    def _make_client(self, clean_start: bool, expiry_s: int | None = None) -> aiomqtt.Client:
        props = Properties(PacketTypes.CONNECT)
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
            max_inflight_messages=1000,
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
        delay = 0.05
        if not self.persistent:
            await self._discard_stale_session()
        while not self._closing:
            client = self._make_client(clean_start=False)
            try:
                async with client:
                    client._client.on_publish = self._wrap_on_publish(client._client.on_publish)
                    self._drain = _write_from_the_loop(client._client)
                    client._client.on_message = self._on_paho_message
                    self._client = client
                    for topic_filter, _ in self.handlers:
                        await self._subscribe_one(client, topic_filter, 1)
                    self.connected.set()
                    if self._first is not None and not self._first.done():
                        self._first.set_result(None)
                    else:
                        self.reconnects += 1
                        metrics.RECONNECTS.labels(role=self.role).inc()
                    delay = 0.05
                    for hook in self.on_connect:
                        self._background(hook())
                    await self._pump(client)
            except aiomqtt.MqttCodeError as exc:
                if self._first is not None and not self._first.done() and _is_auth_failure(exc):
                    self._first.set_exception(
                        BusError(f"broker refused login for {self.config.username!r}: {exc}")
                    )
                    return
                log.warning("bus %s: %s; reconnecting", self.config.username, exc)
            except (aiomqtt.MqttError, OSError) as exc:
                log.info("bus %s: %s; reconnecting", self.config.username, exc)
            except NotAuthorizedError as exc:
                if self._first is not None and not self._first.done():
                    self._first.set_exception(exc)
                    return
                raise
            finally:
                self.connected.clear()
                self._client = None
                self._drain = None
                for fut in self._pending.values():
                    if not fut.done():
                        fut.set_exception(aiomqtt.MqttError("connection lost"))
            if self._closing:
                return
            for hook in self.on_disconnect:
                self._background(hook())
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)

    async def _pump(self, client: aiomqtt.Client) -> None:
        """Dispatch messages until the connection drops.

        A watchdog polls paho's own connection state: when the socket dies in
        the middle of a write, aiomqtt can miss the disconnect and only the
        keepalive would notice, seconds later.
        """

        async def receive() -> None:
            # Deliveries normally reach _on_paho_message straight from paho; the
            # queue only holds what arrived before it was installed (a resumed
            # session's backlog), and the iterator ends when the connection does.
            async for message in client.messages:
                payload = message.payload
                self._dispatch(
                    message.topic.value,
                    payload if isinstance(payload, bytes) else str(payload).encode(),
                )

        async def watchdog() -> None:
            paho_client: paho.Client = client._client
            misses = 0
            while True:
                await asyncio.sleep(0.2)
                misses = 0 if paho_client.is_connected() else misses + 1
                if misses >= 2:
                    raise aiomqtt.MqttError("connection lost (watchdog)")

        tasks = {asyncio.create_task(receive()), asyncio.create_task(watchdog())}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()

    def _wrap_on_publish(self, inner: Any) -> Any:
        def on_publish(c: Any, u: Any, mid: int, reason: Any, props: Any) -> None:
            self._on_publish(c, u, mid, reason, props)
            if inner is not None:
                inner(c, u, mid, reason, props)

        return on_publish

    def _on_paho_message(self, _client: Any, _userdata: Any, message: paho.MQTTMessage) -> None:
        """paho's on_message, in place of aiomqtt's queue: one loop iteration and one
        task switch less per delivery. Handlers are non-blocking by contract."""
        self._dispatch(message.topic, bytes(message.payload))

    def _dispatch(self, topic: str, payload: bytes) -> None:
        self._in_count.inc()
        routes = self._routes.get(topic)
        if routes is None:
            if len(self._routes) > 10_000:
                self._routes.clear()  # topics per match: bound the cache
            routes = self._routes[topic] = [
                (f, h) for f, h in self.handlers if aiomqtt.Topic(topic).matches(f)
            ]
        for topic_filter, handler in routes:
            try:
                handler(topic, payload)
            except Exception:
                log.exception("handler for %s failed on %s", topic_filter, topic)


def _write_from_the_loop(paho_client: paho.Client) -> Callable[[], None]:
    """Write queued packets on the next loop iteration instead of waking the loop through a pipe.

    aiomqtt registers a writer for every packet paho queues, from any thread:
    ``call_soon_threadsafe(add_writer)``, a wake-up, a writable event, then
    ``remove_writer`` — five system calls and two loop iterations per
    publish. Once connected, every publish happens on the loop's own thread,
    so one ``call_soon`` per iteration writes all of them; only when the
    socket's buffer is full (paho still has packets) does aiomqtt's writer
    take over until it drains.
    """
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    via_aiomqtt = paho_client.on_socket_register_write
    scheduled: asyncio.Handle | None = None

    def drain() -> None:
        # Also called directly (a write that must leave now): then the
        # scheduled call has nothing left to do, so it is cancelled.
        nonlocal scheduled
        if scheduled is not None:
            scheduled.cancel()
            scheduled = None
        paho_client.loop_write()
        sock = paho_client.socket()
        if paho_client.want_write() and via_aiomqtt is not None and sock is not None:
            via_aiomqtt(paho_client, None, sock)

    def register_write(client: Any, userdata: Any, sock: Any) -> None:
        nonlocal scheduled
        if threading.get_ident() != loop_thread:
            if via_aiomqtt is not None:
                via_aiomqtt(client, userdata, sock)
            return
        if scheduled is None:
            scheduled = loop.call_soon(drain)

    paho_client.on_socket_register_write = register_write
    return drain


def _is_auth_failure(exc: aiomqtt.MqttCodeError) -> bool:
    rc = exc.rc
    value = getattr(rc, "value", rc)
    return value in (4, 5, 0x86, 0x87, 134, 135)


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
