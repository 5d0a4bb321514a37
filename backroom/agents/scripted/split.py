"""Scripted Split No-Comm baselines: the paper's Coop and Defect agents (section 5.2)."""

from __future__ import annotations

from backroom.agents.base import JSON, ScriptedAgent
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Turn


@register_agent("split-cooperative")
class SplitCooperative(ScriptedAgent):
    """Takes every category it values more, none it values less, half of a tie.

    Against itself this reaches the efficient allocation every round, which is
    the cooperative optimum the welfare measure divides by.
    """

    async def act(self, turn: Turn) -> JSON:
        obs = turn.observation
        mine, theirs, q = obs["my_values"], obs["other_values"], obs["quantities"]
        return {
            k: q[k] if mine[k] > theirs[k] else 0 if mine[k] < theirs[k] else q[k] // 2
            for k in obs["items"]
        }


@register_agent("split-defect")
class SplitDefect(ScriptedAgent):
    """Claims everything, whatever the values: the greedy policy naive MARL converges to."""

    async def act(self, turn: Turn) -> JSON:
        q = turn.observation["quantities"]
        return {k: q[k] for k in turn.observation["items"]}
