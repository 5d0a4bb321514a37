"""What a run gives back: its episodes, its faults, and the summary ``backroom run`` prints.

Kept apart from the bus wiring (``runner.local``) and the fault rules
(``runner.dispatch``) so that a reader of a run's result (the CLI, the
analysis, a league built on the runner) imports neither.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backroom.bus.wire import SHUTTING_DOWN, EpisodeRecord
from backroom.play.faults import Departure as Departure
from backroom.play.faults import Faults
from backroom.play.faults import PlayClock as PlayClock
from backroom.play.faults import RunError as RunError
from backroom.play.faults import clock_text as clock_text
from backroom.play.faults import defaulted as defaulted
from backroom.records import count_fallbacks, fallback_of, warning_lines
from backroom.runner.config import RunConfig
from backroom.runs import read_episodes


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
    defaulted in); ``fallbacks`` per agent (``records.count_fallbacks``:
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
