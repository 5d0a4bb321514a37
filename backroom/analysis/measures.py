"""What a game's analysis module exports: its measures and its tables, one entry per game.

``backroom.analysis`` dispatches through the ``MEASURES`` of each game module
(``social``, ``beauty``, ``bertrand``, ``kuhn``): a new game's measures are one
module with a ``MEASURES`` mapping, named once in ``analysis.GAME_MODULES``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rich.table import Table

from backroom.analysis.episodes import Episode


class GameMeasures(NamedTuple):
    """``analyze(episodes, out_dir)``: a JSON-able dict of measures (PNGs to ``out_dir`` when
    given); ``tables(run, result)``: that dict as rich tables for the terminal and the report."""

    analyze: Callable[[list[Episode], Path | None], dict[str, Any]]
    tables: Callable[[str, dict[str, Any]], list[Table]]


def cell(x: Any, digits: int = 3) -> str:
    """A table cell: ``-`` for nothing, yes/no, a float to ``digits`` places."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)
