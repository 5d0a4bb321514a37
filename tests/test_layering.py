"""The package's layering: light imports, and a match that runs without a broker.

The import contracts themselves (games import nothing of backroom, the bus
only metrics, ...) are checked by ``lint-imports`` (``[tool.importlinter]`` in
pyproject.toml), which CI runs.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import backroom
from backroom.bus.structs import Action, MatchEnd, Struct, Turn  # the move path's messages
from backroom.bus.wire import EpisodeRecord, MatchSpec
from backroom.referee.match import Match

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["aiomqtt", "paho", "pydantic", "prometheus_client", "asyncio", "torch"]


def test_games_import_is_light() -> None:
    code = f"import sys, backroom.games; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_top_level_names_still_work() -> None:
    for name in backroom.__all__:
        assert getattr(backroom, name) is not None
    assert set(backroom.__all__) <= set(dir(backroom))
    from backroom import Agent, BusConfig, Turn

    assert backroom.Agent is Agent and backroom.BusConfig is BusConfig and backroom.Turn is Turn


def test_match_does_not_import_the_referee_service() -> None:
    tree = ast.parse((ROOT / "backroom/referee/match.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "backroom.referee.service" not in imported


class TableReferee:
    """The least a Match needs (``MatchReferee``): seat 0 plays A, seat 1 plays B, at once."""

    id = "test-referee"
    log = logging.getLogger("test")
    offline: frozenset[str] = frozenset()
    offline_grace_s = 1.0

    def __init__(self) -> None:
        self.match: Match | None = None
        self.public_due: dict[str, Match] = {}
        self.sent: list[tuple[str, BaseModel | Struct]] = []
        self.record: EpisodeRecord | None = None

    def send(self, topic: str, msg: BaseModel | Struct, batch: bool = False) -> None:
        self.sent.append((topic, msg))

    def send_to(self, agent: str, msg: BaseModel | Struct) -> None:
        self.sent.append((agent, msg))
        if isinstance(msg, Turn):  # answer in the next loop iteration, as a bus would
            action = Action(match=msg.match, turn=msg.turn, action="AB"[msg.seat])
            asyncio.get_running_loop().call_soon(self.answer, agent, action)

    def answer(self, agent: str, action: Action) -> None:
        assert self.match is not None
        self.match.on_message(agent, action)

    def public_pending(self, match: Match) -> None:
        match.flush_public()

    def latency(self, agent: str, phase: str) -> Any:
        return _NoLatency()

    def reject(
        self,
        agent: str,
        reason: str,
        detail: str,
        match: str | None = None,
        ref_seq: int | None = None,
    ) -> None:
        raise AssertionError(f"{agent} rejected: {reason} {detail}")

    async def finished(self, match: Match, record: EpisodeRecord) -> None:
        self.record = record


class _NoLatency:
    def observe(self, amount: float) -> None:
        pass


async def test_match_plays_ipd_without_a_broker() -> None:
    referee = TableReferee()
    spec = MatchSpec(game="ipd", params={"rounds": 3}, seats=["alice", "bob"], seed=7)
    referee.match = match = Match(referee, "m1", spec)
    await asyncio.wait_for(match.run(), timeout=10)
    record = referee.record
    assert record is not None and record.reason == "normal", record
    assert record.raw_returns == [0.0, 15.0]  # (A, B) pays 0 / 5, three rounds
    assert [(a.agent, a.action) for a in record.actions] == [("alice", "A"), ("bob", "B")] * 3
    ends = [m for _, m in referee.sent if isinstance(m, MatchEnd)]
    assert [e.raw_returns for e in ends] == [[0.0, 15.0]] * 2
