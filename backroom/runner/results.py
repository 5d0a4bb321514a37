"""What a run gives back: its episodes, its faults, and the summary ``backroom run`` prints.

Kept apart from the bus wiring (``runner.local``) and the fault rules
(``runner.dispatch``) so that a reader of a run's result (the CLI, the
analysis, a league built on the runner) imports neither.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backroom.bus.wire import SHUTTING_DOWN, EpisodeRecord
from backroom.referee.fallbacks import count_fallbacks, fallback_of, warning_lines
from backroom.runner.config import RunConfig
from backroom.runs import read_episodes


class RunError(RuntimeError):
    """A run that cannot go on; the message says why, and what to do."""


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

    @property
    def rerequested(self) -> int:
        """Matches requested again, all told."""
        return sum(self.rerequest_reasons.values())


def clock_text(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


@dataclass(repr=False)
class RunResult:
    config: RunConfig
    episodes: list[EpisodeRecord]
    seconds: float  # wall clock of the whole run, processes starting up included
    run_dir: Path
    broker_url: str
    play_seconds: float  # first request out to last episode in
    faults: Faults = field(default_factory=Faults)

    @property
    def matches_per_second(self) -> float:
        """Rate of play: from the first request to the last episode, so the
        seconds that processes take to import and connect do not dilute it."""
        return len(self.episodes) / self.play_seconds if self.play_seconds > 0 else 0.0

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run on Python 3.11 builds the repr of its main
        # task's result twice on the way out (CPython issue #112559), and the
        # dataclass repr of every episode took about a second per 10,000 matches.
        return (
            f"RunResult(run={self.config.run!r}, episodes={len(self.episodes)}, "
            f"seconds={self.seconds:.1f}, run_dir={str(self.run_dir)!r})"
        )


@dataclass
class PlayClock:
    """When a run's first request went out and its last episode came in (``perf_counter``)."""

    started: float = 0.0
    ended: float = 0.0


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


def finished_on_disk(
    path: Path, kept: Iterable[EpisodeRecord], reruns: dict[str, str] | None = None
) -> list[EpisodeRecord]:
    """Matches a stopped run finished whose episode never reached the runner, from ``path``.

    A referee writes a match's record and then publishes it, so a run stopped
    by Ctrl-C can find in its file matches that ended before the Ctrl-C but
    whose episode was still on its way: leaving them out made the summary
    smaller than the file. Read once the run's referees have stopped (they
    void what they were still playing, ``SHUTTING_DOWN``: no result, left out
    here, kept in the file); referees the run did not start may still add to
    the file after.
    The first record of a match counts, as ``MatchLedger.episode`` keeps the
    first that arrives; ``reruns`` maps the ids a match was asked for again
    under to its own. Lines that are no episode are passed over (the file's
    readers count them: ``read_episodes``).
    """
    if not path.exists():
        return []
    reruns = reruns or {}
    have = {reruns.get(ep.match, ep.match) for ep in kept}
    found: list[EpisodeRecord] = []
    for raw in read_episodes(path):
        attempt = raw.get("match")
        match = reruns.get(attempt, attempt) if isinstance(attempt, str) else None
        if match is None or match in have:
            continue  # most lines: parsed only to be passed over
        try:
            record = EpisodeRecord.model_validate(raw)
        except ValueError:
            continue  # not an episode of ours: the file is checked elsewhere
        if record.reason == "voided" and record.detail == SHUTTING_DOWN:
            continue
        have.add(match)
        found.append(record)
    return found


def dedupe_episodes(
    path: Path, kept: Iterable[EpisodeRecord], reruns: dict[str, str] | None = None
) -> int:
    """Keep in ``path`` only the lines of the episodes the runner kept; return how many went.

    A match asked for again (its referee went away, or stopped) may have run
    twice, or left a voided record: the first referee can write its record and
    die before its episode gets out. The runner keeps the first episode it
    received of each match, and the file keeps the same one, in its order.
    ``reruns`` maps the ids a match was asked for again under to its own.
    """
    if not path.exists():
        return 0
    reruns = reruns or {}
    chosen = {reruns.get(ep.match, ep.match): (ep.match, ep.referee) for ep in kept}
    lines = path.read_bytes().splitlines(keepends=True)
    out: list[bytes] = []
    dropped = 0
    for line in lines:
        try:
            record = json.loads(line)
            attempt, referee = record["match"], record["referee"]
        except (ValueError, KeyError, TypeError):
            out.append(line)  # not ours to judge
            continue
        match = reruns.get(attempt, attempt)
        if match in chosen and chosen[match] != (attempt, referee):
            dropped += 1
            continue
        out.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(out))
        os.replace(tmp, path)
    return dropped


def summarize(result: RunResult) -> dict[str, Any]:
    """Per agent: matches, seats, mean raw return and return after the transform per seat,
    timeouts; outcomes; faults (``Faults``: referees lost, matches asked for again,
    duplicates, and each agent that went offline, with the matches its seats were
    defaulted in); ``fallbacks`` per agent (``referee.fallbacks.count_fallbacks``:
    moves that were not its own choice, by reason) and a ``warnings`` line for each
    agent over ``WARN_SHARE`` of them.

    An agent may hold several seats of one match (the beauty contest's 24
    seats, four agents): it played the match once, so ``matches`` counts
    matches and ``seats`` the seats held, over which the means are taken.
    """
    per: dict[str, dict[str, float]] = {}
    outcomes: dict[str, int] = {}
    for ep in result.episodes:
        outcomes[ep.reason] = outcomes.get(ep.reason, 0) + 1
        for agent in dict.fromkeys(ep.seats):
            row = per.setdefault(
                agent, {"matches": 0, "seats": 0, "raw": 0.0, "reward": 0.0, "timeouts": 0}
            )
            row["matches"] += 1
        for seat, agent in enumerate(ep.seats):
            row = per[agent]
            row["seats"] += 1
            row["raw"] += ep.raw_returns[seat]
            row["reward"] += ep.returns[seat]
            row["timeouts"] += ep.timeouts.count(seat)
    for row in per.values():
        n = max(1, int(row["seats"]))
        row["raw"] /= n
        row["reward"] /= n
    faults = {**asdict(result.faults), "rerequested": result.faults.rerequested}
    fallbacks = count_fallbacks(
        (a.agent, fallback_of(a.fallback, a.timed_out))
        for ep in result.episodes
        for a in ep.actions
    )
    return {
        "agents": per,
        "outcomes": outcomes,
        "faults": faults,
        "fallbacks": fallbacks,
        "warnings": warning_lines(fallbacks),
    }
