"""``backroom league CONFIG``: play a league's matches through the runner, count each once.

The league is a run like any other: one ``Stack`` (a broker when no URL is
given, K referees, one process per agent, or agents already on the bus),
and its matches go out through ``play.batch.play``, whose window,
resubmission and fault handling it shares with ``backroom run`` and the
trainer. A round robin plays every pending match of a game in one batch; an
adaptive schedule plays a round of CRN groups per batch and re-rates between
rounds.

Each batch's sink (``LeagueSink``) keeps the run's traces as ``backroom run``
does and hands each episode, by the planned match it answers, to the store,
which keeps the first result of each scheduled match. Every ``FLUSH_S`` the
store commits, and every ``STANDINGS_S`` ``standings.json`` is rewritten
(ratings updated with the new results only), so ``show``, the web page and the
gauges follow the league while it plays.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from backroom import metrics
from backroom.bus.client import BusConfig
from backroom.bus.wire import IDENTITY_WINDOW_S, EpisodeRecord, MatchSpec
from backroom.league.config import LeagueConfig
from backroom.league.ratings import Ratings
from backroom.league.schedule import (
    Slot,
    adaptive_pick,
    group_pairing,
    match_spec,
    players_of,
    round_robin,
)
from backroom.league.standings import CONFIG, STORE, Standings, write_standings
from backroom.league.store import FLUSH_S, LeagueStore, Result
from backroom.league.tracking import LeagueTracking, Plots, open_league_tracking
from backroom.play.batch import play
from backroom.play.plan import MatchPlan, PlayOptions, Presence, Waits
from backroom.runner.local import already_online, connect_stack
from backroom.runner.results import Faults, RunError
from backroom.runner.sink import RunSink
from backroom.runner.stack import Stack, StackProcesses, start_processes
from backroom.runs import bind_run_dir, new_run_dir
from backroom.tracking import TrackingError, require_client

Notice = Callable[[str], None]

#: Seconds between rewrites of standings.json (and the gauges) while a league plays; the
#: store commits every ``FLUSH_S``.
STANDINGS_S = 1.0


class LeagueError(RuntimeError):
    pass


def league_processes(config: LeagueConfig) -> StackProcesses:
    """The processes a league starts (its agents, referees and agent processes): none of its
    matches, which go out as plans."""
    return StackProcesses(
        name=config.league,
        agents=tuple(config.agents()),
        referees=config.referees,
        agent_processes=config.agent_processes,
    )


@dataclass(frozen=True)
class Table:
    """Where and how this session's batches are played: the login, whom to wait for, the
    run directory's stamp and key, its traces file, the stop."""

    bus: BusConfig
    presence: Presence
    waits: Waits
    run_stamp: str
    run_key: str
    traces: Path
    stop: asyncio.Event | None


@dataclass(frozen=True)
class _Pace:
    """What a batch's heartbeat measures against (``runner.heartbeat.Pace``)."""

    matches: int
    concurrency: int
    turn_timeout_s: float


class LeagueSink(RunSink):
    """A batch's sink: its traces as a run's, each episode to the league's store under the
    key of the scheduled match it answers (``keys``: planned match id -> slot key)."""

    def __init__(self, league: League, keys: dict[str, str]) -> None:
        super().__init__(league.notice)
        self.league, self.keys = league, keys

    def episode(self, record: EpisodeRecord) -> None:
        match = self.slot_of.get(record.match, record.match)
        if (key := self.keys.get(match)) is not None:
            self.league.count(key, record)


@dataclass
class LeagueSummary:
    directory: Path
    played: int = 0  # results counted in this session
    pending: int = 0  # scheduled matches still without a result
    skipped: list[str] = field(default_factory=list)  # optional entrants not online
    faults: Faults = field(default_factory=Faults)
    seconds: float = 0.0  # first request out to last episode in, summed over batches (as
    # `backroom run` counts its rate: process start-up is not play)
    standings: dict[str, Any] = field(default_factory=dict)

    @property
    def matches_per_second(self) -> float:
        return self.played / self.seconds if self.seconds > 0 else 0.0


