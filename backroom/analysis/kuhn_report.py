"""How a Kuhn analysis is shown: its figures (seats, advantage, Loki Figure 2) and tables.

Everything here reads :func:`backroom.analysis.kuhn.analyze`'s result, a JSON
dict, and computes nothing that is not already in it: what the run measured is
decided there, how it reads is decided here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.table import Table

from backroom.analysis.kuhn_reference import MEASURED_ROW, SOLVER_READINGS, whole_deck
from backroom.analysis.plotting import figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# --- figures --------------------------------------------------------------------------------


def figures(result: dict[str, Any]) -> dict[str, Figure]:
    """The figures of an ``analyze`` result by file name (unsaved: tests read their legends)."""
    out: dict[str, Figure] = {"kuhn_seats": _seats_figure(result)}
    coalition = result.get("coalition") or {}
    if coalition.get("advantage_by_hand"):
        out["kuhn_coalition_advantage"] = _advantage_figure(result)
    if result.get("heatmap"):
        out["kuhn_collusion_heatmap"] = _heatmap_figure(result)
    return out


def _seats_figure(result: dict[str, Any]) -> Figure:
    seats = result["seats"]
    fig = figure(6.0, 3.8)
    ax = fig.add_subplot()
    x = np.arange(len(seats))
    labels = [f"seat {s['seat']}\n{', '.join(s['agents'])}" for s in seats]
    means = [s["mean_chips"] or 0.0 for s in seats]
    errs = [s["se"] or 0.0 for s in seats]
    ax.bar(x, means, 0.6, yerr=errs, capsize=4, label="played (± 1 s.e.)")
    if all(s["cfr_value"] is not None for s in seats):
        # Markers, not bars: equilibrium values near zero would be bars nobody can see.
        ax.plot(
            x,
            [s["cfr_value"] for s in seats],
            ls="none",
            marker="D",
            color="black",
            label=f"all play CFR ({result['policy']})",
        )
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("mean chips per hand (± 1 s.e.)")
    ax.set_title(f"kuhn: chips per seat over {result['episodes']} hands")
    ax.legend(loc="best", fontsize="small")
    return fig


def _advantage_figure(result: dict[str, Any]) -> Figure:
    from matplotlib.ticker import MaxNLocator

    c = result["coalition"]
    running = c["advantage_by_hand"]
    fig = figure(7.0, 3.8)
    ax = fig.add_subplot()
    hands = np.arange(1, len(running) + 1)
    ax.plot(hands, running, label="played: running mean, deal's CFR value subtracted")
    if c.get("advantage_given_deal_se") is not None:
        m, se = c["advantage_given_deal"], c["advantage_given_deal_se"]
        ax.axhspan(m - se, m + se, color="tab:blue", alpha=0.15, label="played: mean ± 1 s.e.")
    ax.axhline(0.0, color="black", lw=0.8, label="independent play (all CFR)")
    # Both solver readings: what colluders playing the team solve expect against C's CFR
    # policy (the demo's +0.059), and the team game's value, which they keep against any C.
    solver = c.get("solver_advantage") or {}
    for name, style in (("team_vs_unaware", "-."), ("team", "--")):
        if name in solver:
            ax.axhline(solver[name], color="tab:red", ls=style, label=SOLVER_READINGS[name])
    if c.get("paper_advantage") is not None:
        ax.axhline(c["paper_advantage"], color="tab:green", ls=":", label="Loki paper")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("hand")
    ax.set_ylabel("coalition advantage (chips)")
    who = " + ".join(c["agents"])
    ax.set_title(f"kuhn: collusion advantage of {who}, (R_A + R_B) / 2 per hand")
    ax.legend(loc="best", fontsize="small")
    return fig


def _grid(rows: list[list[float | None]]) -> np.ndarray:
    """A heatmap grid with its empty cells as NaN, which the colour map paints grey."""
    return np.array([[np.nan if v is None else v for v in r] for r in rows])


def _heatmap_titles(result: dict[str, Any]) -> dict[str, str]:
    """Each panel's title: the played panel's hands and mean, the solver's mean."""
    h = result["heatmap"]
    coalition = result["coalition"]
    solver_adv = h.get("solver_mean", (coalition.get("solver_advantage") or {}).get("team"))
    return {
        "played": f"played: {coalition['episodes']} hands, "
        f"mean {_fmt(coalition.get('advantage_given_deal'))}",
        "solver": f"solver (team CFR − CFR): mean {_fmt(solver_adv)}",
    }


