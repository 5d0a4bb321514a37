"""``play``'s own connection: what arrives goes to its ``Batch``, what the batch asks goes out.

``play.batch.play`` builds a ``Wiring`` (its own ``Bus``, logged in as the
runner, and the ``play.loop.Batch`` it feeds) and runs it: subscribe (and
claim the runner's identity), wait for the referees and agents, narrow what
it reads, play the batch. What is here is only which topic feeds which door
of the batch (or the caller's ``Sink``), the waits before play, and the rule
for referees of ``backroom run`` and the league (``OwnReferees``). The loop
itself (window, resends, stop) is ``play.loop``'s, the fault rules are the
ledger's (``play.ledger``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.claim import IdentityClaim, IdentityInUse
from backroom.bus.client import Bus, BusConfig
from backroom.bus.wire import MatchRequest, WireError, parse_all
from backroom.play.faults import RunError
from backroom.play.ledger import MatchLedger
from backroom.play.loop import Batch
from backroom.play.plan import MatchPlan, PlayOptions, Processes, Sink

#: Seconds into the wait for processes to come online before the runner says who is missing.
SLOW_START_S = 10.0


class OwnReferees:
    """The referee rule of ``backroom run`` and the league (``loop.Referees``).

    A referee process of the caller's own that exited is lost at once; with
    no referee left the batch fails at once when those were all of them
    (quoting the first one's log), else after ``ready_s`` (others may come
    back), saying at the first look that it waits.
    """

    def __init__(
        self, stack: Processes | None, notice: Callable[[str], None], ready_s: float
    ) -> None:
        self.stack = stack
        self.notice = notice
        self.ready_s = ready_s

    def _dead(self) -> list[str]:
        stack = self.stack
        return [] if stack is None else [n for n in stack.dead() if n in stack.referees]

    def dead(self) -> list[tuple[str, str]]:
        stack = self.stack
        if stack is None:
            return []
        return [
            (stack.referees[name], f"its process {name} exited with {stack.exit_code(name)}")
            for name in self._dead()
        ]

    def none_left(self, gap_s: float, ledger: MatchLedger) -> None:
        stack, left = self.stack, ledger.unfinished
        dead = self._dead()
        if stack is not None and stack.referees and len(dead) == len(stack.referees):
            name = dead[0]
            tail = stack.log_tail(name)
            raise RunError(
                f"referee {name} ({stack.referees[name]}) died (exit code "
                f"{stack.exit_code(name)}) and no referee is left to run the {left} unfinished "
                "matches; the run stops here. "
                + (f"Its log ends:\n{tail}" if tail else "Its log is empty.")
            )
        if gap_s == 0:
            self.notice(f"no referee is online: waiting up to {self.ready_s:.0f}s for one")
        elif gap_s > self.ready_s:
            raise RunError(
                f"no referee online for {self.ready_s:.0f}s with {left} matches unfinished"
            )


class Wiring:
    """``play``'s own bus and the batch it feeds: what arrives goes to the batch, what it asks goes out.

    It is the batch's ``Session`` (``me``, ``send``, ``connected``) over a
    ``Bus`` it makes here and ``play`` opens. Presence is read through a
    ``presence.Roster`` that applies the heartbeat expiry to statuses that
    declare a period (agents do; referees do not, so theirs hold until they
    say ``offline``): a stale retained ``online`` of an agent that died does
    not count once its renewals are overdue.

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
        self.me = bus_config.username or "runner"
        self.wait_for = list(options.presence.wait_for)
        self.stack: Processes | None = options.presence.processes
        self.notice = sink.fault
        self.ready_timeout_s = options.waits.ready_s
        self.claim_window_s = options.presence.claim_window_s
        #: A runner has no status to tell whether its name was used before: with a window
        #: (a name it did not make for itself), it always stays that long to be thrown off.
        self.identity = IdentityClaim(
            bus_config, "runner", window_s=self.claim_window_s, used_before=True
        )
        #: Not open yet: ``play`` enters it.
        self.bus = Bus(
            bus_config,
            role="runner",
            on_connect=[self.reconnected],
            on_disconnect=[self.identity.thrown_off] if self.claim_window_s > 0 else [],
        )
        self.batch = Batch(
            plan, self, sink, options, OwnReferees(self.stack, sink.fault, self.ready_timeout_s)
        )
        self.ledger = self.batch.ledger
        self.roster = presence.Roster(default_heartbeat_s=None)
        self.ready = asyncio.Event()
        self.rostered: set[str] = set()  # identities a referee-only record names referees
        self.unproven: dict[str, bytes] = {}  # "online, kind referee" from names not (yet) rostered
        #: Whose statuses are read, once the run plays (``narrow``); None: everyone's.
        self.reading: set[str] | None = None

    # --- the batch's session ---------------------------------------------------------

    def send(self, request: MatchRequest) -> None:
        # Batched: requests released together (a batch of episodes came back) go out as one message.
        self.bus.publish(topics.CONTROL_MATCHES, request, batch=True)

    def connected(self) -> bool:
        return self.bus.connected.is_set()

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
        if self.reading is not None and name not in self.reading:
            self.reading.add(name)
            self.bus.follow([topics.status(name)], self.on_status)

    async def narrow(self) -> None:
        """Read only the statuses the run acts on from now on: its agents' and its referees'."""
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
            self.batch.referee(name, seen.online)
        else:
            self.batch.agent(name, seen.online)
        self.check_ready()

    def on_ack(self, _topic: str, payload: bytes) -> None:
        """A referee answers each request it takes, and each ask ``again``, in our inbox."""
        self.batch.acks(payload)

    def on_episodes(self, _topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            record = None if isinstance(msg, WireError) else getattr(msg, "record", None)
            if record is not None:
                self.batch.episode(record)

    async def reconnected(self) -> None:
        self.batch.reconnected()

    # --- before play -----------------------------------------------------------------

    async def claim(self) -> None:
        """Subscribe; with ``claim_window_s`` > 0, stay that long to be thrown off by a holder
        of our name (``bus.claim``): then ``RunError``, saying what to do.
        """
        if self.claim_window_s <= 0:  # a name made for this run: nobody else holds it
            await self._subscribe()
            return
        try:
            async with self.identity.on(self.bus):
                await self._subscribe()
                await self.identity.hold()
        except IdentityInUse as exc:
            raise RunError(str(exc)) from None

    async def _subscribe(self) -> None:
        """What the run reads. The referee rosters first: they are retained, so a referee's
        record is here before its status."""
        bus = self.bus
        await bus.subscribe(topics.REFEREE_ROSTERS, self.on_roster)
        await bus.subscribe(topics.ALL_STATUS, self.on_status)
        if self.sink.keeps_traces:
            await bus.subscribe(topics.ALL_TRACES, self.sink.trace)
        await bus.subscribe(topics.episodes(self.plan.game), self.on_episodes)
        await bus.subscribe(topics.inbox(self.me), self.on_ack)

    async def wait_ready(self, external: list[str], stop: asyncio.Event | None) -> bool:
        """Wait for ``wait_for`` and a referee to be online; False when ``stop`` came first."""
        self.check_ready()
        deadline = time.monotonic() + self.ready_timeout_s
        slow_at = time.monotonic() + SLOW_START_S
        if [w for w in self.wait_for if w in external] or not self.ledger.referees_up:
            with contextlib.suppress(TimeoutError):  # the retained "online" of one already up
                await asyncio.wait_for(self.ready.wait(), 0.2)
        # once a wait is said, the start of play is said too: a waiting line goes stale
        said_waiting = self._say_external(external)
        while not self.ready.is_set():
            if slow_at and time.monotonic() > slow_at:
                slow_at = 0.0
                self._say_missing(deadline)
                said_waiting = True
            if not self._still_waiting(deadline, stop):
                return False  # Ctrl-C before any match: nothing is asked for
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), 0.1)
        if said_waiting:
            self.notice("all agents online; playing")
        return True

    def _missing(self) -> list[str]:
        return self.roster.missing(self.wait_for) + (
            [] if self.ledger.referees_up else [self.no_referee()]
        )

    def _say_external(self, external: list[str]) -> bool:
        """Say at once whom the run waits for that is not its own to start; True if it did."""
        awaited = [w for w in self.wait_for if w in external and not self.roster.is_online(w)]
        if awaited:
            self.notice(waiting_notice(awaited, self.bus_config, self.stack, self.ready_timeout_s))
        return bool(awaited)

    def _say_missing(self, deadline: float) -> None:
        left = round(deadline - time.monotonic())
        self.notice(f"still waiting for {', '.join(self._missing())} ({left}s left)")

    def _still_waiting(self, deadline: float, stop: asyncio.Event | None) -> bool:
        """False when ``stop`` is set; ``RunError`` when a process died or the wait ran out."""
        if self.stack is not None and (dead := self.stack.dead()):
            raise RunError(
                f"process {dead[0]} exited before the run started:\n{self.stack.log_tail(dead[0])}"
            )
        if stop is not None and stop.is_set():
            return False
        if time.monotonic() > deadline:
            raise RunError(f"not online after {self.ready_timeout_s}s: {self._missing()}")
        return True

    # --- the run ---------------------------------------------------------------------

    async def play(self) -> None:
        """Play the batch (``loop.Batch.play``); ``RunError`` when it cannot go on."""
        await self.batch.play()
        if self.ledger.failure is not None:
            raise RunError(f"{self.ledger.failure}; the run stops here")


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
