"""Issue 22's attacks, each replayed against a real broker beside the same run without it.

    .venv/bin/python bench/abuse.py                          # every attack, 1,000 demo hands a side
    .venv/bin/python bench/abuse.py --only flood_ones --matches 200

For each attack, on a Mosquitto of its own (``Broker``) that knows the run's
identities and the attacker's (``mallory``, a plain agent): the demo
(``backroom demo``'s config: team colluders, CFR carol, every part its own OS
process as ``backroom run`` starts them) is played calm, under the attack
(running for the whole run), and under its control: the same bytes at the
same pace to a topic the attacker may not write (the broker refuses each,
nobody reads them), which is what the flood costs the machine by itself (the
attacker's process, and the broker). Each is played ``--rounds`` times, taking turns at going first (the
machine drifts within a minute), and the medians are compared: ``ratio`` is
attacked over calm, against the issue's target (0.8; 0.5 for the
10-a-second flood of 63 KB arrays), ``/control`` attacked over the control,
the share backroom's own handling of the flood costs. Then the shutdown under the same
attack: a ``backroom referee`` process of its own, flooded for a second, is
sent SIGTERM, and the seconds until it exits are printed (target 2); then the same
for a ``backroom run`` of the demo (the runner, with its own referee and agents),
SIGTERMed once its first episode is out.

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
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from importlib import resources
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
        "flood_seated",
        budgets.flood_small_seated,
        0.8,
        "small malformed outbox payloads from an agent seated here, flat out",
        b"{nope",
    ),
    Case(
        "flip_status",
        budgets.flip_status,
        0.8,
        "online/offline flips of a status, flat out",
        b'{"v":1,"type":"status","state":"offline","kind":"raw"}',
    ),
    Case(
        "flip_seated",
        budgets.flip_status_seated,
        0.8,
        "online/offline flips of a status from an agent seated here, flat out",
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


def _attacker(name: str, url: str, creds_dir: str, control: bool) -> None:
    """A child process that runs ``name``'s attack (or its control) until it is terminated."""
    logging.getLogger("backroom").setLevel(logging.ERROR)
    case = next(c for c in CASES if c.name == name)
    if control:
        asyncio.run(denied_flood(url, Path(creds_dir), 3600.0, case.payload, case.per_s))
    else:
        asyncio.run(case.attack(url, Path(creds_dir), 3600.0))


async def play(
    broker: Broker, runs: Path, matches: int, case: Case | None, control: bool = False
) -> float:
    """The demo's matches per second on ``broker``, with ``case``'s attack (or its
    ``control``) beside it, from a process of its own as a real attacker's would be."""
    config = demo_config().model_copy(update={"matches": matches})
    attacker = None
    if case is not None:
        attacker = multiprocessing.get_context("spawn").Process(
            target=_attacker, args=(case.name, broker.url, str(broker.dir), control), daemon=True
        )
        attacker.start()
    try:
        result = await run_local(
            config, runs_dir=runs, broker_url=broker.url, credentials_dir=broker.dir
        )
    finally:
        if attacker is not None:
            attacker.terminate()
            attacker.join()
    if len(result.episodes) != matches:
        raise SystemExit(f"{case and case.name}: {len(result.episodes)} of {matches} episodes")
    return result.matches_per_second


