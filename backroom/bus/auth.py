"""Identities and what each may do: the broker's password file and ACL, generated.

Identity is the MQTT username (agent id = username). The ACL is written with
``%u`` patterns so an agent can read only its own inbox and write only its own
outbox, status and traces — whatever its code does. Service roles (referee,
runner, trainer) get explicit per-user rules.

The files use Mosquitto's syntax (the only Mosquitto-specific thing DESIGN.md
allows) and are always generated from ``credentials.json``, never hand-edited.
Passwords are hashed as ``mosquitto_passwd`` does (PBKDF2-SHA512, ``$7$``), in
Python, so no extra binary is needed to add an identity.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from backroom.bus.topics import PREFIX, SHARE_GROUP

Role = Literal["agent", "referee", "runner", "trainer", "observer"]
ROLES: tuple[Role, ...] = ("agent", "referee", "runner", "trainer", "observer")
ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: What each service role may touch, beyond what every identity may read.
ROLE_RULES: dict[Role, list[str]] = {
    "agent": [],
    "referee": [
        f"topic readwrite {PREFIX}/#",
        f"topic read $share/{SHARE_GROUP}/{PREFIX}/control/matches",
    ],
    "runner": [
        f"topic write {PREFIX}/control/matches",
        f"topic read {PREFIX}/episodes/#",
        f"topic read {PREFIX}/traces/#",
        f"topic read {PREFIX}/agents/+/status",
    ],
    "trainer": [
        f"topic write {PREFIX}/control/matches",
        f"topic read {PREFIX}/episodes/#",
        f"topic read {PREFIX}/traces/#",
        f"topic readwrite {PREFIX}/models/+/checkpoint",
    ],
    "observer": [f"topic read {PREFIX}/episodes/#", f"topic read {PREFIX}/agents/+/status"],
}

#: Rules for every identity; ``%u`` is the username (the agent id).
PATTERNS = [
    f"pattern read {PREFIX}/agents/%u/inbox",
    f"pattern write {PREFIX}/agents/%u/outbox",
    f"pattern readwrite {PREFIX}/agents/%u/status",
    f"pattern write {PREFIX}/traces/%u",
]
#: What every identity may read; written into each user's block (a Mosquitto
#: pattern without %u draws a warning, and top-level topic lines apply only to
#: anonymous clients).
EVERYONE_READS = [
    f"topic read {PREFIX}/agents/+/status",
    f"topic read {PREFIX}/matches/+/public",
    f"topic read {PREFIX}/models/+/checkpoint",
]


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

    def add(self, username: str, role: Role = "agent", password: str | None = None) -> Credential:
        """Add (or return the existing) identity and rewrite the broker files."""
        check_identity(username)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        creds = self.load()
        if username in creds:
            if creds[username].role != role:
                raise ValueError(f"{username!r} already exists with role {creds[username].role!r}")
            return creds[username]
        cred = Credential(username, password or secrets.token_urlsafe(18), role)
        creds[username] = cred
        self._write(creds)
        return cred

    def remove(self, username: str) -> None:
        creds = self.load()
        creds.pop(username, None)
        self._write(creds)

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
    lines = ["# generated by backroom from credentials.json: do not edit", *PATTERNS, ""]
    for c in sorted(creds, key=lambda c: c.username):
        lines += [f"user {c.username}", *EVERYONE_READS, *ROLE_RULES[c.role], ""]
    return "\n".join(lines)


def _atomic_write(path: Path, text: str, mode: int) -> None:
    # Write-then-rename, so a broker reloading on SIGHUP never reads half a file.
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
