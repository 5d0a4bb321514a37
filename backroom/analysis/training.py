"""Training curves of a ``backroom train`` run directory: ``train_log.csv`` and ``evaluations.jsonl``.

Three figures, each with a legend: rollout reward per seat and the cooperation
rate by step (the paper's figure 2), the optimiser's statistics (loss, KL,
entropy, gradient norm, TIS clamp fraction), and the learner's mean return
against every evaluation opponent by step (the paper's figure 3 over time).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backroom.analysis.plotting import figure, save

if TYPE_CHECKING:
    from matplotlib.axes import Axes


#: Columns of words: the version, and what a step could not play (``3 of 4 matches (1 voided:
#: reason)``; empty when it played every match).
_TEXT = ("version", "unplayed")


def _num(x: str) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def read_training(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The log rows (numbers as floats; unreadable lines skipped) and the evaluation records."""
    rows: list[dict[str, Any]] = []
    log = run_dir / "train_log.csv"
    if log.exists():
        with log.open(newline="") as f:
            for raw in csv.DictReader(f):
                rows.append({k: (v if k in _TEXT else _num(v)) for k, v in raw.items()})
    evals: list[dict[str, Any]] = []
    path = run_dir / "evaluations.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                evals.append(json.loads(line))
            except ValueError:
                continue  # a torn last line after a crash
    return rows, evals


def step_ticks(ax: Axes) -> None:
    """Steps are whole numbers: a two-step run's axis reads 0, 1, not 0.0, 0.2, ... 1.0."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def analyze_training(run_dir: Path, out_dir: Path | None) -> dict[str, Any]:
    rows, evals = read_training(run_dir)
    result: dict[str, Any] = {
        "steps": len(rows),
        "last": rows[-1] if rows else None,
        "first": rows[0] if rows else None,
        "evaluations": evals,
        # steps that trained on fewer matches than they asked for, and why: said, not only counted
        "unplayed": [f"step {r['step']:.0f}: {r['unplayed']}" for r in rows if r.get("unplayed")],
        "plots": [],
    }
    if not rows or out_dir is None:
        return result
    result["plots"] += [_rollouts_plot(run_dir, rows, out_dir), _optimiser_plot(rows, out_dir)]
    if evals:
        result["plots"].append(_evaluation_plot(run_dir, evals, out_dir))
    return result


def _rollouts_plot(run_dir: Path, rows: list[dict[str, Any]], out_dir: Path) -> str:
    """Each seat's mean return by step, and the cooperation rate where the log has one."""
    steps = [r["step"] for r in rows]
    seats = sorted(k for k in rows[0] if k.startswith("reward_seat"))
    fig = figure()
    ax = fig.add_subplot()
    for key in seats:
        ax.plot(
            steps,
            [r[key] for r in rows],
            label=f"mean return, seat {key.removeprefix('reward_seat')}",
        )
    ax.set_xlabel("training step")
    step_ticks(ax)
    ax.set_ylabel("mean return per match")
    coop = [
        (r["step"], r["cooperation_rate"]) for r in rows if r.get("cooperation_rate") is not None
    ]
    if coop:
        ax2 = ax.twinx()
        ax2.plot(
            *zip(*coop, strict=True), color="tab:green", linestyle="--", label="cooperation rate"
        )
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("cooperation rate")
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(lines, [str(h.get_label()) for h in lines], loc="best")
    else:
        ax.legend(loc="best")
    ax.set_title(f"{run_dir.name}: rollouts by step")
    return save(fig, out_dir, "training_rollouts")


def _optimiser_plot(rows: list[dict[str, Any]], out_dir: Path) -> str:
    """The update's own numbers by step: loss, KL, entropy, gradient norm, clamping, speed."""
    steps = [r["step"] for r in rows]
    fig = figure(8, 5)
    for i, key in enumerate(
        ("loss", "kl", "entropy", "grad_norm", "tis_clamped", "tokens_per_second")
    ):
        ax = fig.add_subplot(2, 3, i + 1)
        values: list[float] = [
            v if isinstance(v := r.get(key), float) else float("nan") for r in rows
        ]
        ax.plot(steps, values, label=key)
        ax.set_title(key)
        ax.set_xlabel("step")
        step_ticks(ax)
    return save(fig, out_dir, "training_optimiser")


def _evaluation_plot(run_dir: Path, evals: list[dict[str, Any]], out_dir: Path) -> str:
    """The learner's mean return against each fixed opponent, at each evaluation."""
    fig = figure()
    ax = fig.add_subplot()
    opponents = sorted({o for e in evals for o in e["against"]})
    for opp in opponents:
        pts = [(e["step"], e["against"][opp]["learner"]) for e in evals if opp in e["against"]]
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"learner vs {opp}")
    ax.set_xlabel("training step")
    step_ticks(ax)
    ax.set_ylabel("learner's mean return per match")
    ax.legend(loc="best")
    ax.set_title(f"{run_dir.name}: evaluation against fixed opponents")
    return save(fig, out_dir, "training_evaluation")
