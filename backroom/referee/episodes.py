"""Append-only episode log: ``runs/<run>/episodes.jsonl``, one fsync'd line per match.

A crash loses at most the matches in progress: each record is written whole
and fsync'd before the referee announces the match as finished. Records that
finish while a write is under way are committed together in the next write
(group commit), so 100 concurrent matches cost one fsync, not 100.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path


class EpisodeLog:
    def __init__(self, runs_dir: str | Path) -> None:
        self.runs_dir = Path(runs_dir)
        self._waiting: list[tuple[Path, bytes, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    def path(self, run: str) -> Path:
        return self.runs_dir / run / "episodes.jsonl"

    async def append(self, run: str, record_json: bytes) -> None:
        """Return once the record (serialised once, by the caller, for disk and bus alike) is on disk."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((self.path(run), record_json + b"\n", done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        await done

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                await asyncio.to_thread(self._write_sync, batch)
            except OSError as exc:
                for *_, fut in batch:
                    fut.set_exception(exc)
            else:
                for *_, fut in batch:
                    fut.set_result(None)

    @staticmethod
    def _write_sync(batch: list[tuple[Path, bytes, asyncio.Future[None]]]) -> None:
        by_path: dict[Path, list[bytes]] = {}
        for path, line, _ in batch:
            by_path.setdefault(path, []).append(line)
        for path, lines in by_path.items():
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, b"".join(lines))
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
            if line.strip():
                yield json.loads(line)
