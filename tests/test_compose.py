"""compose/: the file is valid Compose, its services match the generated identities, and the
generated broker config really enforces the ACL (checked by starting Mosquitto with it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from backroom.bus import topics
from backroom.bus.broker import find_mosquitto, free_port
from backroom.bus.client import Bus, BusConfig, NotAuthorizedError
from backroom.runner.compose import compose_init

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())


def test_compose_file_is_valid_compose_spec() -> None:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(COMPOSE)  # the draft its $schema names
    assert (ROOT / "compose" / "Dockerfile").exists()


def test_services_match_generated_identities(tmp_path: Path) -> None:
    services = COMPOSE["services"]
    agent_ids = []
    for name, svc in services.items():
        command = svc.get("command", "")
        if not command.startswith("backroom"):
            continue
        env_file = svc["env_file"]
        identity = Path(env_file).stem
        if m := re.search(r"--id (\S+)", command):
            agent_ids.append(m.group(1))
            assert m.group(1) == identity == name  # each agent logs in as itself
        assert "--metrics-port 9100" in command
    compose_init(tmp_path, agent_ids)
    for svc in services.values():
        if "env_file" in svc:
            assert (tmp_path / Path(svc["env_file"]).relative_to("generated")).exists()
    targets = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())["scrape_configs"][
        0
    ]["static_configs"][0]["targets"]
    assert {t.split(":")[0] for t in targets} == {
        n for n, s in services.items() if s.get("command", "").startswith("backroom")
    }


async def test_generated_broker_config_enforces_the_acl(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    data.mkdir()
    compose_init(tmp_path, ["alice", "bob"], mount=str(tmp_path), port=port, data_dir=str(data))
    # Mosquitto started as root drops to its own user, as in the container: let it in.
    for p in [tmp_path, data, *tmp_path.parents][:6]:
        os.chmod(p, os.stat(p).st_mode | 0o755)
    os.chmod(data, 0o777)
    proc = subprocess.Popen(
        [find_mosquitto(), "-c", str(tmp_path / "mosquitto" / "mosquitto.conf")]
    )
    try:
        time.sleep(0.3)
        assert proc.poll() is None, "mosquitto refused the generated config"

        def env(name: str) -> BusConfig:
            values = dict(
                line.split("=", 1)
                for line in (tmp_path / "secrets" / f"{name}.env").read_text().split()
            )
            assert values["BACKROOM_BROKER"] == f"mqtt://mosquitto:{port}"
            return BusConfig(
                port=port,
                username=values["BACKROOM_USERNAME"],
                password=values["BACKROOM_PASSWORD"],
            )

        async with Bus(env("alice")) as alice:
            await alice.publish(topics.outbox("alice"), b"{}")
            with pytest.raises(NotAuthorizedError):
                await alice.publish(topics.outbox("bob"), b"{}")
        async with Bus(env("referee")) as ref:
            await ref.publish(topics.inbox("bob"), b"{}")
        await asyncio.sleep(0)
    finally:
        proc.terminate()
        proc.wait(5)
