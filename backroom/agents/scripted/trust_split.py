"""Scripted Trust-and-Split baselines: ``ts-honest`` and ``ts-greedy``.

The paper trains these roles (GRPO-SR cooperators, GRPO defectors) because an
LLM must talk; scripted versions give the same two poles without a model.
"""

from __future__ import annotations

import re
from typing import Any

from backroom.agents.base import JSON, ScriptedAgent
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Turn
from backroom.games.trust_and_split import BEATS, HANDS

_CLAIM = re.compile(
    r"\b(?:my hand is|i have|i hold|i've got|i got)\s+(?:an?\s+)?(rock|paper|scissors)\b", re.I
)
_HAND = re.compile(r"\b(rock|paper|scissors)\b", re.I)
_LOSES_TO = {loser: winner for winner, loser in BEATS.items()}


def claimed_hand(obs: dict[str, Any]) -> str | None:
    """The hand the other player claims in this round's chat, if it names one.

    "My hand is X" wins over a bare mention, since messages often name other
    hands while reasoning ("rock beats scissors").
    """
    me = obs["player"]
    for m in obs.get("messages", []):
        if m["seat"] == me or not m["text"]:
            continue
        found = _CLAIM.search(m["text"]) or _HAND.search(m["text"])
        if found:
            return found.group(1).lower()
    return None


@register_agent("ts-honest")
class TrustAndSplitHonest(ScriptedAgent):
    """Says its hand truthfully; keeps all coins with the upper hand, none with the lower.

    If the other names no hand (or names its own, which cannot be true), it
    cannot tell who is upper and keeps half.
    """

    async def talk(self, turn: Turn) -> str | None:
        return f"My hand is {turn.observation['hand']}."

    async def act(self, turn: Turn) -> JSON:
        obs = turn.observation
        mine, theirs = obs["hand"], claimed_hand(obs)
        if theirs is None or theirs == mine or theirs not in HANDS:
            return obs["coins"] // 2
        return obs["coins"] if BEATS[mine] == theirs else 0


@register_agent("ts-greedy")
class TrustAndSplitGreedy(ScriptedAgent):
    """Keeps all coins every round; when it speaks second it claims the hand that beats the other's."""

    async def talk(self, turn: Turn) -> str | None:
        obs = turn.observation
        theirs = claimed_hand(obs)
        if theirs is not None and theirs in _LOSES_TO:
            return f"My hand is {_LOSES_TO[theirs]}. I have the upper hand."
        return f"My hand is {obs['hand']}."

    async def act(self, turn: Turn) -> JSON:
        return turn.observation["coins"]
