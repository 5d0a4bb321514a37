"""What every game gets from ``backroom analyze``: per-seat and per-agent means, a coalition.

The game modules (``social``, ``beauty``, ``bertrand``, ``kuhn``) measure what their
papers measure. Any other game (an OpenSpiel or PettingZoo one, a game of your own)
still has returns, seats and perhaps a coalition, so it gets the numbers ``backroom
run`` prints and a little more, instead of only a count:

* per seat and per agent: the mean raw return (the game's own payoff, before any
  reward transform) with its standard error, over played matches;
* for a match whose reward transform names a coalition: the coalition's mean raw
  return per member, the other seats' mean, and the coalition's advantage (the two
  differenced match by match, so the spread is over matches, with its standard error);
* the channels' message counts (``episodes.channel_stats``).

The title names the game with its OpenSpiel or PettingZoo name (``openspiel
leduc_poker``), and tables are at least as wide as their titles so rich never
squeezes a title into a column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from backroom.analysis.episodes import Episode, channel_stats
from backroom.analysis.measures import cell


def mean_se(xs: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); None where undefined."""
    if not xs:
        return None, None
    mean = math.fsum(xs) / len(xs)
    if len(xs) < 2:
        return mean, None
    var = math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, math.sqrt(var / len(xs))


def game_label(game: str, params: Mapping[str, Any] | None) -> str:
    """``openspiel leduc_poker``, ``pettingzoo rps``: the game a reader would name."""
    params = params or {}
    inner = params.get("name") if game == "openspiel" else params.get("env")
    return f"{game} {inner}" if isinstance(inner, str) and inner else game


def _raw(e: Episode) -> list[float]:
    raw = e.get("raw_returns") or e.get("returns") or []
    return [float(x) for x in raw]


def _summary(xs: Sequence[float]) -> dict[str, Any]:
    mean, se = mean_se(xs)
    return {"n": len(xs), "mean": mean, "se": se}


def coalition_seats(e: Episode) -> list[int] | None:
    """The seats the match's reward transform names as a coalition, if it names one."""
    transform = (e.get("spec") or {}).get("transform") or {}
    if transform.get("kind") != "coalition" or not transform.get("members"):
        return None
    return [int(s) for s in transform["members"]]


def _coalition(eps: Sequence[Episode]) -> dict[str, Any] | None:
    """Members' mean raw return per match against the other seats', differenced per match."""
    members_mean: list[float] = []
    others_mean: list[float] = []
    agents: set[str] = set()
    for e in eps:
        seats = coalition_seats(e)
        raw = _raw(e)
        if seats is None or not raw or not all(0 <= s < len(raw) for s in seats):
            continue
        rest = [s for s in range(len(raw)) if s not in seats]
        members_mean.append(math.fsum(raw[s] for s in seats) / len(seats))
        others_mean.append(math.fsum(raw[s] for s in rest) / len(rest) if rest else 0.0)
        agents.update(str(e["seats"][s]) for s in seats)
    if not members_mean:
        return None
    return {
        "agents": sorted(agents),
        "matches": len(members_mean),
        "members": _summary(members_mean),
        "others": _summary(others_mean),
        "advantage": _summary([m - o for m, o in zip(members_mean, others_mean, strict=True)]),
    }


def analyze(episodes: list[Episode], out_dir: Path | None = None) -> dict[str, Any]:
    """Per-seat and per-agent means with standard errors, a coalition, channels."""
    del out_dir  # no plots: the numbers are the tables
    first = episodes[0] if episodes else {}
    seats: dict[int, list[float]] = {}
    agents: dict[str, list[float]] = {}
    for e in episodes:
        for seat, (agent, x) in enumerate(zip(e.get("seats") or [], _raw(e), strict=False)):
            seats.setdefault(seat, []).append(x)
            agents.setdefault(str(agent), []).append(x)
    return {
        "game": str(first.get("game", "")),
        "label": game_label(str(first.get("game", "")), first.get("params")),
        "episodes": len(episodes),
        "per_seat": {str(s): _summary(xs) for s, xs in sorted(seats.items())},
        "per_agent": {a: _summary(xs) for a, xs in sorted(agents.items())},
        "coalition": _coalition(episodes),
        "channels": channel_stats(episodes),
        "plots": [],
    }


def _pm(summary: Mapping[str, Any]) -> str:
    se = summary.get("se")
    return cell(summary.get("mean")) + (f" ± {se:.3f}" if se is not None else "")


def _table(title: str) -> Table:
    return Table(title=title, min_width=len(title) + 4)


def tables(run: str, r: dict[str, Any]) -> list[Table]:
    """The per-seat, per-agent and coalition tables, titled ``run / game``."""
    where = f"{run} / {r.get('label') or r.get('game')}".strip(" /")
    out: list[Table] = []
    for key, column in (("per_seat", "seat"), ("per_agent", "agent")):
        t = _table(f"{where}: mean raw return per {column}, {r['episodes']} matches")
        for col in (column, "matches", "mean ± se"):
            t.add_column(col, justify="left" if col == column else "right")
        for name, s in r.get(key, {}).items():
            t.add_row(name, str(s["n"]), _pm(s))
        out.append(t)
    if c := r.get("coalition"):
        t = _table(f"{where}: coalition {' + '.join(c['agents'])} ({c['matches']} matches)")
        for col in ("", "mean ± se"):
            t.add_column(col, justify="left" if not col else "right")
        t.add_row("coalition, per member", _pm(c["members"]))
        t.add_row("other seats, per seat", _pm(c["others"]))
        t.add_row("advantage (per match)", _pm(c["advantage"]))
        out.append(t)
    if channels := r.get("channels"):
        t = _table(f"{where}: channels")
        for col in ("channel", "messages", "deliveries", "overheard"):
            t.add_column(col, justify="left" if col == "channel" else "right")
        for name, ch in channels.items():
            t.add_row(name, str(ch["messages"]), str(ch["deliveries"]), str(ch["overheard"]))
        out.append(t)
    return out
