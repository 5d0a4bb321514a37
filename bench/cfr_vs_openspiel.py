"""Our vectorised CFR against OpenSpiel's C++ solvers, side by side in one process.

    .venv/bin/python bench/cfr_vs_openspiel.py                  # 3-player Kuhn, Leduc, Loki 100k
    .venv/bin/python bench/cfr_vs_openspiel.py --iterations 20000 --repeats 5 --skip-loki

For each pair (OpenSpiel ``CFRSolver`` vs our ``cfr``, ``CFRPlusSolver`` vs
our ``cfr+``, both with alternating updates as OpenSpiel does) on
``kuhn_poker(players=3)`` we run the same number of iterations in segments,
interleaving the two solvers segment by segment so that load from other
processes on a shared machine hits both alike. NashConv of both average
policies is taken at every checkpoint (untimed): OpenSpiel's own
``pyspiel.nash_conv`` for theirs, ours for ours. The run is repeated and the
fastest repeat of each solver is reported (the least disturbed one), with
the median alongside. The same for two-player Leduc poker, OpenSpiel's
``leduc_poker`` seated through ``game: openspiel`` (our tree enumerated from
the adapter, keyed by OpenSpiel's own information states; ``--leduc-iterations``).
Then 100,000 iterations of Loki Kuhn with our CFR+.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import pyspiel

from backroom.games import make_game
from backroom.solvers.cfr import CFRSolver
from backroom.solvers.evaluate import nash_conv
from backroom.solvers.openspiel_compat import from_openspiel_policy
from backroom.solvers.tree import GameTree, build_tree

PAIRS = (("cfr", "CFRSolver"), ("cfr+", "CFRPlusSolver"))


def run_pair(
    algo: str, os_name: str, game: Any, tree: GameTree, iterations: int, checkpoints: int
) -> dict[str, Any]:
    """One repeat: both solvers, interleaved by segment; times exclude NashConv checkpoints."""
    theirs = getattr(pyspiel, os_name)(game)
    ours = CFRSolver(tree, algo)
    seg = max(1, iterations // checkpoints)
    t_theirs = t_ours = 0.0
    curve: list[tuple[int, float, float, float]] = []
    done = 0
    while done < iterations:
        k = min(seg, iterations - done)
        t0 = time.perf_counter()
        for _ in range(k):
            theirs.evaluate_and_update_policy()
        t1 = time.perf_counter()
        ours.run(k)
        t2 = time.perf_counter()
        t_theirs += t1 - t0
        t_ours += t2 - t1
        done += k
        their_avg = theirs.average_policy()
        our_avg = ours.average_policy()
        diff = float(np.abs(from_openspiel_policy(tree, their_avg, game) - our_avg).max())
        curve.append((done, pyspiel.nash_conv(game, their_avg), nash_conv(tree, our_avg), diff))
    return {"theirs": t_theirs, "ours": t_ours, "curve": curve}


def bench_pairs(
    title: str, game: Any, tree: GameTree, iterations: int, checkpoints: int, repeats: int
) -> None:
    print(f"\n== {title}, {iterations:,} iterations, {repeats} repeats ==")
    for algo, os_name in PAIRS:
        runs = [
            run_pair(algo, os_name, game, tree, iterations, checkpoints) for _ in range(repeats)
        ]
        theirs = [iterations / r["theirs"] for r in runs]
        ours = [iterations / r["ours"] for r in runs]
        best_t, best_o = max(theirs), max(ours)
        print(f"\n{os_name} (OpenSpiel C++) vs ours algo={algo!r} (alternating updates)")
        print(
            f"  OpenSpiel : best {best_t:10,.0f} it/s   median {statistics.median(theirs):10,.0f} it/s"
        )
        print(
            f"  ours      : best {best_o:10,.0f} it/s   median {statistics.median(ours):10,.0f} it/s"
        )
        print(
            f"  ratio ours/OpenSpiel: best {best_o / best_t:.2f}x   "
            f"median {statistics.median(ours) / statistics.median(theirs):.2f}x   "
            f"per repeat {[round(o / t, 2) for o, t in zip(ours, theirs, strict=True)]}"
        )
        print(
            f"  {'iteration':>9}  {'NashConv OpenSpiel':>19}  {'NashConv ours':>14}  {'max |Δ avg policy|':>19}"
        )
        for it, nc_t, nc_o, diff in runs[0]["curve"]:
            print(f"  {it:9d}  {nc_t:19.3e}  {nc_o:14.3e}  {diff:19.1e}")


def bench_kuhn(players: int, iterations: int, checkpoints: int, repeats: int) -> None:
    game = pyspiel.load_game("kuhn_poker", {"players": players})
    tree = build_tree(make_game("kuhn", variant="classic", players=players))
    bench_pairs(f"kuhn_poker(players={players})", game, tree, iterations, checkpoints, repeats)


def bench_leduc(iterations: int, checkpoints: int, repeats: int) -> None:
    game = pyspiel.load_game("leduc_poker")
    t0 = time.perf_counter()
    tree = build_tree(make_game("openspiel", name="leduc_poker"))
    print(
        f"\nleduc_poker through game: openspiel: tree built once in "
        f"{time.perf_counter() - t0:.2f}s: {tree.describe()}"
    )
    bench_pairs("leduc_poker (game: openspiel)", game, tree, iterations, checkpoints, repeats)


def bench_loki(iterations: int) -> None:
    print(
        f"\n== Loki Kuhn (3 players, 5 cards, fold/call/raise), ours, {iterations:,} iterations =="
    )
    t0 = time.perf_counter()
    tree = build_tree(make_game("kuhn", variant="loki"))
    print(f"  tree built once in {time.perf_counter() - t0:.2f}s: {tree.describe()}")
    for algo in ("cfr+",):
        solver = CFRSolver(tree, algo)
        t0 = time.perf_counter()
        solver.run(iterations)
        dt = time.perf_counter() - t0
        print(
            f"  {algo}: {iterations:,} iterations in {dt:.1f}s ({iterations / dt:,.0f} it/s); "
            f"NashConv {nash_conv(tree, solver.average_policy()):.2e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=10_000)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--players", type=int, default=3)
    ap.add_argument("--leduc-iterations", type=int, default=1_000)
    ap.add_argument("--loki-iterations", type=int, default=100_000)
    ap.add_argument("--skip-loki", action="store_true")
    args = ap.parse_args()
    bench_kuhn(args.players, args.iterations, args.checkpoints, args.repeats)
    bench_leduc(args.leduc_iterations, args.checkpoints, args.repeats)
    if not args.skip_loki:
        bench_loki(args.loki_iterations)


if __name__ == "__main__":
    main()
