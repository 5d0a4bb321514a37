"""Scripted beauty-contest baseline: ``level-k`` reasoning (Nagel; the paper's section 3.1)."""

from __future__ import annotations

from typing import Any

from backroom.agents.base import JSON, ScriptedAgent
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Turn


@register_agent("level-k")
class LevelK(ScriptedAgent):
    """Level 0 guesses 50; level k best-responds to a crowd of level k-1: 50 * (2/3)^k.

    With ``announce`` it states its number in the discussion ("I will select X."),
    the form of strategy statement the paper's prompt suggests.
    """

    def __init__(self, agent_id: str, k: int = 1, announce: bool = True, **options: Any) -> None:
        super().__init__(agent_id, **options)
        if not isinstance(k, int) or k < 0:
            raise TypeError("level-k needs k, an integer >= 0")
        self.k, self.announce = k, announce

    def guess(self, low: int = 0, high: int = 100) -> int:
        return max(low, min(high, round(50 * (2 / 3) ** self.k)))

    async def talk(self, turn: Turn) -> str | None:
        return f"I will select {self.guess()}." if self.announce else None

    async def act(self, turn: Turn) -> JSON:
        low, high = turn.observation.get("range", [0, 100])
        return self.guess(low, high)
