"""``backroom run``: start what is missing, run the matches, collect the episodes.

On one machine the runner starts a broker (when no URL is given), the
referee(s) and every agent as separate OS processes (``runner.stack``) — the
same processes a user would start by hand on many machines — then submits
match requests with at most ``concurrency`` in flight and gathers one
episode per match.

What a run does when referees die, revive or answer late is the
``MatchLedger``'s (``runner.dispatch``, docs/operations.md "Faults"); this
module only wires it to the broker: what arrives goes to the ledger, what the
ledger asks for goes out. When no referee is left the run fails with the dead
referee's log, rather than wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import aiomqtt

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.client import Bus, BusConfig
from backroom.bus.connection import broker_reachable
from backroom.bus.errors import BusError
from backroom.bus.wire import EpisodeRecord, Event, MatchRequest, WireError, parse_all
from backroom.referee.episodes import bind_run_dir, new_run_dir
from backroom.referee.service import IDENTITY_WINDOW_S
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
from backroom.runner.traces import TRACES_MAX_BYTES, TraceLog, seats_by_attempt

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

#: Seconds into the wait for processes to come online before the runner says who is missing.
SLOW_START_S = 10.0


class _Play:
    """One ``run_matches`` on the bus: what arrives goes to the ledger, what it asks goes out.

    Presence is read through a ``presence.Roster`` that applies the heartbeat
    expiry to statuses that declare a period (agents do; referees do not, so
    theirs hold until they say ``offline``): a stale retained ``online`` of an
    agent that died does not count once its renewals are overdue.
    """

    def __init__(
        self,
        config: RunConfig,
        bus_config: BusConfig,
        wait_for: list[str],
        stack: Stack | None,
        match_ids: list[str],
        faults: Faults,
        notice: Callable[[str], None],
        *,
        ready_timeout_s: float,
        referee_grace_s: float,
        episode_wait_s: float,
    ) -> None:
        self.config = config
        self.bus_config = bus_config
        self.wait_for = wait_for
        self.stack = stack
        self.ledger = MatchLedger(
            match_ids,
            self.publish,
            faults,
            notice,
            agents=[a.id for a in config.agents],
            on_timeout=config.on_timeout,
            referee_grace_s=referee_grace_s,
            episode_wait_s=episode_wait_s,
        )
        self.notice = notice
        self.ready_timeout_s = ready_timeout_s
        self.me = bus_config.username or "runner"
        self.bus: Bus | None = None
        self.roster = presence.Roster(default_heartbeat_s=None)
        self.ready = asyncio.Event()
        self.all_done = asyncio.Event()
        self.window = asyncio.Semaphore(config.concurrency)
        self.rostered: set[str] = set()  # identities a referee-only record names referees
        self.unproven: dict[str, bytes] = {}  # "online, kind referee" from names not (yet) rostered
        self.on_episode: Callable[[EpisodeRecord, int], None] | None = None
        self.clock: PlayClock | None = None
        self.traces: TraceLog | None = None
        self.claim_window_s = 0.0
        self.claiming = True
        self.taken = (
            asyncio.Event()
        )  # thrown off while claiming the identity: another process has it

    def publish(self, request: MatchRequest) -> None:
        # Batched: requests released together (a batch of episodes came back) go out as one message.
        assert self.bus is not None
        self.bus.publish(topics.CONTROL_MATCHES, request, batch=True)

    def check_ready(self) -> None:
        if self.ledger.referees_up and not self.roster.missing(self.wait_for):
            self.ready.set()

    def no_referee(self) -> str:
        """What the run waits for when no referee counts: say why one that says so does not."""
        if not self.unproven:
            return "a referee"
        return (
            f"a referee ({', '.join(sorted(self.unproven))} says online as a referee, but no "
            "roster record names it: only the referee role can write one, so it is not a "
            "referee, or its broker's ACL predates roster records: add an identity there, "
            "which rewrites it, and reload the broker)"
        )

    # --- what arrives --------------------------------------------------------------

    def on_roster(self, topic: str, payload: bytes) -> None:
        """A referee-only record names ``name`` a referee: its "online" counts from now on."""
        name = topics.referee_of(topic)
        if name is None or not payload:
            return
        self.rostered.add(name)
        if (claim := self.unproven.pop(name, None)) is not None:
            self.on_status(topics.status(name), claim)

    def on_status(self, topic: str, payload: bytes) -> None:
        seen = presence.read(topic, payload)
        if seen is None:
            return
        name, kind = seen.name, seen.status.kind
        if not seen.online:
            self.unproven.pop(name, None)  # a later roster record must not replay a stale online
        elif kind == "referee" and name not in self.rostered:
            # Any identity may say "kind: referee" of itself; counted as one, an agent
            # kept a run waiting for ever after the real referee died. Its roster
            # record (which only referees can write) may still be on its way.
            self.unproven[name] = payload
            metrics.UNPROVEN_REFEREES.inc()
            return
        self.roster.hold(seen)
        if kind == "referee":
            (self.ledger.referee_online if seen.online else self.ledger.referee_offline)(name)
        else:
            self.ledger.agent_status(name, seen.online)
        self.check_ready()

    def on_ack(self, _topic: str, payload: bytes) -> None:
        """A referee answers each request it takes, and each ask ``again``, in our inbox."""
        for msg in parse_all(payload):
            if isinstance(msg, WireError) or not msg.match:
                continue
            if not isinstance(msg, Event):
                self.ledger.acknowledged(msg.match)
            elif msg.kind == "accepted":
                self.ledger.accepted(msg.match, _referee_identity(msg.data))
            elif msg.kind == "running":
                self.ledger.running(msg.match)
            elif msg.kind == "forgotten":
                self.ledger.forgotten(msg.match)
            else:
                self.ledger.acknowledged(msg.match)

    def on_episodes(self, _topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            record = None if isinstance(msg, WireError) else getattr(msg, "record", None)
            if record is None or not self.ledger.episode(record):
                continue
            self.window.release()
            if self.on_episode:
                self.on_episode(record, len(self.ledger.episodes))
            if self.clock is not None:  # the last one so far: a run stopped early ends here
                self.clock.ended = time.perf_counter()
            if self.ledger.done:
                self.all_done.set()

    async def reconnected(self) -> None:
        self.ledger.reconnected()

    # --- what goes out --------------------------------------------------------------

    async def submit(self, requests: Iterable[MatchRequest]) -> None:
        for request in requests:
            await self.window.acquire()
            self.ledger.ask(request)

    async def resubmit(self, ack_timeout_s: float) -> None:
        """Resend what no referee acknowledged, and ask again for what went silent (the ledger's rules)."""
        assert self.bus is not None
        while True:
            await asyncio.sleep(ack_timeout_s / 2)
            self.ledger.resend(ack_timeout_s)
            if self.bus.connected.is_set():
                self.ledger.ask_silent_again()

    def watch_referees(self) -> None:
        """Lose referees that went away; fail when none is left (``RunError``)."""
        assert self.bus is not None
        stack, ledger = self.stack, self.ledger
        dead: list[str] = []
        if stack is not None:
            dead = [n for n in stack.dead() if n in stack.referees]
            for name in dead:
                ledger.lose(
                    stack.referees[name], f"its process {name} exited with {stack.exit_code(name)}"
                )
        ledger.expire(self.bus.connected.is_set())
        gap = ledger.without_referee()
        if gap is None:
            return
        left = ledger.unfinished
        if stack is not None and stack.referees and len(dead) == len(stack.referees):
            name = dead[0]
            tail = stack.log_tail(name)
            raise RunError(
                f"referee {name} ({stack.referees[name]}) died (exit code "
                f"{stack.exit_code(name)}) and no referee is left to run the {left} unfinished "
                "matches; the run stops here. "
                + (f"Its log ends:\n{tail}" if tail else "Its log is empty.")
            )
        if gap == 0:
            self.notice(f"no referee is online: waiting up to {self.ready_timeout_s:.0f}s for one")
        elif gap > self.ready_timeout_s:
            raise RunError(
                f"no referee online for {self.ready_timeout_s:.0f}s with {left} matches unfinished"
            )

    # --- the run ---------------------------------------------------------------------

    async def claim(self, claim_window_s: float) -> None:
        """Subscribe; with ``claim_window_s`` > 0, stay that long to be thrown off by a holder of our name.

        Subscribing to the referee rosters first: they are retained, so a
        referee's record is here before its status.
        """
        bus = self.bus
        assert bus is not None
        try:
            await bus.subscribe(topics.REFEREE_ROSTERS, self.on_roster)  # retained: before statuses
            await bus.subscribe(topics.ALL_STATUS, self.on_status)
            if self.traces is not None:
                await bus.subscribe(topics.ALL_TRACES, self.traces.on_trace)
            await bus.subscribe(topics.episodes(self.config.game), self.on_episodes)
            await bus.subscribe(topics.inbox(self.me), self.on_ack)
            if claim_window_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.taken.wait(), claim_window_s)
        except (BusError, aiomqtt.MqttError):
            # Cut off mid-subscribe: a raw MqttError traceback was all a clash said.
            if not (claim_window_s > 0 and await broker_reachable(self.bus_config)):
                raise
            self.taken.set()
        self.claiming = False
        if self.taken.is_set():
            me = self.me
            raise RunError(
                f"runner identity {me!r} is in use: another process logged in as {me!r} "
                f"took the connection back while this run was starting (another `backroom "
                "run` on this broker?). Stop that run, or give this one a runner identity of "
                f"its own (`backroom credentials add NAME --role runner`)"
            )

    async def thrown_off(self) -> None:
        if self.claiming and self.claim_window_s > 0 and await broker_reachable(self.bus_config):
            self.taken.set()
            assert self.bus is not None
            await self.bus.close()  # stay off: the process holding the name keeps it

    async def wait_ready(self, external: list[str], stop: asyncio.Event | None) -> bool:
        """Wait for ``wait_for`` and a referee to be online; False when ``stop`` came first."""
        self.check_ready()
        deadline = time.monotonic() + self.ready_timeout_s
        slow_at = time.monotonic() + SLOW_START_S
        if [w for w in self.wait_for if w in external] or not self.ledger.referees_up:
            with contextlib.suppress(TimeoutError):  # the retained "online" of one already up
                await asyncio.wait_for(self.ready.wait(), 0.2)
        if awaited := [w for w in self.wait_for if w in external and not self.roster.is_online(w)]:
            self.notice(_waiting_notice(awaited, self.bus_config, self.stack, self.ready_timeout_s))
        while not self.ready.is_set():
            missing = self.roster.missing(self.wait_for)
            missing += [] if self.ledger.referees_up else [self.no_referee()]
            if slow_at and time.monotonic() > slow_at:
                slow_at = 0.0
                left = round(deadline - time.monotonic())
                self.notice(f"still waiting for {', '.join(missing)} ({left}s left)")
            if self.stack is not None and (dead := self.stack.dead()):
                raise RunError(
                    f"process {dead[0]} exited before the run started:\n{self.stack.log_tail(dead[0])}"
                )
            if stop is not None and stop.is_set():
                return False  # Ctrl-C before any match: nothing is asked for
            if time.monotonic() > deadline:
                raise RunError(f"not online after {self.ready_timeout_s}s: {missing}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), 0.1)
        return True

    async def play(
        self, requests: list[MatchRequest], ack_timeout_s: float, stop: asyncio.Event | None
    ) -> None:
        """Ask for the matches (``concurrency`` in flight) and watch the referees until all are in."""
        self.ledger.playing = True
        if self.clock is not None:
            self.clock.started = time.perf_counter()

        async def stop_early() -> None:
            if stop is not None:
                await stop.wait()
                self.all_done.set()  # the matches finished so far are the run's result

        submitter = asyncio.create_task(self.submit(requests))
        tasks = [submitter, asyncio.create_task(self.resubmit(ack_timeout_s))]
        tasks.append(asyncio.create_task(stop_early()))
        try:
            while not self.all_done.is_set():
                if submitter.done() and (error := submitter.exception()) is not None:
                    raise error
                self.watch_referees()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.all_done.wait(), 0.2)
        finally:
            for task in tasks:
                task.cancel()
        if self.ledger.failure is not None:
            raise RunError(f"{self.ledger.failure}; the run stops here")


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
) -> list[EpisodeRecord]:
    """Submit the run's matches (``concurrency`` in flight) and return one episode per match.

    With ``traces_path``, every trace a trainable agent publishes for one of
    these matches is appended there as JSON lines (``runner.traces.TraceLog``),
    each decision once, up to ``traces_max_bytes`` for the run (``on_notice``
    hears when it is reached); the file is closed however the run ends. With
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
    nonce = f"{int(time.time() * 1000) % 10**10:010d}"
    me = bus_config.username or "runner"
    requests: list[MatchRequest] = []
    seats: dict[str, list[str]] = {}
    for suffix, spec in config.match_specs():
        match = f"{config.run}.{nonce}.{suffix}"
        if run_stamp is not None:
            spec = spec.model_copy(update={"run_stamp": run_stamp})
        seats[match] = spec.seats
        requests.append(
            MatchRequest(match=match, spec=spec, reply_to=me, reply_batches=True, run_key=run_key)
        )
    play = _Play(
        config,
        bus_config,
        wait_for,
        stack,
        [r.match for r in requests],
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
            seats_of = seats_by_attempt(ledger.slot_of, seats)
            play.traces = exits.enter_context(
                TraceLog(traces_path, seats_of, traces_max_bytes, notice)
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
            await play.play(requests, ack_timeout_s, stop)
        faults.interrupted = stop is not None and stop.is_set() and ledger.unfinished > 0
        await asyncio.sleep(0.2)  # traces of the last decisions are still on their way
    return ledger.result()


def _referee_identity(data: dict[str, object]) -> str:
    """The identity of the referee that sent an ``accepted`` event: its status topic's name."""
    identity = data.get("identity")
    if isinstance(identity, str):
        return identity
    referee = str(data.get("referee", ""))  # a referee before "identity": "<name>@<host>:<pid>"
    return referee.split("@", 1)[0]


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

    async with Bus(bus_config, role="runner") as bus:
        await bus.subscribe(topics.ALL_STATUS, on_status)
        await bus.subscribe(topics.inbox(bus_config.username or "runner"), lambda *_: None)
    return sorted(roster.online(set(names)))


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
        names = run_names(config, stack.nonce) if broker_url is None else None
        stack.start_broker(broker_url, credentials_dir, identities(config, names))
        if names is None:  # someone else's broker: our own names only where we can add them
            names = run_names(config, stack.nonce if stack.can_add_identities() else None)
        stack.names = names
        bus_config = stack.identity(names.runner, role="runner", ephemeral=names.own)
        if stack.broker is None:
            if names.own:
                await asyncio.sleep(0.3)  # the broker rereads its files (SIGHUP) before we log in
            if spawn:
                mine = [*names.referees, *(a.id for a in config.agents if a.kind != EXTERNAL)]
                if taken := await already_online(bus_config, mine):
                    raise RunError(
                        f"already online on {stack.url}: {', '.join(taken)}. Another process "
                        "logs in under each (another `backroom run` of these agents?), and "
                        "starting a second one would throw it off the broker: stop it, rename "
                        "the agents, or play with --no-spawn against the running ones"
                    )
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


def _prepare_dirs(runs_dir: str | Path, run: str) -> tuple[Path, Path]:
    """The runs directory and this run's fresh ``runs/<run>/<UTC stamp>/`` (``latest`` points to it).

    Fresh on every run so that a second run, or a failed one, never appends to
    an earlier run's episodes, traces or logs.
    """
    runs = Path(runs_dir).resolve()
    return runs, new_run_dir(runs, run)
