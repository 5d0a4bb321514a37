"""``backroom league show DIR``: the leaderboard, head to head and exploitability, and plots.

Everything comes from ``standings.json`` (what the league wrote last);
``--refresh`` recomputes it from the store first (a league killed before it
wrote its final standings, or exploitability after a running snapshot).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backroom.analysis.plotting import figure, save
from backroom.league.exploit import MIN_COVERAGE as EXPLOIT_MIN_COVERAGE


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def ratings_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for col in ("#", "agent", "rating", "± sigma", "ordinal", "matches", "mean return"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for i, r in enumerate(rows, 1):
        table.add_row(
            str(i),
            r["agent"],
            _num(r["mu"]),
            _num(r["sigma"]),
            _num(r["ordinal"]),
            str(r["matches"]),
            _num(r["mean_return"], 3),
        )
    return table


def h2h_table(title: str, h2h: dict[str, Any]) -> Table:
    table = Table(title=title, caption="row's mean return against column ± SE (over CRN groups)")
    agents = h2h["agents"]
    table.add_column("")
    for a in agents:
        table.add_column(a, justify="right")
    for i, a in enumerate(agents):
        cells = []
        for j in range(len(agents)):
            m, se = h2h["mean"][i][j], h2h["se"][i][j]
            cells.append("" if m is None else f"{m:.2f}" + ("" if se is None else f" ±{se:.2f}"))
        table.add_row(a, *cells)
    return table


def _ci(x: float | None, ci: list[float | None] | None, digits: int) -> str:
    if x is None:
        return "-"
    lo, hi = ci or [None, None]
    return _num(x, digits) + (
        "" if lo is None or hi is None else f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    )


def rankings_table(title: str, rankings: dict[str, Any], ratings: list[dict[str, Any]]) -> Table:
    """The payoff-consistent ranking: Nash averaging and α-Rank with bootstrap intervals."""
    by = "Nash averaging" if rankings["ordered_by"] == "nash_averaging" else "α-Rank"
    boot = rankings.get("bootstrap", 0)
    caption = f"ordered by {by}; " + (
        f"[95% bootstrap interval over CRN groups, {boot} draws]"
        if boot
        else "no intervals while the league runs"
    )
    table = Table(title=title, caption=caption)
    cols = ("#", "agent", "Nash avg", "Nash mass", "α-Rank", "mean return", "openskill #")
    for col in cols:
        table.add_column(col, justify="left" if col == "agent" else "right")
    means = {r["agent"]: r["mean_return"] for r in ratings}
    for i, r in enumerate(rankings["rows"], 1):
        table.add_row(
            str(i),
            r["agent"],
            _ci(r["nash"], r["nash_ci"], 3),
            _num(r["nash_mass"], 3),
            _ci(r["alpharank"], r["alpharank_ci"], 3),
            _num(means.get(r["agent"]), 3),
            str(r["openskill_rank"] or "-"),
        )
    return table


def print_rankings(key: str, game: dict[str, Any], console: Console) -> None:
    rankings = game["rankings"]
    if rankings.get("ordered_by") is None:
        console.print(f"{key}: no payoff ranking ({rankings.get('reason')})")
        return
    console.print(rankings_table(f"{key}: ranking by the payoffs", rankings, game["ratings"]))
    for field in ("note", "alpharank_missing", "disagreement"):
        if rankings.get(field):
            console.print(rankings[field], markup=False, highlight=False)


def exploit_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title=title,
        caption="exact: the agent's policy asked at every information state; empirical: a best "
        "response to its recorded play (unvisited states uniform), n/a below "
        f"{EXPLOIT_MIN_COVERAGE:.0%} of the states visited, [95% bootstrap over CRN groups]",
    )
    for col in ("agent", "exploitability", "method", "states visited", "decisions", "OpenSpiel"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for r in rows:
        method = r.get("method", "empirical")
        shown = r.get("shown", r["value"])
        value = "n/a" if shown is None else f"{shown:.4f}"
        if method == "empirical" and r.get("ci") and shown is not None:
            value += f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
        table.add_row(
            r["agent"],
            value,
            method,
            f"{r['visited']}/{r['states']}",
            str(r["decisions"]),
            _num(r.get("openspiel"), 4),
        )
    return table


def grounded_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title=title,
        caption="mean over opponents met of (its payoff against them - the equilibrium's "
        "exact payoff against them) [95% bootstrap over CRN groups]",
    )
    for col in ("agent", "gain", "equilibrium vs field", "opponents"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for r in rows:
        table.add_row(
            r["agent"],
            _ci(r["gain"], r["ci"], 3),
            _num(r["equilibrium_vs_field"], 3),
            str(r["opponents"]),
        )
    return table


def coalition_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title=title,
        caption="per match seating every member: the members' summed return - the value "
        "their seats guarantee in the team game [95% bootstrap over CRN groups]; exact: what "
        "a best response takes from the pair's joint policy beyond the team game's value",
    )
    cols = ("coalition", "members", "gain over team value", "team value", "matches", "exact")
    for col in cols:
        table.add_column(col, justify="left" if col in ("coalition", "members") else "right")
    for r in rows:
        values = sorted(set(round(v, 4) for v in r["team_values"].values()))
        exact = r.get("exact") or {}  # the joint policy's exploitability (league/coalition.py)
        table.add_row(
            r["coalition"],
            ", ".join(r["members"]),
            _ci(r["gain"], r["ci"], 3),
            ", ".join(f"{v:.4f}" for v in values),
            str(r["matches"]),
            f"{exact['exploitability']:.4f} at seats {exact['seats']}"
            if "exploitability" in exact
            else "-",
        )
    return table


def _print_game(key: str, game: dict[str, Any], console: Console) -> None:
    """One game's tables, each only where the league measured it."""
    rankings = game.get("rankings", {})
    # a zero-sum game's headline is the payoff ranking; openskill's order follows it
    headline = rankings.get("ordered_by") == "nash_averaging"
    if headline:
        print_rankings(key, game, console)
    console.print(ratings_table(f"{key}: ratings (openskill Plackett-Luce)", game["ratings"]))
    if rankings and not headline:
        print_rankings(key, game, console)
    if game["head_to_head"]["agents"]:
        console.print(h2h_table(f"{key}: head to head", game["head_to_head"]))
    if "exploitability" in game:
        console.print(exploit_table(f"{key}: exploitability", game["exploitability"]))
    if game.get("grounded"):
        console.print(grounded_table(f"{key}: gain over the equilibrium", game["grounded"]))
    if game.get("coalitions"):
        console.print(coalition_table(f"{key}: coalitions", game["coalitions"]))


