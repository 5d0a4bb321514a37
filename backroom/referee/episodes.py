"""Append-only episode log and the layout of a runs directory.

Each ``backroom run`` gets a fresh directory, ``runs/<run>/<UTC start time>/``
(``20261123-134501``; ``-1``, ``-2``, ... for more runs in the same second),
and ``runs/<run>/latest`` is a relative symlink to the newest one: a run never
appends to an earlier run's files, and a failed run never touches a good one.
Matches requested without a stamp (scripts on the bus, the trainer's
rollouts) keep the flat ``runs/<run>/episodes.jsonl``. Readers given a
directory that holds ``latest`` read that one run (``resolve_run_dir``).

A crash loses at most the matches in progress: each record is written whole
and fsync'd before the referee announces the match as finished. Records that
finish while a write is under way are committed together in the next write
(group commit), so 100 concurrent matches cost one fsync, not 100.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

#: The link in ``runs/<run>/`` to the newest run directory.
LATEST = "latest"
#: The file in a run directory that binds it to its run's key (a SHA-256 of it, in hex).
RUN_KEY_FILE = ".run_key"
#: ``strftime`` of a run directory's name: its UTC start time, sortable and safe in any shell.
STAMP_FORMAT = "%Y%m%d-%H%M%S"


def new_run_dir(runs_dir: str | Path, run: str, now: datetime | None = None) -> Path:
    """Create ``runs_dir/run/<UTC stamp>/`` and point ``runs_dir/run/latest`` at it.

    ``mkdir`` without ``exist_ok`` is the claim: two runs started in the same
    second (or by two processes at once) get ``<stamp>``, ``<stamp>-1``, ...
    and never share a directory. The link is replaced atomically (a temporary
    link, then ``os.replace``), so a reader never finds ``latest`` missing.
    """
    parent = Path(runs_dir) / run
    parent.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime(STAMP_FORMAT)
    for n in itertools.count():
        run_dir = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        point_latest(parent, run_dir.name)
        return run_dir
    raise AssertionError("unreachable")  # itertools.count() never ends


def point_latest(parent: Path, name: str) -> None:
    """Make ``parent/latest`` a relative link to ``parent/name``, atomically.

    Relative, so the runs tree can be moved or copied (``cp -r``, ``rsync -a``)
    and its links still point inside it.
    """
    tmp = parent / f".{LATEST}.{os.getpid()}.{name}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by a process killed between the two steps
    os.symlink(name, tmp)
    os.replace(tmp, parent / LATEST)


def resolve_run_dir(path: str | Path) -> Path:
    """The one run directory that ``path`` names: ``path/latest`` when it has one, else ``path``.

    ``runs/<run>`` holds every run of a config, one directory each; reading it
    means reading its newest run, never all of them together. A file, a run
    directory itself, or a flat directory of an older layout is returned as is.
    """
    p = Path(path)
    latest = p / LATEST
    if not latest.is_symlink():
        return p
    target = p / os.readlink(latest)
    if not target.is_dir():
        raise FileNotFoundError(f"{latest} points to {target}, which does not exist")
    return target


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bind_run_dir(run_dir: Path, key: str) -> None:
    """Bind ``run_dir`` to ``key``: referees write there only for requests that carry it.

    The runner does this when it makes the directory, before any request
    names it; a referee whose runs directory is elsewhere binds it to the key
    of the first request that names it (``EpisodeLog.may_write``).
    """
    (run_dir / RUN_KEY_FILE).write_text(key_digest(key) + "\n")


class EpisodeLog:
    def __init__(self, runs_dir: str | Path) -> None:
        self.runs_dir = Path(runs_dir)
        self._waiting: list[tuple[Path, bytes, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._stamped: set[Path] = set()  # run directories of stamped runs, to link as `latest`
        self._keys: dict[Path, str] = {}  # stamped run directory -> the digest it is bound to

    def may_write(self, run: str, stamp: str, key: str | None) -> bool:
        """Whether a request carrying ``key`` may have its record written in ``runs/<run>/<stamp>``.

        Any runner-role identity may send requests, and a run's name and stamp
        are in every episode it publishes: by naming them, a runner made a
        referee append into another run's file. A stamped directory is bound
        to the key of its run (``bind_run_dir``; here, at the first request
        that names it with a key) and takes records only from requests with
        that key. A directory never bound takes keyless requests (scripts,
        runners before keys); one that cannot be read is left to the write,
        whose failure is reported (``Referee._write``).
        """
        run_dir = self.runs_dir / run / stamp
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
        return self.runs_dir / run / (stamp or "") / "episodes.jsonl"

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
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                write_all(fd, b"".join(lines))
                os.fsync(fd)
            finally:
                os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: ``os.write`` may write less than asked (a full disk, a signal).

    A short write ignored left a torn record, fsync'd and reported written.
    """
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # no progress and no error: never loop for ever on it
            raise OSError(f"write made no progress with {len(view)} bytes left")
        view = view[n:]


def read_episodes(
    path: str | Path, stats: dict[str, int] | None = None
) -> Iterator[dict[str, object]]:
    """Records of a run dir or an episodes.jsonl; unreadable lines are skipped, and counted.

    ``runs/<run>`` reads its ``latest`` run only (``resolve_run_dir``). A
    crash mid-write leaves a torn last line, and the next append continues
    that same line, so a bad line can sit anywhere in the file, not only at
    its end: each line that is not a whole JSON object (torn, not JSON, not
    UTF-8, nested too deep) adds one to ``stats["unreadable_lines"]``.
    """
    p = Path(path)
    if p.is_dir():
        p = resolve_run_dir(p) / "episodes.jsonl"
    with p.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            record: object = None
            if line.endswith(b"\n"):  # else torn: the writer died mid-line
                # JSONDecodeError and UnicodeDecodeError are ValueErrors
                with contextlib.suppress(ValueError, RecursionError):
                    record = json.loads(line)
            if isinstance(record, dict):
                yield record
            elif stats is not None:
                stats["unreadable_lines"] = stats.get("unreadable_lines", 0) + 1
