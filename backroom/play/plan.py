"""What a batch is, how it is played, and what its caller keeps: the three inputs of ``play``.

``backroom run``, the league and the trainer each used to hand the runner a
``RunConfig`` (the league a fake one) and some twenty keyword arguments. A
batch needs less: the matches to ask for (``MatchPlan``), how long to wait
for whom and how many at once (``PlayOptions``), and somewhere to put what
comes back (``Sink``). The sink is the caller's: a run directory, a league's
store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from backroom.bus.wire import EpisodeRecord, MatchSpec
from backroom.play.faults import Faults, PlayClock
from backroom.play.ledger import EPISODE_WAIT_S, REFEREE_GRACE_S

OnTimeout = Literal["default", "random", "forfeit"]


@dataclass(frozen=True)
class PlannedMatch:
    """One match to ask for: its id (unique on the bus) and its spec (seats, seed, CRN group)."""

    match: str
    spec: MatchSpec


@dataclass(frozen=True)
class MatchPlan:
    """The matches of one batch, in the order they are asked for, all of one game.

    ``agents`` are the identities the batch seats (their departures are
    counted); ``on_timeout`` is what their timed-out turns become (a departed
    agent's matches are counted as defaulted when it is ``default``);
    ``run_key``, when set, is named in every request, so referees write into the
    run directory bound to it (``runs.bind_run_dir``) and into no other.
    """

    game: str
    matches: tuple[PlannedMatch, ...]
    agents: tuple[str, ...] = ()
    on_timeout: OnTimeout | str = "default"
    run_key: str | None = None

    @classmethod
    def of(
        cls,
        game: str,
        specs: Iterable[tuple[str, MatchSpec]],
        agents: Iterable[str] = (),
        on_timeout: str = "default",
        run_key: str | None = None,
    ) -> MatchPlan:
        """A plan from ``(match id, spec)`` pairs, kept in their order."""
        matches = tuple(PlannedMatch(match, spec) for match, spec in specs)
        return cls(game, matches, tuple(agents), on_timeout, run_key)

    @property
    def ids(self) -> list[str]:
        return [m.match for m in self.matches]

    @property
    def seats(self) -> dict[str, tuple[str, ...]]:
        """Match id -> the identities seated in it, by seat."""
        return {m.match: tuple(m.spec.seats) for m in self.matches}


class Processes(Protocol):
    """The batch's own processes, when it started them (``runner.stack.Stack``): a referee
    whose process exited is lost at once, and the batch's error quotes its log."""

    @property
    def referees(self) -> Mapping[str, str]:
        """Process name -> the referee identity it logs in as."""
        ...

    @property
    def credentials(self) -> _HasDir | None: ...

    def dead(self) -> list[str]: ...

    def exit_code(self, name: str) -> int | None: ...

    def log_tail(self, name: str) -> str: ...


class _HasDir(Protocol):
    @property
    def dir(self) -> Path: ...


@dataclass(frozen=True)
class Waits:
    """How long the batch waits, and for what (seconds)."""

    #: For ``Presence.wait_for`` and a referee to be online; later, for a referee to come back.
    ready_s: float = 60.0
    #: For a referee to acknowledge a request before it is sent again.
    ack_s: float = 2.0
    #: For a referee whose status said offline to say online again before it is lost.
    referee_grace_s: float = REFEREE_GRACE_S
    #: For an accepted match's referee to say anything before it is asked ``again``.
    episode_s: float = EPISODE_WAIT_S
    #: After the last episode, for traces of decisions not seen yet (when the sink keeps traces).
    trace_s: float = 5.0


@dataclass(frozen=True)
class Presence:
    """Who must be online before the first request, and who is not the batch's to start."""

    #: Identities to wait for (besides one referee, always).
    wait_for: tuple[str, ...] = ()
    #: Of those, the ones someone else starts: the batch says at once that it waits for them.
    external: tuple[str, ...] = ()
    #: The processes the caller started, watched for exits; None: nothing was started here.
    processes: Processes | None = None
    #: > 0: the login may be another process's (a fixed ``runner``): stay this long to be
    #: thrown off by it, and fail saying so, rather than take it back and forth.
    claim_window_s: float = 0.0


#: Something to run while the batch plays (``runner.heartbeat``): given the episodes so far.
Watcher = Callable[[Callable[[], Collection[EpisodeRecord]]], Awaitable[None]]


@dataclass
class PlayOptions:
    """How a batch is played: how many at once, the waits, who to wait for, when to stop.

    ``faults`` and ``clock`` are where the counts and the play time go: the
    caller's, so several batches (a league's rounds) add up in one.
    """

    concurrency: int = 10
    waits: Waits = field(default_factory=Waits)
    presence: Presence = field(default_factory=Presence)
    #: Set (Ctrl-C): return the matches finished so far; ``faults.interrupted`` says it stopped short.
    stop: asyncio.Event | None = None
    faults: Faults = field(default_factory=Faults)
    clock: PlayClock = field(default_factory=PlayClock)
    watchers: list[Watcher] = field(default_factory=list)


class Sink(Protocol):
    """What the caller keeps of a batch: its episodes, its traces, what it should be told.

    ``attempts`` gets the ledger's map of attempt ids to planned ones;
    ``episode`` gets each kept episode once (``record.match`` is the attempt's id);
    ``trace`` each trace message when ``keeps_traces`` (the batch then
    subscribes to them, and ``tracer`` names each agent that says it publishes
    traces); ``fault`` every line a user should read (a referee lost, an agent
    gone, whom the batch waits for). ``settle`` runs once the matches are in,
    the bus still open: a sink waits there, up to ``wait_s`` (None: a batch
    stopped or failed, no wait), for what trails the episodes.
    """

    @property
    def keeps_traces(self) -> bool: ...

    def attempts(self, slot_of: Mapping[str, str]) -> None:
        """Attempt id -> the plan's match id, kept up to date while the batch plays (a
        match asked for again under a new id): a trace names the attempt."""
        ...

    def episode(self, record: EpisodeRecord) -> None: ...

    def trace(self, topic: str, payload: bytes) -> None: ...

    def fault(self, text: str) -> None: ...

    def tracer(self, agent: str) -> None: ...

    async def settle(
        self, episodes: list[EpisodeRecord], faults: Faults, wait_s: float | None
    ) -> None: ...


class Collect:
    """A sink that keeps nothing but what ``play`` returns; callers override what they keep."""

    def __init__(self, on_fault: Callable[[str], None] | None = None) -> None:
        self.on_fault = on_fault

    @property
    def keeps_traces(self) -> bool:
        return False

    def attempts(self, slot_of: Mapping[str, str]) -> None:
        return None

    def episode(self, record: EpisodeRecord) -> None:
        return None

    def trace(self, topic: str, payload: bytes) -> None:
        return None

    def fault(self, text: str) -> None:
        if self.on_fault is not None:
            self.on_fault(text)

    def tracer(self, agent: str) -> None:
        return None

    async def settle(
        self, episodes: list[EpisodeRecord], faults: Faults, wait_s: float | None
    ) -> None:
        return None
