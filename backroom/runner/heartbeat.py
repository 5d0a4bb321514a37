"""What a slow run says while it plays: a line every ~30 s, and a warning when turns cannot fit.

An LLM config on a shared machine played for 7 minutes with no output but a
stale "still waiting for alice, bob" (the progress line comes every 5% of
the matches), and 11 of its first 17 matches timed out with nothing said
about why. So, while the matches play, every ``every_s``:

    playing 1m30s: 212 decisions, 3/300 matches done, 2 fallbacks so far

and once, as soon as the first decisions measure it, whether a turn fits its
budget. With ``concurrency`` matches in flight, each waiting on one decision,
a turn takes about ``concurrency`` x the wall time per decision the run
achieves (Little's law: in flight = throughput x time); without live
decisions, the first finished matches' turns are timed. Where a turn exceeds
``turn_timeout_s``, turns will time out and be played by the referee's
default, and the line says which knobs help.

Decisions are counted live from the traces of agents that publish them (the
model-backed kinds), else from the finished matches' records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from backroom.bus.wire import EpisodeRecord

#: Seconds between two heartbeat lines.
HEARTBEAT_S = 30.0
#: Decisions, per match in flight, that the turn-budget estimate waits for.
MEASURED_PER_MATCH = 1


class Pace(Protocol):
    """What the lines measure against: a run's config, or a league's batch."""

    @property
    def matches(self) -> int: ...

    @property
    def concurrency(self) -> int: ...

    @property
    def turn_timeout_s(self) -> float: ...


class Heartbeat:
    """The lines of a run in play; ``beat`` is called every ``every_s``, ``check`` more often."""

    def __init__(
        self,
        config: Pace,
        notice: Callable[[str], None],
        decisions_live: Callable[[], int],
        episodes: Callable[[], Collection[EpisodeRecord]],
        every_s: float | None = None,
        started: float | None = None,
    ) -> None:
        """``every_s``: default ``HEARTBEAT_S``, read now (a test shortens it); ``started``: when
        play began (``time.monotonic``; default now)."""
        self.config, self.notice = config, notice
        self.every_s = every_s if every_s is not None else HEARTBEAT_S
        self.decisions_live, self.episodes = decisions_live, episodes
        self.started = started if started is not None else time.monotonic()
        self.warned = False

    def counts(self) -> tuple[int, int, int]:
        """Decisions so far, matches done, fallbacks in them."""
        done = self.episodes()
        decided = sum(len(ep.actions) for ep in done)
        fallbacks = sum(1 for ep in done for a in ep.actions if a.fallback or a.timed_out)
        return max(decided, self.decisions_live()), len(done), fallbacks

    def line(self) -> str:
        decisions, done, fallbacks = self.counts()
        elapsed = timedelta(seconds=round(time.monotonic() - self.started))
        return (
            f"playing {elapsed}: {decisions} decisions, {done}/{self.config.matches} matches "
            f"done, {fallbacks} fallback{'s' if fallbacks != 1 else ''} so far"
        )

    def turn_time(self) -> tuple[float, str] | None:
        """A turn's measured seconds and how they were measured; None before any measure.

        Live traces (the model-backed agents'): ``concurrency`` x the wall time per
        decision, once there is a decision per match in flight. Without them, the
        finished matches' own turns (their moves' times since the match began):
        their decision counts alone, divided into the whole run's time, would
        undercount the decisions of the matches still playing and cry wolf.
        """
        in_flight = min(self.config.concurrency, self.config.matches)
        live = self.decisions_live()
        if live >= in_flight * MEASURED_PER_MATCH:
            per_decision = (time.monotonic() - self.started) / live
            how = (
                f"{in_flight} matches in flight x {per_decision:.1f} s a decision, measured "
                f"over the first {live}"
            )
            return in_flight * per_decision, how
        done = [ep for ep in self.episodes() if ep.actions]
        if not done:
            return None
        decisions = sum(len(ep.actions) for ep in done)
        spent = sum(max(0.0, ep.actions[-1].t - ep.started_at) for ep in done)
        return spent / decisions, f"the turns of the first {len(done)} matches to finish"

    def check(self) -> None:
        """Say once, as soon as it is measured, when a turn cannot fit ``turn_timeout_s``."""
        if self.warned or (measured := self.turn_time()) is None:
            return
        self.warned = True
        turn, how = measured
        if turn <= self.config.turn_timeout_s:
            return
        self.notice(
            f"turns will time out: about {turn:.0f} s a turn ({how}), over turn_timeout_s "
            f"{self.config.turn_timeout_s:g}; timed-out turns are played by the referee's "
            "default. Lower it with --set concurrency=N, or raise --set turn_timeout_s=S"
        )

    async def run(self) -> None:
        """Until cancelled: check the turn budget every second, a line every ``every_s``."""
        next_beat = self.started + self.every_s
        while True:
            await asyncio.sleep(min(1.0, self.every_s))
            self.check()
            if time.monotonic() >= next_beat:
                next_beat += self.every_s
                self.notice(self.line())
