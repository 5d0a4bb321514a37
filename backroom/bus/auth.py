"""Identities and what each may do: the broker's password file and ACL, generated.

Identity is the MQTT username (agent id = username). Each identity's block of
the ACL holds exactly its role's rules (``ROLE_RULES``), with its own name
written into those about its own topics: an agent can read only its own inbox
and write only its own outbox, status and traces — whatever its code does —
and a service role can touch only what its job needs (only a trainer writes
checkpoints, which every ``local`` agent loads).

The files use Mosquitto's syntax (the only Mosquitto-specific thing DESIGN.md
allows) and are always generated from ``credentials.json``, never hand-edited.
Passwords are hashed as ``mosquitto_passwd`` does (PBKDF2-SHA512, ``$7$``), in
Python, so no extra binary is needed to add an identity.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer at a time is the user's to keep
    fcntl = None  # type: ignore[assignment]

from backroom.bus.topics import PREFIX

Role = Literal["agent", "referee", "runner", "trainer", "observer"]
ROLES: tuple[Role, ...] = ("agent", "referee", "runner", "trainer", "observer")
ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: Exactly what each role reads and writes: its job, nothing more (and nothing
#: for every identity alike: an observer cannot write a status, a referee
#: cannot write a checkpoint). ``{me}`` is the identity's own username,
#: written into its block by ``render_acl`` (usernames are ``ID_PATTERN``, one
#: topic level with no wildcard), so no rule reaches another identity's inbox,
#: outbox, status or traces.
#:
#: * ``agent`` (a program, or a person through ``backroom web``/``tty``):
#:   its inbox, outbox, status and traces; checkpoints and announced versions
#:   (its policy is not its name, so all of them: they are announcements, not
#:   secrets); statuses and
#:   public match events, which the design makes public to players.
#: * ``referee``: the outboxes addressed to it and match requests in,
#:   inboxes, public events and episodes out; statuses; its own status; the referees' group records
#:   under ``control/referees/`` (writes only its own, and its own probe and
#:   roster record).
#: * ``runner`` and ``trainer``: match requests out, the acknowledgements in
#:   their own inbox, episodes, traces and statuses in; the referees' roster
#:   records (which identities are referees: any identity's status may *say*
#:   ``kind: referee``); the trainer alone writes checkpoints and announced
#:   versions (``models/+/versions/+``), the only adapters a ``local`` agent
#:   loads (a match naming any other is refused); it reads checkpoints too, to
#:   follow the policy another trainer trains (co-training).
#: * ``observer`` (the web's spectating identity, healthchecks, dashboards):
#:   reads statuses, public events, episodes, checkpoints and announced
#:   versions; writes nothing.
#:
#: Mosquitto never checks a SUBSCRIBE against the ACL file (its file check
#: returns "allowed" for every subscription and checks reads at delivery), so
#: no line here can keep an identity out of a shared-subscription group. Anyone
#: in the referees' group would be handed a share of the match requests, which
#: the broker then drops because that identity may not read them. The group's
#: name is therefore a secret among referees (``backroom.referee.group``),
#: kept under ``control/referees/+/group``, which only the referee role may read
#: or write: no other role below has a rule that reaches it (runners, trainers
#: and observers read ``control/referees/+/roster`` only).
ROLE_RULES: dict[Role, list[str]] = {
    "agent": [
        f"topic read {PREFIX}/agents/{{me}}/inbox",
        # its outbox to each referee (``agents/{me}/outbox/{referee}``); ``#`` covers the
        # old shared ``agents/{me}/outbox`` too, for a referee from before outboxes per referee
        f"topic write {PREFIX}/agents/{{me}}/outbox/#",
        f"topic write {PREFIX}/agents/{{me}}/status",
        f"topic write {PREFIX}/traces/{{me}}",
        f"topic read {PREFIX}/models/+/checkpoint",
        f"topic read {PREFIX}/models/+/versions/+",
        f"topic read {PREFIX}/agents/+/status",
        f"topic read {PREFIX}/matches/+/public",
    ],
    "referee": [
        f"topic write {PREFIX}/agents/{{me}}/status",
        f"topic read {PREFIX}/agents/+/status",
        # only the outboxes addressed to this referee: no referee reads another's moves
        f"topic read {PREFIX}/agents/+/outbox/{{me}}",
        f"topic write {PREFIX}/agents/+/inbox",
        f"topic write {PREFIX}/matches/+/public",
        f"topic write {PREFIX}/episodes/#",
        f"topic read {PREFIX}/control/matches",
        f"topic read {PREFIX}/control/referees/+/group",
        f"topic write {PREFIX}/control/referees/{{me}}/group",
        f"topic readwrite {PREFIX}/control/referees/{{me}}/probe",
        f"topic write {PREFIX}/control/referees/{{me}}/roster",
    ],
    "runner": [
        f"topic read {PREFIX}/agents/{{me}}/inbox",
        f"topic write {PREFIX}/control/matches",
        f"topic read {PREFIX}/episodes/#",
        f"topic read {PREFIX}/traces/+",
        f"topic read {PREFIX}/agents/+/status",
        f"topic read {PREFIX}/control/referees/+/roster",
    ],
    "trainer": [
        f"topic read {PREFIX}/agents/{{me}}/inbox",
        f"topic write {PREFIX}/control/matches",
        f"topic read {PREFIX}/episodes/#",
        f"topic read {PREFIX}/traces/+",
        f"topic read {PREFIX}/agents/+/status",
        f"topic read {PREFIX}/control/referees/+/roster",
        # read too: in co-training a trainer follows the current adapter another one trains
        f"topic readwrite {PREFIX}/models/+/checkpoint",
        f"topic write {PREFIX}/models/+/versions/+",
    ],
    "observer": [
        f"topic read {PREFIX}/agents/+/status",
        f"topic read {PREFIX}/control/referees/+/roster",
        f"topic read {PREFIX}/matches/+/public",
        f"topic read {PREFIX}/episodes/#",
        f"topic read {PREFIX}/models/+/checkpoint",
        f"topic read {PREFIX}/models/+/versions/+",
    ],
}


def rules_for(cred: Credential) -> list[str]:
    """The ACL lines of one identity: its role's rules with ``{me}`` made its username."""
    check_identity(cred.username)  # a wildcard or a '/' in a name would widen its rules
    return [rule.replace("{me}", cred.username) for rule in ROLE_RULES[cred.role]]