def _print_fallbacks(doc: dict[str, Any], console: Console) -> None:
    """Which agents' moves were not their own, and the warnings that go with them."""
    fallbacks = doc.get("fallbacks")
    if fallbacks is None:
        return
    moved = {a: c for a, c in fallbacks.items() if c["fallbacks"]}
    console.print(
        "moves not the agent's own choice (fallbacks): "
        + (", ".join(f"{a} {c['fallbacks']} of {c['moves']}" for a, c in moved.items()) or "none")
    )
    for line in doc.get("warnings", []):
        console.print(line, style="yellow", markup=False, highlight=False)


def print_standings(doc: dict[str, Any], console: Console) -> None:
    c = doc.get("counters", {})
    state = "running" if doc.get("running") else "finished"
    console.print(
        f"league [bold]{doc['league']}[/bold] ({state}): {doc['counted']} of {doc['scheduled']} "
        f"scheduled matches counted; voided {c.get('voided', 0)}, duplicates dropped "
        f"{c.get('duplicates', 0)}"
    )
    for key, game in doc["games"].items():
        _print_game(key, game, console)
    if "overall" in doc:
        console.print(ratings_table("all games: ratings", doc["overall"]))
    _print_fallbacks(doc, console)


def plot_ratings(title: str, rows: list[dict[str, Any]], out: Path, name: str) -> str:
    fig = figure(7.0, 0.5 + 0.4 * max(1, len(rows)))
    ax = fig.add_subplot()
    agents = [r["agent"] for r in rows][::-1]
    mu = [r["mu"] for r in rows][::-1]
    err = [3 * r["sigma"] for r in rows][::-1]
    ax.errorbar(mu, range(len(agents)), xerr=err, fmt="o", capsize=4)
    ax.set_yticks(range(len(agents)), agents)
    ax.set_xlabel("rating mu ± 3 sigma (left end: the ordinal)")
    ax.set_title(title)
    return save(fig, out, name)


def plot_h2h(title: str, h2h: dict[str, Any], out: Path, name: str) -> str:
    import numpy as np

    agents = h2h["agents"]
    data = np.array([[np.nan if x is None else x for x in row] for row in h2h["mean"]], dtype=float)
    size = 1.5 + 0.7 * len(agents)
    fig = figure(size + 1.5, size)
    ax = fig.add_subplot()
    lim = float(np.nanmax(np.abs(data))) if np.isfinite(data).any() else 1.0
    if np.isfinite(data).any() and float(np.nanmin(data)) >= 0:  # payoffs, not gains and losses
        image = ax.imshow(data, cmap="Blues", vmin=0, vmax=lim or 1)
    else:
        image = ax.imshow(data, cmap="RdBu", vmin=-lim or -1, vmax=lim or 1)
    ax.set_xticks(range(len(agents)), agents, rotation=45, ha="right")
    ax.set_yticks(range(len(agents)), agents)
    for i in range(len(agents)):
        for j in range(len(agents)):
            if np.isfinite(data[i, j]):
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="row's mean return against column")
    ax.set_title(title)
    return save(fig, out, name)


def plot_standings(doc: dict[str, Any], out: Path) -> list[str]:
    paths = []
    for key, game in doc["games"].items():
        if game["ratings"]:
            paths.append(plot_ratings(f"{key}: ratings", game["ratings"], out, f"{key}_ratings"))
        if game["head_to_head"]["agents"]:
            paths.append(plot_h2h(f"{key}: head to head", game["head_to_head"], out, f"{key}_h2h"))
    return paths
