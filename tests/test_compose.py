"""compose/: the file is valid Compose, its services match the generated identities, and the
generated broker config really enforces the ACL (checked by starting Mosquitto with it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from backroom.bus import topics
from backroom.bus.auth import CredentialStore
from backroom.bus.broker import find_mosquitto, free_port
from backroom.bus.client import Bus, BusConfig, NotAuthorizedError
from backroom.runner.compose import REFEREE_POOL, compose_init

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())


def test_compose_file_is_valid_compose_spec() -> None:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(COMPOSE)  # the draft its $schema names
    assert (ROOT / "compose" / "Dockerfile").exists()


GENERATED = "${BACKROOM_GENERATED:-./generated}/"
PROMETHEUS = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
DASHBOARD = json.loads((ROOT / "compose" / "grafana" / "dashboards" / "backroom.json").read_text())
PINNED = re.compile(r":v?\d+\.\d+\.\d+(-[a-z0-9.-]+)?$")


def test_services_match_generated_identities(tmp_path: Path) -> None:
    services = COMPOSE["services"]
    # compose-init (default agents) writes every env file the compose file names, also of
    # services in profiles: Compose reads them all, whichever profiles are on.
    compose_init(tmp_path, ["alice", "bob", "carol"])
    scraped = set()
    for name, svc in services.items():
        command = svc.get("command", "")
        if "env_file" in svc:
            env_files = svc["env_file"] if isinstance(svc["env_file"], list) else [svc["env_file"]]
            for env_file in env_files:
                assert env_file.startswith(GENERATED), env_file
                assert (tmp_path / env_file.removeprefix(GENERATED)).exists(), env_file
            if m := re.search(r"--id (\S+)", command):
                assert m.group(1) == Path(env_files[0]).stem == name  # each agent logs in as itself
        if "serve-model" in command or "api_key_env=BACKROOM_SERVE_KEY" in command:
            # serve-model beyond loopback needs a key; its clients send the same one
            assert any(f.endswith("/secrets/serve.env") for f in env_files), name
        if "--metrics-port 9100" in command:
            scraped.add(name)
            assert svc["environment"]["BACKROOM_METRICS_HOST"] == "0.0.0.0", name
    # Prometheus finds exactly the processes that serve metrics, by their service names.
    (job,) = [j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "backroom"]
    (dns,) = job["dns_sd_configs"]
    assert set(dns["names"]) == scraped and dns["port"] == 9100 and dns["type"] == "A"
    assert (tmp_path / "mosquitto" / "healthcheck.password").stat().st_mode & 0o777 == 0o600
    serve = tmp_path / "secrets" / "serve.env"
    key = serve.read_text()
    assert key.startswith("BACKROOM_SERVE_KEY=") and len(key.strip()) > 30
    assert serve.stat().st_mode & 0o777 == 0o600
    compose_init(tmp_path, ["alice"])
    assert serve.read_text() == key  # kept on re-init: running clients keep working


def test_services_are_healthchecked_ordered_pinned_and_bound() -> None:
    services = COMPOSE["services"]
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        for dep, how in deps.items():
            assert how == {"condition": "service_healthy"}, (name, dep)
            assert dep in services
        assert PINNED.search(svc["image"]), f"{name}: image {svc['image']} not pinned"
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    m = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M)
    assert m and PINNED.search(m.group(1).removesuffix("-slim-bookworm"))
    assert services["mosquitto"]["ports"] == ["${BACKROOM_MQTT_PORT:-1884}:1883"]
    for name, var, port in [
        ("web", "WEB", 8765),
        ("prometheus", "PROMETHEUS", 9090),
        ("grafana", "GRAFANA", 3000),
    ]:
        assert services[name]["ports"] == [
            f"${{BACKROOM_HTTP_BIND:-127.0.0.1}}:${{BACKROOM_{var}_PORT:-{port}}}:{port}"
        ]
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert not [p for p in published if "9100" in p]  # metrics stay on the compose network
    for name in ("model", "qwen-local"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert services[name]["profiles"] == ["gpu"]
    assert services["runner"]["profiles"] == ["run"]
    assert services["trainer"]["profiles"] == ["train"]
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and r[0] != "#"]
    assert rules[0] == "*" and "!backroom/" in rules  # secrets and runs never reach a build


def _metrics() -> dict[str, set[str]]:
    """Every sample name the package's metrics make (the llm agent's too), with its labels."""
    from prometheus_client import REGISTRY

    import backroom.agents.llm  # noqa: F401  (defines the backroom_llm_* metrics)

    found: dict[str, set[str]] = {}
    for collector, names in REGISTRY._collector_to_names.items():
        for name in names:
            found[name] = set(getattr(collector, "_labelnames", ()))
    return found


def test_dashboard_queries_real_metrics_and_labels() -> None:
    known = _metrics()
    panels = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert exprs and all(
        t["datasource"]["uid"] == "backroom-prometheus" for p in panels for t in p["targets"]
    )
    for expr in exprs:
        names = set(re.findall(r"\b((?:backroom|process)_[a-z_]+)", expr))
        assert names or expr.startswith("sum by (service) (up{"), expr
        allowed = {"le", "service", "instance", "job"}  # histograms' and Prometheus's own
        for name in names:
            assert name in known, f"{name} is no metric of backroom: {expr}"
            allowed |= known[name]
        for group in re.findall(r"by \(([^)]*)\)", expr) + re.findall(r"(\w+)=\"", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in allowed, f"{label} is no label of {names}: {expr}"
    text = " ".join(exprs)
    for wanted in [
        "backroom_matches_finished_total",
        "backroom_turn_latency_seconds_bucket",
        "backroom_invalid_inputs_total",
        "backroom_turn_timeouts_total",
        "backroom_reconnects_total",
        "backroom_bus_messages_total",
        "backroom_llm_prompt_tokens_total",
        "backroom_llm_completion_tokens_total",
        "backroom_llm_cost_usd_total",
        'backroom_agent_decisions_total{kind="local"}',
        "backroom_local_batch_rows",
        "backroom_train_step_seconds",
        'stat="tokens_per_second"',
        'stat="loss"',
        'stat="kl"',
        "backroom_train_reward",
        "backroom_train_eval_reward",
        "backroom_train_version_lag",
        "backroom_rating",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    ]:
        assert wanted in text, f"no panel shows {wanted}"


def test_grafana_provisioning_points_at_the_stack() -> None:
    prov = ROOT / "compose" / "grafana" / "provisioning"
    (ds,) = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert (ds["type"], ds["url"], ds["uid"]) == (
        "prometheus",
        "http://prometheus:9090",
        "backroom-prometheus",
    )
    (provider,) = yaml.safe_load((prov / "dashboards" / "backroom.yml").read_text())["providers"]
    grafana = COMPOSE["services"]["grafana"]
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./")
    )
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/backroom.json"
    assert DASHBOARD["uid"] == "backroom"


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
        # Mosquitto exits at once on a config it refuses, and listens once it has read it;
        # the logins below then need the password and ACL files it reads as it starts.
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, "mosquitto refused the generated config"
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"mosquitto does not listen on {port}"
                time.sleep(0.05)

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
            await alice.publish(topics.outbox("alice", "referee-1"), b"{}")
            with pytest.raises(NotAuthorizedError):
                await alice.publish(topics.outbox("bob", "referee-1"), b"{}")
        async with Bus(env("referee-1")) as ref:
            await ref.publish(topics.inbox("bob"), b"{}")
        await asyncio.sleep(0)
    finally:
        proc.terminate()
        proc.wait(5)


def test_the_referee_pool_shares_one_password_also_after_an_older_init(tmp_path: Path) -> None:
    """``--scale referee=N``: every name of the pool logs in with ``referees.env``'s password.
    A directory made before the pool (its ``referee-2`` with a password of its own) is
    brought in line, or a replica that drew that name would be refused at login."""
    store = CredentialStore(tmp_path / "secrets")
    store.add("referee-2", role="referee")  # as the old `referees` profile made it
    compose_init(tmp_path, ["alice"])
    env = dict(
        line.split("=", 1) for line in (tmp_path / "secrets/referees.env").read_text().split()
    )
    assert env["BACKROOM_USERNAME"] == "referee-{n}"
    creds = store.load()
    pool = [f"referee-{i}" for i in range(1, REFEREE_POOL + 1)]
    assert all(creds[n].role == "referee" for n in pool)
    assert {creds[n].password for n in pool} == {env["BACKROOM_PASSWORD"]}
    compose_init(tmp_path, ["alice"])  # again: nothing changes
    assert store.load()["referee-7"].password == env["BACKROOM_PASSWORD"]
