"""Measures for the two-player social dilemmas: IPD, Split No-Comm, Trust-and-Split.

Per round and seat the engines' terminal observations give what was played
(moves, values, hands, proposals); ``round_rewards`` gives what it paid. From
those:

* mean reward per round of each agent (by agent id, over all its seats);
* collective welfare: the sum of both players' rewards divided by the
  cooperative optimum of the same rounds (IPD: the best joint payoff of one
  round, 3 + 3; the splits: every unit to the player who values it more);
* cooperation rate: the share of decisions that do not claim what the other
  values more. IPD: playing A. Split No-Comm: for every category the player
  does not value strictly more, keeping at most the cooperative share (0 where
  it values less, half where values tie). Trust-and-Split: proposing 0 with the
  lower hand; upper-hand decisions have no dilemma and are not counted.
* exploitation table: mean reward per round of each agent (row) against each
  opponent (column), for round-robin runs of baselines.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rich.table import Table

from backroom.analysis.episodes import Episode
from backroom.analysis.measures import GameMeasures, cell
from backroom.analysis.plotting import figure, save
from backroom.games.ipd import COOPERATE

GAMES = ("ipd", "split_nocomm", "trust_and_split")


def _ipd_rounds(ep: Episode) -> list[dict[str, Any]]:
    params = ep.get("params", {})
    r, t = float(params.get("reward", 3)), float(params.get("temptation", 5))
    s, p = float(params.get("sucker", 0)), float(params.get("punishment", 1))
    optimum = max(2 * r, t + s, 2 * p)
    out = []
    for h in ep["final_observations"][0]["history"]:
        moves = [h["mine"], h["theirs"]]  # seat 0's view: mine is seat 0
        out.append({"optimum": optimum, "cooperative": [m == COOPERATE for m in moves]})
    return out


def _split_rounds(ep: Episode) -> list[dict[str, Any]]:
    obs = ep["final_observations"][0]
    q = obs["quantities"]
    items = obs["items"]
    out = []
    for h in obs["history"]:
        values, props = h["values"], h["proposals"]
        optimum = sum(q[k] * max(values[0][i], values[1][i]) for i, k in enumerate(items))
        coop = []
        for seat in (0, 1):
            mine, theirs = values[seat], values[1 - seat]
            ok = all(
                props[seat][i] <= (0 if mine[i] < theirs[i] else q[k] // 2)
                for i, k in enumerate(items)
                if mine[i] <= theirs[i]
            )
            coop.append(ok)
        out.append({"optimum": optimum, "cooperative": coop})
    return out


def _tas_rounds(ep: Episode) -> list[dict[str, Any]]:
    obs = ep["final_observations"][0]
    coins = obs["coins"]
    upper = obs["values"]["upper"]
    out = []
    for h in obs["history"]:
        coop: list[bool | None] = []
        for seat in (0, 1):
            lower = h["values"][seat] < h["values"][1 - seat]
            coop.append(h["proposals"][seat] == 0 if lower else None)
        out.append({"optimum": coins * upper, "cooperative": coop})
    return out


ROUNDS = {"ipd": _ipd_rounds, "split_nocomm": _split_rounds, "trust_and_split": _tas_rounds}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class _Tally:
    """What one pass over the episodes gathers: per agent, per pairing and per round number."""

    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    coop: dict[str, list[bool]] = field(default_factory=lambda: defaultdict(list))
    vs: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    coop_by_round: dict[int, list[bool]] = field(default_factory=lambda: defaultdict(list))
    reward_by_round: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    welfare: float = 0.0
    optimum: float = 0.0
    rounds: int = 0

    def add_round(
        self, number: int, seats: list[str], rr: list[float], info: dict[str, Any]
    ) -> None:
        """One round's rewards and decisions, credited to the agents in its two seats."""
        self.rounds += 1
        self.welfare += sum(rr)
        self.optimum += info["optimum"]
        self.reward_by_round[number].append(sum(rr) / 2)
        for seat in (0, 1):
            agent, other = seats[seat], seats[1 - seat]
            self.rewards[agent].append(rr[seat])
            self.vs[(agent, other)].append(rr[seat])
            c = info["cooperative"][seat]
            if c is not None:
                self.coop[agent].append(bool(c))
                self.coop_by_round[number].append(bool(c))

    def measures(self, game: str, episodes: int) -> dict[str, Any]:
        """The rates and means the tally adds up to (no plots yet)."""
        all_coop = [c for cs in self.coop.values() for c in cs]
        agents = sorted(self.rewards)
        table = {
            a: {b: _mean(self.vs[(a, b)]) for b in agents if (a, b) in self.vs} for a in agents
        }
        return {
            "game": game,
            "episodes": episodes,
            "rounds": self.rounds,
            "mean_reward_per_round": {a: _mean(self.rewards[a]) for a in agents},
            "welfare_fraction": self.welfare / self.optimum if self.optimum else None,
            "cooperation_rate": _mean([float(c) for c in all_coop]),
            "cooperation_rate_by_agent": {
                a: _mean([float(c) for c in self.coop[a]]) for a in agents
            },
            "cooperation_rate_by_round": {
                str(r): _mean([float(c) for c in cs])
                for r, cs in sorted(self.coop_by_round.items())
            },
            "exploitation": table,
            "plots": [],
        }