def open_store(config: LeagueConfig, directory: Path, resume: bool) -> tuple[Path, LeagueStore]:
    """The league's directory (absolute) and store; a directory holding another league, or one
    without --resume, is refused."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STORE
    existed = path.exists()
    if existed and not resume:
        raise LeagueError(f"{directory} already holds a league: pass --resume, or another --dir")
    if resume and not existed:
        raise LeagueError(f"--resume: {path} does not exist (nothing to resume)")
    store = LeagueStore(path)
    name = store.get_meta("league")
    if name is not None and name != config.league:
        store.close()
        raise LeagueError(f"{directory} holds league {name!r}, not {config.league!r}")
    store.set_meta("league", config.league)
    store.set_meta("config", config.model_dump_json())
    (directory / CONFIG).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return directory, store


@dataclass
class Tally:
    """What ``adaptive_pick`` reads: every entrant's rating, and the CRN groups each pairing
    has played, kept result by result.

    Each round's results are rated in the order their matches were scheduled, not
    the order their episodes came back, so the same config and seed pick the same
    rounds (the shown ratings, ``Standings``, keep counted order). Kept up to date with
    the new results only: rating every result again each round took half the time of
    a 3,000-match league of scripted IPD agents (rounds of 16 matches).
    """

    agents: list[str]
    ratings: Ratings = field(init=False)
    played: dict[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)
    groups: set[str] = field(default_factory=set)
    seq: int = 0  # the last result counted in

    def __post_init__(self) -> None:
        self.ratings = Ratings(list(self.agents))

    def update(self, results: Iterable[Result]) -> None:
        for r in results:
            self.seq = max(self.seq, r.seq)
            self.ratings.add(r)
            if r.group not in self.groups:
                self.groups.add(r.group)
                key = group_pairing(r.group)
                self.played[key] = self.played.get(key, 0) + 1

    def sigma(self) -> dict[str, float]:
        return {row.agent: row.sigma for row in self.ratings.table()}


class League:
    """One session of a league: its store, its stack, its rounds."""

    def __init__(
        self,
        config: LeagueConfig,
        directory: Path,
        store: LeagueStore,
        notice: Notice,
        on_result: Callable[[int], None] | None = None,
        tracking: LeagueTracking | None = None,
    ) -> None:
        self.config = config
        self.tracking = tracking
        self.directory = directory
        self.store = store
        self.notice = notice
        self.on_result = on_result
        self.games = {g.key: g for g in config.games}
        self.players = {g.key: players_of(g) for g in config.games}
        self.summary = LeagueSummary(directory)
        self.last_flush = self.last_publish = time.monotonic()
        self.agents = [a.id for a in config.agents()]
        self.standings = Standings(store, config)
        self._tally: Tally | None = None

    def spec_rows(self, slots: list[Slot]) -> list[tuple[str, str, str, MatchSpec]]:
        return [
            (
                s.key,
                s.game,
                s.group,
                match_spec(self.config, self.games[s.game], s, self.players[s.game]),
            )
            for s in slots
        ]

    def count(self, key: str, record: EpisodeRecord) -> None:
        """Keep ``record`` as the result of the scheduled match ``key`` (the first one only)."""
        if self.store.add(key, record):
            self.summary.played += 1
            if self.tracking is not None:
                self.tracking.counted(record)
            if self.on_result is not None:
                self.on_result(self.summary.played)
        now = time.monotonic()
        if now - self.last_publish > STANDINGS_S:
            self.publish(running=True)
        elif now - self.last_flush > FLUSH_S:
            self.store.flush()
            self.last_flush = now

    def publish(self, running: bool) -> dict[str, Any]:
        """Commit the results so far and rewrite standings.json (and the gauges)."""
        self.store.flush()
        self.last_flush = self.last_publish = time.monotonic()
        # Exploitability replays every counted match: once, at the end, not every flush.
        doc = self.standings.update().doc(running, exploit=not running)
        write_standings(self.directory, doc)
        rows = doc.get("overall") or next(iter(doc["games"].values()))["ratings"]
        for row in rows:
            labels = {"league": self.config.league, "agent": row["agent"]}
            metrics.RATING.labels(**labels).set(row["mu"])
            metrics.RATING_SIGMA.labels(**labels).set(row["sigma"])
        self.summary.standings = doc
        if self.tracking is not None:
            self.tracking.standings(doc)
        return doc

    async def play(self, slots: list[Slot], table: Table) -> None:
        """Play ``slots`` (any games), one batch per game."""
        rows = self.spec_rows(slots)
        self.store.schedule(rows)
        for key, game in self.games.items():
            batch = [(slot_key, spec) for slot_key, g, _grp, spec in rows if g == key]
            if not batch:
                continue
            nonce = f"{int(time.time() * 1000) % 10**10:010d}"
            ids = [f"{self.config.league}.{nonce}.{i:06d}" for i in range(len(batch))]
            stamp = {"run_stamp": table.run_stamp}
            plan = MatchPlan.of(
                game.game,
                [
                    (m, spec.model_copy(update=stamp))
                    for m, (_k, spec) in zip(ids, batch, strict=True)
                ],
                agents=self.agents,
                on_timeout=self.config.on_timeout,
                run_key=table.run_key,
            )
            sink = LeagueSink(self, {m: k for m, (k, _spec) in zip(ids, batch, strict=True)})
            pace = _Pace(len(batch), self.config.concurrency, self.config.turn_timeout_s)
            options = PlayOptions(
                concurrency=self.config.concurrency,
                waits=table.waits,
                presence=table.presence,
                stop=table.stop,
                faults=self.summary.faults,
                watchers=[sink.heartbeat(pace)],
            )
            # the decisions of model entrants (prompt, tokens, adapter version), as a run's
            with sink.keep_traces(table.traces, plan):
                await play(plan, table.bus, sink, options)
            clock = options.clock
            if clock.ended > clock.started > 0:  # first request out to last episode in
                self.summary.seconds += clock.ended - clock.started
            if table.stop is not None and table.stop.is_set():
                return

    def pending_round_robin(self, agents: list[str]) -> list[Slot]:
        done = self.store.done()
        return [s for s in round_robin(self.config, agents) if s.key not in done]

    def next_adaptive(self, agents: list[str]) -> list[Slot]:
        """The next round of an adaptive schedule: [] once the budget is spent."""
        assert self.config.schedule.budget is not None
        self.store.flush()
        left = self.config.schedule.budget - len(self.store.done())
        pending = self.pending_scheduled(agents)
        if pending:  # a killed session's round: finish it first
            return pending[:left] if left > 0 else []
        if left <= 0:
            return []
        batch = self.config.schedule.batch or max(1, self.config.concurrency)
        tally = self.tally(agents)
        return adaptive_pick(self.config, agents, tally.sigma(), tally.played, left, batch)

    def tally(self, agents: list[str]) -> Tally:
        """The adaptive schedule's ratings and groups played, brought up to date with the
        results counted since the last round (a new one when the entrants changed)."""
        if self._tally is None or self._tally.agents != agents:
            self._tally = Tally(list(agents))
        self._tally.update(self.store.results(after=self._tally.seq, as_scheduled=True))
        return self._tally

    def pending_scheduled(self, agents: list[str]) -> list[Slot]:
        done, ok = self.store.done(), set(agents)
        out = []
        for key in self.store.scheduled_keys():
            if key in done:
                continue
            slot = Slot.from_key(key)
            if set(slot.pairing) <= ok and slot.game in self.games:
                out.append(slot)
        return out


async def run_league(
    config: LeagueConfig,
    directory: str | Path,
    resume: bool = False,
    broker_url: str | None = None,
    credentials_dir: str | Path | None = None,
    spawn: bool = True,
    metrics_port: int = 0,
    on_notice: Notice | None = None,
    on_result: Callable[[int], None] | None = None,
    ready_timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
    plots: Plots | None = None,
) -> LeagueSummary:
    """Play the league's pending matches in ``directory`` (its store, standings, runs/);
    ``plots``: draws the final standings' plots, logged with them when tracking is on."""
    notice = on_notice or (lambda _m: None)
    try:
        require_client(config.tracking)  # before the directory is made
    except TrackingError as exc:
        raise LeagueError(str(exc)) from None
    directory, store = open_store(config, Path(directory), resume)
    try:
        opened = await asyncio.to_thread(open_league_tracking, config, directory)
    except TrackingError as exc:
        store.close()
        raise LeagueError(f"{exc} (nothing was played: --resume goes on once it opens)") from None
    tracking = LeagueTracking(opened, store, plots)
    league = League(config, directory, store, notice, on_result, tracking)
    try:
        await _session(
            league, broker_url, credentials_dir, spawn, metrics_port, ready_timeout_s, stop
        )
    finally:
        error = sys.exc_info()[1]
        try:
            league.publish(running=False)
        finally:
            store.close()
            await asyncio.to_thread(tracking.close, league.summary.standings, directory, error)
    return league.summary


