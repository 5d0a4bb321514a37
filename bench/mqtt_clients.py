"""backroom's MQTT client against gmqtt on the move path, side by side in one run.

Issue 37 asks whether gmqtt (asyncio-native MQTT 5: PUBACK reason codes handed to the
caller, its own reconnect) should replace aiomqtt plus ``bus/paho_fixes.py`` (the
module that reaches into aiomqtt's private paho client for PUBACK codes, direct
deliveries and one write per flush). Adopt it where it is at least 10% faster and
takes the private-API patching away; otherwise keep the numbers and why not.

What is timed, for each client, through the same Mosquitto (QoS 1, TCP_NODELAY where
the client takes it, uvloop in both processes as backroom runs):

1. **Round trip**: A publishes a ping the size of an agent's answer, B (an echo in
   its own process, the same client library) answers on another topic, A receives.
   This is one refereed move's bus part: a ``Turn`` out, an ``Action`` back.
2. **100 in flight**: round trips per second with 100 pings always outstanding.

The clients: ``bus`` is backroom's ``Bus`` (aiomqtt, with paho_fixes' direct
deliveries and flushes, a handler per topic), ``gmqtt`` is gmqtt 0.8's ``Client``
(``on_message`` handlers, ``publish`` queued on the loop). Blocks of the two alternate
so the machine's drift touches both alike; the printed ratios are gmqtt / bus.

    python bench/mqtt_clients.py            # 10 blocks of 300 round trips, 5 s of 100 in flight each
    python bench/mqtt_clients.py --quick    # a smoke run (tests/test_bench.py)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import TypeVar

from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, BusConfig, install_uvloop

CLIENTS = ("bus", "gmqtt")
T = TypeVar("T")
#: A ping: the size of an agent's answer, with the request's number first.
PING = b'{"turn":%d,"type":"action","v":1,"action":1}'


def pair_topics(name: str) -> tuple[str, str]:
    """Ping and pong topics the broker's ACL allows: A (a trainer) writes checkpoints, B (an
    agent) reads them and answers on its traces, which a trainer reads."""
    return topics.checkpoint(name), topics.traces(f"{name}-b")


# --- one client library behind one small interface -----------------------------------------

Handler = Callable[[bytes], None]


class BusSide:
    """backroom's ``Bus``: publish is queued and flushed, deliveries call the handler."""

    def __init__(self, cfg: BusConfig) -> None:
        self.bus = Bus(cfg)

    async def open(self, topic: str, handler: Handler) -> None:
        await self.bus.open()
        await self.bus.subscribe(topic, lambda _t, payload: handler(payload))

    def send(self, topic: str, payload: bytes) -> None:
        self.bus.publish(topic, payload)

    async def close(self) -> None:
        await self.bus.close()


class GmqttSide:
    """gmqtt's ``Client``: ``publish`` queues the packet on the loop, ``on_message`` delivers."""

    def __init__(self, cfg: BusConfig) -> None:
        from gmqtt import Client

        self.cfg = cfg
        self.client = Client(f"{cfg.username}-g")
        self.client.set_auth_credentials(cfg.username, cfg.password)

    async def open(self, topic: str, handler: Handler) -> None:
        from gmqtt.mqtt.constants import MQTTv50

        subscribed = asyncio.get_running_loop().create_future()

        def on_message(client: object, t: str, payload: bytes, qos: int, props: object) -> int:
            handler(payload)
            return 0  # PUBACK reason: success

        def on_subscribe(client: object, mid: int, qos: object, props: object) -> None:
            if not subscribed.done():
                subscribed.set_result(None)

        self.client.on_message = on_message
        self.client.on_subscribe = on_subscribe
        await self.client.connect(self.cfg.host, self.cfg.port, version=MQTTv50)
        self.client.subscribe(topic, qos=1)
        await subscribed

    def send(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1)

    async def close(self) -> None:
        await self.client.disconnect()


def side(kind: str, cfg: BusConfig) -> BusSide | GmqttSide:
    return BusSide(cfg) if kind == "bus" else GmqttSide(cfg)


# --- the echo process ---------------------------------------------------------------------


async def echo(kind: str, cfg: BusConfig, name: str) -> None:
    """B: answer every ping on the pong topic, until killed."""
    ping, pong = pair_topics(name)
    b = side(kind, cfg)
    await b.open(ping, lambda payload: b.send(pong, payload))
    await asyncio.Event().wait()


# --- the timed side -----------------------------------------------------------------------


