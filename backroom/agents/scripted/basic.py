"""Game-agnostic scripted kinds: ``random``, ``always`` and ``table``."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from backroom.agents.base import JSON, ScriptedAgent, choices, register_agent
from backroom.bus.wire import Turn
from backroom.games.base import ActionSpec


@register_agent("random")
class RandomAgent(ScriptedAgent):
    """Uniform over the legal choices, or over the range or shape the game describes."""

    async def act(self, turn: Turn) -> JSON:
        return ActionSpec.from_json(turn.legal).sample(self.rng)


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


def load_policy(path: str | Path) -> dict[str, Any]:
    """Read a policy file: ``{"game", "params", "policy": {info_state: {action: prob}}}``.

    A bare name such as ``kuhn_loki_cfr`` that is not a file names a policy
    shipped in ``backroom/policies/``.
    """
    p = Path(path)
    if not p.exists() and p.suffix == "" and p.name == str(path):
        shipped = resources.files("backroom").joinpath("policies", f"{path}.json")
        if shipped.is_file():
            return dict(json.loads(shipped.read_text()))
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read policy file {path}: {exc.strerror}") from None
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("policy"), dict):
        raise ValueError(
            f"{path}: a policy file needs a 'policy' mapping of info state -> action probabilities"
        )
    return data


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
        data = policy if isinstance(policy, dict) else load_policy(policy)
        self.table: dict[str, dict[str, float]] = data["policy"]
        self.misses = 0

    async def act(self, turn: Turn) -> JSON:
        legal = choices(turn)
        names = turn.legal.get("names", [])
        probs = self.table.get(str(turn.observation.get("info_state")))
        if not probs:
            self.misses += 1
            return self.rng.choice(legal)
        weights = []
        for i, a in enumerate(legal):
            key = json.dumps(a)
            w = probs.get(key, probs.get(names[i], 0.0) if i < len(names) else 0.0)
            weights.append(max(0.0, float(w)))
        if sum(weights) <= 0:
            self.misses += 1
            return self.rng.choice(legal)
        return self.rng.choices(legal, weights)[0]
