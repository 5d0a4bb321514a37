"""``backroom run``: start what is missing, run the matches, collect the episodes.

On one machine the runner starts a broker (when no URL is given), the
referee(s) and every agent as separate OS processes — the same processes a
user would start by hand on many machines — then submits match requests with
at most ``concurrency`` in flight and gathers one episode per match.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backroom.bus import topics
from backroom.bus.auth import CredentialStore, Role
from backroom.bus.broker import Broker, die_with_parent, reload_broker
from backroom.bus.client import BUSY_MATCHES, Bus, BusConfig
from backroom.bus.wire import EpisodeRecord, MatchRequest, Status, WireError, parse, parse_all
from backroom.runner.config import EXTERNAL, RunConfig

#: Seconds into the wait for processes to come online before the runner says who is missing.
SLOW_START_S = 10.0


class RunError(RuntimeError):
    pass


@dataclass(repr=False)
class RunResult:
    config: RunConfig
    episodes: list[EpisodeRecord]
    seconds: float  # wall clock of the whole run, processes starting up included
    run_dir: Path
    broker_url: str
    play_seconds: float  # first request out to last episode in

    @property
    def matches_per_second(self) -> float:
        """Rate of play: from the first request to the last episode, so the
        seconds that processes take to import and connect do not dilute it."""
        return len(self.episodes) / self.play_seconds if self.play_seconds > 0 else 0.0

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run on Python 3.11 builds the repr of its main
        # task's result twice on the way out (CPython issue #112559), and the
        # dataclass repr of every episode took about a second per 10,000 matches.
        return (
            f"RunResult(run={self.config.run!r}, episodes={len(self.episodes)}, "
            f"seconds={self.seconds:.1f}, run_dir={str(self.run_dir)!r})"
        )


@dataclass
class PlayClock:
    """When a run's first request went out and its last episode came in (``perf_counter``)."""

    started: float = 0.0
    ended: float = 0.0


@dataclass
class Stack:
    """The processes a run started; ``stop`` ends them all (a crash cannot leave orphans behind)."""

    run_dir: Path
    broker: Broker | None = None
    url: str = ""
    credentials: CredentialStore | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: Identities this run added to a broker it did not start: they outlive the run.
    created: list[str] = field(default_factory=list)

    def start_broker(
        self,
        url: str | None,
        credentials_dir: str | Path | None,
        identities: list[tuple[str, Role]] | None = None,
    ) -> None:
        """Start a broker when no URL is given, with ``identities`` created before it starts."""
        if url is None:
            broker = Broker(self.run_dir / "broker")
            for name, role in identities or []:
                broker.credentials.add(name, role=role)
            self.broker = broker.start()
            self.url = self.broker.url
            self.credentials = self.broker.credentials
        else:
            if credentials_dir is None:
                raise RunError(
                    "with --broker, pass --credentials DIR: the credentials.json of that broker "
                    "(written by `backroom broker` or `backroom credentials add`)"
                )
            self.url = url
            self.credentials = CredentialStore(credentials_dir)

    def identity(self, username: str, role: Role = "agent") -> BusConfig:
        assert self.credentials is not None
        known = username in self.credentials.load()
        cred = self.credentials.add(username, role=role)
        if not known and self.broker is None:
            self.created.append(username)
        if not known:
            # A broker we started, or one whose pid file sits beside the
            # credentials (`backroom broker --dir`), rereads them now.
            reload_broker(self.credentials.dir)
        return BusConfig.from_url(self.url, username=cred.username, password=cred.password)

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = (logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "backroom", *args],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.broker is not None:
            self.broker.stop()


def identities(config: RunConfig) -> list[tuple[str, Role]]:
    """Every identity a run needs, so a broker we start knows them all from its first second."""
    refs: list[tuple[str, Role]] = [
        ("referee" if i == 0 else f"referee-{i}", "referee") for i in range(config.referees)
    ]
    return [*refs, ("runner", "runner"), *((a.id, "agent") for a in config.agents)]


