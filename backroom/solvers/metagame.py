"""Rankings of a meta-game (agents x agents, the row's mean payoff against the column).

**Nash averaging** (Balduzzi et al., *Re-evaluating evaluation*, 2018): the
meta-game of a two-entrant zero-sum league is a symmetric zero-sum game with
the antisymmetric payoff ``A`` (``A[i][j] = -A[j][i]``). Its Nash equilibria are
the mixtures ``p`` against which no agent earns more than 0 (``A p <= 0``); they
form a polytope, and the **maximum-entropy** one is unique, so the rating does
not depend on the solver. Each agent's rating is ``(A p)_i``, its payoff
against that mixture: 0 for the agents the equilibrium plays, below 0 for the
rest. Adding copies of an agent does not move anyone's rating (the point of
the method): an agent is rated by whom it beats in the strongest mix, not by
how many weak agents it farms.

The maximum-entropy point is found in two steps, both with scipy: one linear
programme per agent (``max p_i`` over the Nash set, HiGHS) gives the largest
support any equilibrium has; entropy is then maximised over the Nash set on
that support (SLSQP), starting from the mean of those LP solutions, which is
an equilibrium with that support already.

**α-Rank** (Omidshafiei et al., 2019): OpenSpiel's ``alpharank.compute`` on the
single-population (symmetric) game with the row's payoff ``M``, in its
infinite-α limit (``use_inf_alpha``, noise ``inf_alpha_eps = 0.01``): the mass
of each agent in the stationary distribution of the evolutionary walk in which
a mutant takes over when it earns more against the resident than the
resident earns against it. The limit makes the mass depend on the signs of
those payoff differences only, not on the payoffs' scale (a finite α of 100 on
the IPD's payoffs of 0 to 15 overflows OpenSpiel's Fermi function). It is
defined for general-sum games too; the self-play diagonal does not enter it
(the local selection model OpenSpiel uses by default).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backroom.solvers.tree import FloatArray

#: A mixture weight below this is outside the equilibrium's support.
SUPPORT_TOL = 1e-7
#: Slack on the equilibrium's constraints ``A p <= 0`` (payoffs are measured means).
NASH_TOL = 1e-9
#: α-Rank's noise in the infinite-α limit (OpenSpiel's default).
ALPHARANK_EPS = 0.01


def antisymmetric(payoff: Any) -> FloatArray:
    """The zero-sum part ``(M - M^T) / 2``; missing cells (NaN, the diagonal) count as 0.

    For a constant-sum league of two entrants per match it differs from ``M``
    only by the constant (``M[i][j] + M[j][i]`` is the constant), so it keeps
    the game; for a general-sum league it keeps who beats whom by how much.
    """
    m = np.nan_to_num(np.asarray(payoff, dtype=float), nan=0.0)
    return (m - m.T) / 2.0


def maxent_nash(payoff: Any) -> FloatArray:
    """The maximum-entropy Nash equilibrium of the symmetric zero-sum game ``antisymmetric(M)``."""
    from scipy.optimize import linprog, minimize

    a = antisymmetric(payoff)
    n = len(a)
    if n == 1:
        return np.ones(1)
    ones = np.ones((1, n))
    bound = np.full(n, NASH_TOL)
    points = []
    for i in range(n):
        c = np.zeros(n)
        c[i] = -1.0
        res = linprog(c, A_ub=a, b_ub=bound, A_eq=ones, b_eq=[1.0], bounds=(0, 1), method="highs")
        if res.status != 0:  # the Nash set is never empty: only a numerical failure lands here
            raise RuntimeError(f"meta-game LP failed: {res.message}")
        if res.x[i] > SUPPORT_TOL:
            points.append(np.clip(res.x, 0.0, 1.0))
    start = np.mean(points, axis=0)
    support = np.flatnonzero(start > SUPPORT_TOL)
    if len(support) == 1:
        out = np.zeros(n)
        out[support[0]] = 1.0
        return out
    sub = a[:, support]

    def neg_entropy(q: FloatArray) -> float:
        q = np.clip(q, 1e-300, None)
        return float(np.sum(q * np.log(q)))

    def grad(q: FloatArray) -> FloatArray:
        return np.log(np.clip(q, 1e-300, None)) + 1.0

    res = minimize(
        neg_entropy,
        start[support] / start[support].sum(),
        jac=grad,
        method="SLSQP",
        bounds=[(1e-12, 1.0)] * len(support),
        constraints=[
            {"type": "eq", "fun": lambda q: np.sum(q) - 1.0, "jac": lambda q: np.ones_like(q)},
            {"type": "ineq", "fun": lambda q: NASH_TOL - sub @ q, "jac": lambda q: -sub},
        ],
        options={"ftol": 1e-12, "maxiter": 500},
    )
    q = res.x if res.success and np.all(sub @ res.x <= 1e-6) else start[support]
    out = np.zeros(n)
    out[support] = np.clip(q, 0.0, None) / np.clip(q, 0.0, None).sum()
    return out


def nash_averaging(payoff: Any) -> tuple[FloatArray, FloatArray]:
    """(each agent's payoff against the maximum-entropy Nash mixture, that mixture)."""
    p = maxent_nash(payoff)
    return antisymmetric(payoff) @ p, p


def alpharank(payoff: Any) -> FloatArray:
    """OpenSpiel's α-Rank stationary mass of each agent (single population, infinite α)."""
    from open_spiel.python.egt import alpharank as osp_alpharank

    m = np.nan_to_num(np.asarray(payoff, dtype=float), nan=0.0)
    _, _, pi, _, _ = osp_alpharank.compute([m], use_inf_alpha=True, inf_alpha_eps=ALPHARANK_EPS)
    return np.asarray(pi, dtype=float)


def alpharank_available() -> str | None:
    """None if OpenSpiel's α-Rank imports, else why not (shown where its column would be)."""
    try:
        from open_spiel.python.egt import alpharank as _  # noqa: F401
    except ImportError as e:
        return f"α-Rank needs OpenSpiel (pip install -e '.[openspiel]'): {e}"
    return None
