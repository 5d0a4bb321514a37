"""Issue 22's attacks, each replayed against a real broker beside the same run without it.

    .venv/bin/python bench/abuse.py                          # every attack, 300 demo hands a side
    .venv/bin/python bench/abuse.py --only flood_ones --matches 200

For each attack, on a Mosquitto of its own (``Broker``) that knows the run's
identities and the attacker's (``mallory``, a plain agent): the demo
(``backroom demo``'s config: team colluders, CFR carol, every part its own OS
process as ``backroom run`` starts them) is played twice, alternating, once
calm and once with the attack running for the whole run. It prints matches
per second of each and their ratio, against the issue's target (0.8; 0.5 for
the 10-a-second flood of 63 KB arrays). Then the shutdown under the same
attack: a ``backroom referee`` process of its own, flooded for a second, is
sent SIGTERM, and the seconds until it exits are printed (target 2).

The attacks live in ``bench/abuse_parts/`` (one module per area, each
function ``(url, creds_dir, seconds) -> dict`` of what it sent) so that each
can be read, and replayed, on its own. Counts and seconds are bounded: an
attack stops when its run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from abuse_parts import budgets

from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, BusConfig
from backroom.bus.wire import Status, parse_status
from backroom.cli import demo_config
from backroom.runner.local import run_local

Attack = Callable[[str, Path, float], Awaitable[dict[str, Any]]]

ATTACKER = "mallory"


@dataclass(frozen=True)
class Case:
    name: str
    attack: Attack
    target: float  # matches/s under attack over calm, at least
    what: str


CASES = [
    Case("flood_ones", budgets.flood_ones, 0.5, "10/s 63 KB arrays of 1 on an outbox"),
    Case("flood_small", budgets.flood_small, 0.8, "small malformed outbox payloads, flat out"),
    Case("flip_status", budgets.flip_status, 0.8, "online/offline flips of a status, flat out"),
    Case("big_status", budgets.big_status, 0.8, "60 KB statuses, flat out"),
]


async def play(broker: Broker, runs: Path, matches: int, case: Case | None) -> float:
    """The demo's matches per second on ``broker``, with ``case``'s attack beside it."""
    config = demo_config().model_copy(update={"matches": matches})
    attack: asyncio.Task[dict[str, Any]] | None = None
    if case is not None:
        attack = asyncio.create_task(case.attack(broker.url, broker.dir, 3600.0))
    try:
        result = await run_local(
            config, runs_dir=runs, broker_url=broker.url, credentials_dir=broker.dir
        )
    finally:
        if attack is not None:
            attack.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await attack
    if len(result.episodes) != matches:
        raise SystemExit(f"{case and case.name}: {len(result.episodes)} of {matches} episodes")
    return result.matches_per_second


async def sigterm_seconds(broker: Broker, case: Case) -> float:
    """Seconds from SIGTERM to exit of a ``backroom referee`` flooded by ``case`` for a second."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backroom",
            "referee",
            "--broker",
            broker.url,
            "--credentials",
            str(broker.dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    online = asyncio.Event()

    def on(_topic: str, payload: bytes) -> None:
        with contextlib.suppress(Exception):
            msg = parse_status(payload)
            if isinstance(msg, Status) and msg.state == "online":
                online.set()

    broker.credentials.add("watcher", role="observer")
    broker.reload()
    await asyncio.sleep(0.1)
    watcher = broker.credentials.get("watcher")
    config = BusConfig.from_url(broker.url, username="watcher", password=watcher.password)
    async with Bus(config) as bus:
        await bus.subscribe(topics.status("referee"), on)
        await asyncio.wait_for(online.wait(), 60)
    attack = asyncio.create_task(case.attack(broker.url, broker.dir, 3600.0))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None and time.monotonic() - t0 < 120:
        await asyncio.sleep(0.01)
    seconds = time.monotonic() - t0
    if proc.poll() is None:
        proc.kill()
    attack.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await attack
    return seconds


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matches", type=int, default=300, help="demo hands a side")
    ap.add_argument("--only", nargs="*", choices=[c.name for c in CASES], default=None)
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or c.name in args.only]
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
        f"{args.matches} demo hands a side"
    )
    print(
        f"{'attack':<12} {'calm m/s':>9} {'attacked':>9} {'ratio':>6} {'target':>6}  "
        f"{'SIGTERM s':>9}  what"
    )
    failed = 0
    for case in cases:
        with tempfile.TemporaryDirectory() as d:
            broker = Broker(Path(d) / "broker").start()
            try:
                broker.credentials.add(ATTACKER, role="agent")
                broker.reload()
                runs = Path(d) / "runs"
                calm = await play(broker, runs, args.matches, None)
                attacked = await play(broker, runs, args.matches, case)
                term = await sigterm_seconds(broker, case)
            finally:
                broker.stop()
        ratio = attacked / calm if calm else 0.0
        ok = ratio >= case.target and term <= 2.0
        failed += not ok
        print(
            f"{case.name:<12} {calm:>9.1f} {attacked:>9.1f} {ratio:>6.2f} {case.target:>6.1f}  "
            f"{term:>9.2f}  {case.what}{'' if ok else '  <- MISSED'}"
        )
    print(f"{len(cases) - failed} of {len(cases)} attacks within their targets")


if __name__ == "__main__":
    asyncio.run(main())
