"""Files for ``compose/docker-compose.yml``: broker config, passwords, ACL, one env file per service.

Generated, never hand-written, from the same code the local launcher uses, so
the containers enforce exactly the identities and ACL the tests check.
Layout under ``DIR`` (default ``compose/generated``):

* ``mosquitto/`` — ``mosquitto.conf``, ``passwd``, ``acl`` (mounted into the broker);
* ``secrets/`` — ``credentials.json`` and ``<identity>.env`` (mode 0600; the
  env files carry each service's username, password and broker URL).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from backroom.bus.auth import CredentialStore, Role
from backroom.bus.broker import mosquitto_config

SERVICES: list[tuple[str, Role]] = [
    ("referee", "referee"),
    ("runner", "runner"),
    ("trainer", "trainer"),
]


def compose_init(
    directory: str | Path,
    agents: list[str],
    mount: str = "/backroom",
    port: int = 1883,
    broker_host: str = "mosquitto",
    data_dir: str = "/mosquitto/data",
) -> list[Path]:
    """Write (or extend) the generated files; existing passwords are kept."""
    root = Path(directory)
    secrets = root / "secrets"
    store = CredentialStore(secrets)
    for name, role in SERVICES:
        store.add(name, role=role)
    for agent in agents:
        store.add(agent, role="agent")
    broker_dir = root / "mosquitto"
    broker_dir.mkdir(parents=True, exist_ok=True)
    for name in ("passwd", "acl"):
        # The broker container runs as its own user: these two must be readable
        # by it; they hold hashes and rules, not passwords.
        shutil.copyfile(secrets / name, broker_dir / name)
        os.chmod(broker_dir / name, 0o644)
    conf = broker_dir / "mosquitto.conf"
    conf.write_text(
        mosquitto_config(
            port=port,
            host="",
            passwd=f"{mount}/mosquitto/passwd",
            acl=f"{mount}/mosquitto/acl",
            data_dir=data_dir,
            log_dest="stdout",
        )
    )
    written = [conf, broker_dir / "passwd", broker_dir / "acl", store.path]
    for cred in store.load().values():
        env = secrets / f"{cred.username}.env"
        fd = os.open(env, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                f"BACKROOM_BROKER=mqtt://{broker_host}:{port}\n"
                f"BACKROOM_USERNAME={cred.username}\n"
                f"BACKROOM_PASSWORD={cred.password}\n"
            )
        written.append(env)
    return written