def hash_password(password: str, *, iterations: int = 101, salt: bytes | None = None) -> str:
    """Mosquitto's ``$7$`` hash: PBKDF2-HMAC-SHA512 over a 12-byte salt, 64-byte key."""
    salt = salt if salt is not None else secrets.token_bytes(12)
    key = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(key).decode()}"


def check_identity(name: str) -> str:
    if not ID_PATTERN.match(name):
        raise ValueError(
            f"identity {name!r} must be 1-64 characters of letters, digits, '_', '.' or '-' "
            "(it becomes an MQTT topic level)"
        )
    return name


@dataclass(frozen=True)
class Credential:
    username: str
    password: str
    role: Role


class CredentialStore:
    """``credentials.json`` (mode 0600) plus the password and ACL files derived from it."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / "credentials.json"
        self.passwd_path = self.dir / "passwd"
        self.acl_path = self.dir / "acl"

    def load(self) -> dict[str, Credential]:
        if not self.path.exists():
            return {}
        raw = json.loads(self.path.read_text())
        return {u: Credential(u, c["password"], c["role"]) for u, c in raw.items()}

    def get(self, username: str) -> Credential:
        creds = self.load()
        if username not in creds:
            raise KeyError(
                f"no credentials for {username!r} in {self.path}; add them with "
                f"`backroom credentials add {username} --dir {self.dir}`"
            )
        return creds[username]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the store's exclusive lock (``.lock`` beside it) for a read-modify-write.

        Several processes write one store: two ``backroom train --credentials DIR``
        started in the same second each add their identities. Without the lock one
        add would be lost, and the two would share one temporary file (``passwd.tmp``).
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            yield
            return
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def add(self, username: str, role: Role = "agent", password: str | None = None) -> Credential:
        """Add (or return the existing) identity and rewrite the broker files."""
        check_identity(username)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        creds = self.load()
        known = creds.get(username)
        if known is not None and known.role == role and self._acl_current(creds):
            # Nothing to write, so no lock: a read-only folder (compose mounts the
            # secrets read-only into the runner) still serves the identities it holds.
            return known
        with self._locked():
            creds = self.load()
            if username in creds:
                if creds[username].role != role:
                    raise ValueError(
                        f"{username!r} already exists with role {creds[username].role!r}"
                    )
                self._refresh_acl(creds)
                return creds[username]
            cred = Credential(username, password or secrets.token_urlsafe(18), role)
            creds[username] = cred
            self._write(creds)
            return cred

    def remove(self, username: str) -> None:
        with self._locked():
            creds = self.load()
            creds.pop(username, None)
            self._write(creds)

    def _acl_current(self, creds: dict[str, Credential]) -> bool:
        """Whether the ACL file holds this version's rules for ``creds``."""
        try:
            return self.acl_path.read_text() == render_acl(creds.values())
        except OSError:
            return False

    def _refresh_acl(self, creds: dict[str, Credential]) -> None:
        """Rewrite the ACL if this version's rules differ from the file's.

        A broker directory made by an older version keeps its identities but
        gets the current rules the next time anything adds one (every broker
        start and ``compose-init`` does), so narrowed rules take effect there.
        """
        if self._acl_current(creds):
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.acl_path, render_acl(creds.values()), mode=0o600)

    def _write(self, creds: dict[str, Credential]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        data = {u: {"password": c.password, "role": c.role} for u, c in sorted(creds.items())}
        _atomic_write(self.path, json.dumps(data, indent=1), mode=0o600)
        _atomic_write(
            self.passwd_path,
            "".join(f"{c.username}:{hash_password(c.password)}\n" for c in creds.values()),
            mode=0o600,
        )
        _atomic_write(self.acl_path, render_acl(creds.values()), mode=0o600)


def render_acl(creds: Iterable[Credential]) -> str:
    """Mosquitto's ACL file: a block per user and no ``pattern`` line (those apply to every user)."""
    lines = ["# generated by backroom from credentials.json: do not edit", ""]
    for c in sorted(creds, key=lambda c: c.username):
        lines += [f"user {c.username}", *rules_for(c), ""]
    return "\n".join(lines)


def _atomic_write(path: Path, text: str, mode: int) -> None:
    # Write-then-rename, so a broker reloading on SIGHUP never reads half a file; a
    # temporary file of its own, so no other writer renames it from under this one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp's files are 0600 already; fchmod is POSIX
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
