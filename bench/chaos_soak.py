"""Chaos soak: thousands of matches over two referees while processes are killed and restarted.

One run of the loki Kuhn demo (alice and bob ``kuhn-colluder``, carol
``cfr``) with ``referees: 2``, every part a separate OS process as
``backroom run`` starts them, on a Mosquitto on loopback. Beside it, a chaos
task seeded by ``--seed`` waits a random interval (exponential, mean
``--interval`` s), then does one of:

- **agent**: SIGKILL one agent process, wait 0.2-3 s, start it again with the
  same command line and identity (the runner does not restart agents);
- **referee**: SIGKILL one referee (never both: the other one is up and its
  last restart is at least ``REFEREE_SETTLE_S`` old), wait until the runner
  has given it up (``Faults.referees_lost``: it polls its own processes) and
  0.3-3 s, start it again under the same identity (the runner does not
  restart referees either);
- **broker**: stop Mosquitto and start it again on the same port with its
  persistence file after 0.2-2 s (``Broker.restart``, as
  ``tests/test_e2e.py`` does).

Besides, early in the run, the broker is SIGKILLed (``--early-kills``: after
20, 60 and 140 episodes, whatever the chaos does) and started again on its
persistence file after 0.5 s: the sessions made since its last save are
gone, so episodes published before the runner subscribes again reach
nobody. The runner asks again for accepted matches with no episode
(``EPISODE_WAIT_S``) and their referee publishes them again (issue 22).

The chaos stops after ``--duration`` seconds, or when the run ends; the
run plays its remaining matches calmly. ``--timeout`` bounds the whole
thing: past it the soak stops and counts what is missing as lost.

At the end it reads the run's ``episodes.jsonl`` (after the runner's own
dedupe, ``dedupe_episodes``, as ``backroom run`` does) and the runner's
``Faults`` and prints:

- requested: matches the runner asked for (their first request);
- finished: matches with a kept episode, by reason (``normal``; ``timeout``
  when a killed agent's seat got the default; ``voided`` when the broker went
  away mid-match and the void stands);
- re-run: matches asked for again under ``<id>.r<n>`` (their referee died,
  or stopped), mapped back to their match through ``Faults.reruns``;
- lost: requested with no episode, in the runner's result and in the file
  (must be 0);
- duplicated: a match id (after mapping ``<id>.r<n>`` back) with two episodes
  in the runner's result, or two lines in the file (must be 0); beside it the
  extra episodes the runner received and dropped (``Faults.duplicates``) and
  the lines it took out of the file (``duplicates_on_disk``), which are the
  faults being handled, not failures;
- the longest wait for a referee: from the match's first request (the time
  the runner built its ``MatchRequest``, recorded by wrapping that
  constructor in ``backroom.play.loop``: nothing else says when a match
  was asked for) to the ``started_at`` of its kept episode, reruns included.
  Both are ``time.time()`` on this one machine.

Exit status 0 when lost and duplicated are 0, 1 otherwise.

``--fast-referee-restart`` starts a killed referee again at once, as a
supervisor (``restart: always``) would, instead of after the runner has given
it up: the same identity may say ``online`` again before the runner polled
the dead process and within its ``REFEREE_GRACE_S``, which would leave the
matches the dead process had accepted never asked for again (lost). Not yet
tried.

Run: ``python bench/chaos_soak.py`` (a few minutes; ``--matches``,
``--duration``, ``--seed``, ``--interval``). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import backroom.play.loop as loop
import backroom.runner.local as local
from backroom.bus import topics
from backroom.bus.wire import EpisodeRecord, MatchRequest
from backroom.cli.run import demo_config
from backroom.runner.config import RunConfig
from backroom.runner.local import (
    Faults,
    RunError,
    Stack,
    dedupe_episodes,
    identities,
    run_matches,
)
from backroom.runs import read_episodes

#: Seconds after a referee restarts before either referee may be killed again.
REFEREE_SETTLE_S = 5.0
#: Relative odds of each kind of chaos event.
WEIGHTS = {"agent": 3, "referee": 2, "broker": 1}
#: Episodes after which the broker is SIGKILLed early in the run (``--early-kills``).
EARLY_KILLS = (20, 60, 140)


@dataclass
class Report:
    requested: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    rerun: int = 0  # matches asked for again at least once
    rerequests: int = 0  # requests under a new id, all told
    rerequest_reasons: Counter[str] = field(default_factory=Counter)
    resubmitted: int = 0
    asked_again: int = 0  # Faults.asked_again: accepted, no episode, asked again
    lost: int = 0
    lost_on_disk: int = 0
    duplicated: int = 0
    duplicated_on_disk: int = 0
    dropped_duplicates: int = 0  # Faults.duplicates: extra episodes the runner dropped
    deduped_on_disk: int = 0  # Faults.duplicates_on_disk
    max_wait_s: float = 0.0
    max_wait_match: str = ""
    most_attempts: int = 0  # the highest n of an <id>.r<n> asked for
    rerun_after_chaos_s: float = 0.0  # last kept <id>.r<n> started this long after the chaos ended
    events: Counter[str] = field(default_factory=Counter)
    referees_lost: int = 0
    referees_revived: int = 0
    seconds: float = 0.0
    error: str = ""
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return not (
            self.lost or self.lost_on_disk or self.duplicated or self.duplicated_on_disk
        ) and (not self.error)

    def lines(self) -> list[str]:
        done = sum(self.finished.values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finished.items()))
        return [
            f"run dir:               {self.run_dir}",
            f"seconds:               {self.seconds:.1f}",
            "chaos events:          "
            + ", ".join(
                f"{k} {self.events[k]}" for k in ("agent", "referee", "broker", "broker_sigkill")
            ),
            f"requested:             {self.requested}",
            f"finished:              {done} ({reasons})",
            f"voided (void stands):  {self.finished.get('voided', 0)}",
            f"re-run (<id>.r<n>):    {self.rerun} matches, {self.rerequests} requests "
            f"({self.referees_lost} referees given up, {self.referees_revived} of them alive "
            f"after all; {self.resubmitted} unacknowledged requests sent again; "
            f"{self.asked_again} accepted matches with no episode asked again)",
            "re-requested because:  "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.rerequest_reasons.items())) or "-"),
            f"lost:                  {self.lost} (in the file: {self.lost_on_disk})",
            f"duplicated:            {self.duplicated} (in the file: {self.duplicated_on_disk}); "
            f"handled: {self.dropped_duplicates} extra episodes dropped, "
            f"{self.deduped_on_disk} lines taken out of the file",
            f"most requests of one match: {self.most_attempts + 1}; a kept re-run started "
            f"{self.rerun_after_chaos_s:.1f} s after the last chaos event at the latest",
            f"longest wait for a referee: {self.max_wait_s:.2f} s ({self.max_wait_match}; "
            "first request to the kept episode's started_at)",
            *([f"error:                 {self.error}"] if self.error else []),
            "OK" if self.ok else "FAILED",
        ]


def _environ(pid: int) -> dict[str, str]:
    """The ``BACKROOM_*`` variables of a running process (its identity)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode().split("=", 1) for item in raw if b"=" in item)
    return {k: v for k, v in pairs if k.startswith("BACKROOM_")}


