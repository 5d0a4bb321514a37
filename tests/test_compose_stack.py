"""compose/ for real (slow): the stack users run comes up healthy, plays, and Prometheus sees it.

Needs a Docker engine: when none answers, the test starts Debian's ``dockerd``
(``.ci/run`` installs docker.io, docker-compose and debootstrap) and stops it
at the end. Either ``docker compose`` (v2) or ``docker-compose`` 1.29 drives it.

Public images cannot be pulled in CI, so every pinned image that is neither
present nor pullable is replaced by a stand-in of the same name, built from
Debian packages: a debootstrap base (cached in ``~/.cache/backroom-test``,
``$BACKROOM_TEST_CACHE``), with Debian's python3 (and this host's CA bundle,
for pip), mosquitto or prometheus on it. Grafana, which Debian does not
package, is replaced by a stand-in that checks the provisioning files where
Grafana reads them (tests/data/compose_stack/grafana_standin.py); every
dashboard expression is then run against the stack's real Prometheus.

``compose/docker-compose.yml`` and ``compose/prometheus.yml`` are used as
users run them. The override file adds only what stands in for GPU work:
``fakeai``, an OpenAI-compatible endpoint answering as ``model`` (serve-model)
does, so the ``qwen`` llm agent plays for real; and ``trainer`` runs a
stand-in that exports training steps through the trainer loop's own code and
counts local-agent decisions (both need torch). The test itself joins as
``mallory`` from the host, through the published MQTT port, like an agent on
another machine: it sends a malformed message and never answers its turns.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.bus import topics
from backroom.bus.broker import free_port
from backroom.bus.wire import Status, dump, parse
from backroom.runner.compose import compose_init

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DATA = ROOT / "tests" / "data" / "compose_stack"
CACHE = Path(os.environ.get("BACKROOM_TEST_CACHE", Path.home() / ".cache" / "backroom-test"))
MIRROR = os.environ.get("BACKROOM_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: What the stand-ins need from Debian, all in one base image (one layer shared by all).
BASE_PACKAGES = [
    "ca-certificates",
    "python3",
    "python3-venv",
    "python-is-python3",
    "python3-yaml",
    "mosquitto",
    "mosquitto-clients",
    "prometheus",
    "wget",
]
#: Grafana's placeholders, as the test substitutes them (windows long enough for the whole test).
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "15s", "$__range": "10m"}
#: Play a config with the runner service, as the docs say (--use-aliases: Prometheus finds it).
RUNNER = ["--profile", "run", "run", "--rm", "-T", "--use-aliases", "runner"]
#: Every profile of the compose file.
PROFILES = sorted(
    {
        p
        for s in yaml.safe_load(COMPOSE_FILE.read_text())["services"].values()
        for p in s.get("profiles", [])
    }
)
#: Backroom services of the default set, which must come up healthy.
DEFAULT_SERVICES = ["mosquitto", "referee", "alice", "bob", "carol", "web", "prometheus", "grafana"]


def sh(
    cmd: list[str], *, timeout: float = 600, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def docker() -> Iterator[None]:
    """A Docker engine: the one that runs, or Debian's dockerd started here (and stopped after)."""
    if docker_answers():
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0 or shutil.which("docker") is None:
        pytest.skip("no Docker engine, and none to start (CI installs docker.io as root)")
    CACHE.mkdir(parents=True, exist_ok=True)
    log = (CACHE / "dockerd.log").open("ab")
    proc = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not docker_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd did not start; see {CACHE / 'dockerd.log'}")
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither `docker compose` nor `docker-compose` is installed")


# --- images: present, pulled, or a stand-in of the same name -----------------------------


