"""``backroom run``: start what is missing, run the matches, collect the episodes.

On one machine the runner starts a broker (when no URL is given), the
referee(s) and every agent as separate OS processes (``runner.stack``) — the
same processes a user would start by hand on many machines — then submits
match requests with at most ``concurrency`` in flight and gathers one
episode per match.

What a run does when referees die, revive or answer late is the
``MatchLedger``'s (``runner.dispatch``, docs/operations.md "Faults");
``runner.wiring`` connects it to the broker; the result and its summary are
``runner.results``'. When no referee is left the run fails with the dead
referee's log, rather than wait.
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
from backroom.bus.wire import IDENTITY_WINDOW_S, EpisodeRecord, MatchRequest, MatchSpec
from backroom.runner.config import EXTERNAL, RunConfig
from backroom.runner.dispatch import (
    AGAIN_TRIES,
    EPISODE_WAIT_S,
    REFEREE_GRACE_S,
    RERUNS,
    MatchLedger,
)
from backroom.runner.results import (
    Departure,
    Faults,
    PlayClock,
    RunError,
    RunResult,
    dedupe_episodes,
    finished_on_disk,
    summarize,
)
from backroom.runner.stack import (
    MODEL_KINDS,
    RunNames,
    Stack,
    env_for,
    identities,
    run_names,
    start_processes,
    torch_threads_env,
)
from backroom.runner.traces import (
    TRACE_WAIT_S,
    TRACES_MAX_BYTES,
    TraceLog,
    overflow_lines,
    seats_by_attempt,
)
from backroom.runner.wiring import SLOW_START_S, Wiring
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
    """Submit the run's matches (``concurrency`` in flight) and return one episode per match.

    With ``traces_path``, every trace a trainable agent publishes for one of
    these matches is appended there as JSON lines (``runner.traces.TraceLog``),
    each decision once, up to ``traces_max_bytes`` for the run, shared out
    equally among its seated agents (``on_notice`` hears when an agent reaches
    its share, and after the run every agent past it: ``faults.traces_over_share``);
    the file is closed however the run ends. After
    the last episode the run waits, up to ``trace_wait_s``, for the traces of
    decisions it has not seen yet, and counts those that never came
    (``faults.traces_missing``). With
    ``run_stamp``, every request names it, so referees write
    ``runs/<run>/<run_stamp>/``: this run's own directory, never an earlier
    run's file.

    ``on_notice`` hears, while the run waits, whom it waits for: at once for
    ``external`` (identities whose process someone else starts; default: the
    config's ``external`` agents), and after ``SLOW_START_S`` for any process
    still missing, so a wait for a process nobody starts is never silent.
    Besides ``wait_for``, the run waits for one referee (any status of kind
    ``referee`` that a roster record proves) to be online. An agent's
    ``online`` counts only while renewed (``presence.Roster``).

    While the run plays, a submitting task fills the window and this one
    watches the referees, so a submit waiting on a full window never keeps a
    dead referee from being noticed. What happens to matches whose referee
    dies, revives or answers late is the ``MatchLedger``'s (its methods say
    each rule; ``referee_grace_s`` and ``episode_wait_s`` are its waits).
    With no referee left, the run fails: at once when the run's own referees
    all died, after ``ready_timeout_s`` when others may come back.
    ``on_notice`` hears of each referee lost and each agent gone offline;
    ``faults`` gets the counts. Once ``stop`` is set (Ctrl-C), the run
    returns the matches finished by then and ``faults.interrupted`` says that
    it stopped short.

    ``claim_window_s`` > 0: the runner's identity may be another process's (a
    fixed ``runner``, shared by two runs on one broker). The runner stays
    ready that long after connecting to be thrown off by a process still
    logged in under it (which reconnects at once), and then fails with a
    ``RunError`` saying so, rather than throw it off again and again (both
    runs hung). As the agents do (``AgentRunner._claim``).
    """
    faults = faults if faults is not None else Faults()
    notice = on_notice or (lambda _msg: None)
    matches = _matches(config, run_stamp)
    me = bus_config.username or "runner"

    def request(i: int) -> MatchRequest:
        # Built when it is first sent, not before: bench/chaos_soak.py times a match from
        # its request's construction (``local.MatchRequest``).
        match, spec = matches[i]
        return MatchRequest(
            match=match, spec=spec, reply_to=me, reply_batches=True, run_key=run_key
        )

    play = Wiring(
        config,
        bus_config,
        wait_for,
        stack,
        [match for match, _ in matches],
        faults,
        notice,
        ready_timeout_s=ready_timeout_s,
        referee_grace_s=referee_grace_s,
        episode_wait_s=episode_wait_s,
    )
    ledger = play.ledger
    play.on_episode, play.clock, play.claim_window_s = on_episode, clock, claim_window_s
    if external is None:
        external = [a.id for a in config.agents if a.kind == EXTERNAL]
    async with contextlib.AsyncExitStack() as exits:
        if traces_path is not None:
            seats = {match: spec.seats for match, spec in matches}
            seats_of = seats_by_attempt(ledger.slot_of, seats)
            seated = {agent for spec_seats in seats.values() for agent in spec_seats}
            play.traces = exits.enter_context(
                TraceLog(traces_path, seats_of, traces_max_bytes, notice, agents=seated)
            )
        play.bus = await exits.enter_async_context(
            Bus(
                bus_config,
                role="runner",
                on_connect=[play.reconnected],
                on_disconnect=[play.thrown_off],
            )
        )
        await play.claim(claim_window_s)
        if await play.wait_ready(external, stop):
            await play.narrow()
            await play.play(request, len(matches), ack_timeout_s, stop)
        faults.interrupted = stop is not None and stop.is_set() and ledger.unfinished > 0
        # a league's rounds without traces need not wait, nor a run stopped or failed
        if play.traces is not None and not (faults.interrupted or ledger.failure):
            await _last_traces(play.traces, ledger, faults, notice, trace_wait_s)
        if play.traces is not None:
            over = play.traces.overflow(ledger.episodes.values())
            faults.traces_over_share = {a: list(n) for a, n in over.items()}
            for line in overflow_lines(over):
                notice(line)
    return ledger.result()


async def _last_traces(
    traces: TraceLog,
    ledger: MatchLedger,
    faults: Faults,
    notice: Callable[[str], None],
    wait_s: float,
) -> None:
    """Wait for the last decisions' traces, which may trail their episode (another reader,
    another path); count and say those that never came."""
    if missing := await traces.wait_for(list(ledger.episodes.values()), wait_s):
        faults.traces_missing = len(missing)
        agents = sorted({agent for _match, agent, _seat, _turn in missing})
        notice(
            f"{len(missing)} decisions have no trace in traces.jsonl "
            f"{wait_s:g} s after the last episode (agents: {', '.join(agents)})"
        )


def _matches(config: RunConfig, run_stamp: str | None) -> list[tuple[str, MatchSpec]]:
    """The run's matches under ids of this run's own (``<run>.<nonce>.<n>``), stamped with its directory."""
    nonce = f"{int(time.time() * 1000) % 10**10:010d}"
    stamp = {} if run_stamp is None else {"run_stamp": run_stamp}
    return [
        (f"{config.run}.{nonce}.{suffix}", spec.model_copy(update=stamp))
        for suffix, spec in config.match_specs()
    ]


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
    faults = Faults()
    try:
        bus_config = await connect_stack(stack, config, broker_url, credentials_dir, spawn)
        names = stack.names
        assert names is not None
        if spawn:
            waiting = start_processes(stack, config, runs, metrics_port)
        else:
            waiting = [a.id for a in config.agents]  # and a referee, any (run_matches)
            external = waiting
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
            run_stamp=run_dir.name,
            faults=faults,
            stop=stop,
            # A fixed name (compose's `runner`) may be another run's: claim it first.
            claim_window_s=0.0 if names.own else IDENTITY_WINDOW_S,
            run_key=run_key,
        )
        seconds = time.perf_counter() - t0
        stack.stop()  # the referees write what they still have before the file is checked
        if faults.interrupted:  # matches that ended before the Ctrl-C, their episode on its way
            late = finished_on_disk(run_dir / "episodes.jsonl", episodes, faults.reruns)
            episodes, faults.read_back = [*episodes, *late], len(late)
        faults.duplicates_on_disk = dedupe_episodes(
            run_dir / "episodes.jsonl", episodes, faults.reruns
        )
        return RunResult(
            config, episodes, seconds, run_dir, stack.url, clock.ended - clock.started, faults
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
    config: RunConfig,
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
            mine = [*names.referees, *(a.id for a in config.agents if a.kind != EXTERNAL)]
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
