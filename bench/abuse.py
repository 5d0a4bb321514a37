"""Issue 22's attacks, each replayed against a real broker beside the same run without it.

    .venv/bin/python bench/abuse.py                          # every attack, 300 demo hands a side
    .venv/bin/python bench/abuse.py --only flood_ones --matches 200

For each attack, on a Mosquitto of its own (``Broker``) that knows the run's
identities and the attacker's (``mallory``, a plain agent): the demo
(``backroom demo``'s config: team colluders, CFR carol, every part its own OS
process as ``backroom run`` starts them) is played twice, alternating, once
calm and once with the attack running for the whole run. It prints matches
per second of each and their ratio, against the issue's target (0.8; 0.5 for
the 10-a-second flood of 63 KB arrays). A third run sends the same bytes at
the same pace to a topic the attacker may not write (the broker refuses each,
nobody reads them): the flood's cost to the machine by itself, the attacker's
process and the broker, which on 2 shared cores is most of it; ``/control``
is the attacked rate over that one, the share the referee's handling costs. Then the shutdown under the same
attack: a ``backroom referee`` process of its own, flooded for a second, is
sent SIGTERM, and the seconds until it exits are printed (target 2).

After the rate attacks, the one-shot ones (a trace flood at a trainer's
intake, trace squatting, the web front end, a dripping adapter server), each
once on a broker of its own: whether the attack got through, and what it
measured (the trainer's longest loop block, what was stored).

The attacks live in ``bench/abuse_parts/`` (one module per area, each
function ``(url, creds_dir, seconds) -> dict`` of what it sent) so that each
can be read, and replayed, on its own. Counts and seconds are bounded: an
attack stops when its run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from abuse_parts import budgets, login, provenance, traces, webfetch

from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, NotAuthorizedError
from backroom.bus.wire import Status, parse_status
from backroom.cli.run import demo_config
from backroom.runner.local import run_local

Attack = Callable[[str, Path, float], Coroutine[Any, Any, dict[str, Any]]]

ATTACKER = "mallory"


@dataclass(frozen=True)
class Case:
    name: str
    attack: Attack
    target: float  # matches/s under attack over calm, at least
    what: str
    #: The same bytes at the same pace to a topic the attacker may not write: the broker
    #: refuses each (a PUBACK "not authorized"), nobody else reads them. What the flood
    #: costs the machine by itself (the attacker's process and the broker), apart from
    #: what it costs the referee: on 2 shared cores a flat-out sender takes a core.
    payload: bytes
    per_s: float | None = None  # None: flat out


CASES = [
    Case(
        "flood_ones",
        budgets.flood_ones,
        0.5,
        "10/s 63 KB arrays of 1 on an outbox",
        budgets.ONES,
        10.0,
    ),
    Case(
        "flood_small",
        budgets.flood_small,
        0.8,
        "small malformed outbox payloads, flat out",
        b"{nope",
    ),
    Case(
        "flip_status",
        budgets.flip_status,
        0.8,
        "online/offline flips of a status, flat out",
        b'{"v":1,"type":"status","state":"offline","kind":"raw"}',
    ),
    Case("big_status", budgets.big_status, 0.8, "60 KB statuses, flat out", b"x" * 60_000),
]


async def denied_flood(
    url: str, creds_dir: Path, seconds: float, payload: bytes, per_s: float | None
) -> dict[str, Any]:
    """``payload`` to another agent's inbox, which the attacker may not write (the control)."""
    sent = 0
    async with Bus(login(url, creds_dir, ATTACKER)) as bus:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with contextlib.suppress(NotAuthorizedError):
                await bus.publish(topics.inbox("nobody"), payload)
            sent += 1
            if per_s:
                await asyncio.sleep(1.0 / per_s)
    return {"payloads": sent}


async def play(
    broker: Broker, runs: Path, matches: int, case: Case | None, control: bool = False
) -> float:
    """The demo's matches per second on ``broker``, with ``case``'s attack (or its
    ``control``) beside it."""
    config = demo_config().model_copy(update={"matches": matches})
    attack: asyncio.Task[dict[str, Any]] | None = None
    if case is not None and control:
        attack = asyncio.create_task(
            denied_flood(broker.url, broker.dir, 3600.0, case.payload, case.per_s)
        )
    elif case is not None:
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
    async with Bus(login(broker.url, broker.dir, "watcher")) as bus:
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


@dataclass(frozen=True)
class Check:
    """An attack whose harm is not a rate: run once, it says whether it got through."""

    name: str
    run: Callable[[str, Path], Coroutine[Any, Any, dict[str, Any]]]
    ok: Callable[[dict[str, Any]], bool]
    what: str