def _diagnose(stack: Stack, say: Any) -> None:
    """On a failed run: which processes live, who is connected, the retained statuses."""
    import subprocess

    for name, proc in stack.procs.items():
        say(f"diagnose: process {name} pid {proc.pid} exit code {proc.poll()}")
    port = stack.url.rsplit(":", 1)[-1]
    conns = subprocess.run(
        ["ss", "-tnpH", "state", "established", f"( dport = :{port} )"],
        capture_output=True,
        text=True,
    ).stdout
    say(f"diagnose: connections to the broker:\n{conns}")
    cfg = stack.identity("runner", "runner")
    login = ["-h", str(cfg.host), "-p", str(cfg.port), "-u", str(cfg.username)]
    login += ["-P", str(cfg.password), "-i", str(cfg.username)]
    statuses = subprocess.run(
        ["mosquitto_sub", *login, "-t", topics.ALL_STATUS, "-v", "-W", "2"],
        capture_output=True,
        text=True,
    )
    say(f"diagnose: retained statuses:\n{statuses.stdout}{statuses.stderr}")


async def _progress(got: dict[str, EpisodeRecord], say: Any, every_s: float = 5.0) -> None:
    """Every ``every_s`` seconds: matches finished so far; a stall shows as ``+0``."""
    before = 0
    while True:
        await asyncio.sleep(every_s)
        say(f"progress: {len(got)} finished (+{len(got) - before} in {every_s:.0f} s)")
        before = len(got)


