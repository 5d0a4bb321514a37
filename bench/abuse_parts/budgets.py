"""Issue 22, items 1 and 8: floods priced by work, replayed against a real broker.

Each function logs in as ``agent`` (an identity of the ``agent`` role in the
credential store at ``creds_dir``, which the caller creates and the broker has
loaded), floods for ``seconds`` (or once), and returns what it sent. Run one
beside a demo and compare matches per second with and without it
(``bench/abuse.py`` does); the referee's side shows in
``backroom_invalid_inputs_total``, ``backroom_inputs_dropped_total`` and
``backroom_statuses_dropped_total``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from abuse_parts import login
from backroom.bus import topics
from backroom.bus.client import Bus
from backroom.bus.wire import Status, dump

#: 63 KB of ``1``: before issue 22, 2.6 s of the referee's loop each (judged element by element).
ONES = b"[" + b",".join([b"1"] * 31_500) + b"]"


async def flood_ones(
    url: str, creds_dir: str | Path, seconds: float, per_s: float = 10.0, agent: str = "mallory"
) -> dict[str, float]:
    """``per_s`` 63 KB arrays of ``1`` a second on ``agent``'s outbox (the issue's 10/s:
    matches/s fell 10x, SIGTERM took 48-60 s). Each is now one refusal."""
    sent = 0
    async with Bus(login(url, creds_dir, agent)) as bus:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await bus.publish(topics.outbox(agent), ONES)
            sent += 1
            await asyncio.sleep(1.0 / per_s)
    return {"payloads": sent, "bytes": sent * len(ONES), "seconds": seconds}


async def flood_small(
    url: str, creds_dir: str | Path, seconds: float, agent: str = "mallory"
) -> dict[str, float]:
    """Small malformed payloads as fast as the broker takes them (cost 5x under the byte
    budget): each is charged the loop time it took plus the per-payload overhead."""
    sent = 0
    async with Bus(login(url, creds_dir, agent)) as bus:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await bus.publish(topics.outbox(agent), b"{nope")
            sent += 1
    return {"payloads": sent, "seconds": seconds}


async def flip_status(
    url: str, creds_dir: str | Path, seconds: float, agent: str = "mallory"
) -> dict[str, float]:
    """Online/offline flips of ``agent``'s own status as fast as the broker takes them (cut
    throughput 8x: each ``offline`` visits every match); now out of its input budget."""
    flips = [dump(Status(state=s, kind="raw")) for s in ("offline", "online")]
    sent = 0
    async with Bus(login(url, creds_dir, agent)) as bus:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await bus.publish(topics.status(agent), flips[sent % 2])
            sent += 1
    return {"statuses": sent, "seconds": seconds}


async def big_status(
    url: str,
    creds_dir: str | Path,
    seconds: float,
    size: int = 60_000,
    retain: bool = False,
    agent: str = "mallory",
) -> dict[str, float]:
    """Statuses of ``size`` bytes (60 KB: 14x slower; retained 15 MB: handed to every new
    reader) for ``seconds``; readers now drop any past ``MAX_STATUS_BYTES`` unread.
    With ``retain`` the last one stays on the broker: the caller clears it (an empty
    retained message from ``agent``) when done."""
    head = dump(Status(state="online", kind="raw"))
    big = head.replace(b'"kind"', b'"pad":"' + b"x" * size + b'","kind"')
    sent = 0
    async with Bus(login(url, creds_dir, agent)) as bus:
        end = time.monotonic() + seconds
        while True:
            await bus.publish(topics.status(agent), big, retain=retain)
            sent += 1
            if time.monotonic() >= end:
                break
    return {"statuses": sent, "bytes": sent * len(big), "seconds": seconds}
