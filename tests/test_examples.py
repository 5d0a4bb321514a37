"""Every example config runs with scripted agents over the bus; games at full size stay bounded."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest

from backroom.analysis import analyze_run
from backroom.bus.broker import Broker
from backroom.runner.config import RunConfig, load_config
from backroom.runner.local import run_local

from .conftest import Runner, agents, stack

ROOT = Path(__file__).resolve().parent.parent
#: Training configs (``backroom train``) name an ``algorithm``; tests/test_trainer.py runs the trainer.
#: Configs with model players (``kind: model``) run, shortened, in tests/test_llm_examples.py.
EXAMPLES = sorted(
    p
    for p in (ROOT / "examples").glob("*.yaml")
    if "\nalgorithm:" not in p.read_text()
    and "kind: model" not in p.read_text()
    and "\nleague:" not in p.read_text()  # league configs: tests/test_league.py
)
#: openspiel_leduc: its CFR seat enumerates three-player Leduc (224k histories) on start.
LONG = {"bertrand_linear.yaml", "bertrand_logit.yaml", "openspiel_leduc.yaml"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in LONG else p for p in EXAMPLES],
    ids=[p.stem for p in EXAMPLES],
)
def test_example_config_runs_over_the_bus(path: Path, tmp_path: Path) -> None:
    config = load_config(path)
    result = asyncio.run(run_local(config, runs_dir=tmp_path))
    assert len(result.episodes) == config.matches
    assert all(e.reason == "normal" for e in result.episodes), [e.detail for e in result.episodes]
    measures = analyze_run(result.run_dir)
    assert config.game in measures["games"]


def beauty_config(processes: str) -> RunConfig:
    ids = [f"p{i:02d}" for i in range(24)]
    return RunConfig.model_validate(
        {
            "run": f"beauty24-{processes}",
            "game": "beauty_contest",
            "params": {"players": 24, "rule": "amplified", "discussion": True},
            "matches": 1,
            "turn_timeout_s": 20,
            "agent_processes": processes,
            "agents": [
                {"id": a, "kind": "level-k", "options": {"k": i % 4}} for i, a in enumerate(ids)
            ],
            "channels": [{"name": "table", "members": ids, "opens": "game", "max_messages": 2}],
        }
    )


@pytest.mark.parametrize("processes", [pytest.param("separate", marks=pytest.mark.slow), "single"])
def test_24_player_beauty_contest_with_discussion(processes: str, tmp_path: Path) -> None:
    result = asyncio.run(run_local(beauty_config(processes), runs_dir=tmp_path))
    (ep,) = result.episodes
    assert ep.reason == "normal" and not ep.timeouts
    talks = [a for a in ep.actions if a.phase == "talk"]
    choices = [a for a in ep.actions if a.phase == "act"]
    assert len(talks) == 48 and len(choices) == 24  # two turns each, then one choice each
    assert len({a.agent for a in choices}) == 24
    # every spoken message reached the 23 other players
    spoken = [a for a in talks if a.action]
    assert len(ep.deliveries) == 23 * len(spoken)


@pytest.mark.slow  # 40 s on 2 busy cores: the default suite stays under 15 minutes
async def test_800_round_bertrand_referee_memory_stays_flat(broker: Broker, tmp_path: Path) -> None:
    """Over the bus, the referee's memory grows only by the episode record, not per round beyond it."""
    from backroom.bus.wire import MatchSpec

    players = agents(("f1", "nash-pricer"), ("f2", "undercutter"))
    async with stack(broker, tmp_path / "runs", players) as (ref, _), Runner(broker) as run:
        spec = MatchSpec(
            game="bertrand",
            params={"demand": "linear", "rounds": 800},
            seats=["f1", "f2"],
            run="mem",
        )
        tracemalloc.start()
        await run.submit("b800", spec)
        sizes: dict[int, int] = {}
        while "b800" not in run.episodes:
            match = ref.matches.get("b800")
            if match is not None:
                rounds = len(match.actions) // 2
                for mark in (200, 700):
                    if rounds >= mark and mark not in sizes:
                        sizes[mark] = tracemalloc.get_traced_memory()[0]
            await asyncio.sleep(0.05)
        tracemalloc.stop()
        (ep,) = await run.wait(["b800"], timeout=120)
    assert ep.reason == "normal" and len(ep.round_rewards) == 800
    per_round = (sizes[700] - sizes[200]) / 500
    # Two action records and a few floats of history per round cost ~1.5 KB; a
    # per-round copy of the growing observation would cost tens of KB.
    assert per_round < 4096, per_round