def _backroom(*args: str) -> subprocess.Popen[bytes]:
    """``python -m backroom ARGS`` in a session of its own (its children killed with it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "backroom", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


async def _watch(broker: Broker, topic: str, ready: Callable[[bytes], bool]) -> None:
    """Return once a message on ``topic`` satisfies ``ready`` (read as an observer)."""
    seen = asyncio.Event()

    def on(_topic: str, payload: bytes) -> None:
        with contextlib.suppress(Exception):
            if ready(payload):
                seen.set()

    if "watcher" not in broker.credentials.load():
        broker.credentials.add("watcher", role="observer")
        broker.reload()
        await asyncio.sleep(0.1)
    async with Bus(login(broker.url, broker.dir, "watcher")) as bus:
        await bus.subscribe(topic, on)
        await asyncio.wait_for(seen.wait(), 60)


async def _sigterm(proc: subprocess.Popen[bytes], broker: Broker, case: Case) -> float:
    """Seconds from SIGTERM to exit of ``proc``, flooded by ``case`` for a second before."""
    attack = asyncio.create_task(case.attack(broker.url, broker.dir, 3600.0))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None and time.monotonic() - t0 < 120:
        await asyncio.sleep(0.01)
    seconds = time.monotonic() - t0
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of its session (a runner's children)
    proc.wait()
    attack.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await attack
    return seconds


def _online(payload: bytes) -> bool:
    msg = parse_status(payload)
    return isinstance(msg, Status) and msg.state == "online"


async def sigterm_seconds(broker: Broker, case: Case) -> float:
    """Seconds from SIGTERM to exit of a ``backroom referee`` flooded by ``case`` for a second."""
    proc = _backroom("referee", "--broker", broker.url, "--credentials", str(broker.dir))
    await _watch(broker, topics.status("referee"), _online)
    return await _sigterm(proc, broker, case)


async def runner_sigterm_seconds(broker: Broker, runs: Path, case: Case) -> float:
    """Seconds from SIGTERM to exit of a ``backroom run`` of the demo (its own referee and
    agents, a run longer than the bench) that has published its first episode, flooded by
    ``case`` for a second: the issue asks the runner, too, to answer within 2 s."""
    demo = runs / "demo.yaml"
    demo.write_bytes(resources.files("backroom").joinpath("demo.yaml").read_bytes())
    args = ["run", str(demo), "--broker", broker.url, "--credentials", str(broker.dir)]
    proc = _backroom(*args, "--runs-dir", str(runs), "--matches", "20000")
    await _watch(broker, topics.ALL_EPISODES, lambda payload: bool(payload))
    return await _sigterm(proc, broker, case)


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
    ap.add_argument("--matches", type=int, default=1000, help="demo hands a side")
    ap.add_argument(
        "--rounds", type=int, default=3, help="calm, control and attacked runs of each attack"
    )
    names = [c.name for c in CASES] + [c.name for c in CHECKS]
    ap.add_argument("--only", nargs="*", choices=names, default=None)
    args = ap.parse_args()
    logging.getLogger("backroom").setLevel(logging.ERROR)  # the control's refusals, one a line
    cases = [c for c in CASES if not args.only or c.name in args.only]
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
        f"{args.matches} demo hands a side, {args.rounds} rounds (medians)"
    )
    print(
        f"{'attack':<12} {'calm m/s':>9} {'control':>8} {'attacked':>9} {'ratio':>6} "
        f"{'target':>6} {'/control':>8}  {'referee':>9} {'runner':>9}  what"
    )
    failed = 0
    for case in cases:
        with tempfile.TemporaryDirectory() as d:
            broker = Broker(Path(d) / "broker").start()
            try:
                broker.credentials.add(ATTACKER, role="agent")
                broker.credentials.add(budgets.SEATER, role="runner")
                broker.reload()
                runs = Path(d) / "runs"
                rates: dict[str, list[float]] = {"calm": [], "control": [], "attacked": []}
                for r in range(args.rounds):
                    order = list(rates)[r % 3 :] + list(rates)[: r % 3]  # each first in turn
                    for side in order:
                        attack = None if side == "calm" else case
                        rates[side].append(
                            await play(broker, runs, args.matches, attack, side == "control")
                        )
                calm, control, attacked = (statistics.median(rates[k]) for k in rates)
                term = await sigterm_seconds(broker, case)
                runner_term = await runner_sigterm_seconds(broker, runs, case)
            finally:
                broker.stop()
        ratio = attacked / calm if calm else 0.0
        apart = attacked / control if control else 0.0
        ok = ratio >= case.target and max(term, runner_term) <= 2.0
        why = "" if ok else "  <- MISSED"
        if not ok and apart >= case.target and max(term, runner_term) <= 2.0:
            why = f"  <- MISSED, as the control did ({control / calm:.2f} of calm)"
        failed += not ok
        print(
            f"{case.name:<12} {calm:>9.1f} {control:>8.1f} {attacked:>9.1f} {ratio:>6.2f} "
            f"{case.target:>6.1f} {apart:>8.2f}  {term:>9.2f} {runner_term:>9.2f}  {case.what}"
            f"{why}"
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
