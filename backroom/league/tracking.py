"""Experiment tracking of ``backroom league``: ``tracking:`` in a league config, the same block
and tools as ``backroom train``'s (backroom/tracking/ says what a failure does).

What a league logs to its tracker run:

* the league config, once, as params (MLflow), config (W&B) or text (TensorBoard);
* at each rewrite of ``standings.json`` (every ``STANDINGS_S`` while it plays),
  with step = the results counted so far: each entrant's ``mu``, ``sigma``,
  ``ordinal`` and ``matches`` per game (``ipd/d1/mu``; ``all/d1/mu`` for the
  rating over every game when the league has several), and the counts
  ``league/results``, ``league/voided``, ``league/duplicates`` and
  ``league/fallbacks`` (moves of counted matches that were not their agent's own);
* at the end, ``standings.json`` (and the PNG plots, when the caller draws
  them) as artifacts, or references where the tool keeps no files.

The calls go through one worker thread, in order: a tracker that answers
slowly (a remote MLflow retrying) delays the tracking, not the matches.
``--resume`` continues the tracker run ``DIR/tracking.json`` names; the steps
go on from the results counted before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backroom.bus.wire import EpisodeRecord
from backroom.league.config import LeagueConfig
from backroom.league.standings import ALL_GAMES, STANDINGS
from backroom.league.store import LeagueStore
from backroom.records import fallback_of
from backroom.tracking import Tracking, open_tracking

#: The stream of ``tracking.json`` (``standings_through``: the last results count sent).
STREAM = "standings"
#: An entrant's figures logged per flush, from each row of ``ratings``.
RATING_FIELDS = ("mu", "sigma", "ordinal", "matches")

#: Draws ``standings.json``'s plots into a folder and says which files it wrote
#: (``backroom.analysis.league.plot_standings``, above the league in the layers).
Plots = Callable[[dict[str, Any], Path], list[str]]


def fallbacks_of(record: EpisodeRecord) -> int:
    """The moves of a match that were not their agent's own (as ``standings.json`` counts them)."""
    return sum(fallback_of(a.fallback, a.timed_out) is not None for a in record.actions)


def standings_values(doc: Mapping[str, Any], fallbacks: int) -> dict[str, Any]:
    """One standings document as one record: step = the results counted."""
    out: dict[str, Any] = {"step": int(doc["counted"])}
    tables = [(key, game["ratings"]) for key, game in doc["games"].items()]
    if "overall" in doc:
        tables.append((ALL_GAMES, doc["overall"]))
    for key, rows in tables:
        for row in rows:
            for name in RATING_FIELDS:
                out[f"{key}/{row['agent']}/{name}"] = row[name]
    counters = doc.get("counters") or {}
    out["league/results"] = int(doc["counted"])
    for name in ("voided", "duplicates"):
        out[f"league/{name}"] = int(counters.get(name, 0))
    out["league/fallbacks"] = fallbacks
    return out


class LeagueTracking:
    """A league's tracker: standings as they are rewritten, the final files, the close."""

    def __init__(self, tracking: Tracking, store: LeagueStore, plots: Plots | None) -> None:
        self.tracking, self.plots = tracking, plots
        self.on = tracking.tracker is not None
        # the counted matches' fallbacks so far (a resumed league's too), kept up per result
        self.fallbacks = sum(fallbacks_of(r) for r in store.records()) if self.on else 0
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="league-tracking")

    def counted(self, record: EpisodeRecord) -> None:
        """A result the store counted (its fallbacks join the count)."""
        if self.on:
            self.fallbacks += fallbacks_of(record)

    def standings(self, doc: Mapping[str, Any]) -> None:
        """Queue one standings document's figures for the worker (never blocks the league)."""
        if self.on:
            self._worker.submit(self.tracking.send, STREAM, [standings_values(doc, self.fallbacks)])

    def close(self, doc: Mapping[str, Any], directory: Path, error: BaseException | None) -> None:
        """After the last standings: send what is queued, the files, and end the run (blocking)."""
        self._worker.shutdown(wait=True)
        if not self.on:
            return
        if doc:  # none when the league failed before its first standings
            self.tracking.send(STREAM, [standings_values(doc, self.fallbacks)])
            files = [directory / STANDINGS]
            if self.plots is not None:
                with self.tracking.attempt("drawing the plots"):
                    files += [Path(p) for p in self.plots(dict(doc), directory / "plots")]
            self.tracking.files(int(doc["counted"]), "standings", files)
        self.tracking.close(error)


def open_league_tracking(config: LeagueConfig, directory: Path) -> Tracking:
    """The tracker of ``config.tracking`` in the league directory (off: every call a no-op),
    for a ``LeagueTracking`` (made in the thread that owns the store: it reads it).

    Blocking (clients start, stores open): call it in a worker thread from async code.
    Raises ``TrackingError`` when the tracker cannot open.
    """
    return open_tracking(
        config.tracking,
        directory,
        config.model_dump(mode="json"),
        Tracking,
        title=config.league,
        work="the league",
    )