def pinned_images() -> dict[str, str]:
    """Stand-in kind -> the image the compose file (and its Dockerfile) pins."""
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    images = {name: svc["image"] for name, svc in services.items() if "build" not in svc}
    by_kind = {
        "mosquitto": images["mosquitto"],
        "prometheus": images["prometheus"],
        "grafana": images["grafana"],
    }
    m = re.search(r"^ARG PYTHON_IMAGE=(\S+)", (COMPOSE_DIR / "Dockerfile").read_text(), re.M)
    assert m, "compose/Dockerfile pins its python image in ARG PYTHON_IMAGE"
    by_kind["python"] = m.group(1)
    for kind, image in by_kind.items():
        assert re.search(r":v?\d+\.\d+\.\d+", image), f"{kind} image {image} is not pinned"
    return by_kind


def image_present(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def base_image() -> str:
    """The debootstrap base, imported from a cached tarball (made once: a few minutes)."""
    key = hashlib.sha256(f"bookworm {MIRROR} {sorted(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    tag = f"backroom-test/debian-base:{key}"
    if image_present(tag):
        return tag
    tar = CACHE / f"debian-base-{key}.tar"
    if not tar.exists():
        if os.geteuid() != 0 or shutil.which("debootstrap") is None:
            pytest.skip("stand-in images need debootstrap, as root")
        rootfs = CACHE / f"rootfs-{key}"
        shutil.rmtree(rootfs, ignore_errors=True)
        sh(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                MIRROR,
            ],
            timeout=1200,
        )
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        sh(["tar", "-C", str(rootfs), "-cf", f"{tar}.tmp", "."], timeout=600)
        os.replace(f"{tar}.tmp", tar)
        shutil.rmtree(rootfs)
    sh(["docker", "import", str(tar), tag], timeout=600)
    return tag


def ensure_images(work: Path) -> list[str]:
    """Make every pinned image available; return those replaced by a stand-in."""
    replaced = []
    for kind, image in pinned_images().items():
        if image_present(image):
            continue
        if (
            subprocess.run(["docker", "pull", image], capture_output=True, timeout=600).returncode
            == 0
        ):
            continue
        ctx = work / f"standin-{kind}"
        shutil.copytree(DATA, ctx)
        host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
        (ctx / "host-ca.crt").write_bytes(host_ca.read_bytes() if host_ca.exists() else b"")
        sh(
            [
                "docker",
                "build",
                "-q",
                "-f",
                str(ctx / f"{kind}.Dockerfile"),
                "--build-arg",
                f"BASE={base_image()}",
                "-t",
                image,
                str(ctx),
            ]
        )
        replaced.append(image)
    return replaced


# --- the stack -----------------------------------------------------------------------------

OVERRIDE = """
services:
  fakeai:  # serve-model's place: the `qwen` llm agent asks it at http://model:8000/v1
    image: backroom:0.1.0
    command: python /test-data/fake_openai.py
    volumes: ["${BACKROOM_TEST_DATA}:/test-data:ro"]
    networks:
      default:
        aliases: [model]
    healthcheck:
      test: ["CMD", "python", "-m", "backroom.health", "-q", "--url", "http://127.0.0.1:8000/health"]
      interval: 2s
      retries: 30
  trainer:  # the trainer needs torch: a stand-in exports steps through the trainer's own code
    image: backroom:0.1.0
    build: {target: base}
    command: python /test-data/trainer_standin.py
    volumes: ["${BACKROOM_TEST_DATA}:/test-data:ro"]
"""

EXTRA_RUN = """
# qwen (an llm agent, through fakeai) against mallory (the test, which never answers)
run: compose-extra
game: kuhn
matches: 3
seed: 0
concurrency: 3
turn_timeout_s: 1
agents:
  - {id: qwen, kind: external}
  - {id: mallory, kind: external}
seats: [qwen, mallory]
"""


class Stack:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.project = f"brtest{os.getpid()}"
        self.ports = {name: free_port() for name in ("MQTT", "WEB", "PROMETHEUS", "GRAFANA")}
        self.env = {
            **os.environ,
            "BACKROOM_GENERATED": str(work / "generated"),
            "BACKROOM_RUNS": str(work / "runs"),
            "BACKROOM_CONFIGS": str(work / "configs"),
            "BACKROOM_TEST_DATA": str(DATA),
            "BACKROOM_MODEL_NAME": "fake",
            "BACKROOM_MODEL_PRICE_IN": "0.5",
            "BACKROOM_MODEL_PRICE_OUT": "1.5",
            **{f"BACKROOM_{name}_PORT": str(port) for name, port in self.ports.items()},
        }
        (work / "override.yml").write_text(OVERRIDE)
        self.base = [
            *compose_command(),
            "-p",
            self.project,
            "-f",
            str(COMPOSE_FILE),
            "-f",
            str(work / "override.yml"),
        ]

    def compose(self, *args: str, timeout: float = 600, check: bool = True, **env: str) -> str:
        out = sh([*self.base, *args], timeout=timeout, check=check, env={**self.env, **env})
        return out.stdout + out.stderr

    def containers(self) -> list[dict[str, Any]]:
        ids = sh(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"]
        ).stdout.split()
        return json.loads(sh(["docker", "inspect", *ids]).stdout) if ids else []

    def wait_healthy(self, services: list[str], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state: dict[str, list[str]] = {s: [] for s in services}
            for c in self.containers():
                svc = c["Config"]["Labels"].get("com.docker.compose.service")
                oneoff = c["Config"]["Labels"].get("com.docker.compose.oneoff") == "True"
                if svc in state and not oneoff:
                    health = (c["State"].get("Health") or {}).get("Status", "none")
                    state[svc].append(health if c["State"]["Running"] else c["State"]["Status"])
            if all(v and all(h == "healthy" for h in v) for v in state.values()):
                return
            broken = {s: v for s, v in state.items() if any(h in ("exited", "dead") for h in v)}
            if broken or time.monotonic() > deadline:
                logs = self.compose("logs", "--tail", "30", *services, check=False)
                raise AssertionError(f"not healthy: {state}\n{logs[-6000:]}")
            time.sleep(2)

    def http(self, port_name: str, path: str) -> Any:
        url = f"http://127.0.0.1:{self.ports[port_name]}{path}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def promql(self, expr: str) -> list[dict[str, Any]]:
        reply = self.http("PROMETHEUS", "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert reply["status"] == "success", reply
        return list(reply["data"]["result"])


def can_log_in(stack: Stack, identity: str, timeout_s: float = 10) -> bool:
    """Whether ``identity`` logs in through the published MQTT port (retried: a reload takes a moment)."""
    import paho.mqtt.client as mqtt

    creds = json.loads((stack.work / "generated/secrets/credentials.json").read_text())
    deadline = time.monotonic() + timeout_s
    while True:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, identity, protocol=mqtt.MQTTv5)
        client.username_pw_set(identity, creds[identity]["password"])
        try:
            if client.connect("127.0.0.1", stack.ports["MQTT"]) == mqtt.MQTT_ERR_SUCCESS:
                client.loop_start()
                for _ in range(50):
                    if client.is_connected():
                        return True
                    time.sleep(0.05)
        except OSError:
            pass
        finally:
            client.loop_stop()
            client.disconnect()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


@contextlib.contextmanager
def mallory(stack: Stack) -> Iterator[threading.Event]:
    """An agent on "another machine": in from the host through the published MQTT port.

    Once a referee seats her (her first inbox message), she sends a payload that is
    not JSON: the referee refuses it, answers with an error and counts it. Before
    she is seated no referee reads her outbox (``referee/outboxes.py``). The event
    says it went out.
    """
    import paho.mqtt.client as mqtt

    creds = json.loads((stack.work / "generated/secrets/credentials.json").read_text())
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "mallory", protocol=mqtt.MQTTv5)
    client.username_pw_set("mallory", creds["mallory"]["password"])
    sent = threading.Event()

    def on_message(c: mqtt.Client, _userdata: object, msg: mqtt.MQTTMessage) -> None:
        if not sent.is_set():
            sent.set()
            # to the outbox of the referee that seated her (its MatchStart names it)
            referee = getattr(parse(msg.payload), "referee", None)
            c.publish(topics.outbox("mallory", referee), b"{not json", qos=1)

    client.on_message = on_message
    client.connect("127.0.0.1", stack.ports["MQTT"])
    client.loop_start()
    try:
        client.subscribe(topics.inbox("mallory"), qos=1)
        online = dump(Status(state="online", kind="random"))
        client.publish(topics.status("mallory"), online, qos=1, retain=True).wait_for_publish(10)
        yield sent
    finally:
        offline = dump(Status(state="offline", kind="random"))
        client.publish(topics.status("mallory"), offline, qos=1, retain=True).wait_for_publish(10)
        client.loop_stop()
        client.disconnect()


def dashboard_expressions() -> list[tuple[str, str]]:
    dash = json.loads((COMPOSE_DIR / "grafana/dashboards/backroom.json").read_text())
    found = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            found.append((panel["title"], expr))
    return found


def test_compose_stack_comes_up_plays_and_is_observed(docker: None, tmp_path: Path) -> None:
    t0 = time.monotonic()
    replaced = ensure_images(tmp_path)
    print(f"stand-ins: {replaced or 'none'} ({time.monotonic() - t0:.0f}s)")
    compose_init(tmp_path / "generated", ["alice", "bob", "carol"])
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/extra.yaml").write_text(EXTRA_RUN)
    (tmp_path / "runs").mkdir()
    stack = Stack(tmp_path)
    stack.compose("config", "-q")
    try:
        stack.compose("build", "referee", timeout=1200)
        print(f"built ({time.monotonic() - t0:.0f}s)")
        stack.compose("up", "-d", "--no-build")
        stack.wait_healthy([*DEFAULT_SERVICES, "fakeai"])
        # The gpu profile's llm agent (its model is fakeai) and the trainer's stand-in.
        stack.compose("up", "-d", "--no-build", "--no-deps", "qwen", "trainer")
        stack.wait_healthy(["qwen", "trainer"])
        print(f"healthy ({time.monotonic() - t0:.0f}s)")

        # Published as the docs say: MQTT on every interface, the web pages on loopback.
        bindings = {
            c["Config"]["Labels"]["com.docker.compose.service"]: c["HostConfig"]["PortBindings"]
            for c in stack.containers()
        }
        assert bindings["mosquitto"]["1883/tcp"][0]["HostIp"] in ("", "0.0.0.0")
        for svc, port in [("web", 8765), ("prometheus", 9090), ("grafana", 3000)]:
            assert bindings[svc][f"{port}/tcp"][0]["HostIp"] == "127.0.0.1", bindings[svc]
        assert not any("9100/tcp" in (b or {}) for b in bindings.values())  # metrics stay inside
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['WEB']}/healthz", timeout=10):
            pass
        assert "backroom" in {d["uid"] for d in stack.http("GRAFANA", "/api/search?type=dash-db")}

        # A second referee: the service scaled, each replica with a name of the pool of its own.
        stack.compose("up", "-d", "--no-build", "--no-deps", "--scale", "referee=2", "referee")
        stack.wait_healthy(["referee"])
        replicas = [
            c
            for c in stack.containers()
            if c["Config"]["Labels"].get("com.docker.compose.service") == "referee"
        ]
        assert len(replicas) == 2, replicas

        # A few matches first: Prometheus sees a counter rise only from its second sample, so
        # the series the demo fills must exist before it (rates over a run that starts and
        # ends between two scrapes would be 0, and latency quantiles NaN).
        out = stack.compose(*RUNNER, BACKROOM_RUN_ARGS="--matches 5")
        assert "5 matches of kuhn" in out, out
        time.sleep(6)

        # An agent from another machine, added as docs/operations.md says, to the running broker.
        secrets = str(tmp_path / "generated/secrets")
        cli = [sys.executable, "-m", "backroom"]
        sh([*cli, "credentials", "add", "mallory", "--dir", secrets, "--no-reload"])
        sh([*cli, "compose-init", "--dir", str(tmp_path / "generated")])
        stack.compose("kill", "-s", "SIGHUP", "mosquitto")
        assert can_log_in(stack, "mallory"), "the broker did not reread its password file"

        # Every process reconnects after a broker restart (and counts it).
        stack.compose("restart", "mosquitto")
        stack.wait_healthy(["mosquitto", "referee", "alice", "bob", "carol", "qwen"])

        with mallory(stack) as misbehaved:
            out = stack.compose(*RUNNER)
            assert "200 matches of kuhn" in out, out
            out = stack.compose(*RUNNER, BACKROOM_RUN_CONFIG="/configs/extra.yaml")
            assert "3 matches of kuhn" in out, out
            assert misbehaved.is_set(), "mallory was never seated"
        # A league among the agent services (examples/league_compose.yaml): it holds after its
        # matches, so its rating gauges stay served for Prometheus and the dashboard's panel.
        league = COMPOSE_DIR.parent / "examples" / "league_compose.yaml"
        (tmp_path / "configs/league_compose.yaml").write_text(league.read_text())
        stack.compose("--profile", "league", "up", "-d", "--no-build", "--no-deps", "league")
        deadline = time.monotonic() + 300
        while "matches counted this session" not in (
            logs := stack.compose("--profile", "league", "logs", "league")
        ):
            assert time.monotonic() < deadline, logs[-3000:]
            time.sleep(3)
        assert "60 matches counted this session" in logs, logs[-3000:]
        print(f"played ({time.monotonic() - t0:.0f}s)")
        # The referee wrote the demo's episodes into the runs directory on the host.
        episodes = (tmp_path / "runs/demo/latest/episodes.jsonl").read_text().splitlines()
        assert len(episodes) == 200

        # Prometheus: every backroom target it finds is up (the runner's leaves with it).
        deadline = time.monotonic() + 60
        while True:
            targets = stack.http("PROMETHEUS", "/api/v1/targets?state=active")["data"]
            ours = [t for t in targets["activeTargets"] if t["labels"]["job"] == "backroom"]
            services = {t["labels"]["service"] for t in ours}
            if (
                all(t["health"] == "up" for t in ours)
                and {"referee", "alice", "bob", "carol", "qwen", "trainer", "league"} <= services
            ) or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert all(t["health"] == "up" for t in ours), [
            (t["labels"], t["health"], t.get("lastError")) for t in ours
        ]
        assert {"referee", "alice", "bob", "carol", "qwen", "trainer"} <= services, services
        time.sleep(6)  # a scrape after the last match
        finished = stack.promql('sum(backroom_matches_finished_total{game="kuhn"})')
        assert finished and float(finished[0]["value"][1]) >= 208, finished
        # Both referees took a share of the requests (one target per replica).
        shares = stack.promql(
            'sum by (instance) (backroom_matches_finished_total{service="referee"})'
        )
        assert len([r for r in shares if float(r["value"][1]) > 0]) == 2, shares

        # Every dashboard expression returns data (a finite number somewhere). A rate needs
        # two scrapes of a series: those born in the last match may take a few seconds.
        deadline = time.monotonic() + 45
        while True:
            empty = []
            for title, expr in dashboard_expressions():
                result = stack.promql(expr)
                if not any(math.isfinite(float(r["value"][1])) for r in result):
                    empty.append((title, expr, result))
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert not empty, "dashboard expressions without data:\n" + "\n".join(map(str, empty))
        print(f"checked ({time.monotonic() - t0:.0f}s)")
    except BaseException:
        print(stack.compose("ps", check=False))
        print(stack.compose("logs", "--tail", "40", check=False)[-20000:])
        raise
    finally:
        if os.environ.get("BACKROOM_TEST_KEEP_STACK"):  # to look around: down -v it yourself
            print(f"kept: {' '.join(stack.base)} (environment: {stack.work})")
        else:
            # Every profile: `docker compose down` (v2) leaves out services of profiles that are off.
            profiles = [a for p in PROFILES for a in ("--profile", p)]
            stack.compose(
                *profiles, "down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300
            )
