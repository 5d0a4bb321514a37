"""A batch on the bus: what arrives goes to the ``MatchLedger``, what it asks for goes out.

``play.batch.play`` builds a ``Wiring`` and runs it: subscribe (and claim the
runner's identity), wait for the referees and agents, play. The fault rules
are the ledger's (``play.ledger``); what is here is only which topic feeds
which of its methods (or the caller's ``Sink``), and the waits around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import aiomqtt

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.client import Bus, BusConfig
from backroom.bus.connection import broker_reachable
from backroom.bus.errors import BusError
from backroom.bus.wire import (
    MatchRequest,
    WireError,
    parse_all,
)
from backroom.play.faults import RunError
from backroom.play.ledger import MatchLedger, feed_acks
from backroom.play.plan import MatchPlan, PlayOptions, Processes, Sink

#: Seconds into the wait for processes to come online before the runner says who is missing.
SLOW_START_S = 10.0


class Wiring:
    """One batch on the bus: what arrives goes to the ledger, what it asks goes out.

    Presence is read through a ``presence.Roster`` that applies the heartbeat
    expiry to statuses that declare a period (agents do; referees do not, so
    theirs hold until they say ``offline``): a stale retained ``online`` of an
    agent that died does not count once its renewals are overdue.

    While it waits for its processes the runner reads every status, to say
    who is missing and who only claims to be a referee; once the run plays
    (``narrow``) only those of the run's agents and of rostered referees: a
    flood of status flips or 60 KB statuses from an identity the run does not
    seat cost it a third of its matches per second (``bench/abuse.py``).
    """

    def __init__(
        self, plan: MatchPlan, bus_config: BusConfig, sink: Sink, options: PlayOptions
    ) -> None:
        self.plan = plan
        self.bus_config = bus_config
        self.sink = sink
        self.options = options
        self.wait_for = list(options.presence.wait_for)
        self.stack: Processes | None = options.presence.processes
        self.ledger = MatchLedger(
            plan.ids,
            self.publish,
            options.faults,
            sink.fault,
            agents=plan.agents,
            on_timeout=plan.on_timeout,
            referee_grace_s=options.waits.referee_grace_s,
            episode_wait_s=options.waits.episode_s,
        )
        self.notice = sink.fault
        self.ready_timeout_s = options.waits.ready_s
        self.me = bus_config.username or "runner"
        self.bus: Bus | None = None
        self.roster = presence.Roster(default_heartbeat_s=None)
        self.ready = asyncio.Event()
        self.all_done = asyncio.Event()
        self.window = asyncio.Semaphore(options.concurrency)
        self.rostered: set[str] = set()  # identities a referee-only record names referees
        self.unproven: dict[str, bytes] = {}  # "online, kind referee" from names not (yet) rostered
        self.clock = options.clock
        self.claim_window_s = options.presence.claim_window_s
        self.claiming = True
        #: Thrown off while claiming the identity: another process has it.
        self.taken = asyncio.Event()
        #: Whose statuses are read, once the run plays (``narrow``); None: everyone's.
        self.reading: set[str] | None = None

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
        if self.reading is not None and name not in self.reading and self.bus is not None:
            self.reading.add(name)
            self.bus.follow([topics.status(name)], self.on_status)

    async def narrow(self) -> None:
        """Read only the statuses the run acts on from now on: its agents' and its referees'."""
        assert self.bus is not None
        names = [*self.plan.agents, *self.wait_for, *sorted(self.rostered)]
        self.reading = set(names)
        await self.bus.subscribe_many([topics.status(n) for n in self.reading], self.on_status)
        await self.bus.unsubscribe(topics.ALL_STATUS)  # after: nothing missed between the two

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
        if seen.online and seen.status.traces and self.sink.keeps_traces:
            self.sink.tracer(name)  # its last decisions' traces are waited for
        if kind == "referee":
            (self.ledger.referee_online if seen.online else self.ledger.referee_offline)(name)
        else:
            self.ledger.agent_status(name, seen.online)
        self.check_ready()

    def on_ack(self, _topic: str, payload: bytes) -> None:
        """A referee answers each request it takes, and each ask ``again``, in our inbox."""
        feed_acks(self.ledger, payload)

    def on_episodes(self, _topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            record = None if isinstance(msg, WireError) else getattr(msg, "record", None)
            if record is None or not self.ledger.episode(record):
                continue
            self.window.release()
            self.sink.episode(record)
            self.clock.ended = time.perf_counter()  # the last one so far: a stop ends here
            if self.ledger.done:
                self.all_done.set()

    async def reconnected(self) -> None:
        self.ledger.reconnected()

    # --- what goes out --------------------------------------------------------------

    async def submit(self, request: Callable[[int], MatchRequest], n: int) -> None:
        """Ask for matches 0 to ``n``-1, each once the window has room (``request(i)`` builds it)."""
        for i in range(n):
            await self.window.acquire()
            self.ledger.ask(request(i))

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
            if self.sink.keeps_traces:
                await bus.subscribe(topics.ALL_TRACES, self.sink.trace)
            await bus.subscribe(topics.episodes(self.plan.game), self.on_episodes)
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
        said_waiting = False  # then the start of play is said too: a waiting line goes stale
        if awaited := [w for w in self.wait_for if w in external and not self.roster.is_online(w)]:
            self.notice(waiting_notice(awaited, self.bus_config, self.stack, self.ready_timeout_s))
            said_waiting = True
        while not self.ready.is_set():
            missing = self.roster.missing(self.wait_for)
            missing += [] if self.ledger.referees_up else [self.no_referee()]
            if slow_at and time.monotonic() > slow_at:
                slow_at = 0.0
                left = round(deadline - time.monotonic())
                self.notice(f"still waiting for {', '.join(missing)} ({left}s left)")
                said_waiting = True
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
        if said_waiting:
            self.notice("all agents online; playing")
        return True

    async def play(
        self,
        request: Callable[[int], MatchRequest],
        n: int,
        ack_timeout_s: float,
        stop: asyncio.Event | None,
    ) -> None:
        """Ask for the matches (``concurrency`` in flight) and watch the referees until all are in."""
        self.ledger.playing = True
        self.clock.started = time.perf_counter()

        async def stop_early() -> None:
            if stop is not None:
                await stop.wait()
                self.all_done.set()  # the matches finished so far are the run's result

        submitter = asyncio.create_task(self.submit(request, n))
        tasks = [submitter, asyncio.create_task(self.resubmit(ack_timeout_s))]
        tasks.append(asyncio.create_task(stop_early()))
        for watch in self.options.watchers:  # a slow run says how it goes (runner.heartbeat)
            tasks.append(asyncio.create_task(_watching(watch(self.ledger.episodes.values))))
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


async def _watching(watch: Awaitable[None]) -> None:
    await watch


def waiting_notice(
    who: list[str], bus_config: BusConfig, stack: Processes | None, timeout_s: float
) -> str:
    """Whom the run waits for and how they join: their process is not the runner's to start."""
    url = f"mqtt://{bus_config.host}:{bus_config.port}"
    text = f"waiting up to {timeout_s:.0f}s for {', '.join(who)} to connect to {url}"
    if stack is not None and stack.credentials is not None:
        name, whose = (who[0], "its") if len(who) == 1 else ("NAME", "each one's")
        text += f"; `backroom credentials add {name} --dir {stack.credentials.dir}` prints {whose} password"
    return text