class Chaos:
    """Kills and restarts the stack's processes at random intervals (one event at a time)."""

    def __init__(
        self,
        stack: Stack,
        faults: Faults,
        rng: random.Random,
        interval: float,
        say: Any,
        weights: dict[str, int] | None = None,
    ) -> None:
        self.stack = stack
        self.faults = faults
        self.rng = rng
        self.interval = interval
        self.say = say
        self.events: Counter[str] = Counter()
        self.weights = weights or WEIGHTS
        self.last_event = 0.0  # time.time() the last event ended
        self.referee_settled = 0.0
        self.fast_referee_restart = False
        #: Held while the broker restarts: an early SIGKILL and a chaos restart never overlap.
        self.broker_lock = asyncio.Lock()
        # Command line and identity of each process, to start it again as it was.
        self.argv = {n: list(p.args)[3:] for n, p in stack.procs.items()}  # after -m backroom
        self.env = {n: _environ(p.pid) for n, p in stack.procs.items()}

    def restart(self, name: str) -> None:
        self.stack.spawn(name, self.argv[name], self.env[name])

    async def kill(self, name: str) -> None:
        proc = self.stack.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)

    async def agent(self) -> None:
        name = self.rng.choice([n for n in self.stack.procs if n not in self.stack.referees])
        await self.kill(name)
        await asyncio.sleep(self.rng.uniform(0.2, 3.0))
        self.restart(name)
        self.say(f"chaos: agent {name} killed and restarted")

    def referee_may_die(self) -> bool:
        """Only one referee at a time: both up, and the last restart settled."""
        alive = [n for n in self.stack.referees if self.stack.procs[n].poll() is None]
        return len(alive) == len(self.stack.referees) and time.monotonic() > self.referee_settled

    async def referee(self) -> None:
        name = self.rng.choice(list(self.stack.referees))
        before = len(self.faults.referees_lost)
        await self.kill(name)
        if not self.fast_referee_restart:
            # The runner polls its referee processes; restarting one before it saw
            # the death hides it (see --fast-referee-restart).
            deadline = time.monotonic() + 10
            while len(self.faults.referees_lost) == before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(self.rng.uniform(0.3, 3.0))
        self.restart(name)
        self.referee_settled = time.monotonic() + REFEREE_SETTLE_S
        self.say(f"chaos: referee {name} killed and restarted")

    async def broker(self) -> None:
        assert self.stack.broker is not None
        async with self.broker_lock:
            await asyncio.to_thread(self.stack.broker.restart, self.rng.uniform(0.2, 2.0))
        self.say("chaos: broker restarted")

    async def run(self, until: float) -> None:
        kinds, weights = list(self.weights), list(self.weights.values())
        while True:
            await asyncio.sleep(self.rng.expovariate(1 / self.interval))
            if time.monotonic() > until:
                return
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "referee" and not self.referee_may_die():
                continue
            self.events[kind] += 1  # counted as it starts: the run may end mid-event
            await getattr(self, kind)()
            self.last_event = time.time()


