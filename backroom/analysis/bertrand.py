"""Measures for Bertrand competition ("Shall We Team Up" Figure 3; Calvano et al. 2020).

* price trajectories of both firms against the Nash and cartel (monopoly)
  prices derived from the episode's demand parameters
  (``games.bertrand_market``, as the game and the scripted firms derive them);
* Calvano's profit gain Delta = (profit - Nash profit) / (cartel profit - Nash
  profit) per firm, over the whole episode and over its last ``tail`` rounds
  (0 = competitive, 1 = perfect cartel);
* the paper's collusion flag (section 2.2): both prices between the Nash and
  the cartel price and close to each other for ``window`` (200) consecutive
  rounds. With g = cartel - Nash: "between" is Nash + 0.05 g < p <= cartel +
  0.05 g (strictly above Nash, so firms at the competitive price are not
  flagged, with a little slack above the cartel price for rounding), and
  "close" is |p_1 - p_2| <= 0.1 g.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from backroom.analysis.episodes import Episode
from backroom.analysis.measures import GameMeasures, cell
from backroom.analysis.plotting import figure, save
from backroom.games.bertrand_market import Equilibrium, equilibrium_prices

#: Consecutive rounds of collusive prices that make a collusion (the paper: 200).
WINDOW = 200
#: Band above Nash (and slack above cartel), and the closeness bound, in units of cartel - Nash.
MARGIN = 0.05
CLOSE = 0.10
#: Rounds at the end of an episode over which the "converged" profit gain is taken.
TAIL = 100


def equilibrium_of(ep: Episode) -> Equilibrium:
    """The benchmarks of the market the firms played in, as their observation states it.

    The same derivation (``equilibrium_prices``) as the game's and the scripted
    firms', from the demand system and its full parameters (defaults merged in).
    """
    market = ep["final_observations"][0]["market"]
    return equilibrium_prices(market["demand"], market["params"])


def collusive_rounds(p0: list[float], p1: list[float], eq: Equilibrium) -> list[bool]:
    gap = eq.cartel_price - eq.nash_price
    lo, hi, close = eq.nash_price + MARGIN * gap, eq.cartel_price + MARGIN * gap, CLOSE * gap
    return [
        lo < a <= hi and lo < b <= hi and abs(a - b) <= close for a, b in zip(p0, p1, strict=True)
    ]


def longest_run(flags: list[bool]) -> tuple[int, int | None]:
    """Length of the longest streak of True, and the 1-based round it starts."""
    best, start, cur, cur_start = 0, None, 0, 0
    for i, f in enumerate(flags):
        if f:
            if cur == 0:
                cur_start = i
            cur += 1
            if cur > best:
                best, start = cur, cur_start + 1
        else:
            cur = 0
    return best, start


def _price_measures(p0: list[float], p1: list[float]) -> dict[str, Any]:
    """Each firm's mean and last price (None for a firm that never priced)."""
    return {
        "mean_price": [statistics.fmean(p0) if p0 else None, statistics.fmean(p1) if p1 else None],
        "final_price": [p0[-1] if p0 else None, p1[-1] if p1 else None],
    }


def _gain_measures(eq: Equilibrium, profits: list[list[float]], n: int, k: int) -> dict[str, Any]:
    """Calvano's Delta per firm over the whole match and its last ``k`` rounds, and their means."""
    deltas = [eq.profit_gain(statistics.fmean(pr)) if pr else None for pr in profits]
    tail_deltas = [eq.profit_gain(statistics.fmean(pr[-k:])) if k else None for pr in profits]
    return {
        "delta": deltas,
        "delta_mean": statistics.fmean([d for d in deltas if d is not None]) if n else None,
        "delta_tail": tail_deltas,
        "delta_tail_mean": statistics.fmean([d for d in tail_deltas if d is not None])
        if n
        else None,
    }


def _collusion_measures(
    p0: list[float], p1: list[float], eq: Equilibrium, window: int
) -> dict[str, Any]:
    """The paper's flag: the longest collusive streak, and whether (and where) it reaches ``window``."""
    streak, start = longest_run(collusive_rounds(p0, p1, eq))
    return {
        "longest_collusive_streak": streak,
        "collusion": streak >= window,
        "collusion_starts": start if streak >= window else None,
    }


