"""Files for ``compose/docker-compose.yml``: broker config, passwords, ACL, one env file per service.

Generated, never hand-written, from the same code the local launcher uses, so
the containers enforce exactly the identities and ACL the tests check.
Layout under ``DIR`` (default ``compose/generated``):

* ``mosquitto/`` — ``mosquitto.conf``, ``passwd``, ``acl`` (mounted into the broker)
  and ``healthcheck.password`` (mode 0600): the password of ``healthcheck``, an
  observer identity the broker's container healthcheck logs in with;
* ``secrets/`` — ``credentials.json`` and ``<identity>.env`` (mode 0600; the
  env files carry each service's username, password and broker URL), and
  ``serve.env``, the API key of the ``gpu`` profile's ``serve-model``.

Every identity a service of the compose file logs in as is created here, also
those of services in profiles (``gpu``: ``qwen``, ``qwen-local``), because
Compose reads a service's ``env_file`` even when its profile is off.

The ``referee`` service scales (``docker compose up --scale referee=4``): its
replicas share one env file, ``referees.env``, whose username is the pattern
``referee-{n}`` and whose password is that of every name of the pool,
``referee-1`` to ``referee-{REFEREE_POOL}``; each replica takes a name no other
one holds (``backroom referee``, ``referee.pool.claim_pooled``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from backroom.bus.auth import CredentialStore, Role
from backroom.bus.broker import mosquitto_config

#: Names of the referee pool: at most this many replicas of the ``referee`` service.
REFEREE_POOL = 16
#: The username pattern the ``referee`` service's replicas share.
REFEREE_PATTERN = "referee-{n}"

SERVICES: list[tuple[str, Role]] = [
    ("runner", "runner"),
    ("trainer", "trainer"),
    ("web-observer", "observer"),  # the web front end's spectating identity
    ("healthcheck", "observer"),  # the broker's healthcheck: may only read
    ("qwen", "agent"),  # the `gpu` profile's agents
    ("qwen-local", "agent"),
]
#: The identity the broker container's healthcheck logs in with (an observer: it reads, never writes).
HEALTHCHECK = "healthcheck"


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
    known = store.load()
    pool = [REFEREE_PATTERN.replace("{n}", str(i)) for i in range(1, REFEREE_POOL + 1)]
    shared = known[pool[0]].password if pool[0] in known else secrets_token()
    for name in pool:
        if name in known and known[name].password != shared:
            store.remove(name)  # made before the pool (compose's old `referees` profile)
        store.add(name, role="referee", password=shared)
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
    # Read by the healthcheck, which runs as root in the broker's container.
    health = broker_dir / "healthcheck.password"
    fd = os.open(health, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(store.get(HEALTHCHECK).password)
    written = [conf, broker_dir / "passwd", broker_dir / "acl", health, store.path]
    url = f"mqtt://{broker_host}:{port}"
    for cred in store.load().values():
        written.append(
            _write_env(secrets / f"{cred.username}.env", url, cred.username, cred.password)
        )
    # The referee service's replicas share one: the pool's pattern and password.
    written.append(_write_env(secrets / "referees.env", url, REFEREE_PATTERN, shared))
    # serve-model refuses to listen beyond loopback without an API key: the `gpu`
    # profile's server and the agents that use it share this one (kept on re-init).
    serve = secrets / "serve.env"
    if not serve.exists():
        fd = os.open(serve, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"BACKROOM_SERVE_KEY={secrets_token()}\n")
    written.append(serve)
    return written


def _write_env(path: Path, url: str, username: str, password: str) -> Path:
    """A service's env file (mode 0600): broker URL, username, password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            f"BACKROOM_BROKER={url}\nBACKROOM_USERNAME={username}\nBACKROOM_PASSWORD={password}\n"
        )
    return path


def secrets_token() -> str:
    import secrets

    return secrets.token_urlsafe(24)
