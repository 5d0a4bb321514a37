"""A run directory as the sink of ``play``: its traces.jsonl, its episodes' callback, its notices.

The episodes themselves are written by the referees (into the directory bound
to the run's key); what the runner keeps is the traces of trainable agents
(``runner.traces.TraceLog``), each decision once and within each agent's
share, and what it tells the user. The last decisions' traces may trail their
episode (another reader, another path): ``settle`` waits for them and counts
those that never came. Once the referees stopped, ``reconcile`` makes the run's
``episodes.jsonl`` agree with what it kept. The league's sink is this one with
its store behind ``episode`` (``league.play``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from backroom.bus.wire import EpisodeRecord
from backroom.play.faults import Faults
from backroom.play.plan import MatchPlan, Watcher
from backroom.runner.heartbeat import Heartbeat, Pace
from backroom.runner.results import dedupe_episodes, finished_on_disk
from backroom.runner.traces import TRACES_MAX_BYTES, TraceLog, overflow_lines


class RunSink:
    """What ``backroom run`` keeps of its batch (``play.plan.Sink``)."""

    def __init__(
        self,
        notice: Callable[[str], None],
        on_episode: Callable[[EpisodeRecord, int], None] | None = None,
    ) -> None:
        """``on_episode`` hears each kept episode with how many are in so far (the progress line)."""
        self.notice = notice
        self.on_episode = on_episode
        self.traces: TraceLog | None = None
        self.done = 0
        #: Attempt -> the plan's match: the ledger's own, kept up to date as it asks again.
        self.slot_of: Mapping[str, str] = {}

    def keep_traces(
        self, path: Path, plan: MatchPlan, max_bytes: int = TRACES_MAX_BYTES
    ) -> TraceLog:
        """Keep the plan's traces in ``path`` (to be entered: the file is closed on exit)."""
        seats = plan.seats

        def seats_of(attempt: str) -> tuple[str, ...] | None:
            match = self.slot_of.get(attempt)
            return None if match is None else seats[match]

        agents = {agent for seated in seats.values() for agent in seated}
        self.traces = TraceLog(path, seats_of, max_bytes, self.notice, agents=agents)
        return self.traces

    @property
    def keeps_traces(self) -> bool:
        return self.traces is not None

    def attempts(self, slot_of: Mapping[str, str]) -> None:
        self.slot_of = slot_of

    def episode(self, record: EpisodeRecord) -> None:
        self.done += 1
        if self.on_episode is not None:
            self.on_episode(record, self.done)

    def trace(self, topic: str, payload: bytes) -> None:
        if self.traces is not None:
            self.traces.on_trace(topic, payload)

    def fault(self, text: str) -> None:
        self.notice(text)

    def tracer(self, agent: str) -> None:
        if self.traces is not None:
            self.traces.tracers.add(agent)

    def decisions(self) -> int:
        """Decisions whose trace came so far (the heartbeat's live count)."""
        return len(self.traces.decided) if self.traces is not None else 0

    async def settle(
        self, episodes: list[EpisodeRecord], faults: Faults, wait_s: float | None
    ) -> None:
        """Wait for the last decisions' traces (``wait_s``; None: the batch stopped or failed),
        count and say those that never came; say every agent past its share of the budget."""
        if self.traces is None:
            return
        if wait_s is not None and (missing := await self.traces.wait_for(episodes, wait_s)):
            faults.traces_missing = len(missing)
            agents = sorted({agent for _match, agent, _seat, _turn in missing})
            self.notice(
                f"{len(missing)} decisions have no trace in traces.jsonl "
                f"{wait_s:g} s after the last episode (agents: {', '.join(agents)})"
            )
        over = self.traces.overflow(episodes)
        faults.traces_over_share = {a: list(n) for a, n in over.items()}
        for line in overflow_lines(over):
            self.notice(line)

    def reconcile(
        self, path: Path, episodes: list[EpisodeRecord], faults: Faults
    ) -> list[EpisodeRecord]:
        """The run's episodes, and its ``episodes.jsonl`` (``path``) made to agree with them,
        once its referees have stopped: a stopped run adds the matches that ended before the
        stop but whose episode was still on its way (``faults.read_back``); the file keeps
        one line per kept episode (``faults.duplicates_on_disk``: the lines that went)."""
        if faults.interrupted:
            late = finished_on_disk(path, episodes, faults.reruns)
            episodes, faults.read_back = [*episodes, *late], len(late)
        faults.duplicates_on_disk = dedupe_episodes(path, episodes, faults.reruns)
        return episodes

    def heartbeat(self, pace: Pace) -> Watcher:
        """The batch's heartbeat lines while it plays (``runner.heartbeat``), to ``notice``."""

        def watch(episodes: Callable[[], Collection[EpisodeRecord]]) -> Heartbeat:
            return Heartbeat(pace, self.notice, self.decisions, episodes)

        return lambda episodes: watch(episodes).run()
