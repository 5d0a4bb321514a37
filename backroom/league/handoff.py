"""Checkpoints handed over by training runs: ``<league dir>/entrants.d/*.yaml``.

``backroom train`` with ``league: {dir: D, every: N}`` writes one file per
N-th checkpoint into ``D/entrants.d/`` (``backroom.trainer.entrants``; the
format is in docs/training.md). A league played into ``D`` adds those it
does not have yet to its entrants, so ``backroom league CONFIG --dir D --resume``
after more training plays only the new checkpoints' pairings (the store
counts every match once).

A file there is data, not an agent: anyone who can write the folder could
otherwise seat any agent kind with any options (an ``llm`` agent sending what
its ``api_key_env`` names to a ``base_url`` of theirs). So a file names only a
trained policy version (``HandedCheckpoint``: its name, policy, version, the
adapter folder and that folder's sha256), and the league seats it as its own
config's ``model:`` block plays (kind ``local``, the config's options) with that
adapter. The adapter must lie inside the league directory or a training run
directory the league config names (``trainers:``, or an entrant's
``from_run``), with no ``..`` and no symlink leading out, and hash to the
sha256 the file gives. A file that is anything else is refused with its
reason, moved to ``entrants.d/rejected/`` beside a ``.reason`` file, and the
league goes on with the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backroom.league.config import Entrant, LeagueConfig
from backroom.runner.config import ConfigError

log = logging.getLogger("backroom.league")

#: The folder a league directory receives training runs' checkpoints in.
HANDED_DIR = "entrants.d"
#: Where a refused file goes (with ``<file>.reason``), so the next session does not read it again.
REJECTED_DIR = "rejected"
#: The record format this league reads: 2, a checkpoint (1 carried a whole agent entry).
HANDED_FORMAT = 2
#: A record is a few lines; a bigger file is no record (and is not read into memory).
MAX_RECORD_BYTES = 64 * 1024
#: The model kind that plays an adapter folder.
ADAPTER_KIND = "local"

Refusal = Callable[[str], None]


class Refused(ValueError):
    """Why a handed-over file is not seated (one line, naming the file)."""


def shown(value: object, limit: int = 1000) -> str:
    """``value`` as a message may quote it: whoever wrote the file chose it, so a control
    character (a terminal escape, a newline) is escaped, and a long one cut."""
    text = str(value)
    text = text if text.isprintable() else ascii(text)
    return text if len(text) <= limit else f"{text[:limit]}..."


class HandedCheckpoint(BaseModel):
    """Everything an ``entrants.d`` file may say: which checkpoint, and where its adapter is."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: int
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the entrant's id")
    policy: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    version: str = Field(pattern=r"^v[0-9]{1,12}$")
    adapter: str = Field(min_length=1, max_length=4096, description="the adapter folder")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="adapter_digest of the folder")
    size: int | None = Field(default=None, ge=0)
    step: int | None = Field(default=None, ge=0)


def read_record(path: Path) -> HandedCheckpoint:
    """The checkpoint ``path`` names; ``Refused`` for anything that is not one."""
    record = _read_mapping(path)
    _check_format(path, record.get("format"))
    if extra := sorted(shown(k, 40) for k in record if k not in HandedCheckpoint.model_fields):
        raise Refused(
            f"{path}: field(s) {', '.join(extra[:10])} refused: a handed-over file names only a "
            f"checkpoint ({', '.join(HandedCheckpoint.model_fields)}), which the league seats "
            "as its config's model: plays"
        )
    try:
        return HandedCheckpoint.model_validate(record)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors()
        )
        raise Refused(f"{path}: {problems}") from None


def _read_mapping(path: Path) -> dict[object, object]:
    """The YAML mapping in ``path``, read as a plain file of at most ``MAX_RECORD_BYTES``
    (a symlink, a FIFO or a huge file is refused before it is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # a symlink (ELOOP) among others: not a file a trainer wrote
        raise Refused(f"{path}: cannot be read as a plain file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Refused(f"{path}: not a plain file")
        raw = f.read(MAX_RECORD_BYTES + 1)
    if len(raw) > MAX_RECORD_BYTES:
        raise Refused(f"{path}: larger than {MAX_RECORD_BYTES} bytes, no checkpoint record")
    try:
        record = yaml.safe_load(raw.decode())
    except (UnicodeDecodeError, yaml.YAMLError):
        raise Refused(f"{path}: not YAML; write it again with backroom train") from None
    if not isinstance(record, dict):
        raise Refused(f"{path}: not a mapping; write it again with backroom train")
    return record


def _check_format(path: Path, version: object) -> None:
    if version == HANDED_FORMAT:
        return
    if isinstance(version, int) and version > HANDED_FORMAT:
        raise Refused(f"{path}: format {version} is newer than {HANDED_FORMAT}")
    given = version if isinstance(version, int) else "missing or no number"
    raise Refused(
        f"{path}: format {given} is not {HANDED_FORMAT} (a checkpoint: name, policy, "
        "version, adapter, sha256); write it again with this version's backroom train"
    )


def allowed_roots(config: LeagueConfig, directory: Path) -> list[Path]:
    """The folders a handed-over adapter may lie in: the league's, and the runs its config names."""
    runs = [*config.trainers, *(e.from_run for e in config.entrants if e.from_run)]
    return [directory.resolve(), *(Path(p).resolve() for p in runs)]