async def _session(
    league: League,
    broker_url: str | None,
    credentials_dir: str | Path | None,
    spawn: bool,
    metrics_port: int,
    ready_timeout_s: float,
    stop: asyncio.Event | None,
) -> None:
    config = league.config
    processes = league_processes(config)
    run_dir = new_run_dir(league.directory / "runs", config.league)
    run_key = secrets.token_hex(16)
    bind_run_dir(run_dir, run_key)
    stack = Stack(run_dir)
    try:
        # The runner's: start or join the broker, name the processes, refuse to throw anyone off.
        bus_config = await connect_stack(stack, processes, broker_url, credentials_dir, spawn)
        names = stack.names
        assert names is not None  # connect_stack names them
        agents = list(league.agents)
        if optional := sorted(config.optional()):
            online = set(await already_online(bus_config, optional))
            league.summary.skipped = [a for a in optional if a not in online]
            if league.summary.skipped:
                notice = f"not online, their matches wait: {', '.join(league.summary.skipped)}"
                league.notice(notice)
            agents = [a for a in agents if a not in league.summary.skipped]
        if spawn:
            waiting = start_processes(stack, processes, run_dir.parent.parent, metrics_port)
        else:
            waiting = list(agents)
        waiting = [w for w in waiting if w not in league.summary.skipped]
        table = Table(
            bus_config,
            Presence(
                tuple(waiting),
                tuple(config.external()) if spawn else tuple(waiting),
                stack,
                claim_window_s=0.0 if names.own else IDENTITY_WINDOW_S,
            ),
            Waits(ready_s=ready_timeout_s),
            run_dir.name,
            run_key,
            run_dir / "traces.jsonl",
            stop,
        )
        await _rounds(league, agents, table)
        league.summary.pending = len(league.pending_scheduled(league.agents))
    except RunError as exc:
        raise LeagueError(str(exc)) from None
    finally:
        stack.stop()


async def _rounds(league: League, agents: list[str], table: Table) -> None:
    if league.config.schedule.kind == "round_robin":
        slots = league.pending_round_robin(agents)
        # The absent optional entrants' matches are scheduled too (pending); `play` adds the rest.
        known = {*league.store.scheduled_keys(), *(s.key for s in slots)}
        every = round_robin(league.config, league.agents)
        league.store.schedule(league.spec_rows([s for s in every if s.key not in known]))
        league.publish(running=True)
        total = len(known | {s.key for s in every})
        league.notice(f"{len(slots)} matches to play ({total} scheduled)")
        await league.play(slots, table)
        return
    while not (table.stop is not None and table.stop.is_set()):
        slots = league.next_adaptive(agents)
        if not slots:
            return
        league.publish(running=True)
        await league.play(slots, table)
