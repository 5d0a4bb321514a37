"""The ``cfr`` agent kind: plays a CFR average policy, from a file or solved on start.

A policy file is what ``backroom solve ... --out`` writes; with no file the
agent solves the game named by its options once, in ``setup`` (off the event
loop, with a bounded iteration count so a start can never hang), and then plays
exactly like the ``table`` agent.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from backroom.agents.kinds import register_agent
from backroom.agents.scripted.basic import TableAgent

#: Most iterations an agent will spend solving on start (about 10 s for Loki Kuhn).
MAX_START_ITERATIONS = 50_000
#: Most histories an agent will enumerate on start.
MAX_START_NODES = 500_000


@register_agent("cfr")
class CFRAgent(TableAgent):
    """A ``table`` agent whose table is a CFR average policy.

    Options: ``policy=PATH`` (a policy file), or ``game`` (default ``kuhn``)
    with ``params`` (a dict or JSON text) and/or the Kuhn shorthands
    ``variant``/``players``, plus ``iterations`` (capped at
    ``MAX_START_ITERATIONS``) and ``algo`` (``cfr``, ``cfr+``, ``linear``, ``dcfr``).
    """

    def __init__(
        self,
        agent_id: str,
        policy: str | dict[str, Any] | None = None,
        game: str = "kuhn",
        params: dict[str, Any] | str | None = None,
        variant: str | None = None,
        players: int | None = None,
        iterations: int = 10_000,
        algo: str = "cfr+",
        **options: Any,
    ) -> None:
        super().__init__(
            agent_id, policy=policy if policy is not None else {"policy": {}}, **options
        )
        self.solve_spec: dict[str, Any] | None = None
        if policy is None:
            spec = json.loads(params) if isinstance(params, str) else dict(params or {})
            if variant is not None:
                spec["variant"] = variant
            if players is not None:
                spec["players"] = int(players)
            iters = int(iterations)
            if not 1 <= iters <= MAX_START_ITERATIONS:
                raise TypeError(
                    f"iterations must be in 1..{MAX_START_ITERATIONS} when solving on start"
                )
            self.solve_spec = {"game": game, "params": spec, "iterations": iters, "algo": algo}
        self.meta: dict[str, Any] = {}

    async def setup(self) -> None:
        """Solve on start when no policy file was given (in a thread: the solve is CPU-bound)."""
        await super().setup()
        if self.solve_spec is None or self.table:
            return
        from backroom.solvers.cfr import policy_document, solve_game

        spec = self.solve_spec

        def work() -> dict[str, Any]:
            result = solve_game(
                spec["game"],
                spec["params"],
                spec["iterations"],
                spec["algo"],
                max_nodes=MAX_START_NODES,
            )
            return policy_document(result)

        doc = await asyncio.to_thread(work)
        self.table = doc["policy"]
        self.meta = doc["meta"]
