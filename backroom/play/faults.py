"""What went wrong while a batch of matches played, and what was done about it.

``Faults`` is what the ``MatchLedger`` (``play.ledger``) counts for every caller
(``backroom run``, the league, the trainer); ``Departure`` is an agent that
went offline while its matches played. Re-exported by ``runner.results``,
where they lived before.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from backroom.bus.wire import EpisodeRecord


@dataclass
class Departure:
    """An agent of the run whose status said offline while the run played."""

    agent: str
    at: float  # time.time() of the status
    back_at: float | None = None  # when its status said online again
    defaulted: int = 0  # matches since ``at`` in which a seat of it got the timeout default

    def line(self) -> str:
        """What the run says of it: ``agent X went offline at ... (its seats got defaults in N matches)``."""
        text = f"agent {self.agent} went offline at {clock_text(self.at)}"
        if self.back_at is not None:
            text += f", back at {clock_text(self.back_at)}"
        n = self.defaulted
        return f"{text} (its seats got defaults in {n} match{'' if n == 1 else 'es'})"


@dataclass
class Faults:
    """What went wrong during a run, and what the runner did about it."""

    #: Referees that went away while the run played (identities).
    referees_lost: list[str] = field(default_factory=list)
    #: Referees given up that then took a match requested after that: alive after all.
    referees_revived: list[str] = field(default_factory=list)
    #: Matches requested again, by why: ``referee lost`` (it had accepted them),
    #: ``accepted by a lost referee`` (its acknowledgement came after the runner gave
    #: it up), ``voided`` (its referee stopped mid-match).
    rerequest_reasons: Counter[str] = field(default_factory=Counter)
    #: Requests sent again because no referee acknowledged them in time.
    resubmitted: int = 0
    #: Accepted matches asked again because neither their episode nor their referee was
    #: heard of for ``EPISODE_WAIT_S`` (``MatchRequest.again``).
    asked_again: int = 0
    #: Episodes of a match past its first (dropped; a match asked for again ran twice).
    duplicates: int = 0
    #: Lines of such episodes taken out of the run's ``episodes.jsonl`` (``dedupe_episodes``).
    duplicates_on_disk: int = 0
    #: Ids a match was asked for again under -> the run's id of that match. A match
    #: played again gets a new id (``<id>.r<n>``): agents drop a turn they answered
    #: before, by match, turn and seat, so a rerun under the old id would time out.
    reruns: dict[str, str] = field(default_factory=dict)
    departures: list[Departure] = field(default_factory=list)
    #: Stopped by Ctrl-C (SIGINT) while playing: the episodes are the matches finished by then.
    interrupted: bool = False
    #: Of those, matches whose episode was in the run's ``episodes.jsonl`` but had not
    #: reached the runner when it stopped (``finished_on_disk``).
    read_back: int = 0
    #: Decisions of tracing agents whose trace had not come in the wait after the last
    #: episode (``run_matches``' ``trace_wait_s``): traces.jsonl lacks them
    #: (``runner.traces.TraceLog.wait_for``).
    traces_missing: int = 0
    #: Agents past their share of the run's trace bound (``runner.traces.TraceLog``): agent
    #: -> [its traces not recorded, the run's decisions of it left without a trace by that].
    #: A flooding agent shows here; an agent that only traced its decisions never does.
    traces_over_share: dict[str, list[int]] = field(default_factory=dict)

    @property
    def rerequested(self) -> int:
        """Matches requested again, all told."""
        return sum(self.rerequest_reasons.values())


def clock_text(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def defaulted(episodes: Iterable[EpisodeRecord], departure: Departure) -> int:
    """Matches that ended after ``departure.at`` (and began before its return) with a seat of
    its agent defaulted."""
    count = 0
    for ep in episodes:
        if ep.ended_at < departure.at:
            continue
        if departure.back_at is not None and ep.started_at > departure.back_at:
            continue
        if any(ep.seats[seat] == departure.agent for seat in ep.timeouts):
            count += 1
    return count


class RunError(RuntimeError):
    """A batch that cannot go on; the message says why, and what to do."""


@dataclass
class PlayClock:
    """When a batch's first request went out and its last episode came in (``perf_counter``)."""

    started: float = 0.0
    ended: float = 0.0