async def soak(  # noqa: C901, PLR0915 (one run under faults: start, play beside the chaos, stop, then the report's counts)
    matches: int,
    duration: float,
    seed: int,
    runs_dir: Path,
    interval: float = 4.0,
    limit_s: float | None = None,
    concurrency: int = 20,
    say: Any = print,
    fast_referee_restart: bool = False,
    events: tuple[str, ...] = tuple(WEIGHTS),
    early_kills: tuple[int, ...] = EARLY_KILLS,
) -> Report:
    config: RunConfig = demo_config().model_copy(
        update={
            "run": "chaos",
            "matches": matches,
            "referees": 2,
            "concurrency": concurrency,
            "turn_timeout_s": 3.0,
            "seed": seed,
        }
    )
    rng = random.Random(seed)
    report = Report()
    asked_at: dict[str, float] = {}  # match id -> time.time() of its first request
    got: dict[str, EpisodeRecord] = {}

    def timed_request(**kw: Any) -> MatchRequest:
        asked_at.setdefault(kw["match"], time.time())
        return MatchRequest(**kw)

    kills = sorted(early_kills)
    killing: list[asyncio.Task[None]] = []

    def on_episode(record: EpisodeRecord, _n: int) -> None:
        got[faults.reruns.get(record.match, record.match)] = record
        if kills and len(got) >= kills[0] and not any(not t.done() for t in killing):
            kills.pop(0)
            killing.append(asyncio.ensure_future(sigkill_broker(len(got))))

    async def sigkill_broker(n: int) -> None:
        assert stack.broker is not None
        while chaos is None:  # the run is not ready yet
            await asyncio.sleep(0.1)
        async with chaos.broker_lock:
            await asyncio.to_thread(stack.broker.restart, 0.5, True)
        report.events["broker_sigkill"] += 1
        say(f"chaos: broker SIGKILLed after {n} episodes and started again")

    stack = Stack(runs_dir / config.run)
    report.run_dir = str(stack.run_dir)
    faults = Faults()
    chaos_task: asyncio.Task[None] | None = None
    chaos: Chaos | None = None
    ticker: asyncio.Task[None] | None = None
    t0 = time.monotonic()
    deadline = limit_s if limit_s is not None else duration + 300.0
    episodes: list[EpisodeRecord] | None = None
    saved = loop.MatchRequest
    loop.MatchRequest = timed_request  # type: ignore[assignment,misc]
    try:
        stack.start_broker(None, None, identities(config))
        waiting = local.start_processes(stack, config, runs_dir)
        play = asyncio.create_task(
            run_matches(
                config,
                stack.identity("runner", "runner"),
                waiting,
                stack,
                on_episode,
                on_notice=lambda m: say(f"runner: {m}"),
                faults=faults,
            )
        )
        while not asked_at and not play.done():  # the run is ready: every process online
            await asyncio.sleep(0.1)
        chaos = Chaos(stack, faults, rng, interval, say, {k: WEIGHTS[k] for k in events})
        chaos.fast_referee_restart = fast_referee_restart
        chaos_task = asyncio.create_task(chaos.run(time.monotonic() + duration))
        ticker = asyncio.create_task(_progress(got, say))
        try:
            episodes = await asyncio.wait_for(play, max(1.0, deadline - (time.monotonic() - t0)))
        except TimeoutError:
            report.error = f"the run did not end within {deadline:.0f} s"
        except RunError as exc:
            report.error = f"RunError: {exc}"
        if report.error:
            await asyncio.to_thread(_diagnose, stack, say)
    finally:
        loop.MatchRequest = saved  # type: ignore[misc]
        if ticker is not None:
            ticker.cancel()
        if chaos_task is not None:
            chaos_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await chaos_task
        await asyncio.to_thread(stack.stop)
    report.seconds = time.monotonic() - t0
    for task in killing:
        with contextlib.suppress(Exception):
            await task
    if chaos is not None:
        report.events.update(chaos.events)
    if episodes is not None:
        faults.duplicates_on_disk = dedupe_episodes(
            stack.run_dir / "episodes.jsonl", episodes, faults.reruns
        )
    kept = episodes if episodes is not None else list(got.values())

    report.requested = len(asked_at)
    report.finished = Counter(e.reason for e in kept)
    by_match = Counter(faults.reruns.get(e.match, e.match) for e in kept)
    report.duplicated = sum(n - 1 for n in by_match.values() if n > 1)
    report.lost = len(set(asked_at) - set(by_match))
    path = stack.run_dir / "episodes.jsonl"
    on_disk = Counter(
        faults.reruns.get(str(r["match"]), str(r["match"]))
        for r in (read_episodes(path) if path.exists() else [])
    )
    report.duplicated_on_disk = sum(n - 1 for n in on_disk.values() if n > 1)
    report.lost_on_disk = len(set(asked_at) - set(on_disk))
    report.rerun = len(set(faults.reruns.values()))
    report.rerequests = faults.rerequested
    report.rerequest_reasons = faults.rerequest_reasons
    report.resubmitted = faults.resubmitted
    report.asked_again = faults.asked_again
    report.referees_lost = len(faults.referees_lost)
    report.referees_revived = len(faults.referees_revived)
    report.dropped_duplicates = faults.duplicates
    report.deduped_on_disk = faults.duplicates_on_disk
    report.most_attempts = max((int(a.rsplit(".r", 1)[1]) for a in faults.reruns), default=0)
    if chaos is not None and chaos.last_event:
        report.rerun_after_chaos_s = max(
            (e.started_at - chaos.last_event for e in kept if e.match in faults.reruns),
            default=0.0,
        )
    for e in kept:
        match = faults.reruns.get(e.match, e.match)
        wait = e.started_at - asked_at.get(match, e.started_at)
        if wait > report.max_wait_s:
            report.max_wait_s, report.max_wait_match = wait, e.match
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matches", type=int, default=10_000)
    p.add_argument("--duration", type=float, default=240.0, help="seconds of chaos at most")
    p.add_argument("--timeout", type=float, default=None, help="hard cap (default duration+300)")
    p.add_argument("--interval", type=float, default=4.0, help="mean seconds between events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--runs-dir", type=Path, default=None, help="default: a fresh temp dir")
    p.add_argument(
        "--fast-referee-restart",
        action="store_true",
        help="start a killed referee again at once (as a supervisor would), "
        "not after the runner has given it up",
    )
    p.add_argument(
        "--events",
        default=",".join(WEIGHTS),
        help="kinds of chaos, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--early-kills",
        default=",".join(map(str, EARLY_KILLS)),
        help="SIGKILL the broker after these many episodes (default: %(default)s; '' for none)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the figures")
    args = p.parse_args()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    report = asyncio.run(
        soak(
            args.matches,
            args.duration,
            args.seed,
            runs_dir,
            args.interval,
            args.timeout,
            args.concurrency,
            say,
            args.fast_referee_restart,
            tuple(args.events.split(",")),
            tuple(int(n) for n in args.early_kills.split(",") if n),
        )
    )
    print("\n".join(report.lines()))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