def _env(cfg: BusConfig) -> dict[str, str]:
    return {
        "BACKROOM_BROKER": f"mqtt://{cfg.host}:{cfg.port}",
        "BACKROOM_USERNAME": cfg.username or "",
        "BACKROOM_PASSWORD": cfg.password or "",
    }


def start_processes(
    stack: Stack, config: RunConfig, runs_dir: Path, metrics_port: int = 0, referees: bool = True
) -> list[str]:
    """Spawn the referee(s) and agents; return the identities to wait for.

    Agents of kind ``external`` are not started: they are someone else's
    process (a notebook, another machine) and the run waits for them to come
    online (``run_matches`` says so at once). With ``metrics_port`` P, the
    referees and agents serve metrics on P+1, P+2, ... in the order they are
    started.
    """
    waiting = []
    ports = iter(range(metrics_port + 1, metrics_port + 10_000)) if metrics_port else None

    def metrics_args() -> list[str]:
        return ["--metrics-port", str(next(ports))] if ports else []

    if referees:
        for i in range(config.referees):
            name = "referee" if i == 0 else f"referee-{i}"
            cfg = stack.identity(name, role="referee")
            stack.spawn(name, ["referee", "--runs-dir", str(runs_dir), *metrics_args()], _env(cfg))
            waiting.append(name)
    local = [a for a in config.agents if a.kind != EXTERNAL]
    for a in config.agents:
        stack.identity(a.id)  # external agents get their identity too, to be handed out
    if config.agent_processes == "single" and local:
        passwords = {a.id: stack.identity(a.id).password or "" for a in local}
        spec = json.dumps([a.model_dump() for a in local])
        env = {**_env(stack.identity(local[0].id)), "BACKROOM_PASSWORDS": json.dumps(passwords)}
        stack.spawn("agents", ["agent-host", "--spec-json", spec, *metrics_args()], env)
    else:
        for a in local:
            args = [
                "agent",
                a.kind,
                "--id",
                a.id,
                "--options-json",
                json.dumps(a.options),
                *metrics_args(),
            ]
            stack.spawn(a.id, args, _env(stack.identity(a.id)))
    waiting += [a.id for a in config.agents]
    return waiting


