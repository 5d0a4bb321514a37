"""Publishing: one queue, one batching rule, at least once.

Every message a process sends goes through ``Outbox.put`` (``Bus.publish``)
into one queue, and the queue is flushed at two moments:

* when a delivery's handlers return (``bus.connection``): what they queued
  leaves at once, before paho queues the delivery's PUBACK. An agent's
  answer to a turn leaves in the callback that read the turn.
* once per event-loop iteration (``call_soon``): what tasks and timers
  queued in one iteration leaves at the start of the next, before the loop
  polls again. A referee's next turns, sent by the match tasks, leave so.

So the rule is: **what is queued between two flushes leaves together, in
order**; nothing lingers and nothing waits for an earlier PUBACK. Messages
put with ``batch=True`` to the same topic share one MQTT message, a JSON
array that readers split with ``wire.parse_all`` (only for readers that
said they read arrays). One match at a time sends arrays of one, which go
out as plain messages; a hundred matches in flight queue many moves per
delivery and per iteration, and the pure-Python MQTT client's per-packet
cost, which bounds the rate there, is paid once per array. Flushing once
per iteration alone measured a slower move: the answer then waited behind
the turn's PUBACK (docs/speed.md).

Nothing waits on the broker unless asked: ``Bus.publish`` returns a ``Sent``
that a caller may ``await`` for the PUBACK (and a ``NotAuthorizedError`` when
the broker's ACL refused it) or drop. Delivery is at least once: a packet
whose PUBACK has not come when the connection drops is queued again and sent
after the reconnect, before anything newer; receivers drop duplicates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator
from typing import Any

from paho.mqtt.reasoncodes import ReasonCode

from backroom.bus.errors import BusError, NotAuthorizedError
from backroom.bus.paho_fixes import PahoLink

log = logging.getLogger("backroom.bus")

#: Largest array one topic's messages are joined into: half the referee's limit on
#: what an agent may send (``wire.MAX_PAYLOAD_BYTES``), so an agent's array is never
#: refused. More goes as several arrays, in order.
BATCH_MAX_BYTES = 32 * 1024

#: MQTT 5's PUBACK reason "no matching subscribers": taken, and given to nobody.
NO_SUBSCRIBERS = 16


class Sent:
    """One MQTT message on its way: ``await`` it to wait for the broker's PUBACK.

    Raises ``NotAuthorizedError`` when the broker refused the message, and
    ``BusError`` when the bus closed before the broker answered. Left
    unawaited, a refusal is logged instead. Messages joined into one array
    share their ``Sent``.
    """

    __slots__ = ("_done", "_error", "_waiter", "topic", "unheard")

    def __init__(self, topic: str) -> None:
        self.topic = topic
        #: The broker took it with nobody subscribed to its topic (MQTT 5's PUBACK reason
        #: 16, "no matching subscribers"): delivered to no one, and no error either.
        self.unheard = False
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None  # made only when someone awaits

    def __await__(self) -> Generator[Any, None, None]:
        if not self._done:
            # A waiter already done was cancelled with an earlier awaiter: make a new one.
            if self._waiter is None or self._waiter.done():
                self._waiter = asyncio.get_running_loop().create_future()
            yield from self._waiter.__await__()
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        """Whether the broker has answered (or the bus gave up): awaiting it returns at once."""
        return self._done

    def resolve(self, error: BaseException | None, unheard: bool = False) -> None:
        """The broker answered (``error`` None when it took the message), or the bus gave up."""
        if self._done:
            return
        self._done, self._error, self.unheard = True, error, unheard
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        elif isinstance(error, NotAuthorizedError):
            log.error("%s", error)  # nobody awaits it to raise


class Packet:
    """One MQTT message to be: a message, or an array of messages to one topic."""

    __slots__ = ("parts", "qos", "retain", "sent", "size", "topic")

    def __init__(self, topic: str, data: bytes, qos: int, retain: bool) -> None:
        self.topic = topic
        self.parts = [data]
        self.size = len(data) + 2  # as an array: the brackets
        self.qos = qos
        self.retain = retain
        self.sent = Sent(topic)

    def payload(self) -> bytes:
        parts = self.parts
        return parts[0] if len(parts) == 1 else b"[" + b",".join(parts) + b"]"


class Outbox:
    """The queue behind ``Bus.publish``; ``bus.connection`` attaches it to each new connection."""

    def __init__(self, who: str | None, count_out: Any) -> None:
        self.who = who  # the MQTT identity, for messages about refusals
        self.batch_max_bytes = BATCH_MAX_BYTES
        self._count_out = count_out
        self._link: PahoLink | None = None
        self._queue: list[Packet] = []  # waiting for the next flush (or the next connection)
        self._open: dict[str, Packet] = {}  # topic -> its array in the queue, still joinable
        self._unacked: dict[int, Packet] = {}  # mid -> handed to paho, no PUBACK yet (send order)
        self._flush_handle: asyncio.Handle | None = None

    def put(self, topic: str, data: bytes, qos: int, retain: bool, batch: bool) -> Sent:
        """Queue ``data`` for ``topic``; with ``batch``, join the array queued for it since the last flush."""
        if batch:
            packet = self._open.get(topic)
            if (
                packet is not None
                and packet.qos == qos
                and packet.retain == retain
                and packet.size + len(data) + 1 <= self.batch_max_bytes
            ):
                packet.parts.append(data)
                packet.size += len(data) + 1
                return packet.sent
        packet = Packet(topic, data, qos, retain)
        self._queue.append(packet)
        if batch:
            self._open[topic] = packet
        else:
            self._open.pop(topic, None)  # what comes after it to this topic leaves after it
        if self._flush_handle is None and self._link is not None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)
        return packet.sent

    def flush(self) -> None:
        """Hand everything queued to paho and write it to the socket, now."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        link = self._link
        if link is None or not self._queue:
            return
        queue, self._queue = self._queue, []
        self._open.clear()
        for i, packet in enumerate(queue):
            try:
                mid = link.publish(packet.topic, packet.payload(), packet.qos, packet.retain)
            except ValueError as exc:  # paho refuses the topic (a wildcard) or the size
                log.error("cannot publish to %r: %s", packet.topic, exc)
                packet.sent.resolve(BusError(f"cannot publish to {packet.topic!r}: {exc}"))
                continue
            if mid is None:  # the connection is going: keep the rest for the next one
                self._queue[:0] = queue[i:]
                break
            self._count_out.inc()
            if mid:
                self._unacked[mid] = packet
            else:
                packet.sent.resolve(None)  # QoS 0: no answer will come
        link.write()

    def acked(self, mid: int, reason: ReasonCode | None) -> None:
        """paho's PUBACK for ``mid``, with its reason code (``PahoLink``)."""
        packet = self._unacked.pop(mid, None)
        if packet is None:
            return
        error = None
        if reason is not None and reason.is_failure:
            error = NotAuthorizedError(
                f"broker refused publish to {packet.topic!r} by {self.who!r}: {reason}; "
                "an identity may write only its own outbox, status and traces"
            )
        packet.sent.resolve(error, unheard=reason is not None and reason.value == NO_SUBSCRIBERS)

    def flush_due(self) -> bool:
        """Whether a flush is scheduled in this loop iteration (``PahoLink`` then waits for it)."""
        return self._flush_handle is not None

    def attach(self, link: PahoLink) -> None:
        """A connection is up: send what waited for it."""
        self._link = link
        link.flush_due = self.flush_due
        self.flush()

    def detach(self) -> None:
        """The connection dropped: what it did not acknowledge goes first on the next one."""
        if self._link is not None:
            self._link.flush_due = None
        self._link = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._unacked:
            self._queue[:0] = self._unacked.values()
            self._unacked.clear()
        self._open.clear()  # the requeued arrays are whole; new messages start new ones

    def close(self) -> None:
        """The bus is closed: nothing queued or unacknowledged will be answered now."""
        self.detach()
        gone = BusError(f"bus {self.who!r} closed before the broker acknowledged")
        for packet in self._queue:
            packet.sent.resolve(gone)
        self._queue.clear()