def adapter_folder(record: HandedCheckpoint, directory: Path, roots: list[Path]) -> Path:
    """The record's adapter folder, resolved, inside one of ``roots``, its digest checked."""
    from backroom.model.adapters import ADAPTER_FILES, AdapterRejected, adapter_digest

    given = Path(record.adapter)
    if ".." in given.parts or "\0" in record.adapter:
        raise Refused(f"adapter {shown(record.adapter)}: no `..` (nor NUL) in an adapter path")
    folder = (given if given.is_absolute() else directory / given).resolve()
    inside = [r for r in roots if folder.is_relative_to(r)]
    if not inside:
        raise Refused(
            f"adapter {shown(record.adapter)} lies outside the league directory and the training runs "
            f"its config names ({', '.join(map(str, roots))}); name the run under trainers:"
        )
    if folder.name != record.version:
        raise Refused(
            f"adapter {shown(record.adapter)}: the folder of version {record.version} is named so"
        )
    for name in ADAPTER_FILES:  # a file of the folder linked elsewhere is no escape either
        if not (folder / name).resolve().is_relative_to(inside[0]):
            raise Refused(f"adapter {shown(record.adapter)}: {name} leads out of {inside[0]}")
    try:
        sha, size = adapter_digest(folder)
    except (AdapterRejected, OSError) as exc:
        raise Refused(f"adapter {shown(record.adapter)}: {shown(exc)}") from None
    if sha != record.sha256 or (record.size is not None and size != record.size):
        raise Refused(
            f"adapter {shown(record.adapter)}: its sha256 is {sha} ({size} bytes), not the "
            f"{record.sha256} ({record.size} bytes) handed over"
        )
    return folder


def set_aside(path: Path, why: str) -> None:
    """Move a refused file to ``rejected/`` with its reason (kept where it is if that fails).

    Whoever writes ``entrants.d`` may swap ``rejected/`` for a link at any moment, so the
    folder is opened once (``O_NOFOLLOW``: a link is refused) and the move and the reason
    go through that open folder, never through its name again.
    """
    rejected = path.parent / REJECTED_DIR
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(rejected, 0o700)
        try:
            into = os.open(rejected, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            raise OSError(f"{rejected} is not a folder of the league's") from None
        try:
            source = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:  # a link there is replaced, not followed
                os.replace(path.name, path.name, src_dir_fd=source, dst_dir_fd=into)
            finally:
                os.close(source)
            reason = f"{path.name}.reason"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(reason, dir_fd=into)  # nor is one planted here written through
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            with os.fdopen(os.open(reason, flags, 0o600, dir_fd=into), "w") as f:
                f.write(why + "\n")
        finally:
            os.close(into)
    except OSError as exc:
        log.warning("%s stays where it is (%s); it is refused again next time", path, exc)


def handed_entrants(
    directory: str | Path, config: LeagueConfig, on_refused: Refusal | None = None
) -> list[Entrant]:
    """The checkpoints in ``directory/entrants.d`` as entrants, by file name.

    A refused file is moved aside and ``on_refused`` told why (one line naming it).
    """
    say = on_refused or (lambda line: log.warning("%s", line))
    directory = Path(directory)
    folder = directory / HANDED_DIR
    roots = allowed_roots(config, directory)
    entrants: list[Entrant] = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        try:
            record = read_record(path)
            if record.name in (e.id for e in entrants):
                raise Refused(f"{path}: another file already hands over {record.name}")
            adapter = adapter_folder(record, directory, roots)
        except Refused as exc:
            why = str(exc).replace(str(path), shown(path), 1)
            why = why if why.startswith(shown(path)) else f"{shown(path)}: {why}"
            set_aside(path, why)
            say(f"{why} (moved to {folder / REJECTED_DIR})")
            continue
        if config.model.kind != ADAPTER_KIND:
            raise ConfigError(
                f"{path}: a checkpoint plays on a local model, and this league's model: is "
                f"kind {config.model.kind}; give it model: {{kind: local, options: ...}}"
            )
        options = {k: v for k, v in config.model.options.items() if k != "policy"}  # frozen
        entrants.append(
            Entrant(id=record.name, kind=ADAPTER_KIND, options={**options, "adapter": str(adapter)})
        )
    return entrants


def with_handed_entrants(
    config: LeagueConfig, directory: str | Path, on_refused: Refusal | None = None
) -> tuple[LeagueConfig, list[str]]:
    """``config`` with the handed-over entrants it lacks (checked like its own), and their ids."""
    have = {a.id for e in config.entrants for a in e.agents()}
    new = [e for e in handed_entrants(directory, config, on_refused) if e.id not in have]
    if not new:
        return config, []
    try:
        merged = LeagueConfig.model_validate({**dict(config), "entrants": [*config.entrants, *new]})
    except ValueError as exc:
        raise ConfigError(f"{Path(directory) / HANDED_DIR}: {exc}") from None
    return merged, [e.id for e in new]