async def run_matches(
    config: RunConfig,
    bus_config: BusConfig,
    wait_for: list[str],
    stack: Stack | None = None,
    on_episode: Callable[[EpisodeRecord, int], None] | None = None,
    ready_timeout_s: float = 60.0,
    ack_timeout_s: float = 2.0,
    traces_path: Path | None = None,
    clock: PlayClock | None = None,
    on_notice: Callable[[str], None] | None = None,
    external: list[str] | None = None,
) -> list[EpisodeRecord]:
    """Submit the run's matches (``concurrency`` in flight) and return one episode per match.

    With ``traces_path``, every trace a trainable agent publishes for one of
    these matches (prompt and completion tokens, log-probs, the raw request and
    reply of an API model) is appended there as JSON lines.

    ``on_notice`` hears, while the run waits, whom it waits for: at once for
    ``external`` (identities whose process someone else starts; default: the
    config's ``external`` agents), and after ``SLOW_START_S`` for any process
    still missing, so a wait for a process nobody starts is never silent.
    """
    online: set[str] = set()
    ready = asyncio.Event()
    episodes: dict[str, EpisodeRecord] = {}
    window = asyncio.Semaphore(config.concurrency)
    all_done = asyncio.Event()
    nonce = f"{int(time.time() * 1000) % 10**10:010d}"
    match_ids = [f"{config.run}.{nonce}.{suffix}" for suffix, _ in config.match_specs()]
    wanted = set(match_ids)
    sent: dict[str, tuple[MatchRequest, float]] = {}  # submitted, not yet acknowledged
    me = bus_config.username or "runner"

    def on_status(topic: str, payload: bytes) -> None:
        agent = topics.agent_of(topic)
        try:
            msg = parse(payload)
        except WireError:
            return
        if agent and isinstance(msg, Status):
            (online.add if msg.state == "online" else online.discard)(agent)
            if all(w in online for w in wait_for):
                ready.set()

    def on_ack(_topic: str, payload: bytes) -> None:
        # A referee acknowledges each request it takes in the runner's own inbox.
        for msg in parse_all(payload):
            if not isinstance(msg, WireError) and msg.match:
                sent.pop(msg.match, None)

    def on_episode_msg(_topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            if not isinstance(msg, WireError):
                on_episode_record(getattr(msg, "record", None))

    def on_episode_record(record: EpisodeRecord | None) -> None:
        if record is None or record.match not in wanted or record.match in episodes:
            return  # someone else's run, or a redelivery
        episodes[record.match] = record
        sent.pop(record.match, None)
        window.release()
        if on_episode:
            on_episode(record, len(episodes))
        if len(episodes) == len(wanted):
            all_done.set()
            if clock is not None:
                clock.ended = time.perf_counter()

    async def resubmit() -> None:
        """Send again what no referee acknowledged: a broker restart can drop a request.

        Safe because referees drop requests for matches they run or ran; with
        several referees, a request lost *after* one referee took it but before
        its "started" event got out could run twice (the runner keeps the first).
        """
        while True:
            await asyncio.sleep(ack_timeout_s / 2)
            now = time.monotonic()
            for match_id, (request, at) in list(sent.items()):
                if now - at > ack_timeout_s:
                    sent[match_id] = (request, now)
                    await bus.publish(topics.CONTROL_MATCHES, request)

    trace_file = traces_path.open("ab") if traces_path is not None else None

    def on_trace(_topic: str, payload: bytes) -> None:
        try:
            msg = parse(payload)
        except WireError:
            return
        if trace_file is not None and msg.match in wanted:
            trace_file.write(payload.rstrip(b"\n") + b"\n")

    async with Bus(bus_config, role="runner") as bus:
        await bus.subscribe(topics.ALL_STATUS, on_status)
        if trace_file is not None:
            await bus.subscribe(topics.ALL_TRACES, on_trace)
        await bus.subscribe(topics.episodes(config.game), on_episode_msg)
        await bus.subscribe(topics.inbox(me), on_ack)
        if not wait_for:
            ready.set()
        deadline = time.monotonic() + ready_timeout_s
        slow_at = time.monotonic() + SLOW_START_S
        notice = on_notice or (lambda _msg: None)
        others = (
            [a.id for a in config.agents if a.kind == EXTERNAL] if external is None else external
        )
        if [w for w in wait_for if w in others]:
            with contextlib.suppress(TimeoutError):  # the retained "online" of one already up
                await asyncio.wait_for(ready.wait(), 0.2)
        if awaited := [w for w in wait_for if w in others and w not in online]:
            notice(_waiting_notice(awaited, bus_config, stack, ready_timeout_s))
        while not ready.is_set():
            if slow_at and time.monotonic() > slow_at:
                slow_at = 0.0
                left = round(deadline - time.monotonic())
                notice(
                    f"still waiting for {', '.join(sorted(set(wait_for) - online))} ({left}s left)"
                )
            if stack is not None and (dead := stack.dead()):
                raise RunError(
                    f"process {dead[0]} exited before the run started:\n{stack.log_tail(dead[0])}"
                )
            if time.monotonic() > deadline:
                missing = sorted(set(wait_for) - online)
                raise RunError(f"not online after {ready_timeout_s}s: {missing}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), 0.1)
        resubmitter = asyncio.create_task(resubmit())
        if clock is not None:
            clock.started = time.perf_counter()
        bus.set_busy(config.concurrency >= BUSY_MATCHES)
        for match_id, (_, spec) in zip(match_ids, config.match_specs(), strict=False):
            await window.acquire()
            request = MatchRequest(match=match_id, spec=spec, reply_to=me, reply_batches=True)
            sent[match_id] = (request, time.monotonic())
            # Batched: requests released together (a batch of episodes came back)
            # go out as one message; an unacknowledged one is resubmitted.
            bus.publish_batched(topics.CONTROL_MATCHES, request)
        while not all_done.is_set():
            if stack is not None and (dead := [d for d in stack.dead() if d.startswith("referee")]):
                raise RunError(f"referee {dead[0]} died:\n{stack.log_tail(dead[0])}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_done.wait(), 0.5)
        resubmitter.cancel()
        await asyncio.sleep(0.2)  # traces of the last decisions are still on their way
    if trace_file is not None:
        trace_file.close()
    return [episodes[m] for m in match_ids]


def _waiting_notice(
    who: list[str], bus_config: BusConfig, stack: Stack | None, timeout_s: float
) -> str:
    """Whom the run waits for and how they join: their process is not the runner's to start."""
    url = f"mqtt://{bus_config.host}:{bus_config.port}"
    text = f"waiting up to {timeout_s:.0f}s for {', '.join(who)} to connect to {url}"
    if stack is not None and stack.credentials is not None:
        name, whose = (who[0], "its") if len(who) == 1 else ("NAME", "each one's")
        text += f"; `backroom credentials add {name} --dir {stack.credentials.dir}` prints {whose} password"
    return text


async def run_local(
    config: RunConfig,
    runs_dir: str | Path = "runs",
    broker_url: str | None = None,
    credentials_dir: str | Path | None = None,
    on_episode: Callable[[EpisodeRecord, int], None] | None = None,
    spawn: bool = True,
    metrics_port: int = 0,
    on_notice: Callable[[str], None] | None = None,
    ready_timeout_s: float = 60.0,
) -> RunResult:
    """Start broker (if no URL), referee(s) and agents as processes; run the config; stop them.

    ``spawn=False`` starts nothing: the referee and agents are already running
    (docker compose, other machines) and the run waits for them to be online.
    ``on_notice`` hears whom the run waits for and, when a run on someone
    else's broker fails, which identities it added there (they stay: a process
    may be using them, and ``backroom credentials remove`` takes them away).
    """
    runs, run_dir = _prepare_dirs(runs_dir, config.run)
    stack = Stack(run_dir)
    external: list[str] | None = None  # None: the config's `external` agents
    try:
        stack.start_broker(broker_url, credentials_dir, identities(config))
        if spawn:
            waiting = start_processes(stack, config, runs, metrics_port)
        else:
            waiting = ["referee"] + [a.id for a in config.agents]
            external = waiting
        bus_config = stack.identity("runner", role="runner")
        t0 = time.perf_counter()
        clock = PlayClock()
        episodes = await run_matches(
            config,
            bus_config,
            waiting,
            stack,
            on_episode,
            ready_timeout_s=ready_timeout_s,
            traces_path=run_dir / "traces.jsonl",
            clock=clock,
            on_notice=on_notice,
            external=external,
        )
        seconds = time.perf_counter() - t0
        return RunResult(config, episodes, seconds, run_dir, stack.url, clock.ended - clock.started)
    except BaseException as exc:
        if stack.created and stack.credentials is not None:
            added = (
                f"this run added {', '.join(stack.created)} to {stack.credentials.path}; "
                f"`backroom credentials remove NAME --dir {stack.credentials.dir}` removes one"
            )
            if isinstance(exc, RunError):
                raise RunError(f"{exc}\n{added}") from None
            if on_notice is not None:
                on_notice(added)
        raise
    finally:
        stack.stop()


def _prepare_dirs(runs_dir: str | Path, run: str) -> tuple[Path, Path]:
    runs = Path(runs_dir).resolve()
    (runs / run).mkdir(parents=True, exist_ok=True)
    return runs, runs / run


def summarize(result: RunResult) -> dict[str, Any]:
    """Per agent: matches, mean raw return, mean return after the transform, timeouts; outcomes."""
    per: dict[str, dict[str, float]] = {}
    outcomes: dict[str, int] = {}
    for ep in result.episodes:
        outcomes[ep.reason] = outcomes.get(ep.reason, 0) + 1
        for seat, agent in enumerate(ep.seats):
            row = per.setdefault(agent, {"matches": 0, "raw": 0.0, "reward": 0.0, "timeouts": 0})
            row["matches"] += 1
            row["raw"] += ep.raw_returns[seat]
            row["reward"] += ep.returns[seat]
            row["timeouts"] += ep.timeouts.count(seat)
    for row in per.values():
        n = max(1, int(row["matches"]))
        row["raw"] /= n
        row["reward"] /= n
    return {"agents": per, "outcomes": outcomes}