def analyze(game: str, episodes: list[Episode], out_dir: Path | None = None) -> dict[str, Any]:
    tally = _Tally()
    for ep in episodes:
        rounds = ROUNDS[game](ep)
        for i, (rr, info) in enumerate(zip(ep["round_rewards"], rounds, strict=False)):
            tally.add_round(i + 1, ep["seats"], rr, info)
    result = tally.measures(game, len(episodes))
    if out_dir is not None and episodes:
        result["plots"] = _plots(game, result, tally.reward_by_round, out_dir)
    return result


def _plots(
    game: str, result: dict[str, Any], reward_by_round: dict[int, list[float]], out_dir: Path
) -> list[str]:
    paths = []
    fig = figure()
    ax = fig.add_subplot()
    rounds = sorted(reward_by_round)
    ax.plot(
        rounds,
        [sum(reward_by_round[r]) / len(reward_by_round[r]) for r in rounds],
        marker="o",
        label="mean reward per player",
    )
    ax.set_xlabel("round")
    ax.set_ylabel("reward")
    ax2 = ax.twinx()
    by_round = result["cooperation_rate_by_round"]
    ax2.plot(
        [int(r) for r in by_round],
        list(by_round.values()),
        color="tab:green",
        marker="s",
        label="cooperation rate",
    )
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel("cooperation rate")
    # Two y-axes: one legend naming both lines, or the reader cannot tell which scale is whose.
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], loc="best", fontsize="small")
    ax.set_title(f"{game}: reward and cooperation by round")
    paths.append(save(fig, out_dir, f"{game}_by_round"))

    table = result["exploitation"]
    agents = sorted(table)
    if agents:
        fig = figure(1.6 + 1.1 * len(agents), 1.4 + 0.8 * len(agents))
        ax = fig.add_subplot()
        grid = [[table[a].get(b) for b in agents] for a in agents]
        nums = [[float("nan") if v is None else v for v in row] for row in grid]
        im = ax.imshow(nums, cmap="viridis")
        ax.set_xticks(range(len(agents)), agents, rotation=30, ha="right")
        ax.set_yticks(range(len(agents)), agents)
        ax.set_xlabel("opponent")
        ax.set_ylabel("agent")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w")
        fig.colorbar(im, ax=ax, label="mean reward per round")
        ax.set_title(f"{game}: exploitation table")
        paths.append(save(fig, out_dir, f"{game}_exploitation"))
    return paths


def tables(game: str, run: str, r: dict[str, Any]) -> list[Table]:
    """Mean reward and cooperation per agent; with several agents, who exploits whom."""
    t = Table(title=f"{run} {game}: {r['episodes']} episodes, {r['rounds']} rounds".strip())
    for col in ("agent", "mean reward / round", "cooperation rate"):
        t.add_column(col)
    for agent, mean in r["mean_reward_per_round"].items():
        t.add_row(agent, cell(mean), cell(r["cooperation_rate_by_agent"].get(agent)))
    t.caption = (
        f"welfare {cell(r['welfare_fraction'])} of the cooperative optimum; "
        f"cooperation rate {cell(r['cooperation_rate'])}"
    )
    out = [t]
    agents = sorted(r["exploitation"])
    if len(agents) > 1:
        x = Table(title=f"{game}: mean reward per round (row agent vs column opponent)")
        x.add_column("agent \\ opponent")
        for a in agents:
            x.add_column(a)
        for a in agents:
            x.add_row(a, *(cell(r["exploitation"][a].get(b)) for b in agents))
        out.append(x)
    return out


MEASURES = {g: GameMeasures(partial(analyze, g), partial(tables, g)) for g in GAMES}
