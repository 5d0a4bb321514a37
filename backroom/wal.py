"""SQLite in WAL mode, as backroom's stores use it: one connection, transactions said aloud.

The trainer's episode store and the league's result store share their discipline
(readers never block the writer; a second process waits at ``BEGIN IMMEDIATE``
instead of failing to upgrade halfway through a transaction; a schema newer than
the code is refused rather than misread); they differ only in how durable a
commit must be, which ``synchronous`` says.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

#: How long a connection waits for another process's write lock before it fails.
BUSY_TIMEOUT_MS = 10_000


def connect(
    path: Path, synchronous: Literal["NORMAL", "FULL"], readonly: bool = False
) -> sqlite3.Connection:
    """A connection in WAL mode (``readonly``: the file as it is, no mode set, nothing written).

    ``isolation_level=None``: no implicit transactions, ``transaction`` says where
    each one begins and ends. A file that refuses WAL is an error, not a slower store.
    """
    target = f"file:{path}?mode=ro" if readonly else str(path)
    db = sqlite3.connect(target, uri=readonly, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not readonly:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"{path}: SQLite refused WAL mode (got {mode!r})")
            db.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        db.close()
        raise
    return db


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: BEGIN IMMEDIATE takes the write lock up front."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def create_schema(db: sqlite3.Connection, path: Path, schema: str, version: int) -> None:
    """Create what ``schema`` declares (``IF NOT EXISTS`` statements) and stamp ``version``."""
    with transaction(db):
        found = db.execute("PRAGMA user_version").fetchone()[0]
        if found > version:
            raise RuntimeError(
                f"{path}: schema version {found} is newer than this code's {version}"
            )
        for statement in schema.split(";"):
            if statement.strip():
                db.execute(statement)
        if found < version:
            db.execute(f"PRAGMA user_version = {version}")