def _annotate_cells(
    ax: Axes, grid: np.ndarray, size: int, hands: list[list[int]] | None, limit: float
) -> None:
    """Each dealt cell's value (and, for the played panel, its hands), legible on its colour."""
    for a in range(size):
        for b in range(size):
            if math.isnan(grid[a, b]):
                continue
            text = f"{grid[a, b]:+.2f}"
            if hands is not None:
                text += f"\nn={hands[a][b]}"
            dark = abs(grid[a, b]) > 0.6 * (limit or 1.0)
            ax.text(b, a, text, ha="center", va="center", fontsize=7, color="w" if dark else "k")


def _heatmap_figure(result: dict[str, Any]) -> Figure:
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    h = result["heatmap"]
    grids = {"played": _grid(h["played"]), "solver": _grid(h["solver"])}
    limit = max(
        float(np.nanmax(np.abs(g))) if np.isfinite(g).any() else 0.0 for g in grids.values()
    )
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-(limit or 1.0), vmax=limit or 1.0)
    cmap = colormaps["RdBu_r"].with_extremes(bad="#d9d9d9")  # grey: impossible or never dealt
    names = h["cards"]
    a_seat, b_seat = h["seats"]
    titles = _heatmap_titles(result)
    fig = figure(10.0, 4.6)
    axes = fig.subplots(1, 2)
    im = None
    for ax, (name, grid) in zip(axes, grids.items(), strict=True):
        im = ax.imshow(grid, cmap=cmap, norm=norm, origin="lower")
        ax.set_xticks(range(len(names)), names)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel(f"colluder B's card (seat {b_seat})")
        ax.set_ylabel(f"colluder A's card (seat {a_seat})")
        ax.set_title(titles[name], fontsize=10)
        _annotate_cells(ax, grid, len(names), h["hands"] if name == "played" else None, limit)
    assert im is not None
    fig.colorbar(im, ax=list(axes), shrink=0.85, label="Δ coalition payoff vs all-CFR, per deal")
    fig.suptitle("collusion advantage by colluders' cards, mean over C's card (Loki Figure 2)")
    return fig


# --- tables ---------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) < 0.5 * 10**-digits:
        x = 0.0  # an equilibrium value of -8e-05 reads "+0.000", not "-0.000"
    return f"{x:+.{digits}f}"


def _pm(mean: float | None, se: float | None) -> str:
    return _fmt(mean) + (f" ± {se:.3f}" if se is not None else "")


def _measured_cell(c: Mapping[str, Any]) -> str:
    """A Table 1 cell from play: mean ± s.e. (n hands), two decimals as the solver's cells."""
    if not c["n"]:
        return "–"
    se = f" ± {c['se']:.2f}" if c["se"] is not None else ""
    return f"{c['mean']:+.2f}{se} (n={c['n']})"


def _dealt_line(dealt: Mapping[str, Any]) -> str:
    """How the hands were dealt, for a caption; empty when chance dealt them all."""
    if not dealt.get("fixed"):
        return ""
    low, high = dealt["per_hand"]
    each = f"{low}" if low == high else f"{low} to {high}"
    which = "every deal" if dealt.get("every_deal") else f"{dealt['hands']} hands"
    line = f"fixed deals: {which}, {each} each"
    if dealt.get("chance"):
        line += f"; {dealt['chance']} dealt by chance"
    return line


