"""Append-only episode log: ``runs/<run>/episodes.jsonl``, one fsync'd line per match.

A crash loses at most the match in progress: each record is written whole,
flushed and fsync'd before the referee announces the match as finished.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

from backroom.bus.wire import EpisodeRecord


class EpisodeLog:
    def __init__(self, runs_dir: str | Path) -> None:
        self.runs_dir = Path(runs_dir)
        self._lock = asyncio.Lock()

    def path(self, run: str) -> Path:
        return self.runs_dir / run / "episodes.jsonl"

    async def append(self, record: EpisodeRecord) -> None:
        line = record.model_dump_json() + "\n"
        async with self._lock:
            await asyncio.to_thread(self._append_sync, self.path(record.run), line)

    @staticmethod
    def _append_sync(path: Path, line: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def read_episodes(path: str | Path) -> Iterator[dict[str, object]]:
    """Records of a run dir or an episodes.jsonl; a torn last line (crash mid-write) is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / "episodes.jsonl"
    with p.open() as f:
        for line in f:
            if not line.endswith("\n"):
                break
            yield json.loads(line)
