"""The referee's append-only episode log (the runs directory's layout is ``backroom.runs``).

A crash loses at most the matches in progress: each record is written whole
and fsync'd before the referee announces the match as finished, and a write
that fails (a full disk) leaves the file at its last whole record
(``runs.RecordFile``), never a torn line. Records that
finish while a write is under way are committed together in the next write
(group commit), so 100 concurrent matches cost one fsync, not 100.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from backroom import metrics
from backroom.bus.wire import EpisodeRecord
from backroom.runs import (
    EPISODES_FILE,
    LATEST,
    RUN_KEY_FILE,
    append_records,
    key_digest,
    point_latest,
)


class EpisodeLog:
    def __init__(self, runs_dir: str | Path) -> None:
        self.runs_dir = Path(runs_dir)
        self._waiting: list[tuple[Path, bytes, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._stamped: set[Path] = set()  # run directories of stamped runs, to link as `latest`
        self._keys: dict[Path, str] = {}  # stamped run directory -> the digest it is bound to
        # (run, stamp) -> its run directory: every match asks twice, and joining a Path
        # costs more than the dictionary (docs/speed.md, *In flight without a scan*).
        self._dirs: dict[tuple[str, str], Path] = {}

    def may_write(self, run: str, stamp: str, key: str | None) -> bool:
        """Whether a request carrying ``key`` may have its record written in ``runs/<run>/<stamp>``.

        Any runner-role identity may send requests, and a run's name and stamp
        are in every episode it publishes: by naming them, a runner could make
        a referee append into another run's file. A stamped directory is bound
        to the key of its run (``bind_run_dir``; here, at the first request
        that names it with a key) and takes records only from requests with
        that key. A directory never bound takes keyless requests (scripts,
        runners before keys); one that cannot be read is left to the write,
        whose failure is reported (``EpisodeLog.commit``).
        """
        run_dir = self._run_dir(run, stamp)
        digest = key_digest(key) if key else None
        bound = self._keys.get(run_dir)
        if bound is None:
            key_file = run_dir / RUN_KEY_FILE
            try:
                bound = key_file.read_text().strip()
            except FileNotFoundError:
                if digest is None:
                    return True
                try:
                    if not run_dir.is_dir():
                        run_dir.mkdir(parents=True, exist_ok=True)
                        # Never away from another run's keyed directory: any runner may
                        # name a new stamp with a key of its own, and `latest` is what
                        # `backroom analyze runs/<run>` reads.
                        latest = run_dir.parent / LATEST
                        if not (latest.exists() and (latest / RUN_KEY_FILE).exists()):
                            point_latest(run_dir.parent, run_dir.name)
                    with key_file.open("x") as f:
                        f.write(digest + "\n")
                    bound = digest
                except FileExistsError:  # another referee bound it just now
                    bound = key_file.read_text().strip()
                except OSError:
                    return True
            except OSError:
                return True
            self._keys[run_dir] = bound
        return digest == bound

    def path(self, run: str, stamp: str | None = None) -> Path:
        """``runs/<run>/<stamp>/episodes.jsonl``; without a stamp, ``runs/<run>/episodes.jsonl``."""
        return self._run_dir(run, stamp or "") / EPISODES_FILE

    def _run_dir(self, run: str, stamp: str) -> Path:
        run_dir = self._dirs.get((run, stamp))
        if run_dir is None:
            if len(self._dirs) >= 1024:  # a referee that outlives many runs forgets the old
                self._dirs.clear()
            run_dir = self._dirs[run, stamp] = self.runs_dir / run / stamp
        return run_dir

    async def commit(
        self, record: EpisodeRecord, record_json: bytes, log: logging.Logger
    ) -> EpisodeRecord:
        """Append ``record`` to its run's file; the ``error`` record to publish when that fails.

        On a full disk or a broken run directory the episode still goes out,
        as an ``error`` naming the ``OSError`` (its play kept, for the record)
        and marked ``not_written``: the runner fails the run with that reason
        rather than wait for a record that never comes.
        """
        try:
            await self.append(record.run, record_json, record.spec.run_stamp)
        except OSError as exc:
            metrics.EPISODES_NOT_WRITTEN.inc()
            where = self.path(record.run, record.spec.run_stamp)
            log.error("match %s: episode not written to %s: %r", record.match, where, exc)
            was = f"{record.reason}: {record.detail}" if record.detail else record.reason
            detail = f"episode not written to {where}: {exc!r} (the match ended {was})"
            return record.model_copy(
                update={"reason": "error", "detail": detail, "not_written": True}
            )
        return record

    async def append(self, run: str, record_json: bytes, stamp: str | None = None) -> None:
        """Return once the record (serialised once, by the caller, for disk and bus alike) is on disk."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        path = self.path(run, stamp)
        if stamp:
            self._stamped.add(path.parent)
        self._waiting.append((path, record_json + b"\n", done))
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

    def _write_sync(self, batch: list[tuple[Path, bytes, asyncio.Future[None]]]) -> None:
        by_path: dict[Path, list[bytes]] = {}
        for path, line, _ in batch:
            by_path.setdefault(path, []).append(line)
        for path, lines in by_path.items():
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.parent in self._stamped:
                    # A stamped run directory this referee made (the runner's runs
                    # directory is elsewhere, e.g. another machine): `latest` here too.
                    point_latest(path.parent.parent, path.parent.name)
            append_records(path, b"".join(lines))
