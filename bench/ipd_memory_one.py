"""The trainer's credit over the paper's scale of steps, on a memory-one IPD policy.

``backroom/trainer/memory_one.py`` replaces the LLM with five logits and keeps
the rest of ``backroom train``'s IPD setup. This script runs GRPO and
Advantage Alignment for several seeds (and, with ``--betas``, several beta),
prints each run's final policy and its return against always-A, always-B,
tit-for-tat and itself, and draws the cooperation rate by step. Seconds, not
hours: use it to check a credit variant, or to choose a step size and beta,
before an LLM run.

    .venv/bin/python bench/ipd_memory_one.py --seeds 0 1 2 3 4 5 6 7 --out docs/img
    .venv/bin/python bench/ipd_memory_one.py --tied 256 --lr 0.1 --steps 400  # states tied as an LLM's
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from backroom.trainer.advantages import BASELINES
from backroom.trainer.algorithms import CREDITED
from backroom.trainer.memory_one import STATES, Result, Settings, train


def smooth(xs: list[float], width: int) -> np.ndarray:
    return np.convolve(xs, np.ones(width) / width, mode="valid")


def plot(
    runs: dict[str, dict[int, Result]], out: Path, width: int, tied: int, baseline: str
) -> str:
    from backroom.analysis.plotting import figure, save

    fig = figure(8, 4)
    ax = fig.add_subplot()
    colours: dict[str, Any] = {}
    for label, by_seed in runs.items():
        for r in by_seed.values():
            (line,) = ax.plot(
                smooth(r.coop_by_step, width),
                color=colours.get(label),
                linestyle="--" if label.startswith("grpo") else "-",
                linewidth=1,
                label=label if label not in colours else None,
            )
            colours.setdefault(label, line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel(f"share of A in rollouts ({width}-step mean)")
    ax.set_ylim(0, 1)
    policy = f"{tied} weights tied over the states" if tied else "memory-one IPD policy"
    ax.set_title(f"{policy}, {baseline} baseline (one line per seed)")
    ax.legend(loc="best")
    name = "ipd_memory_one_tied_cooperation" if tied else "ipd_memory_one_cooperation"
    return save(fig, out, name if baseline == "per_seat" else f"{name}_{baseline}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=["grpo", "adalign"],
        choices=CREDITED,
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--betas", type=float, nargs="+", default=[0.5], help="Advantage Alignment")
    p.add_argument("--steps", type=int, default=Settings.steps)
    p.add_argument("--lr", type=float, default=Settings.lr)
    p.add_argument("--batch", type=int, default=Settings.batch, help="matches per step")
    p.add_argument("--rounds", type=int, default=Settings.rounds)
    p.add_argument("--init-coop", type=float, default=Settings.init_coop, help="P(A) of the start")
    p.add_argument("--entropy", type=float, default=Settings.entropy, help="entropy bonus")
    p.add_argument("--rho", type=float, default=Settings.rho, help="share vs the agent buffer")
    p.add_argument(
        "--tied",
        type=int,
        default=0,
        metavar="M",
        help="tie the states as an LLM's are: M shared weights over near-parallel features "
        "(Settings.tied_features)",
    )
    p.add_argument("--tied-spread", type=float, default=Settings.tied_spread)
    p.add_argument(
        "--baseline",
        choices=list(BASELINES),
        default=Settings.baseline,
        help="per_seat (the paper's) or pooled_other_matches (trainer/advantages.py)",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for the plot")
    args = p.parse_args()

    runs: dict[str, dict[int, Result]] = {}
    states = " ".join(f"{s:>5s}" for s in STATES)
    print(f"baseline: {args.baseline}")
    print(f"{'run':18s} seed  {states}   return vs A / B / TFT / self   verdict")
    base = Settings(
        steps=args.steps,
        lr=args.lr,
        batch=args.batch,
        rounds=args.rounds,
        init_coop=args.init_coop,
        rho=args.rho,
        entropy=args.entropy,
        tied_features=args.tied,
        tied_spread=args.tied_spread,
        baseline=args.baseline,
    )
    t0 = time.perf_counter()
    for algorithm in args.algorithms:
        for beta in args.betas if algorithm == "adalign" else [0.0]:
            label = f"adalign beta {beta:g}" if algorithm == "adalign" else algorithm
            s = replace(base, algorithm=algorithm, beta=beta)
            for seed in args.seeds:
                r = runs.setdefault(label, {})[seed] = train(s, seed)
                verdict = "always-B" if r.is_always_b else "always-A" if r.is_always_a else "other"
                verdict = "tit-for-tat" if r.is_tit_for_tat else verdict
                print(
                    f"{label:18s} {seed:4d}  "
                    + " ".join(f"{r.p_a[k]:5.2f}" for k in STATES)
                    + "   "
                    + " / ".join(f"{v:4.1f}" for v in r.returns.values())
                    + f"   {verdict}",
                    flush=True,
                )
    print(f"{sum(len(v) for v in runs.values())} runs in {time.perf_counter() - t0:.0f} s")
    for label, by_seed in runs.items():
        tft = sum(r.is_tit_for_tat for r in by_seed.values())
        always_a = sum(r.is_always_a for r in by_seed.values())
        always_b = sum(r.is_always_b for r in by_seed.values())
        n = len(by_seed)
        print(
            f"{label}: tit-for-tat in {tft}/{n} seeds, always-A in {always_a}/{n}, "
            f"always-B in {always_b}/{n}"
        )
    if args.out:
        print("plot:", plot(runs, args.out, max(1, args.steps // 30), args.tied, args.baseline))


if __name__ == "__main__":
    main()
