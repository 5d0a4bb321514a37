"""Issue 22, items 2, 7 and 9: traces from agents who want to hurt, replayed against a real broker.

Each function logs in as agents of the credential store at ``creds_dir``
(identities the caller creates and the broker has loaded: ``agent`` role for
the attackers, ``trainer`` role for ``trainer``) and returns what it sent and
what it saw. The trainer's side runs in this process (a ``TrainerBus`` on a
store in a temporary directory, under the ``trainer`` identity: not one a
running trainer uses, its persistent session would be shared), so its loop can
be timed. The runner's side is the runner's own: run ``flood_seated_traces``
beside a run that seats ``agent`` and compare its traces.jsonl with the run's
bound (``backroom_traces_rejected_total`` says what was refused, and why).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from abuse_parts import login
from backroom.bus import topics
from backroom.bus.client import Bus
from backroom.bus.wire import MatchSpec, Trace
from backroom.trainer.bus import TrainerBus
from backroom.trainer.store import Request, Store

#: 63 KB of ``1``: before issue 22, one fsync'd transaction per element in the trainer's
#: receive callback (its loop held 112-131 s, the message redelivered and counted twice).
ONES = b"[" + b",".join([b"1"] * 31_500) + b"]"


@contextlib.asynccontextmanager
async def _trainer(
    url: str, creds_dir: str | Path, trainer: str, seats: list[str]
) -> AsyncIterator[tuple[Store, list[float]]]:
    """A trainer's intake on a fresh store that requested match ``m1`` seating ``seats``, with
    the gaps of its loop beyond a 10 ms tick (what a message's handling held it for)."""
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "store.sqlite") as store:
        spec = MatchSpec(game="ipd", params={"rounds": 2}, seats=seats, seed=1)
        store.add_requests([Request("m1", 0, "g0", "train", spec, tuple(range(len(seats))))])
        loop = asyncio.get_running_loop()
        gaps: list[float] = []

        async def tick() -> None:
            while True:
                t = loop.time()
                await asyncio.sleep(0.01)
                gaps.append(loop.time() - t - 0.01)

        async with TrainerBus(login(url, creds_dir, trainer), store, "ipd"):
            ticker = asyncio.create_task(tick())
            try:
                yield store, gaps
            finally:
                ticker.cancel()


async def flood_trainer_traces(
    url: str,
    creds_dir: str | Path,
    seconds: float,
    per_s: float = 10.0,
    agent: str = "mallory",
    trainer: str = "trainer-victim",
) -> dict[str, float]:
    """``per_s`` 63 KB arrays of ``1`` a second on ``agent``'s own traces topic, at a trainer's
    intake. Returns what was sent, what the trainer counted (each payload once: nothing
    redelivered, nothing twice) and the longest its loop was held (must stay under 1 s)."""
    sent = 0
    async with _trainer(url, creds_dir, trainer, [agent, "other"]) as (store, gaps):
        async with Bus(login(url, creds_dir, agent)) as bus:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await bus.publish(topics.traces(agent), ONES)
                sent += 1
                await asyncio.sleep(1.0 / per_s)
        deadline = time.monotonic() + 30
        while store.counters().get("trace_malformed", 0) < sent and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        counted = store.counters().get("trace_malformed", 0)
    return {
        "payloads": sent,
        "bytes": sent * len(ONES),
        "counted": counted,
        "max_loop_block_s": max(gaps, default=0.0),
    }


async def squat_trace(
    url: str,
    creds_dir: str | Path,
    agent: str = "mallory",
    victim: str = "alice",
    trainer: str = "trainer-victim",
) -> dict[str, float]:
    """``agent`` (not seated) sends its own trace for ``victim``'s seat-0 decision before
    ``victim`` does (match ids are predictable). Before issue 22 the squat was stored and the
    genuine trace refused as a duplicate; ``genuine_stored`` must be 1 and ``squat_stored`` 0."""
    async with _trainer(url, creds_dir, trainer, [victim, "other"]) as (store, gaps):
        async with Bus(login(url, creds_dir, agent)) as bus:
            await bus.publish(
                topics.traces(agent), Trace(match="m1", agent=agent, turn=0, seat=0, phase="act")
            )
        deadline = time.monotonic() + 30
        while not store.counters() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with Bus(login(url, creds_dir, victim)) as bus:
            await bus.publish(
                topics.traces(victim), Trace(match="m1", agent=victim, turn=0, seat=0, phase="act")
            )
        stored: list[str] = []
        while not stored and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            stored = [a for (a,) in store._db.execute("SELECT agent FROM traces")]
    return {
        "genuine_stored": float(victim in stored),
        "squat_stored": float(agent in stored),
        "max_loop_block_s": max(gaps, default=0.0),
    }


async def flood_seated_traces(
    url: str,
    creds_dir: str | Path,
    seconds: float,
    match: str,
    seat: int,
    agent: str = "mallory",
    pad: int = 60_000,
) -> dict[str, float]:
    """As fast as the broker takes them, valid traces of ``agent`` (seated at ``seat`` of
    ``match``, a match of a running run) for turns that never happen, each ``pad`` bytes,
    plus a replay of each. Before issue 22 the runner wrote all of it (245 MB in 14 s);
    now its traces.jsonl takes each turn once and stops at the run's bound, with a notice."""
    sent = sent_bytes = 0
    async with Bus(login(url, creds_dir, agent)) as bus:
        end = time.monotonic() + seconds
        turn = 10_000
        while time.monotonic() < end:
            trace = Trace(
                match=match, agent=agent, turn=turn, seat=seat, phase="act", reply="x" * pad
            )
            data = trace.model_dump_json().encode()
            await asyncio.gather(
                bus.publish(topics.traces(agent), data), bus.publish(topics.traces(agent), data)
            )
            sent += 2
            sent_bytes += 2 * len(data)
            turn += 1
    return {"traces": sent, "bytes": sent_bytes, "seconds": seconds}
