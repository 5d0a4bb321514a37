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


def exploit_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title=title,
        caption="best response against the empirical policy; unvisited states play uniformly",
    )
    for col in ("agent", "exploitability", "states visited", "decisions"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for r in rows:
        table.add_row(
            r["agent"], f"{r['value']:.4f}", f"{r['visited']}/{r['states']}", str(r["decisions"])
        )
    return table


def print_standings(doc: dict[str, Any], console: Console) -> None:
    c = doc.get("counters", {})
    state = "running" if doc.get("running") else "finished"
    console.print(
        f"league [bold]{doc['league']}[/bold] ({state}): {doc['counted']} of {doc['scheduled']} "
        f"scheduled matches counted; voided {c.get('voided', 0)}, duplicates dropped "
        f"{c.get('duplicates', 0)}"
    )
    for key, game in doc["games"].items():
        console.print(ratings_table(f"{key}: ratings (openskill Plackett-Luce)", game["ratings"]))
        if game["head_to_head"]["agents"]:
            console.print(h2h_table(f"{key}: head to head", game["head_to_head"]))
        if "exploitability" in game:
            console.print(exploit_table(f"{key}: exploitability", game["exploitability"]))
    if "overall" in doc:
        console.print(ratings_table("all games: ratings", doc["overall"]))
    fallbacks = doc.get("fallbacks")
    if fallbacks is not None:
        moved = {a: c for a, c in fallbacks.items() if c["fallbacks"]}
        console.print(
            "moves not the agent's own choice (fallbacks): "
            + (
                ", ".join(f"{a} {c['fallbacks']} of {c['moves']}" for a, c in moved.items())
                or "none"
            )
        )
        for line in doc.get("warnings", []):
            console.print(line, style="yellow", markup=False, highlight=False)


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
