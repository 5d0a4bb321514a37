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
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from abuse_parts import login
from backroom.bus import topics
from backroom.bus.client import Bus
from backroom.bus.wire import MatchRequest, MatchSpec, MatchStart, Status, dump, parse_all

#: The runner-role identity that seats the attacker (``flood_small_seated``); the
#: caller adds it to the credential store.
SEATER = "abuse-seater"

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
            await bus.publish(topics.outbox(agent, "referee"), ONES)
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
            await bus.publish(topics.outbox(agent, "referee"), b"{nope")
            sent += 1
    return {"payloads": sent, "seconds": seconds}


async def seat(url: str, creds_dir: str | Path, agent: str, seated: asyncio.Event) -> None:
    """Seat ``agent`` in one long Kuhn match on whichever referee takes it (asked again each
    second until ``agent``'s inbox has the ``MatchStart``: no referee may be up yet). Its two
    other seats are identities nobody runs, so the match waits on them for its whole run."""
    spec = MatchSpec(
        game="kuhn",
        params={"variant": "loki"},
        seats=["abuse-ghost-0", "abuse-ghost-1", agent],
        turn_timeout_s=3600,
        run="abuse-seat",
    )
    request = MatchRequest(match="abuse-seat-0", spec=spec)
    async with Bus(login(url, creds_dir, SEATER)) as bus:
        while not seated.is_set():
            await bus.publish(topics.CONTROL_MATCHES, request)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(seated.wait(), 1.0)


@contextlib.asynccontextmanager
async def seated_bus(url: str, creds_dir: str | Path, agent: str) -> AsyncIterator[Bus]:
    """``agent``'s bus, once ``agent`` is seated in a match of the attacked referee's (one
    that never ends: its other seats never answer), so that the referee reads its outbox
    and status (``referee.outboxes``)."""
    seated = asyncio.Event()

    def on_inbox(_topic: str, payload: bytes) -> None:
        if any(isinstance(m, MatchStart) for m in parse_all(payload)):
            seated.set()

    async with Bus(login(url, creds_dir, agent)) as bus:
        await bus.subscribe(topics.inbox(agent), on_inbox)
        seater = asyncio.create_task(seat(url, creds_dir, agent, seated))
        try:
            await seated.wait()
            yield bus
        finally:
            seater.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await seater


async def flood_small_seated(
    url: str, creds_dir: str | Path, seconds: float, agent: str = "mallory"
) -> dict[str, float]:
    """``flood_small`` from an agent seated on the attacked referee: what it costs is its
    input budget's share (``INPUT_SHARE``); past it the referee stops reading it."""
    sent = 0
    async with seated_bus(url, creds_dir, agent) as bus:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await bus.publish(topics.outbox(agent, "referee"), b"{nope")
            sent += 1
    return {"payloads": sent, "seconds": seconds}


async def flip_status_seated(
    url: str, creds_dir: str | Path, seconds: float, agent: str = "mallory"
) -> dict[str, float]:
    """``flip_status`` from an agent seated on the attacked referee: each ``offline`` visits
    its matches, out of the same budget as its outbox."""
    flips = [dump(Status(state=s, kind="raw")) for s in ("offline", "online")]
    sent = 0
    async with seated_bus(url, creds_dir, agent) as bus:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await bus.publish(topics.status(agent), flips[sent % 2])
            sent += 1
    return {"statuses": sent, "seconds": seconds}


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
