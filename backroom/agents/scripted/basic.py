"""Game-agnostic scripted kinds: ``random``, ``always`` and ``table``."""

from __future__ import annotations

import json
from typing import Any

from backroom.agents.base import JSON, ScriptedAgent, choices
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Turn
from backroom.games.base import ActionSpec
from backroom.solvers.policy_file import read_policy


@register_agent("random")
class RandomAgent(ScriptedAgent):
    """Uniform over the legal choices, or over the range or shape the game describes."""

    async def act(self, turn: Turn) -> JSON:
        return ActionSpec.from_json(turn.legal).sample(self.rng_for(turn.match, turn.seat))


@register_agent("always")
class AlwaysAgent(ScriptedAgent):
    """Always the same action (by value or by name); the first legal one when it is not legal."""

    def __init__(self, agent_id: str, action: Any = None, **options: Any) -> None:
        super().__init__(agent_id, **options)
        self.action = action

    async def act(self, turn: Turn) -> JSON:
        legal = choices(turn)
        names = turn.legal.get("names", [])
        if self.action in legal or not legal:
            return self.action
        if self.action in names:
            return legal[names.index(self.action)]
        return legal[0]


@register_agent("table")
class TableAgent(ScriptedAgent):
    """Plays a fixed policy keyed by the engine's information-state strings.

    Actions are keyed by their JSON text (``"0"``, ``"2"``) or by name
    (``"raise"``). An information state missing from the table is played
    uniformly at random and counted in ``self.misses``, so a stale policy file
    shows up instead of silently skewing results.
    """

    def __init__(
        self, agent_id: str, policy: str | dict[str, Any] | None = None, **options: Any
    ) -> None:
        super().__init__(agent_id, **options)
        if policy is None:
            raise TypeError("table agent needs policy=PATH (a JSON or YAML policy file)")
        data = policy if isinstance(policy, dict) else read_policy(policy)
        self.table: dict[str, dict[str, float]] = data["policy"]
        self.misses = 0

    async def act(self, turn: Turn) -> JSON:
        legal = choices(turn)
        names = turn.legal.get("names", [])
        rng = self.rng_for(turn.match, turn.seat)
        probs = self.table.get(str(turn.observation.get("info_state")))
        if not probs:
            self.misses += 1
            return rng.choice(legal)
        weights = []
        for i, a in enumerate(legal):
            key = json.dumps(a)
            w = probs.get(key, probs.get(names[i], 0.0) if i < len(names) else 0.0)
            weights.append(max(0.0, float(w)))
        if sum(weights) <= 0:
            self.misses += 1
            return rng.choice(legal)
        return rng.choices(legal, weights)[0]