class Pinger:
    """A: sends pings, wakes the waiter on each answer."""

    def __init__(self, kind: str, cfg: BusConfig, name: str) -> None:
        self.ping, self.pong = pair_topics(name)
        self.a = side(kind, cfg)
        self.answers = 0
        self.wake: asyncio.Event = asyncio.Event()

    def _on(self, payload: bytes) -> None:
        self.answers += 1
        self.wake.set()

    async def open(self) -> None:
        await self.a.open(self.pong, self._on)

    async def until_answered(self, echo_proc: asyncio.subprocess.Process) -> None:
        """Ping until the echo process is up and answering."""
        while not self.answers:
            if echo_proc.returncode is not None:
                raise RuntimeError(f"the echo process exited with {echo_proc.returncode}")
            self.a.send(self.ping, PING % 0)
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), 0.2)
            except TimeoutError:
                continue

    async def round_trips(self, n: int) -> list[float]:
        samples = []
        for i in range(n):
            self.wake.clear()
            seen = self.answers
            t = time.perf_counter()
            self.a.send(self.ping, PING % i)
            while self.answers == seen:
                await self.wake.wait()
                self.wake.clear()
            samples.append(time.perf_counter() - t)
        return samples

    async def in_flight(self, k: int, seconds: float) -> float:
        """Round trips per second with ``k`` pings always outstanding."""
        start_answers, sent = self.answers, 0
        for i in range(k):
            self.a.send(self.ping, PING % i)
            sent += 1
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.wake.clear()
            await self.wake.wait()
            while sent - (self.answers - start_answers) < k:
                self.a.send(self.ping, PING % sent)
                sent += 1
        done = self.answers - start_answers
        elapsed = time.perf_counter() - t0
        while self.answers - start_answers < sent:  # drain what is still out
            self.wake.clear()
            await asyncio.wait_for(self.wake.wait(), 10)
        return done / elapsed


async def measured(broker: Broker, kind: str, work: Callable[[Pinger], Awaitable[T]]) -> T:
    name = f"{kind}-{os.getpid()}-{time.monotonic_ns()}"
    a = identity(broker, f"{name}-a", "trainer")
    b = identity(broker, f"{name}-b", "agent")
    await asyncio.sleep(0.1)  # the broker rereads its password file
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--echo",
        kind,
        str(b.port),
        name,
        env={**os.environ, "BENCH_ECHO_PASSWORD": b.password or ""},
    )
    pinger = Pinger(kind, a, name)
    try:
        await pinger.open()
        await pinger.until_answered(proc)
        return await work(pinger)
    finally:
        await pinger.a.close()
        proc.terminate()
        await proc.wait()


def identity(broker: Broker, name: str, role: str) -> BusConfig:
    cred = broker.credentials.add(name, role=role)  # type: ignore[arg-type]
    broker.reload()
    return BusConfig(host=broker.host, port=broker.port, username=name, password=cred.password)


async def main_async(blocks: int, per_block: int, seconds: float) -> dict[str, dict[str, float]]:
    with TemporaryDirectory() as tmp:
        broker = Broker(Path(tmp) / "broker")
        broker.start()
        try:
            latency: dict[str, list[float]] = {k: [] for k in CLIENTS}
            rate: dict[str, list[float]] = {k: [] for k in CLIENTS}
            for _ in range(blocks):
                for kind in CLIENTS:

                    async def work(p: Pinger) -> tuple[list[float], float]:
                        return await p.round_trips(per_block), await p.in_flight(100, seconds)

                    samples, per_s = await measured(broker, kind, work)
                    latency[kind].extend(samples)
                    rate[kind].append(per_s)
        finally:
            broker.stop()
    return {
        k: {"median_ms": statistics.median(latency[k]) * 1e3, "per_s": statistics.median(rate[k])}
        for k in CLIENTS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--echo", nargs=3, metavar=("CLIENT", "PORT", "NAME"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    install_uvloop()
    if args.echo:
        kind, port, name = args.echo
        cfg = BusConfig(
            host="127.0.0.1",
            port=int(port),
            username=f"{name}-b",
            password=os.environ["BENCH_ECHO_PASSWORD"],
        )
        asyncio.run(echo(kind, cfg, name))
        return
    blocks, per_block, seconds = (2, 50, 0.5) if args.quick else (10, 300, 5.0)
    result = asyncio.run(main_async(blocks, per_block, seconds))
    bus, gm = result["bus"], result["gmqtt"]
    print(f"{blocks} blocks of each, alternating; Mosquitto, QoS 1, uvloop")
    print(f"{'client':8} {'round trip (median)':>20} {'100 in flight':>18}")
    for kind in CLIENTS:
        r = result[kind]
        print(f"{kind:8} {r['median_ms']:>17.3f} ms {r['per_s']:>14,.0f} /s")
    print(
        f"gmqtt / bus: round trip {gm['median_ms'] / bus['median_ms']:.2f}x the time, "
        f"100 in flight {gm['per_s'] / bus['per_s']:.2f}x the rate "
        "(adopt at >= 10% faster on the move path: round trip <= 0.91x or rate >= 1.10x)"
    )


if __name__ == "__main__":
    main()
