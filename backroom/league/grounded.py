"""Solver-grounded scores: each entrant's gain over the equilibrium against the field it met.

A rating says who did well in *this* field; exploitability says how badly the
worst opponent could punish an entrant. Between the two: what did the entrant
earn from the opponents it actually met, compared with what the game's Nash
equilibrium would have earned from the same opponents? For a two-player
zero-sum game whose tree the solvers hold,

``gain_i = mean_j ( M[i][j] − u(σ*, π_j) )``

over the opponents j that i met: ``M[i][j]`` is i's measured mean payoff
against j (the head-to-head cell), ``σ*`` the equilibrium (CFR+,
``policies.equilibrium``), and ``π_j`` j's policy: asked at every state where
it can be (``policies.py``), else the empirical policy it played (unvisited
states uniform, as for exploitability). ``u(σ*, π_j)`` is computed exactly on
the tree, the mean of both seats. Positive: the entrant took more from this
field than the equilibrium would (it exploited weak opponents); negative: it
left chips on the table or was exploited. The equilibrium itself scores about
0 (its measured payoffs are samples of the exact ones). The 95% interval is a
bootstrap over each pair's CRN groups (the ``u(σ*, π_j)`` terms are held fixed:
exact for asked policies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from backroom.league.ratings import Cells
from backroom.seeds import derive_seed

#: Bootstrap draws behind a gain's interval.
BOOTSTRAP = 200


def equilibrium_gains(
    cells: Cells,
    agents: Sequence[str],
    tree: Any,
    policies: dict[str, dict[str, dict[str, float]]],
    seed: object,
    bootstrap: int = BOOTSTRAP,
) -> list[dict[str, Any]]:
    """One row per agent with results: its gain over the equilibrium, interval, opponents met."""
    from backroom.league.policies import equilibrium, pair_value

    star = equilibrium(tree)
    eq_value = {j: pair_value(tree, star, tree.sigma_from_policy(p)) for j, p in policies.items()}
    rng = np.random.default_rng(derive_seed("backroom", "league", "gain-bootstrap", seed))
    rows = []
    for i in agents:
        pairs = []
        for j in agents:
            groups = cells.cells.get((i, j))
            if j == i or not groups or j not in eq_value:
                continue
            pairs.append((np.array([t / c for t, c in groups.values()]), eq_value[j]))
        if not pairs:
            continue
        gain = float(np.mean([s.mean() - v for s, v in pairs]))
        draws = [
            np.mean([s[rng.integers(0, len(s), len(s))].mean() - v for s, v in pairs])
            for _ in range(bootstrap)
        ]
        ci = (
            [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))] if draws else None
        )
        rows.append(
            {
                "agent": i,
                "gain": gain,
                "ci": ci,
                "equilibrium_vs_field": float(np.mean([v for _, v in pairs])),
                "opponents": len(pairs),
            }
        )
    return sorted(rows, key=lambda r: (-r["gain"], r["agent"]))
