"""The economics of Bertrand competition: demand, profit, Nash and cartel prices, best responses.

One place for the numbers that the game (``bertrand``), the scripted firms
(``nash-pricer`` and friends) and the analysis (profit gain, collusion flag)
all need, so that a firm's benchmark, the referee's profits and the
analysis's yardstick come from the same formulas. Two symmetric demand systems:

* ``linear`` — the public code of "Shall We Team Up"
  (``SABM_Agent_Economics.demand_function``) in the form the paper reports:
  q_i = 1400 - 200 p_i + 100 p_j, cost 2. Nash price 6, cartel price 8.
* ``logit`` — Calvano et al. (2020): q_i = e^((a - p_i)/mu) /
  (sum_j e^((a - p_j)/mu) + e^(a0/mu)) with a = 2, a0 = 0, mu = 0.25, cost 1.
  Nash price 1.4729, monopoly price 1.9250.

The benchmark prices are derived from the demand parameters by
``equilibrium_prices`` (closed form for linear demand, the first-order
conditions solved by bisection for logit), never typed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Demand = Literal["linear", "logit"]
DEMAND_DEFAULTS: dict[str, dict[str, float]] = {
    # q_i = intercept - own_slope * p_i + cross_slope * p_j
    "linear": {"intercept": 1400.0, "own_slope": 200.0, "cross_slope": 100.0, "cost": 2.0},
    # Calvano et al. (2020), baseline
    "logit": {"a": 2.0, "a0": 0.0, "mu": 0.25, "cost": 1.0},
}


def _exp(x: float) -> float:
    return math.exp(min(x, 700.0))


@dataclass(frozen=True)
class Market:
    """A symmetric two-firm demand system: quantities and profits for a pair of prices."""

    demand: str
    params: Mapping[str, float] = field(default_factory=dict)

    @property
    def cost(self) -> float:
        return float(self.params["cost"])

    def quantity(self, price: float, rival: float) -> float:
        p = self.params
        if self.demand == "linear":
            # Demand cannot go negative: a firm priced out of the market sells nothing.
            return max(0.0, p["intercept"] - p["own_slope"] * price + p["cross_slope"] * rival)
        # Logit shares, written relative to the firm's own term so that large
        # price gaps cannot overflow the exponentials.
        mu = p["mu"]
        return 1.0 / (1.0 + _exp((price - rival) / mu) + _exp((p["a0"] - p["a"] + price) / mu))

    def profit(self, price: float, rival: float) -> float:
        return (price - self.cost) * self.quantity(price, rival)

    def profit_bounds(self, max_price: float) -> tuple[float, float]:
        """Least and most one-round profit over every pair of prices in [0, ``max_price``], attained.

        A firm's demand rises with the rival's price, so both ends are against
        a rival at ``max_price``: the least profit is pricing at 0 (below cost,
        profit falls as the price does, and the most is sold), the most is the
        best response to ``max_price`` (``best_response``; profit is
        single-peaked in the own price). Either is 0 when costs or prices make it so.
        """
        worst = min(0.0, self.profit(0.0, max_price))
        best = max(0.0, self.profit(best_response(self, max_price, 0.0, max_price), max_price))
        return worst, best


def make_market(demand: str, params: Mapping[str, float] | None = None) -> Market:
    """The market of a demand system, its defaults overridden by ``params`` (checked)."""
    if demand not in DEMAND_DEFAULTS:
        raise ValueError(
            f"bertrand: demand must be one of {sorted(DEMAND_DEFAULTS)}, not {demand!r}"
        )
    merged = dict(DEMAND_DEFAULTS[demand])
    unknown = sorted(set(params or {}) - set(merged))
    if unknown:
        raise ValueError(
            f"bertrand: unknown {demand} demand parameters {unknown}; known: {sorted(merged)}"
        )
    merged.update({k: float(v) for k, v in (params or {}).items()})
    if demand == "linear":
        if not merged["own_slope"] > merged["cross_slope"] >= 0:
            raise ValueError("bertrand: linear demand needs own_slope > cross_slope >= 0")
    elif merged["mu"] <= 0:
        raise ValueError("bertrand: logit demand needs mu > 0")
    return Market(demand, merged)


@dataclass(frozen=True)
class Equilibrium:
    """Symmetric benchmarks: one-shot Nash and joint-profit-maximising (cartel / monopoly) play."""

    nash_price: float
    cartel_price: float
    nash_profit: float
    cartel_profit: float

    def profit_gain(self, profit: float) -> float:
        """Calvano's Delta: 0 at the Nash profit, 1 at the cartel profit."""
        return (profit - self.nash_profit) / (self.cartel_profit - self.nash_profit)


def _bisect(g: Callable[[float], float], lo: float, hi: float) -> float:
    """Root of an increasing function with g(lo) < 0 < g(hi)."""
    for _ in range(200):
        mid = (lo + hi) / 2
        if g(mid) < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, abs(hi)):
            break
    return (lo + hi) / 2


def equilibrium_prices(demand: str, params: Mapping[str, float] | None = None) -> Equilibrium:
    """Nash and cartel prices derived from the demand parameters.

    Linear, q_i = A - B p_i + D p_j, cost c. Firm i's first-order condition
    A - 2B p_i + B c + D p_j = 0 at p_i = p_j gives p_N = (A + B c) / (2B - D);
    maximising the joint profit 2 (p - c)(A - (B - D) p) gives
    p_C = (A + (B - D) c) / (2 (B - D)).

    Logit: with own share q, dq_i/dp_i = -q (1 - q) / mu, so the Nash
    condition is p = c + mu / (1 - q(p, p)); at a common price the joint
    profit's condition is p = c + mu / (1 - 2 q(p, p)). Both right-hand sides
    fall as p rises, so each root is unique and bisection finds it.
    """
    m = make_market(demand, params)
    p, c = m.params, m.cost
    if demand == "linear":
        a, b, d = p["intercept"], p["own_slope"], p["cross_slope"]
        nash = (a + b * c) / (2 * b - d)
        cartel = (a + (b - d) * c) / (2 * (b - d))
    else:
        mu = p["mu"]

        def share(x: float) -> float:
            return m.quantity(x, x)

        def foc(k: int) -> Callable[[float], float]:
            return lambda x: x - c - mu / (1.0 - k * share(x))

        hi = c + mu
        while foc(2)(hi) <= 0 or foc(1)(hi) <= 0:
            hi = c + 2 * (hi - c)
        nash = _bisect(foc(1), c, hi)
        cartel = _bisect(foc(2), c, hi)
    return Equilibrium(nash, cartel, m.profit(nash, nash), m.profit(cartel, cartel))


def best_response(market: Market, rival: float, lo: float, hi: float) -> float:
    """Profit-maximising own price against ``rival`` by golden-section search.

    Both demand systems give a single-peaked profit in the own price, so this
    is a model-free check of ``equilibrium_prices`` and a tool for scripted firms.
    """
    inv = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    x1, x2 = b - inv * (b - a), a + inv * (b - a)
    f1, f2 = market.profit(x1, rival), market.profit(x2, rival)
    for _ in range(200):
        if f1 < f2:
            a, x1, f1 = x1, x2, f2
            x2 = a + inv * (b - a)
            f2 = market.profit(x2, rival)
        else:
            b, x2, f2 = x2, x1, f1
            x1 = b - inv * (b - a)
            f1 = market.profit(x1, rival)
        if b - a < 1e-12:
            break
    return (a + b) / 2
