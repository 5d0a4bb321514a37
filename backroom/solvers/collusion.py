"""What collusion is worth in theory: per-deal values, the Figure 2 heatmap and the Table 1 rows.

Reproduces the CFR analyses of the Loki paper (section 4) on our engine:

* **(a) all-CFR** — every seat plays the three-player CFR average policy.
* **(b) team-CFR vs CFR** — the colluders play the team solve's joint
  strategy (both private cards known to both) and the third player plays the
  strategy it learned running CFR against the team in the same solve (see
  :mod:`backroom.solvers.team` for why this is the reading we take).

For every deal (the cards of every seat; the random first player is averaged
out) we compute each seat's expected return under each profile. The
*collusion advantage* of a deal is the change in the colluders' coalition
payoff, Loki eq. 1, ``R_coalition = (R_A + R_B) / 2``, from (a) to (b); its
average over deals is the paper's 0.0078. Extra profiles, reported alongside:

* ``team_vs_unaware`` — the team strategy against a third player who keeps
  its three-player CFR policy;
* ``team_br`` — the team's best response to that fixed policy (the most an
  unaware CFR player can lose to colluders);
* ``distilled`` — each colluder plays the Algorithm 3 distillation of the team
  strategy (its own card only, no channel) against the team solve's third player;
* ``paper`` — the paper's own construction: Algorithm 3 applied to the
  colluders' *individual* three-player CFR strategies (query {hand, bets,
  folds}, pooled over both colluders; :func:`~backroom.solvers.team.distill_individual_policy`),
  the third player keeping its CFR strategy. No card is shared, so this
  measures what pooling the two CFR strategies changes, not what knowing the
  partner's card is worth; it is the reading comparable with the paper's 0.0078.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backroom.games.base import Game, make_game
from backroom.solvers.cfr import CFRSolver
from backroom.solvers.evaluate import best_response, nash_conv
from backroom.solvers.policy_file import write_policy
from backroom.solvers.team import (
    TEAM,
    TeamSolution,
    build_team_tree,
    distill_individual_policy,
    distill_team_policy,
    lift_policy,
    paper_state,
    solve_team,
)
from backroom.solvers.tree import FloatArray, GameTree, build_tree

Deal = tuple[int, ...]
#: The hands of the paper's Table 1, as [card of A, card of B, card of C].
PAPER_HANDS: tuple[Deal, ...] = ((0, 1, 4), (2, 3, 4), (3, 4, 0))
PAPER_AVERAGE_ADVANTAGE = 0.0078
#: What each reading (profile) of a :class:`CollusionReport` is, for printouts.
READINGS: dict[str, str] = {
    "cfr": "every seat plays the three-player CFR policy (the baseline)",
    "team": "team solve: colluders share cards, C runs CFR against them",
    "team_vs_unaware": "team strategy vs C's unchanged three-player CFR policy",
    "team_br": "team's best response to C's three-player CFR policy",
    "distilled": "Algorithm 3 on the team strategy (own card only) vs the team solve's C",
    "paper": "paper's construction: Algorithm 3 on the colluders' individual CFR strategies vs CFR C",
}
#: Where docs/solvers.md explains why our averages differ from the paper's.
WHY_DIFFERENT_DOC = 'docs/solvers.md, "Why our average differs from the paper\'s 0.0078"'


def per_deal_values(
    tree: GameTree, sigma: FloatArray, deal_len: int | None = None
) -> tuple[list[Deal], FloatArray]:
    """Expected raw return of every seat conditional on each deal.

    A deal is the first ``deal_len`` chance outcomes (default: one card per
    seat); later chance (Loki's random first player) is averaged over with its
    probabilities: ``E[u | deal] = Σ_{z ∈ deal} π(z) u(z) / P(deal)``.
    """
    k = tree.num_seats if deal_len is None else deal_len
    deals: dict[Deal, int] = {}
    path_deal = np.array(
        [
            deals.setdefault(tuple(int(c) for c in path[:k]), len(deals))
            for path in tree.chance_paths
        ],
        dtype=np.int64,
    )
    reach = tree.terminal_reach(sigma)
    term_deal = path_deal[tree.term_path]
    prob = np.bincount(path_deal, tree.chance_path_prob, minlength=len(deals))
    values = np.stack(
        [
            np.bincount(term_deal, reach * tree.term_returns[:, s], minlength=len(deals))
            for s in range(tree.num_seats)
        ],
        axis=1,
    )
    return list(deals), values / prob[:, None]


def _merge(
    team_policy: Mapping[str, Any], other: Mapping[str, Any], team_prefix: str = "team["
) -> dict[str, Any]:
    """The team's rows from one policy, everybody else's from another."""
    out = {k: v for k, v in team_policy.items() if k.startswith(team_prefix)}
    out.update({k: v for k, v in other.items() if not k.startswith(team_prefix)})
    return out


@dataclass
class CollusionReport:
    """Per-deal expected returns of every seat under each profile, plus how they were made."""

    game: str
    params: dict[str, Any]
    team: tuple[int, ...]
    deals: list[Deal]
    values: dict[str, FloatArray]  # profile -> (num deals, num seats)
    summary: dict[str, Any] = field(default_factory=dict)
    policies: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def victims(self) -> list[int]:
        return [s for s in range(self.values["cfr"].shape[1]) if s not in self.team]

    def coalition(self, profile: str) -> FloatArray:
        """Loki eq. 1 per deal: ``(R_A + R_B) / 2`` (the mean over the colluders)."""
        return self.values[profile][:, list(self.team)].mean(axis=1)

    def advantage(self, profile: str = "team", base: str = "cfr") -> FloatArray:
        """Collusion advantage per deal: coalition payoff under ``profile`` minus under ``base``."""
        return self.coalition(profile) - self.coalition(base)

    def average_advantage(self, profile: str = "team", base: str = "cfr") -> float:
        """Mean over deals (deals are equally likely, so this is the expected advantage)."""
        return float(np.mean(self.advantage(profile, base)))

    def hand_value(self, profile: str, hand: Deal, seat: int) -> float:
        return float(self.values[profile][self.deals.index(tuple(hand)), seat])

    def to_json(self) -> dict[str, Any]:
        return {
            "game": self.game,
            "params": self.params,
            "team": list(self.team),
            "summary": self.summary,
            "deals": [
                {
                    "deal": list(d),
                    **{name: v[i].tolist() for name, v in self.values.items()},
                    "advantage": float(self.advantage()[i]),
                }
                for i, d in enumerate(self.deals)
            ],
        }


def why_different(report: CollusionReport) -> str:
    """One line for printouts: why our average is not the paper's 0.0078, and where the doc says more."""
    adv = report.summary["average_advantage"]
    return (
        f"why ours differs: the paper applies Algorithm 3 to each colluder's own three-player CFR "
        f"strategy (no card shared; reading 'paper' here: {adv['paper']:+.4f}), while 'team' "
        f"({adv['team']:+.4f}) is the exact worth of sharing cards; see {WHY_DIFFERENT_DOC}"
    )


def analyse_collusion(
    game: Game | None = None,
    iterations: int = 20_000,
    *,
    team: Sequence[int] = (0, 1),
    algo: str = "cfr+",
    team_iterations: int | None = None,
    cfr_policy: Mapping[str, Mapping[str, float]] | None = None,
) -> CollusionReport:
    """Solve the game both ways and tabulate per-deal values (see the module docstring).

    ``cfr_policy`` (a policy file's ``policy``) stands for the three-player
    solve: given, the all-CFR profile is that policy, so a run whose third
    player played a shipped policy is compared with what it actually played,
    and only the team game is solved (``team_iterations``, else ``iterations``).
    """
    game = game or make_game("kuhn", variant="loki")
    team = tuple(team)
    tree = build_tree(game, features=paper_state)
    solved = cfr_policy is None
    cfr = _three_player_profile(tree, iterations, algo, cfr_policy)
    cfr_rows = tree.policy_dict(cfr)

    team_tree = build_team_tree(game, team)
    sol: TeamSolution = solve_team(game, team, team_iterations or iterations, algo, tree=team_tree)
    team_policy = sol.policy()
    vs_unaware = team_tree.sigma_from_policy(_merge(team_policy, cfr_rows))
    lifted = lift_policy(team_tree, cfr_rows)
    br_value, br_sigma = best_response(team_tree, lifted, TEAM, with_response=True)
    assert br_sigma is not None
    distilled = distill_team_policy(sol)
    distilled_sigma = tree.sigma_from_policy({**cfr_rows, **_merge({}, team_policy), **distilled})
    paper = distill_individual_policy(tree, cfr, team)
    paper_sigma = tree.sigma_from_policy({**cfr_rows, **paper})

    deals, v_cfr = per_deal_values(tree, cfr)
    values = {"cfr": v_cfr}
    for name, t, s in (
        ("team", team_tree, sol.sigma),
        ("team_vs_unaware", team_tree, vs_unaware),
        ("team_br", team_tree, br_sigma),
        ("distilled", tree, distilled_sigma),
        ("paper", tree, paper_sigma),
    ):
        d, v = per_deal_values(t, s)
        index = {deal: i for i, deal in enumerate(d)}
        values[name] = v[[index[deal] for deal in deals]]
    report = CollusionReport(
        game=game.name,
        params=dict(game.params()),
        team=team,
        deals=deals,
        values=values,
        policies={"cfr": cfr_rows, "team": team_policy, "distilled": distilled, "paper": paper},
    )
    report.summary = {
        "iterations": iterations if solved else None,
        "cfr_policy": "solved" if solved else "given",
        "team_iterations": team_iterations or iterations,
        "algo": algo,
        "cfr_nash_conv": nash_conv(tree, cfr),
        "team_game_exploitability": sol.exploitability,
        "team_value_sum": sol.team_value,
        "team_guaranteed_value_sum": sol.guaranteed_value(),
        "team_br_value_sum": br_value,
        "average_advantage": {
            name: report.average_advantage(name) for name in values if name != "cfr"
        },
        "paper_average_advantage": PAPER_AVERAGE_ADVANTAGE,
        "readings": {name: READINGS.get(name, "") for name in values},
        "mean_values": {name: v.mean(axis=0).tolist() for name, v in values.items()},
    }
    return report


def _three_player_profile(
    tree: GameTree,
    iterations: int,
    algo: str,
    cfr_policy: Mapping[str, Mapping[str, float]] | None,
) -> FloatArray:
    """The all-CFR profile: ``cfr_policy`` when given (what a run actually played), else solved."""
    if cfr_policy is not None:
        return tree.sigma_from_policy({k: dict(v) for k, v in cfr_policy.items()})
    solver = CFRSolver(tree, algo)
    solver.run(iterations)
    return solver.average_policy()


# --- Figure 2 -------------------------------------------------------------------------------


def advantage_grid(report: CollusionReport, profile: str = "team", base: str = "cfr") -> FloatArray:
    """``grid[c, a, b]``: advantage when A holds ``a``, B holds ``b`` and the victim ``c``;
    ``grid[-1]`` averages over the victim's card. NaN marks impossible deals."""
    adv = report.advantage(profile, base)
    cards = 1 + max(max(d) for d in report.deals)
    a_seat, b_seat = report.team[:2]
    c_seat = report.victims[0]
    grid = np.full((cards + 1, cards, cards), np.nan)
    sums: dict[tuple[int, int], list[float]] = defaultdict(list)
    for deal, value in zip(report.deals, adv, strict=True):
        grid[deal[c_seat], deal[a_seat], deal[b_seat]] = value
        sums[(deal[a_seat], deal[b_seat])].append(float(value))
    for (a, b), vals in sums.items():
        grid[cards, a, b] = float(np.mean(vals))
    return grid


def plot_heatmap(
    report: CollusionReport, path: str | Path, profile: str = "team", base: str = "cfr"
) -> Path:
    """Figure 2: colluder A's card × B's card, red = collusion gains, blue = loses, grey = impossible.

    The large panel averages over the victim's card; the small ones fix it.
    Uses matplotlib's Agg canvas directly, so no global backend is touched.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    grid = advantage_grid(report, profile, base)
    cards = grid.shape[1]
    limit = float(np.nanmax(np.abs(grid))) or 1.0
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit)
    names = card_names(report, cards)
    cmap = colormaps["RdBu_r"].with_extremes(bad="#d9d9d9")  # grey: impossible deal
    a_seat, b_seat = report.team[:2]
    cols = (cards + 1) // 2
    fig = Figure(figsize=(11, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 2 + cols, width_ratios=[1.0, 1.0] + [0.62] * cols)
    ax = fig.add_subplot(gs[:, :2])
    im = ax.imshow(grid[cards], cmap=cmap, norm=norm, origin="lower")
    ax.set_xticks(range(cards), names)
    ax.set_yticks(range(cards), names)
    ax.set_xlabel(f"colluder B's card (seat {b_seat})")
    ax.set_ylabel(f"colluder A's card (seat {a_seat})")
    avg = report.average_advantage(profile, base)
    ax.set_title(
        f"collusion advantage ({profile} − {base}), mean over C's card\n"
        f"average {avg:+.4f} (Loki paper: {PAPER_AVERAGE_ADVANTAGE})",
        fontsize=10,
    )
    for a in range(cards):
        for b in range(cards):
            if not math.isnan(grid[cards, a, b]):
                ax.text(b, a, f"{grid[cards, a, b]:+.3f}", ha="center", va="center", fontsize=8)
    for c in range(cards):
        axc = fig.add_subplot(gs[c // cols, 2 + c % cols])
        axc.imshow(grid[c], cmap=cmap, norm=norm, origin="lower")
        axc.set_title(f"C holds {names[c]}", fontsize=9)
        axc.set_xticks(range(cards), names, fontsize=6)
        axc.set_yticks(range(cards), names, fontsize=6)
    if profile in READINGS:
        fig.suptitle(f"reading '{profile}': {READINGS[profile]}", fontsize=10)
    fig.colorbar(im, ax=fig.axes, shrink=0.85, label="Δ coalition payoff (R_A + R_B) / 2 per deal")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def card_names(report: CollusionReport, cards: int) -> list[str]:
    """Axis labels of a heatmap: "3:K" for Loki's cards (index and face), the index otherwise."""
    if report.game == "kuhn" and report.params.get("variant") == "loki":
        from backroom.games.kuhn import LOKI_CARD_NAMES

        return [f"{i}:{n if n == '10' else n[0]}" for i, n in enumerate(LOKI_CARD_NAMES)][:cards]
    return [str(i) for i in range(cards)]


# --- Table 1 --------------------------------------------------------------------------------


def hand_values(
    report: CollusionReport, profile: str, hands: Iterable[Deal], seat: int
) -> dict[Deal, float]:
    """One Table 1 row: ``seat``'s expected return for each hand under ``profile``."""
    return {tuple(h): report.hand_value(profile, tuple(h), seat) for h in hands}


def hand_evs_from_episodes(
    records: Iterable[Any], seat: int, *, raw: bool = True
) -> dict[Deal, tuple[float, int]]:
    """Mean return of ``seat`` per dealt hand from episode records: ``{hand: (mean, episodes)}``.

    Records are ``EpisodeRecord`` objects or their JSON dicts. The hand comes
    from the final observations' ``card`` fields, or else by replaying the
    record's seed through the engine (the seed fixes the deal). ``raw`` picks
    the engine's returns over the transformed (coalition) ones.
    """
    sums: dict[Deal, list[float]] = defaultdict(list)
    for rec in records:
        r = rec if isinstance(rec, Mapping) else rec.model_dump()
        if r.get("reason", "normal") not in ("normal",):
            continue
        returns = r["raw_returns"] if raw else r["returns"]
        sums[deal_of(r)].append(float(returns[seat]))
    return {h: (float(np.mean(v)), len(v)) for h, v in sums.items()}


def deal_of(record: Mapping[str, Any]) -> Deal:
    """The cards of every seat in an episode record (a JSON dict), as ``per_deal_values`` keys them.

    From the final observations' ``card`` fields; a record without them (an
    older referee's) is replayed from its seed, which fixes the deal.
    """
    obs = record.get("final_observations") or []
    n = len(record["seats"])
    cards = [o.get("card") for o in obs] if obs else []
    if len(cards) != n or any(c is None for c in cards):
        state = make_game(record["game"], **record["params"]).new_initial_state(record["seed"])
        cards = [state.observation(s).get("card") for s in range(n)]
    return tuple(int(c) for c in cards)


def ev_table(
    rows: Mapping[str, Mapping[Deal, float | tuple[float, int]]],
    hands: Sequence[Deal] = PAPER_HANDS,
    *,
    seat_name: str = "C",
) -> str:
    """Table 1 as Markdown: one row per method, one column per hand [A, B, C].

    Values may be plain EVs or ``(mean, n)`` pairs from
    :func:`hand_evs_from_episodes`; measured cells show their episode count.
    A hand missing from a row is shown as "–".
    """
    head = "| Hand | " + " | ".join(f"[{', '.join(map(str, h))}]" for h in hands) + " |"
    lines = [f"Expected value for player {seat_name}", "", head, "|---" * (len(hands) + 1) + "|"]
    for name, values in rows.items():
        cells = []
        for h in hands:
            v = values.get(tuple(h))
            if v is None:
                cells.append("–")
            elif isinstance(v, tuple):
                cells.append(f"{v[0]:.2f} (n={v[1]})")
            else:
                cells.append(f"{v:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    report: CollusionReport,
    out_dir: str | Path,
    measured: Mapping[str, Iterable[Any]] | None = None,
    heatmaps: Sequence[str] = ("team", "paper"),
) -> dict[str, Path]:
    """Policies, per-deal JSON, the heatmaps and the EV table under ``out_dir``.

    ``measured`` maps a row label (say "LLM Collusion") to episode records of
    Loki Kuhn played by real agents; their per-hand means become extra rows of
    the table, as the paper's LLM rows. One Figure 2 per reading in
    ``heatmaps``: ``collusion_heatmap.png`` for the team solve (our headline),
    ``collusion_heatmap_<reading>.png`` for the others, so the paper's own
    construction sits beside ours.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    meta = {"iterations": report.summary.get("iterations"), "algo": report.summary.get("algo")}
    for name, policy in report.policies.items():
        path = out / f"{name}_policy.json"
        write_policy(
            path,
            {
                "game": report.game,
                "params": report.params,
                "policy": policy,
                "meta": {**meta, "kind": name, "team": list(report.team)},
            },
        )
        files[f"{name}_policy"] = path
    (out / "collusion.json").write_text(json.dumps(report.to_json(), indent=1))
    files["json"] = out / "collusion.json"
    for name in heatmaps:
        if name in report.values:
            suffix = "" if name == "team" else f"_{name}"
            key = "heatmap" if name == "team" else f"heatmap_{name}"
            files[key] = plot_heatmap(report, out / f"collusion_heatmap{suffix}.png", name)
    victim = report.victims[0]
    rows: dict[str, Mapping[Deal, float | tuple[float, int]]] = {
        "CFR": hand_values(report, "cfr", PAPER_HANDS, victim),
        "CFR Collusion": hand_values(report, "team", PAPER_HANDS, victim),
        "CFR Collusion vs unaware C": hand_values(report, "team_vs_unaware", PAPER_HANDS, victim),
        "CFR Collusion, paper's construction": hand_values(report, "paper", PAPER_HANDS, victim),
    }
    for label, records in (measured or {}).items():
        rows[label] = hand_evs_from_episodes(records, victim)
    table = ev_table(rows)
    (out / "ev_table.md").write_text(table)
    files["table"] = out / "ev_table.md"
    return files