def episode_measures(ep: Episode, window: int = WINDOW, tail: int = TAIL) -> dict[str, Any]:
    eq = equilibrium_of(ep)
    hist = ep["final_observations"][0]["history"]
    p0, p1 = [float(x) for x in hist["prices"]], [float(x) for x in hist["rival_prices"]]
    profits = [
        [float(r[0]) for r in ep["round_rewards"]],
        [float(r[1]) for r in ep["round_rewards"]],
    ]
    n = len(p0)
    return {
        "match": ep["match"],
        "seats": ep["seats"],
        "rounds": n,
        "nash_price": eq.nash_price,
        "cartel_price": eq.cartel_price,
        **_price_measures(p0, p1),
        **_gain_measures(eq, profits, n, min(tail, n)),
        **_collusion_measures(p0, p1, eq, window),
        "prices": [p0, p1],
    }


def analyze(
    episodes: list[Episode], out_dir: Path | None = None, max_plots: int = 12
) -> dict[str, Any]:
    per = [episode_measures(ep) for ep in episodes]
    result: dict[str, Any] = {
        "game": "bertrand",
        "episodes": len(per),
        "collusion_rate": sum(m["collusion"] for m in per) / len(per) if per else None,
        "mean_delta": statistics.fmean(
            [m["delta_mean"] for m in per if m["delta_mean"] is not None]
        )
        if per
        else None,
        "mean_delta_tail": (
            statistics.fmean(
                [m["delta_tail_mean"] for m in per if m["delta_tail_mean"] is not None]
            )
            if per
            else None
        ),
        "per_episode": [{k: v for k, v in m.items() if k != "prices"} for m in per],
        "plots": [],
    }
    if out_dir is not None:
        for m in per[:max_plots]:
            result["plots"].append(_plot(m, out_dir))
    return result


def _plot(m: dict[str, Any], out_dir: Path) -> str:
    fig = figure(8.0, 4.0)
    ax = fig.add_subplot()
    rounds = range(1, m["rounds"] + 1)
    for seat, prices in enumerate(m["prices"]):
        ax.plot(rounds, prices, lw=1.2, zorder=3, label=f"firm {seat + 1} ({m['seats'][seat]})")
    ax.axhline(
        m["nash_price"],
        color="k",
        ls="--",
        lw=1,
        label=f"Bertrand equilibrium {m['nash_price']:.4g}",
    )
    ax.axhline(
        m["cartel_price"],
        color="tab:red",
        ls="--",
        lw=1,
        label=f"cartel price {m['cartel_price']:.4g}",
    )
    if m["collusion_starts"]:
        ax.axvspan(
            m["collusion_starts"],
            m["collusion_starts"] + m["longest_collusive_streak"] - 1,
            color="tab:red",
            alpha=0.08,
            label="collusion (flag)",
        )
    ax.set_xlabel("round")
    ax.set_ylabel("price")
    ax.set_title(f"Bertrand {m['match']}: Delta {m['delta_mean']:.2f}")
    ax.legend(loc="best", fontsize="small")
    return save(fig, out_dir, f"bertrand_{m['match']}")


def tables(run: str, r: dict[str, Any]) -> list[Table]:
    """One row per match: prices, Delta (whole and tail), the longest collusive streak."""
    t = Table(title=f"{run} bertrand: {r['episodes']} episodes".strip())
    for col in (
        "match",
        "seats",
        "rounds",
        "mean prices",
        "Delta",
        f"Delta (last {TAIL})",
        "longest collusive streak",
        "collusion",
    ):
        t.add_column(col)
    for m in r["per_episode"]:
        t.add_row(
            m["match"],
            " vs ".join(m["seats"]),
            str(m["rounds"]),
            " / ".join(cell(p) for p in m["mean_price"]),
            cell(m["delta_mean"]),
            cell(m["delta_tail_mean"]),
            str(m["longest_collusive_streak"]),
            cell(m["collusion"]),
        )
    if r["per_episode"]:
        first = r["per_episode"][0]
        t.caption = (
            f"Nash price {first['nash_price']:.4f}, cartel price {first['cartel_price']:.4f}"
        )
    return [t]


MEASURES = {"bertrand": GameMeasures(analyze, tables)}
