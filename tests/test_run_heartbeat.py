"""A slow run says how it goes (issue 40 item 2) and when its turns cannot fit (item 1).

An LLM config played for 7 minutes showing only a stale "still waiting for
alice, bob" while they played, and timed out 11 of its first 17 matches with
nothing said about ``concurrency`` x a decision's time against
``turn_timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from backroom.agents.base import Agent
from backroom.bus.broker import Broker
from backroom.bus.wire import JSON, Turn
from backroom.cli.run import demo_config
from backroom.runner import heartbeat
from backroom.runner.config import RunConfig, parse_config
from backroom.runner.heartbeat import Heartbeat
from backroom.runner.local import run_matches
from tests.conftest import agents, eventually, identity, load_factor, stack


def _config(run: str, **fields: object) -> RunConfig:
    data = demo_config().model_dump()
    data.update(run=run, **fields)
    return parse_config(data, source="test")


class Slow(Agent):
    """Checks every legal move for a while before it calls: a decision takes ``delay_s``."""

    def __init__(self, agent_id: str, delay_s: float) -> None:
        super().__init__(agent_id)
        self.delay_s = delay_s

    async def act(self, turn: Turn) -> JSON:
        await asyncio.sleep(self.delay_s)
        legal = turn.legal.get("choices") if isinstance(turn.legal, dict) else None
        return legal[0] if isinstance(legal, list) and legal else "call"


def test_turns_that_cannot_fit_their_budget_are_said_once() -> None:
    """20 in flight, 20 decisions in 50 s: 2.5 s each, a turn about 50 s, over a 30 s budget."""
    config = _config("budget", matches=300, concurrency=20, turn_timeout_s=30.0)
    notices: list[str] = []
    beat = Heartbeat(config, notices.append, lambda: 20, list, started=time.monotonic() - 50)
    beat.check()
    beat.check()
    assert len(notices) == 1
    assert notices[0].startswith(
        "turns will time out: about 50 s a turn (20 matches in flight x 2.5 s a decision, "
        "measured over the first 20), over turn_timeout_s 30;"
    )
    assert "--set concurrency=N" in notices[0]


def test_turns_that_fit_say_nothing_and_unmeasured_ones_wait() -> None:
    config = _config("fits", matches=300, concurrency=4, turn_timeout_s=30.0)
    notices: list[str] = []
    few = Heartbeat(config, notices.append, lambda: 2, list, started=time.monotonic() - 5)
    few.check()  # 2 decisions of 4 matches in flight: not measured yet
    assert not few.warned
    fits = Heartbeat(config, notices.append, lambda: 40, list, started=time.monotonic() - 40)
    fits.check()  # 4 x 1 s = 4 s a turn
    assert fits.warned and notices == []


async def test_a_slow_run_says_all_online_then_a_heartbeat(
    broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """carol joins late: "all agents online; playing" follows the waiting line, then the
    heartbeat counts decisions, matches done and fallbacks while the matches play."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 0.3)
    notices: list[str] = []
    config = _config("beat", matches=6, concurrency=2, turn_timeout_s=10.0 * load_factor())
    run = asyncio.create_task(
        run_matches(
            config,
            identity(broker, "runner", "runner"),
            ["alice", "bob", "carol"],
            ready_timeout_s=30 * load_factor(),
            on_notice=notices.append,
            external=["carol"],
        )
    )
    await eventually(lambda: any("carol to connect" in n for n in notices), 10 * load_factor())
    assert not any("playing" in n for n in notices)
    players = agents(("alice", "kuhn-colluder"), ("bob", "kuhn-colluder"))
    players.append(Slow("carol", 0.2))
    async with stack(broker, tmp_path / "runs", players):
        episodes = await asyncio.wait_for(run, 60 * load_factor())
    assert len(episodes) == 6
    online = notices.index("all agents online; playing")
    assert online > 0 and "carol to connect" in notices[online - 1]
    beats = [n for n in notices[online:] if n.startswith("playing ")]
    assert beats, notices
    assert "decisions" in beats[-1] and "/6 matches done" in beats[-1]
    assert "fallbacks so far" in beats[-1] or "fallback so far" in beats[-1]
    # carol publishes no traces: her turns are timed from the finished matches, and a
    # 0.2 s decision fits 10 s, however long the run has played
    assert not any(n.startswith("turns will time out") for n in notices)
    # the same records against a budget they do not fit
    tight = _config("beat", matches=6, concurrency=2, turn_timeout_s=0.01)
    said: list[str] = []
    Heartbeat(tight, said.append, lambda: 0, lambda: episodes).check()
    assert len(said) == 1 and "(the turns of the first 6 matches to finish)" in said[0]
