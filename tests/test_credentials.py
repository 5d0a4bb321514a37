"""The credential store under concurrent writers: every identity added is kept, in every file."""

from __future__ import annotations

import multiprocessing
import stat
import time
from pathlib import Path

import pytest
import typer

from backroom.bus.auth import CredentialStore

PROCESSES, EACH = 5, 10


def _add_many(directory: str, worker: int, start_at: float) -> None:
    store = CredentialStore(directory)
    time.sleep(max(0.0, start_at - time.time()))  # all five begin in the same instant
    for i in range(EACH):
        store.add(f"w{worker}-{i}", role="agent")


def test_fifty_identities_added_by_five_processes_at_once_are_all_kept(tmp_path: Path) -> None:
    """Before the lock, an unlocked read-modify-write lost adds, and writers renamed each
    other's shared ``passwd.tmp`` (FileNotFoundError)."""
    ctx = multiprocessing.get_context("spawn")  # no state inherited: separate programs
    start_at = time.time() + 3.0  # past every worker's start-up
    procs = [
        ctx.Process(target=_add_many, args=(str(tmp_path), w, start_at)) for w in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    names = {f"w{w}-{i}" for w in range(PROCESSES) for i in range(EACH)}
    store = CredentialStore(tmp_path)
    assert set(store.load()) == names
    passwd = {line.split(":", 1)[0] for line in store.passwd_path.read_text().splitlines()}
    assert passwd == names
    acl_users = {
        line.split()[1]
        for line in store.acl_path.read_text().splitlines()
        if line.startswith("user ")
    }
    assert acl_users == names
    # no temporary file left behind
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_an_identity_already_held_is_served_without_writing(tmp_path: Path) -> None:
    """compose mounts the secrets read-only into the runner, which asks for its own identity:
    asking again for an identity the store holds (its ACL current) writes nothing, not even
    the lock file (which a read-only folder would refuse)."""
    store = CredentialStore(tmp_path)
    first = store.add("runner", role="runner")
    (tmp_path / ".lock").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert store.add("runner", role="runner") == first
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    # a new identity, or a stale ACL, is a write: under the lock
    store.add("dora")
    assert (tmp_path / ".lock").exists() and "dora" in store.load()


def test_a_process_reads_its_password_from_a_file_only_its_user_can_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``backroom run`` hands each process its password as a file (its path in
    BACKROOM_PASSWORD_FILE, an agent host's as --passwords-file), never in the environment,
    where an agent's options could name it; ``backroom agent --password-file`` reads the same."""
    from backroom.cli.common import bus_config
    from backroom.runner.stack import Stack

    stack = Stack(tmp_path / "run")
    path = stack.private_file("dora.password", "s3cret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for name in ("BACKROOM_PASSWORD", "BACKROOM_PASSWORD_FILE", "BACKROOM_USERNAME"):
        monkeypatch.delenv(name, raising=False)
    assert bus_config(None, "dora", None, password_file=path).password == "s3cret"
    monkeypatch.setenv("BACKROOM_PASSWORD_FILE", str(path))
    assert bus_config(None, "dora", None).password == "s3cret"
    monkeypatch.setenv("BACKROOM_USERNAME", "someone-else")  # the file is that identity's
    with pytest.raises(typer.BadParameter, match="no password for 'dora'"):
        bus_config(None, "dora", None)
    with pytest.raises(typer.BadParameter, match=rf"password file {tmp_path / 'none'}: cannot"):
        bus_config(None, "dora", None, password_file=tmp_path / "none")
    stack.stop()
    assert not path.parent.exists()  # the files go when the processes that read them do
