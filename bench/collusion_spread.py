"""How much the paper's collusion reading moves across the three-player equilibria our solvers find.

    .venv/bin/python bench/collusion_spread.py                       # 4 variants x 2 update orders
    .venv/bin/python bench/collusion_spread.py --algos cfr+ dcfr --orders alternating --seeds 1 2 3

Three-player Loki Kuhn has no unique equilibrium, and the Loki paper's
"CFR Collusion" (Algorithm 3 on the colluders' individual CFR strategies)
depends on which one CFR lands on; the team solve does not (the team game is
two-player zero-sum: one value), but its advantage is measured from the same
all-CFR baseline. For every CFR variant and update order we run one solve and
at each checkpoint score the average policy: NashConv (how far from an
equilibrium), the colluders' baseline coalition payoff ``(R_A + R_B) / 2``,
and the average advantage of the ``paper`` and ``team`` readings over it
(:mod:`backroom.solvers.collusion`). The shipped policy
(``backroom/policies/kuhn_loki_cfr.json``) is one more row. Full-width CFR is
deterministic from its uniform start, so variants, update orders and
iteration counts pick the equilibrium; ``--seeds`` adds runs that start from
random regrets (``CFRSolver(seed=...)``), to reach equilibria the uniform
start does not.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from typing import Any

import numpy as np

from backroom.games import make_game
from backroom.solvers.cfr import ALGOS, CFRSolver
from backroom.solvers.collusion import per_deal_values
from backroom.solvers.evaluate import nash_conv
from backroom.solvers.team import distill_individual_policy, paper_state, solve_team
from backroom.solvers.tree import FloatArray, GameTree, build_tree

TEAM = (0, 1)


def score(tree: GameTree, cfr: FloatArray, team_value_sum: float) -> dict[str, float]:
    """NashConv and the two readings' average advantages over the all-CFR baseline ``cfr``."""
    _deals, base = per_deal_values(tree, cfr)
    coalition = float(base[:, list(TEAM)].mean(axis=1).mean())  # mean over deals of (R_A+R_B)/2
    paper = distill_individual_policy(tree, cfr, TEAM)
    sigma = tree.sigma_from_policy({**tree.policy_dict(cfr), **paper})
    _deals, vals = per_deal_values(tree, sigma)
    paper_adv = float(vals[:, list(TEAM)].mean(axis=1).mean()) - coalition
    return {
        "nash_conv": nash_conv(tree, cfr),
        "coalition": coalition,
        "paper": paper_adv,
        "team": team_value_sum / 2 - coalition,  # the team solve's (R_A+R_B)/2 minus the baseline
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, nargs="+", default=[1000, 10000, 50000])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    orders = ["alternating", "simultaneous"]
    ap.add_argument("--orders", nargs="+", default=orders, choices=orders)
    ap.add_argument("--seeds", type=int, nargs="*", default=[], help="random starts, too")
    ap.add_argument("--team-iterations", type=int, default=20000)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()

    game = make_game("kuhn", variant="loki")
    tree = build_tree(game, features=paper_state)
    t0 = time.perf_counter()
    sol = solve_team(game, TEAM, args.team_iterations, "cfr+")
    print(
        f"team solve: cfr+ x {args.team_iterations}, R_A+R_B {sol.team_value:+.6f}, "
        f"exploitability {sol.exploitability:.2g} ({time.perf_counter() - t0:.0f}s)"
    )
    rows: list[dict[str, Any]] = []
    checkpoints = sorted(set(args.iterations))
    for algo in args.algos:
        for alternating in (order == "alternating" for order in args.orders):
            for seed in [None, *args.seeds]:  # None: the uniform start
                solver = CFRSolver(tree, algo, alternating=alternating, seed=seed)
                t0, done = time.perf_counter(), 0
                for target in checkpoints:
                    solver.run(target - done)
                    done = target
                    row = {"algo": algo, "alternating": alternating, "seed": seed}
                    row["iterations"] = target
                    row.update(score(tree, solver.average_policy(), sol.team_value))
                    rows.append(row)
                    print(_line(row), f"({time.perf_counter() - t0:.0f}s)", flush=True)
    shipped = json.loads(
        resources.files("backroom").joinpath("policies", "kuhn_loki_cfr.json").read_text()
    )
    meta = shipped["meta"]
    row = {"algo": f"shipped {meta['algo']}", "alternating": meta["alternating"], "seed": None}
    row["iterations"] = meta["iterations"]
    row.update(score(tree, tree.sigma_from_policy(shipped["policy"]), sol.team_value))
    rows.append(row)
    print(_line(row))

    print(
        "\n| algo | updates | start | iterations | NashConv | baseline (R_A+R_B)/2 "
        "| paper − cfr | team − cfr |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        upd = "alternating" if r["alternating"] else "simultaneous"
        start = "uniform" if r["seed"] is None else f"seed {r['seed']}"
        print(
            f"| {r['algo']} | {upd} | {start} | {r['iterations']:,} | {r['nash_conv']:.1e} | "
            f"{r['coalition']:+.4f} | {r['paper']:+.4f} | {r['team']:+.4f} |"
        )
    for cut in (1e-2, 2e-3):
        near = [r for r in rows if r["nash_conv"] <= cut]
        if near:
            p = np.array([r["paper"] for r in near])
            t = np.array([r["team"] for r in near])
            print(
                f"NashConv <= {cut:g} ({len(near)} profiles): paper {p.min():+.4f} .. {p.max():+.4f}, "
                f"team {t.min():+.4f} .. {t.max():+.4f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def _line(r: dict[str, Any]) -> str:
    upd = "alt" if r["alternating"] else "sim"
    start = "" if r["seed"] is None else f" seed {r['seed']}"
    return (
        f"{r['algo']:>10} {upd}{start} {r['iterations']:>7,}: NashConv {r['nash_conv']:.2e}  "
        f"baseline {r['coalition']:+.4f}  paper {r['paper']:+.4f}  team {r['team']:+.4f}"
    )


if __name__ == "__main__":
    main()
