"""Where the bus reaches past aiomqtt into the paho client under it, and why.

aiomqtt 2.x wraps paho-mqtt for asyncio. Four things it does not do as the bus
needs them, so once a connection is up ``PahoLink`` installs its own paho
callbacks. Every use of aiomqtt's private ``_client`` (the paho client) is in
this module; nothing else in backroom touches paho's internals.

1. **PUBACK reason codes.** ``aiomqtt.Client.publish`` waits for the PUBACK
   but drops its MQTT 5 reason code, so a publish the broker's ACL refused
   (0x87 "not authorized") looks like a success. ``PahoLink.publish`` hands
   the packet to paho directly and paho's ``on_publish`` reports each
   acknowledgement with its reason code (``on_ack``).
2. **Deliveries.** aiomqtt puts each message in a queue that a task drains
   through an async iterator: one loop iteration and a task switch per
   delivery. Handlers here are non-blocking by contract, so paho's
   ``on_message`` calls them directly. (aiomqtt's queue still holds what
   arrived before this callback was installed: a resumed session's backlog.)
3. **Writes.** For every packet paho queues, aiomqtt registers a socket
   writer from any thread: ``call_soon_threadsafe(add_writer)``, a self-pipe
   wake-up, a writable event, then ``remove_writer``: five system calls and
   two loop iterations per packet. Once connected, every publish happens on
   the loop's own thread, so ``PahoLink.write`` writes what paho holds in one
   go; aiomqtt's writer takes over only when the socket's buffer is full.

4. **Acknowledgements after answers.** paho queues a delivery's PUBACK
   the moment its ``on_message`` returns, so a referee's next turn, queued
   by the match task that the delivered answer woke, left in a second
   socket write behind that PUBACK. With paho's public ``manual_ack``,
   ``PahoLink`` acknowledges what it read in its next write, after
   everything the outbox queued meanwhile: the turn is on its way before
   the PUBACK of the move that caused it (docs/speed.md, *Answers before
   acknowledgements*). A connection that drops between the two loses the
   PUBACK, as it could before, and the broker delivers the message again.

A write from inside a paho callback (every handler that answers a
delivery) lets go of paho's callback lock while it writes: see ``write``.

aiomqtt can also miss a disconnect when the socket dies in the middle of a
write (only the keepalive notices, seconds later); ``PahoLink.is_connected``
reads paho's own state for the watchdog in ``bus.connection``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.reasoncodes import ReasonCode

#: ``on_ack(mid, reason)``: the broker acknowledged packet ``mid``; ``reason`` is
#: the PUBACK's reason code (None when the broker sent none).
AckCallback = Callable[[int, ReasonCode | None], None]
#: ``deliver(topic, payload)``: a message arrived.
DeliverCallback = Callable[[str, bytes], None]


class PahoLink:
    """The paho client under one connected ``aiomqtt.Client``, with the three fixes above.

    Made on each connect (``bus.connection``) and dropped with the connection.
    """

    def __init__(
        self, client: aiomqtt.Client, deliver: DeliverCallback, on_ack: AckCallback
    ) -> None:
        self._paho: paho.Client = client._client
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._deliver = deliver
        self._on_ack = on_ack
        self._aiomqtt_on_publish: Any = self._paho.on_publish  # paho types it as v1 | v2
        self._aiomqtt_register_write = self._paho.on_socket_register_write
        self._write_scheduled: asyncio.Handle | None = None
        #: Whether the outbox will write in this loop iteration anyway (``Outbox.flush_due``):
        #: then what paho queued of its own (acknowledgements, pings) leaves with that write.
        self.flush_due: Callable[[], bool] | None = None
        # Fix 4: what was read is acknowledged in the next write, after what it caused.
        self._acks: list[tuple[int, int]] = []  # (mid, qos) read, not yet acknowledged
        self._paho.manual_ack_set(True)
        self._paho.on_publish = self._on_publish
        self._paho.on_message = self._on_message
        self._paho.on_socket_register_write = self._register_write

    def publish(self, topic: str, data: bytes, qos: int, retain: bool) -> int | None:
        """Queue one packet in paho (``write`` sends it).

        Returns its message id when a PUBACK will follow, 0 when none will
        (QoS 0), None when paho is not connected (send it again on the next
        connection).
        """
        info = self._paho.publish(topic, data, qos, retain)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            return None
        return info.mid if qos else 0

    def write(self) -> None:
        """Write what paho holds to the socket now (fix 3).

        Most writes happen inside a paho callback: a handler answering a
        delivery, under paho's callback lock, which is not reentrant. A write
        that finds the socket dead makes paho close it and call
        ``on_socket_close`` and ``on_disconnect``, each under that same lock,
        on the same thread: the process stopped for good (found by
        ``bench/chaos_soak.py``: a referee answering while the broker
        restarted). So the lock is let go for the write and taken back after
        (paho runs only on the loop's thread once connected: the holder is this
        thread). Deferring the write to the next loop iteration instead cost about
        10% of the bus's rate at 100 matches in flight (``bench/bus_overhead.py
        --quick --only rate``, three alternating runs each).
        """
        if self._acks:
            acks, self._acks = self._acks, []
            for mid, qos in acks:
                self._paho.ack(mid, qos)  # behind what the outbox handed paho before this write
        if self._write_scheduled is not None:
            self._write_scheduled.cancel()  # this call does what it would have done
            self._write_scheduled = None
        lock = self._paho._in_callback_mutex
        inside = threading.get_ident() == self._loop_thread and lock.locked()
        if inside:
            lock.release()
        try:
            with contextlib.suppress(OSError):  # a dead socket: paho reports the loss itself
                self._paho.loop_write()
        finally:
            if inside:
                lock.acquire()
        sock = self._paho.socket()
        if self._paho.want_write() and self._aiomqtt_register_write is not None and sock:
            self._aiomqtt_register_write(self._paho, None, sock)

    def is_connected(self) -> bool:
        return self._paho.is_connected()

    def _register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        # paho queued a packet of its own (a PUBACK, a PINGREQ) or ours.
        if threading.get_ident() != self._loop_thread:  # the connect, in aiomqtt's executor
            if self._aiomqtt_register_write is not None:
                self._aiomqtt_register_write(client, userdata, sock)
            return
        if self._write_scheduled is None:
            self._write_scheduled = self._loop.call_soon(self._write_soon)

    def _write_soon(self) -> None:
        """A write paho asked for, or an acknowledgement's: left to the outbox's flush when
        one is due in this iteration (it writes everything paho holds), else done now."""
        self._write_scheduled = None
        if self.flush_due is None or not self.flush_due():
            self.write()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        self._on_ack(mid, reason if isinstance(reason, ReasonCode) else None)
        if self._aiomqtt_on_publish is not None:
            self._aiomqtt_on_publish(client, userdata, mid, reason, props)

    def _on_message(self, _client: Any, _userdata: Any, message: paho.MQTTMessage) -> None:
        if message.qos:
            # Written by the first write after the handlers return, never during them: a
            # handler's publish only queues (``bus.publish``), so what a handler commits
            # (the trainer's store) is committed before the broker hears it was taken.
            self._acks.append((message.mid, message.qos))
        try:
            self._deliver(message.topic, bytes(message.payload))
        finally:  # a delivery that raised is acknowledged all the same, as paho did
            if self._acks and self._write_scheduled is None:  # the handlers wrote nothing
                self._write_scheduled = self._loop.call_soon(self._write_soon)
