"""What a user does from the README: add an agent of their own to a running stack; scrape metrics."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from backroom.agents.runtime import AgentRunner
from backroom.bus import topics
from backroom.bus.broker import Broker, free_port
from backroom.bus.wire import Error
from backroom.referee.episodes import read_episodes

from .conftest import RawAgent, agents, identity, stack
from .test_referee import Runner, loki_spec

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
    broker = subprocess.Popen([PY, "-m", "backroom", "broker", "--dir", str(bdir), "--port", str(port)])
    procs = [broker]
    try:
        wait_port(port)
        # a new identity while the broker runs (files rewritten + SIGHUP)
        add = subprocess.run(
            [PY, "-m", "backroom", "credentials", "add", "dora", "--dir", str(bdir)],
            capture_output=True, text=True, check=True,
        )
        password = add.stdout.strip()
        assert len(password) >= 16
        env = {**os.environ, "BACKROOM_BROKER": f"mqtt://127.0.0.1:{port}", "BACKROOM_PASSWORD": password}
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
            [PY, "-m", "backroom", "run", str(config), "--broker", f"mqtt://127.0.0.1:{port}",
             "--credentials", str(bdir), "--runs-dir", str(tmp_path / "runs")],
            capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "dora" in run.stdout and "normal: 10" in run.stdout
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
    eps = list(read_episodes(tmp_path / "runs" / "dora"))
    assert len(eps) == 10
    dora_moves = [a for e in eps for a in e["actions"] if a["agent"] == "dora"]
    assert dora_moves and not any(a["timed_out"] for a in dora_moves)
    assert any(d["text"].startswith("my card is") and d["from_seat"] == 0 for e in eps for d in e["deliveries"])


async def test_referee_process_serves_prometheus_metrics(broker: Broker, tmp_path: Path) -> None:
    mport = free_port()
    ref = identity(broker, "referee", "referee")
    env = {**os.environ, "BACKROOM_BROKER": f"mqtt://127.0.0.1:{broker.port}",
           "BACKROOM_USERNAME": "referee", "BACKROOM_PASSWORD": ref.password or ""}
    proc = subprocess.Popen(
        [PY, "-m", "backroom", "referee", "--runs-dir", str(tmp_path / "runs"), "--metrics-port", str(mport)], env=env
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
                await r.__aenter__()
            while not all(online(p.id) for p in players):
                await asyncio.sleep(0.05)
            ids = [f"x{i}" for i in range(5)]
            for i, m in enumerate(ids):
                await run.submit(m, loki_spec(["a", "b", "c"], seed=i, channels=[]))
            eps = await run.wait(ids)
            await mal.send(b"not json")
            await mal.next_of(Error)
        for r in runners:
            await r.__aexit__(None, None, None)
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{mport}/metrics")).text
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
                Trace(match=turn.match, agent=self.id, turn=turn.turn, phase="act",
                      request={"prompt": turn.prompt}, reply={"text": "call"})
            )
            names = turn.legal["names"]
            return "call" if "call" in names else names[0]

    players = [Traced("t0"), Traced("t1"), Traced("t2")]
    config = RunConfig.model_validate(
        {"run": "traced", "game": "kuhn", "params": {"variant": "loki"}, "matches": 4,
         "agents": [{"id": p.id, "kind": "external"} for p in players]}
    )
    async with stack(broker, tmp_path / "runs", players):
        path = tmp_path / "traces.jsonl"
        eps = await run_matches(config, identity(broker, "runner", "runner"), [], traces_path=path)
    traces = [json.loads(line) for line in path.read_text().splitlines()]
    acts = [(e.match, a.turn) for e in eps for a in e.actions if a.phase == "act"]
    assert sorted((t["match"], t["turn"]) for t in traces) == sorted(acts)
    assert all("Kuhn Poker" in t["request"]["prompt"] for t in traces)