def tables(run: str, r: dict[str, Any]) -> list[Table]:
    """Rich tables of :func:`analyze`'s result: seats, coalition, Table 1, channels."""
    out = [_seats_table(run, r)]
    if c := r.get("coalition"):
        out.append(_coalition_table(r, c))
    if tab := r.get("table1"):
        out.append(_table1_table(tab))
    if r.get("channels"):
        out.append(_channels_table(r["channels"]))
    return out


def _seats_table(run: str, r: dict[str, Any]) -> Table:
    title = f"{run} kuhn: {r['episodes']} hands".strip()
    if r.get("other_rules"):
        title += f" ({r['other_rules']} with other rules left out)"
    t = Table(title=title)
    for col in ("seat", "agent", "hands", "mean chips ± s.e.", "all play CFR", "mean reward"):
        t.add_column(col, justify="left" if col == "agent" else "right")
    for s in r["seats"]:
        t.add_row(
            str(s["seat"]),
            ", ".join(s["agents"]),
            str(s["hands"]),
            _pm(s["mean_chips"], s["se"]),
            _fmt(s["cfr_value"]),
            _fmt(s["mean_reward"]),
        )
    if r.get("policy"):
        t.caption = f"all play CFR: every seat plays {r['policy']} (expected chips per hand)"
        if not whole_deck(r):
            t.caption += ", on the hands played"
    if dealt := _dealt_line(r.get("dealt") or {}):
        t.caption = f"{t.caption}\n{dealt}" if t.caption else dealt
    return t


def _coalition_table(r: dict[str, Any], c: dict[str, Any]) -> Table:
    t = Table(title=f"coalition {' + '.join(c['agents'])} (seats {c['seats']}; {c['source']})")
    t.add_column("(R_A + R_B) / 2 per hand")
    t.add_column("value", justify="right")
    t.add_row("played", _pm(c["mean"], c["se"]))
    if "cfr_value" in c:
        t.add_row("all play CFR (same seats)", _fmt(c["cfr_value"]))
        t.add_row("advantage over independent play", _pm(c["advantage"], c["advantage_se"]))
        t.add_row(
            "advantage, deal's CFR value subtracted",
            _pm(c["advantage_given_deal"], c["advantage_given_deal_se"]),
        )
    for name, adv in (c.get("solver_advantage") or {}).items():
        t.add_row(SOLVER_READINGS.get(name, name), _fmt(adv))
    if c.get("paper_advantage") is not None:
        t.add_row("Loki paper (Figure 2 average)", _fmt(c["paper_advantage"], 4))
    if solver := r.get("solver"):
        t.caption = (
            f"team solve: CFR+ x {solver['team_iterations']}, "
            f"exploitability {solver['team_game_exploitability']:.2g}"
        )
    if not whole_deck(r):
        more = "CFR and solver values are on the hands played, not the whole deck"
        t.caption = f"{t.caption}\n{more}" if t.caption else more
    return t


def _table1_table(tab: dict[str, Any]) -> Table:
    t = Table(title=f"Table 1: expected chips of player C (seat {tab['seat']}) per hand [A, B, C]")
    t.add_column("")
    for h in tab["hands"]:
        t.add_column(f"[{', '.join(map(str, h))}]", justify="right")
    t.add_column(tab.get("last", "all hands"), justify="right")
    for label, cells in tab["rows"].items():
        if label == MEASURED_ROW:
            t.add_row(label, *(_measured_cell(c) for c in cells))
        else:
            t.add_row(label, *(_fmt(v, 2) for v in cells))
    return t


def _channels_table(channels: dict[str, Any]) -> Table:
    t = Table(title="messages per channel")
    for col in ("channel", "messages", "overheard", "deliveries", "senders", "overheard by"):
        t.add_column(
            col, justify="right" if col in ("messages", "overheard", "deliveries") else "left"
        )
    for name, ch in channels.items():
        t.add_row(
            name,
            str(ch["messages"]),
            str(ch["overheard_messages"]),
            str(ch["deliveries"]),
            ", ".join(ch["senders"]) or "-",
            ", ".join(ch["overhearers"]) or "-",
        )
    t.caption = "overheard: messages an eavesdropper read; deliveries: one per reader"
    return t
