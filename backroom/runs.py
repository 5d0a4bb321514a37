"""The layout of a runs directory, and the one reader of its episodes.

Each ``backroom run`` gets a fresh directory, ``runs/<run>/<UTC start time>/``
(``20261123-134501``; ``-1``, ``-2``, ... for more runs in the same second),
and ``runs/<run>/latest`` is a relative symlink to the newest one: a run never
appends to an earlier run's files, and a failed run never touches a good one.
Matches requested without a stamp (scripts on the bus, the trainer's
rollouts) keep the flat ``runs/<run>/episodes.jsonl``. Readers given a
directory that holds ``latest`` read that one run (``resolve_run_dir``).

The runner makes run directories, the referee writes into them
(``referee.episodes.EpisodeLog``), and the analysis, the trainer and the CLI
read them: hence a module of its own below all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer at a time is the user's to keep
    fcntl = None  # type: ignore[assignment]

from backroom.bus.wire import EpisodeRecord

#: The link in ``runs/<run>/`` to the newest run directory.
LATEST = "latest"
#: The file in a run directory that binds it to its run's key (a SHA-256 of it, in hex).
RUN_KEY_FILE = ".run_key"
#: ``strftime`` of a run directory's name: its UTC start time, sortable and safe in any shell.
STAMP_FORMAT = "%Y%m%d-%H%M%S"
#: The episodes file of a run directory.
EPISODES_FILE = "episodes.jsonl"


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


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: ``os.write`` may write less than asked (a full disk, a signal),
    and a short write ignored would leave a torn record, fsync'd and reported written."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # no progress and no error: never loop for ever on it
            raise OSError(f"write made no progress with {len(view)} bytes left")
        view = view[n:]


class RecordFile:
    """A JSONL file opened for appending whole records: it ends at a whole record, whatever fails.

    A full disk (or a file size limit, a failing device) lets a write put down
    part of a record and then fail; left there, the torn line is read as junk,
    and the next append continues it, so a good record is lost too. So each
    append holds the file's lock (other processes appending with this class
    wait; two referees share a run's ``episodes.jsonl``), first cuts a torn
    tail an earlier crash left, and on a failed write or fsync cuts the file
    back to where this append began before the error goes up: what failed is
    not in the file, what was written before it is. Cutting needs no space.

    ``shared=False``: this object is the file's one writer (the runner's
    traces.jsonl), so no lock, and the end is checked once, at open: the
    appends cost one ``write`` each.
    """

    def __init__(self, path: Path, fsync: bool = True, shared: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self.shared = shared and fcntl is not None
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.end = 0 if self.shared else self._whole_end()
        except BaseException:
            os.close(self.fd)
            raise

    def append(self, data: bytes) -> None:
        """Append ``data`` (whole lines, each ending in a newline), or nothing and raise."""
        if self.shared:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            start = self._whole_end() if self.shared else self.end
            try:
                write_all(self.fd, data)
                if self.fsync:
                    os.fsync(self.fd)
            except OSError as exc:
                try:
                    os.ftruncate(self.fd, start)
                except OSError as cut:
                    exc.add_note(f"{self.path}: could not cut the torn record back off: {cut!r}")
                raise
            self.end = start + len(data)
        finally:
            if self.shared:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _whole_end(self) -> int:
        """The file's size, once a torn last line (a writer killed mid-record) is cut off."""
        size = os.fstat(self.fd).st_size
        if size == 0 or os.pread(self.fd, 1, size - 1) == b"\n":
            return size
        end, chunk = size, 1 << 16
        while end > 0:
            begin = max(0, end - chunk)
            newline = os.pread(self.fd, end - begin, begin).rfind(b"\n")
            if newline >= 0:
                end = begin + newline + 1
                break
            end = begin
        os.ftruncate(self.fd, end)
        return end

    def close(self) -> None:
        os.close(self.fd)


def append_records(path: Path, data: bytes) -> None:
    """Append whole lines to ``path`` and fsync them, or leave it as it was and raise (``RecordFile``)."""
    records = RecordFile(path)
    try:
        records.append(data)
    finally:
        records.close()


def _count(stats: dict[str, int] | None, key: str) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0) + 1


def episodes_path(path: str | Path) -> Path:
    """The episodes file ``path`` names: itself, or its (latest) run directory's file."""
    p = Path(path)
    return resolve_run_dir(p) / EPISODES_FILE if p.is_dir() else p


def read_episodes(
    path: str | Path, stats: dict[str, int] | None = None
) -> Iterator[dict[str, object]]:
    """Records of a run dir or an episodes.jsonl; unreadable lines are skipped, and counted.

    ``runs/<run>`` reads its ``latest`` run only (``resolve_run_dir``). The one
    torn-line rule: a crash mid-write leaves a torn last line, and an append
    by another writer than ``RecordFile`` (an older version, a script)
    continues that same line, so a bad line can sit anywhere in the file, not
    only at its end: each line that is not a whole JSON object
    (torn, not JSON, not UTF-8, nested too deep) adds one to
    ``stats["unreadable_lines"]``.
    """
    with episodes_path(path).open("rb") as f:
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
            else:
                _count(stats, "unreadable_lines")


def read_records(path: str | Path, stats: dict[str, int] | None = None) -> Iterator[EpisodeRecord]:
    """``read_episodes`` validated as ``EpisodeRecord``s (what the trainer learns from).

    A line that is whole JSON but no episode record (another version's, a
    hand edit) is skipped too, and counted in ``stats["invalid_records"]``.
    """
    for data in read_episodes(path, stats):
        try:
            yield EpisodeRecord.model_validate(data)
        except ValidationError:
            _count(stats, "invalid_records")
