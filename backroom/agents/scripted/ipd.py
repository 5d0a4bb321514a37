"""Scripted IPD baselines: ``tit-for-tat``, ``grim-trigger`` and ``memory-one``.

Always-A and always-B need no class of their own: they are the ``always`` kind
with ``action: A`` or ``action: B`` (the IPD's legal choices are "A" and "B").
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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


#: The memory-one states: the first round, then (own last move, the other's last move).
#: The trainer's harness (``backroom.trainer.memory_one``) trains and writes P(A) by these.
MEMORY_ONE_STATES = ("first", "AA", "AB", "BA", "BB")


def read_memory_one(run: str | Path) -> dict[str, float]:
    """P(A) per state from a memory-one training run's ``memory_one.json`` (its final policy).

    Read here rather than through the trainer, which would pull torch into
    every agent host: the file is the contract (``memory_one.run`` writes it).
    """
    path = Path(run) / "memory_one.json"
    try:
        p_a = json.loads(path.read_text())["p_a"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"memory-one agent: cannot read a final policy from {path} ({exc}); run "
            "`backroom train examples/ipd_memory_one.yaml --run-dir DIR` and pass run: DIR"
        ) from None
    return checked_p_a(p_a, str(path))


def checked_p_a(p_a: Any, source: str) -> dict[str, float]:
    if not isinstance(p_a, dict) or set(p_a) != set(MEMORY_ONE_STATES):
        got = sorted(p_a) if isinstance(p_a, dict) else type(p_a).__name__
        raise ValueError(
            f"memory-one agent: {source} needs P(A) for exactly the states "
            f"{list(MEMORY_ONE_STATES)}, got {got}"
        )
    out: dict[str, float] = {}
    for state in MEMORY_ONE_STATES:
        value = p_a[state]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"memory-one agent: {source}[{state!r}] is not a number: {value!r}")
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"memory-one agent: {source}[{state!r}] = {value} is not in [0, 1]")
        out[state] = float(value)
    return out


@register_agent("memory-one")
class MemoryOne(ScriptedAgent):
    """P(A) by the last round's pair of moves: a policy trained on the memory-one harness, frozen.

    Why a kind: the harness trains the paper's Advantage Alignment policy in
    seconds (tit-for-tat-like, ``examples/ipd_memory_one.yaml``), which a
    small LLM on a CPU cannot become; played on the bus, it is a real frozen
    AA opponent for an LLM learner (``opponents:``) or a league entrant.
    ``run: DIR`` plays the final policy of a memory-one run directory;
    ``p_a: {first, AA, AB, BA, BB}`` gives the five probabilities by hand.
    Draws come from the match seed and seat, so a rerun replays every move.
    """

    def __init__(
        self,
        agent_id: str,
        run: str | None = None,
        p_a: dict[str, float] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(agent_id, **options)
        if (run is None) == (p_a is None):
            raise TypeError(
                "memory-one agent needs exactly one of run=DIR (a memory-one training run) "
                "or p_a={first, AA, AB, BA, BB}"
            )
        self.p_a = read_memory_one(run) if run is not None else checked_p_a(p_a, "p_a")

    async def act(self, turn: Turn) -> JSON:
        history = turn.observation.get("history") or []
        state = history[-1]["mine"] + history[-1]["theirs"] if history else "first"
        draw = self.rng_for(turn.match, turn.seat).random()
        return COOPERATE if draw < self.p_a[state] else DEFECT
