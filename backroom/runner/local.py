"""``backroom run``: start what is missing, run the matches, collect the episodes.

On one machine the runner starts a broker (when no URL is given), the
referee(s) and every agent as separate OS processes (``runner.stack``) — the
same processes a user would start by hand on many machines — then submits
match requests with at most ``concurrency`` in flight and gathers one
episode per match.

The matches are played by ``play.batch.play`` (the one operation behind
``backroom run``, the league and, through the same ledger, the trainer:
docs/architecture.md, "One batch, three callers"): the run's plan
(``run_plan``), its options, and its run directory as the sink
(``runner.sink.RunSink``). What a run does when referees die, revive or
answer late is the ``MatchLedger``'s (``play.ledger``, docs/operations.md
"Faults"); the result and its summary are ``runner.results``'. When no
referee is left the run fails with the dead referee's log, rather than wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from backroom.bus import presence, topics
from backroom.bus.client import Bus, BusConfig
from backroom.bus.errors import LoginRefused
from backroom.bus.wire import IDENTITY_WINDOW_S, EpisodeRecord, MatchRequest
from backroom.play.batch import play
from backroom.play.plan import MatchPlan, PlayOptions, Presence, Waits
from backroom.play.wiring import SLOW_START_S
from backroom.runner.config import EXTERNAL, RunConfig
from backroom.runner.dispatch import (
    AGAIN_TRIES,
    EPISODE_WAIT_S,
    REFEREE_GRACE_S,
    RERUNS,
)
from backroom.runner.results import (
    Departure,
    Faults,
    PlayClock,
    RunError,
    RunResult,
    dedupe_episodes,
    summarize,
)
from backroom.runner.sink import RunSink
from backroom.runner.stack import (
    MODEL_KINDS,
    RunNames,
    Stack,
    StackProcesses,
    env_for,
    identities,
    run_names,
    start_processes,
    torch_threads_env,
)
from backroom.runner.traces import (
    TRACE_WAIT_S,
    TRACES_MAX_BYTES,
)
from backroom.runs import bind_run_dir, new_run_dir

# Re-exported: the CLI, the tests, the benches and other runners built on this one import
# them from here (the public names stay where they were before the split).
__all__ = [
    "AGAIN_TRIES",
    "EPISODE_WAIT_S",
    "MODEL_KINDS",
    "REFEREE_GRACE_S",
    "RERUNS",
    "SLOW_START_S",
    "TRACES_MAX_BYTES",
    "Departure",
    "Faults",
    "MatchRequest",
    "PlayClock",
    "RunError",
    "RunNames",
    "RunResult",
    "Stack",
    "StackProcesses",
    "already_online",
    "dedupe_episodes",
    "env_for",
    "identities",
    "run_local",
    "run_matches",
    "run_names",
    "start_processes",
    "summarize",
    "torch_threads_env",
]


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
    run_stamp: str | None = None,
    faults: Faults | None = None,
    referee_grace_s: float = REFEREE_GRACE_S,
    stop: asyncio.Event | None = None,
    traces_max_bytes: int = TRACES_MAX_BYTES,
    episode_wait_s: float = EPISODE_WAIT_S,
    claim_window_s: float = 0.0,
    run_key: str | None = None,
    trace_wait_s: float = TRACE_WAIT_S,
) -> list[EpisodeRecord]:
    """A run config's matches through ``play.batch.play``: one episode per match.

    For callers that hold a ``RunConfig`` (the tests, the benches, other
    runners built on this one); each argument lands in the plan, the options
    or the run's sink (``run_plan``, ``run_options``, ``runner.sink.RunSink``),
    whose docstrings say what it does. With ``traces_path``, every trace a
    trainable agent publishes for one of these matches is appended there
    (``runner.traces.TraceLog``), each decision once, up to
    ``traces_max_bytes`` for the run, shared out equally among its seated
    agents; the file is closed however the run ends. ``external`` defaults
    to the config's ``external`` agents.
    """
    plan = run_plan(config, run_stamp, run_key)
    sink = RunSink(on_notice or (lambda _msg: None), on_episode)
    options = run_options(
        config,
        sink,
        Presence(tuple(wait_for), _external(config, external), stack, claim_window_s),
        Waits(ready_timeout_s, ack_timeout_s, referee_grace_s, episode_wait_s, trace_wait_s),
        stop,
    )
    if faults is not None:
        options.faults = faults
    if clock is not None:
        options.clock = clock
    with contextlib.ExitStack() as exits:
        if traces_path is not None:
            exits.enter_context(sink.keep_traces(traces_path, plan, traces_max_bytes))
        return await play(plan, bus_config, sink, options)


def _external(config: RunConfig, external: list[str] | None) -> tuple[str, ...]:
    """Whose process someone else starts (None: the config's ``external`` agents)."""
    if external is None:
        return tuple(a.id for a in config.agents if a.kind == EXTERNAL)
    return tuple(external)


def run_options(
    config: RunConfig, sink: RunSink, presence: Presence, waits: Waits, stop: asyncio.Event | None
) -> PlayOptions:
    """How a run config's batch is played: its window, and its heartbeat to ``sink``."""
    return PlayOptions(
        concurrency=config.concurrency,
        waits=waits,
        presence=presence,
        stop=stop,
        watchers=[sink.heartbeat(config)],
    )


def run_plan(config: RunConfig, run_stamp: str | None, run_key: str | None = None) -> MatchPlan:
    """The run's matches under ids of this run's own (``<run>.<nonce>.<n>``), stamped with its
    directory (``run_stamp``) and key (``run_key``)."""
    nonce = f"{int(time.time() * 1000) % 10**10:010d}"
    stamp = {} if run_stamp is None else {"run_stamp": run_stamp}
    return MatchPlan.of(
        config.game,
        [
            (f"{config.run}.{nonce}.{suffix}", spec.model_copy(update=stamp))
            for suffix, spec in config.match_specs()
        ],
        agents=[a.id for a in config.agents],
        on_timeout=config.on_timeout,
        run_key=run_key,
    )


async def already_online(bus_config: BusConfig, names: Iterable[str]) -> list[str]:
    """Which of ``names`` a retained status says online, read as ``bus_config``.

    ``bus_config`` must be an identity no other process uses (this run's own
    runner): no process can look at a status without logging in, and logging
    in under a name that is online throws its process off (the client id is
    the username). A probe: it relies on the broker sending the retained
    statuses of the first subscription before the SUBACK of the second
    (docs/architecture.md, "Presence").
    """
    roster = presence.Roster(default_heartbeat_s=None)

    def on_status(topic: str, payload: bytes) -> None:
        roster.see(topic, payload)

    names = sorted(set(names))
    if not names:
        return []
    async with Bus(bus_config, role="runner") as bus:
        await bus.subscribe_many([topics.status(n) for n in names], on_status)
        await bus.subscribe(topics.inbox(bus_config.username or "runner"), lambda *_: None)
    return sorted(roster.online(set(names)))


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
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Start broker (if no URL), referee(s) and agents as processes; run the config; stop them.

    ``spawn=False`` starts nothing: the referee and agents are already running
    (docker compose, other machines) and the run waits for them to be online.
    ``on_notice`` hears whom the run waits for and, when a run on someone
    else's broker fails, which identities it added there (they stay: a process
    may be using them, and ``backroom credentials remove`` takes them away).

    The runner and the referees it starts get identities of this run's own
    (``run_names``), removed again from a broker the run did not start; where
    the run cannot add identities, the fixed ``runner`` and ``referee``. On a
    broker the run did not start, it refuses to start a process whose identity
    a retained status says is online: that process would be thrown off.
    """
    runs, run_dir = _prepare_dirs(runs_dir, config.run)
    # Referees write into the run directory only for requests with its key (only
    # referees read requests; no episode carries it): no other runner can name it.
    run_key = secrets.token_hex(16)
    bind_run_dir(run_dir, run_key)
    stack = Stack(run_dir)
    external: list[str] | None = None  # None: the config's `external` agents
    try:
        processes = StackProcesses.of_run(config)
        bus_config = await connect_stack(stack, processes, broker_url, credentials_dir, spawn)
        names = stack.names
        assert names is not None
        if spawn:
            waiting = start_processes(stack, processes, runs, metrics_port)
        else:
            waiting = [a.id for a in config.agents]  # and a referee, any (run_matches)
            external = waiting
        t0 = time.perf_counter()
        plan = run_plan(config, run_dir.name, run_key)
        sink = RunSink(on_notice or (lambda _msg: None), on_episode)
        # A fixed name (compose's `runner`) may be another run's: claim it first.
        claim_s = 0.0 if names.own else IDENTITY_WINDOW_S
        presence = Presence(tuple(waiting), _external(config, external), stack, claim_s)
        options = run_options(config, sink, presence, Waits(ready_s=ready_timeout_s), stop)
        with sink.keep_traces(run_dir / "traces.jsonl", plan):
            episodes = await play(plan, bus_config, sink, options)
        seconds = time.perf_counter() - t0
        stack.stop()  # the referees write what they still have before the file is checked
        episodes = sink.reconcile(run_dir / "episodes.jsonl", episodes, options.faults)
        clock = options.clock
        return RunResult(
            config,
            episodes,
            seconds,
            run_dir,
            stack.url,
            clock.ended - clock.started,
            options.faults,
        )
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


async def _accepted(bus_config: BusConfig, timeout_s: float = 10.0) -> None:
    """Return once the broker takes ``bus_config``'s login: one just added is refused until
    the broker has reread its password file (a fixed 0.3 s wait was a guess at how long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with Bus(bus_config, role="runner"):
                return
        except LoginRefused:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def connect_stack(
    stack: Stack,
    config: StackProcesses,
    broker_url: str | None,
    credentials_dir: str | Path | None,
    spawn: bool,
) -> BusConfig:
    """Start or join the broker, name the run's processes (``stack.names``); the runner's login.

    On a broker the run did not start, refuse to start a process whose
    identity a retained status says is online: that process would be thrown off.
    """
    names = run_names(config, stack.nonce) if broker_url is None else None
    stack.start_broker(broker_url, credentials_dir, identities(config, names))
    if names is None:  # someone else's broker: our own names only where we can add them
        names = run_names(config, stack.nonce if stack.can_add_identities() else None)
    stack.names = names
    bus_config = stack.identity(names.runner, role="runner", ephemeral=names.own)
    if stack.broker is None:
        if names.own:
            await _accepted(bus_config)  # the broker rereads its files on SIGHUP, not at once
        if spawn:
            mine = [*names.referees, *(a.id for a in config.local())]
            if taken := await already_online(bus_config, mine):
                raise RunError(
                    f"already online on {stack.url}: {', '.join(taken)}. Another process "
                    "logs in under each (another `backroom run` of these agents?), and "
                    "starting a second one would throw it off the broker: stop it, rename "
                    "the agents, or play with --no-spawn against the running ones"
                )
    return bus_config


def _prepare_dirs(runs_dir: str | Path, run: str) -> tuple[Path, Path]:
    """The runs directory and this run's fresh ``runs/<run>/<UTC stamp>/`` (``latest`` points to it).

    Fresh on every run so that a second run, or a failed one, never appends to
    an earlier run's episodes, traces or logs.
    """
    runs = Path(runs_dir).resolve()
    return runs, new_run_dir(runs, run)
