"""A CFR policy played by three `cfr` agents through the referee scores what the solver says."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from backroom.agents import make_agent
from backroom.bus.broker import Broker
from backroom.games import make_game
from backroom.solvers.evaluate import expected_seat_returns
from backroom.solvers.policy_file import read_policy
from backroom.solvers.tree import build_tree

from .conftest import Runner, loki_spec, stack

MATCHES = 600


async def test_cfr_agents_through_the_referee_match_solver_values(
    broker: Broker, tmp_path: Path
) -> None:
    policy = read_policy("kuhn_loki_cfr")
    # Seat 0 always starts, so the seats' values differ and the check has teeth.
    params = {"variant": "loki", "start": 0}
    tree = build_tree(make_game("kuhn", **params))
    expected = expected_seat_returns(tree, policy["policy"])
    assert max(expected) - min(expected) > 0.05

    players = [
        make_agent("cfr", name, policy="kuhn_loki_cfr", seed=i) for i, name in enumerate("xyz")
    ]
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        ids = [f"c{i}" for i in range(MATCHES)]
        for i, m in enumerate(ids):
            await run.submit(
                m,
                loki_spec(
                    ["x", "y", "z"], seed=i, channels=[], transform={"kind": "none"}, params=params
                ),
            )
        eps = await run.wait(ids, timeout=120)
    returns = np.array([ep.raw_returns for ep in eps])
    assert all(ep.reason == "normal" for ep in eps)
    mean, se = returns.mean(axis=0), returns.std(axis=0, ddof=1) / math.sqrt(MATCHES)
    for seat in range(3):
        assert abs(mean[seat] - expected[seat]) < 4 * se[seat], (seat, mean, expected, se)
    assert all(a.misses == 0 for a in players)  # every info state was in the table
