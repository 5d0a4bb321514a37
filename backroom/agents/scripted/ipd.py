"""Scripted IPD baselines: ``tit-for-tat`` and ``grim-trigger``.

Always-A and always-B need no class of their own: they are the ``always`` kind
with ``action: A`` or ``action: B`` (the IPD's legal choices are "A" and "B").
"""

from __future__ import annotations

from backroom.agents.base import JSON, ScriptedAgent
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Turn
from backroom.games.ipd import COOPERATE, DEFECT


@register_agent("tit-for-tat")
class TitForTat(ScriptedAgent):
    """A first, then the other's previous move: the reciprocity Advantage Alignment learns."""

    async def act(self, turn: Turn) -> JSON:
        return turn.observation.get("last_opponent_move") or COOPERATE


@register_agent("grim-trigger")
class GrimTrigger(ScriptedAgent):
    """A until the other plays B once, then B for the rest of the game."""

    async def act(self, turn: Turn) -> JSON:
        history = turn.observation.get("history", [])
        return DEFECT if any(h["theirs"] == DEFECT for h in history) else COOPERATE
