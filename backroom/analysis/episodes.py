"""Reading a run's episodes: the lines of ``runs/<run>/episodes.jsonl`` as dicts.

Measures take plain dicts (not pydantic models) so they work on files written
by any version of the referee and on records built by hand in notebooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from backroom.referee.episodes import read_episodes

Episode = dict[str, Any]

#: Episodes that reached the end of the game; timeouts were played by default actions.
PLAYED = ("normal", "timeout")


def load_episodes(path: str | Path) -> list[Episode]:
    """Records of a run directory or an episodes.jsonl; a torn last line (crash mid-write) is skipped."""
    return list(read_episodes(path))


def played(episodes: Iterable[Episode]) -> list[Episode]:
    """Episodes with a terminal state to measure (errors and voided matches have none)."""
    return [
        e for e in episodes if e.get("reason", "normal") in PLAYED and e.get("final_observations")
    ]


def by_game(episodes: Iterable[Episode]) -> dict[str, list[Episode]]:
    out: dict[str, list[Episode]] = {}
    for e in episodes:
        out.setdefault(str(e["game"]), []).append(e)
    return out