CHECKS = [
    Check(
        "trainer_flood",
        lambda url, d: traces.flood_trainer_traces(url, d, 3.0),
        lambda r: r["counted"] == r["payloads"] and r["max_loop_block_s"] < 1.0,
        "10/s 63 KB arrays on traces/<me> at a trainer: each counted once, its loop held < 1 s",
    ),
    Check(
        "trace_squat",
        lambda url, d: traces.squat_trace(url, d),
        lambda r: r["genuine_stored"] == 1 and r["squat_stored"] == 0,
        "an unseated agent's trace for another seat's decision, sent first",
    ),
    Check(
        "web_xff",
        lambda url, d: webfetch.forwarded_guesses(url, d, 10.0),
        lambda r: bool(r["ok"]),
        "token guesses behind rotating X-Forwarded-For: locked out",
    ),
    Check(
        "web_rebind",
        lambda url, d: webfetch.rebound_host(url, d, 10.0),
        lambda r: bool(r["ok"]),
        "a rebound Host/Origin pair: not answered",
    ),
    Check(
        "web_seat",
        lambda url, d: webfetch.seat_takeover(url, d, 10.0),
        lambda r: bool(r["ok"]),
        "the token link within the holder's reconnect window: refused",
    ),
    Check(
        "adapter",
        lambda url, d: provenance.name_unannounced_adapter(url, d, 30.0),
        lambda r: bool(r["ok"]),
        "a referee naming an adapter no trainer announced: refused, then loaded once announced",
    ),
    Check(
        "drip_fetch",
        lambda url, d: webfetch.drip_checkpoint(url, d, 10.0),
        lambda r: bool(r["ok"]),
        "an adapter server dripping a byte every 5 s: cut off at the fetch deadline",
    ),
]


async def run_checks(names: list[str] | None) -> int:
    """Each check on a broker of its own; returns how many let the attack through."""
    failed = 0
    for check in CHECKS:
        if names and check.name not in names:
            continue
        with tempfile.TemporaryDirectory() as d:
            broker = Broker(Path(d) / "broker")
            for name, role in [
                (ATTACKER, "agent"),
                ("alice", "agent"),
                ("other", "agent"),
                ("abuse-seat", "agent"),
                ("trainer-victim", "trainer"),
                ("agent", "agent"),
                ("trainer", "trainer"),
            ]:
                broker.credentials.add(name, role=role)  # type: ignore[arg-type]
            broker.start()
            try:
                result = await check.run(broker.url, broker.dir)
            finally:
                broker.stop()
        ok = check.ok(result)
        failed += not ok
        shown = {k: v for k, v in result.items() if k != "ok"}
        print(f"{check.name:<14} {'held' if ok else 'GOT THROUGH':<11} {check.what}: {shown}")
    return failed


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matches", type=int, default=300, help="demo hands a side")
    names = [c.name for c in CASES] + [c.name for c in CHECKS]
    ap.add_argument("--only", nargs="*", choices=names, default=None)
    args = ap.parse_args()
    logging.getLogger("backroom").setLevel(logging.ERROR)  # the control's refusals, one a line
    cases = [c for c in CASES if not args.only or c.name in args.only]
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
        f"{args.matches} demo hands a side"
    )
    print(
        f"{'attack':<12} {'calm m/s':>9} {'control':>8} {'attacked':>9} {'ratio':>6} "
        f"{'target':>6} {'/control':>8}  {'SIGTERM s':>9}  what"
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
                control = await play(broker, runs, args.matches, case, control=True)
                attacked = await play(broker, runs, args.matches, case)
                term = await sigterm_seconds(broker, case)
            finally:
                broker.stop()
        ratio = attacked / calm if calm else 0.0
        apart = attacked / control if control else 0.0
        ok = ratio >= case.target and term <= 2.0
        failed += not ok
        print(
            f"{case.name:<12} {calm:>9.1f} {control:>8.1f} {attacked:>9.1f} {ratio:>6.2f} "
            f"{case.target:>6.1f} {apart:>8.2f}  {term:>9.2f}  {case.what}"
            f"{'' if ok else '  <- MISSED'}"
        )
    print(f"{len(cases) - failed} of {len(cases)} rate attacks within their targets")
    print()
    failed_checks = await run_checks(args.only)
    print(f"{failed_checks} one-shot attacks got through")
    # Not replayed here (they need a run's own processes or a runner holding its name):
    # a run directory the referee cannot write, the broker SIGKILLed early, two runs under
    # one runner name, a forged run directory (tests/test_hangs.py, bench/chaos_soak.py
    # --early-kills); a seated agent flooding traces.jsonl (tests/test_trace_ingest.py).


if __name__ == "__main__":
    asyncio.run(main())
