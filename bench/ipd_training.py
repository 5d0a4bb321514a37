"""The paper's IPD experiment on a CPU: naive multi-agent GRPO against Advantage Alignment.

Runs ``backroom train`` on ``examples/ipd_grpo.yaml`` and ``examples/ipd_adalign.yaml``
for several seeds (each its own broker, referee and agents), then draws both
algorithms' curves side by side: the rollouts' cooperation rate by step (the
paper's figure 2 in shape: GRPO should fall toward always-B) and the learner's
mean return against always-A, always-B, tit-for-tat and itself (figure 3:
Advantage Alignment should cooperate with itself and tit-for-tat and answer
always-B with B). Prints a table with the numbers and the wall time.

    .venv/bin/python bench/ipd_training.py --seeds 0 1 --steps 12 --rounds 5 --batch 8

Figure 3 in shape on a CPU, through the bus: a small transformer given
SmolLM2's cooperative prior (``bench/ipd_warmup.py``), both algorithms and two
seeds at once, 400 steps of the paper's 10-round matches (docs/training.md):

    .venv/bin/python bench/ipd_training.py --small --parallel --seeds 0 1 --steps 400 \
        --rounds 10 --batch 8 --lr 3e-5 --eval-every 25 --eval-matches 4 --out runs/ipd-small

Scaled-down overrides are written into copies of the example configs under
``--out``; what was scaled is printed and goes into ``summary.json``.

On a GPU (``--device cuda``), as many steps as fit in a time budget, both
algorithms at once:

    python bench/ipd_training.py --device cuda --parallel --minutes 4 --steps 1000 \
        --rounds 10 --batch 128 --lr 2e-5 --eval-every 5

``--minutes`` stops each run that long after it started (SIGINT to its
process group, SIGKILL 30 s later); the steps it finished are in its
``train_log.csv`` and count as the run's result, and the summary says that
it was stopped and after how many steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "grpo": ROOT / "examples" / "ipd_grpo.yaml",
    "adalign": ROOT / "examples" / "ipd_adalign.yaml",
}


def scaled(path: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    config = yaml.safe_load(path.read_text())
    config["seed"] = seed
    config["steps"] = args.steps
    config["params"] = {**config.get("params", {}), "rounds": args.rounds}
    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.hyper)}
    config["hyper"] = {
        **config.get("hyper", {}),
        "batch_size": args.batch,
        "lr": args.lr,
        **extra,
    }
    config["evaluation"] = {
        **config["evaluation"],
        "every": args.eval_every,
        "matches": args.eval_matches,
    }
    config["run"] = f"{config['run']}{args.tag}-s{seed}"
    if args.device:
        config["model"] = {**config.get("model", {}), "device": args.device}
    if args.model:
        config["model"] = {**config.get("model", {}), "path": str(args.model)}
    if args.concurrency:
        config["concurrency"] = args.concurrency
    if args.threads:
        config["threads"] = args.threads
    return dict(config)


@dataclass
class Training:
    """One ``backroom train`` process of the bench, in its own process group."""

    run: str
    proc: subprocess.Popen[bytes]
    started: float
    stopped: bool = False  # ended by --minutes, not by finishing its steps

    def stop(self) -> None:
        """SIGINT to its process group: the trainer stops within a micro-batch and says so."""
        if self.proc.poll() is None:
            self.stopped = True
            os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def finish(self) -> float:
        """Wait for the run (30 s after a stop, then kill it); its wall seconds. Raises if it failed."""
        try:
            self.proc.wait(timeout=30 if self.stopped else None)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.returncode != 0 and not self.stopped:
            raise RuntimeError(f"{self.run}: backroom train exited {self.proc.returncode}")
        return time.time() - self.started


def wait_all(trainings: list[Training], minutes: float | None) -> None:
    """Until every run has ended, stopping all of them at once at the deadline (``--minutes``)."""
    deadline = min(t.started for t in trainings) + minutes * 60 if minutes else None
    while any(t.proc.poll() is None for t in trainings):
        if deadline is not None and time.time() >= deadline:
            for t in trainings:
                t.stop()
            return
        time.sleep(1)


def start(config: dict[str, Any], out: Path) -> Training:
    cfg = out / f"{config['run']}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    with (out / f"{config['run']}.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "backroom",
                "train",
                str(cfg),
                "--run-dir",
                str(out / config["run"]),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            start_new_session=True,  # --minutes stops it with its broker, referee and agents
        )
    return Training(config["run"], proc, time.time())


def curves(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from backroom.analysis.training import read_training

    rows, evals = read_training(run_dir)
    # a run stopped by SIGKILL may leave a torn last line (its numbers read as None)
    keep = [r for r in rows if r.get("step") is not None and r.get("cooperation_rate") is not None]
    return keep, evals


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = sorted(r[key] for r in rows if isinstance(r.get(key), float | int))
    return round(values[len(values) // 2], 2) if values else None


def plot(results: dict[str, dict[int, Path]], out: Path) -> list[str]:
    from backroom.analysis.plotting import figure, save

    paths = []
    fig = figure(8, 4)
    ax = fig.add_subplot()
    for algorithm, runs in results.items():
        for seed, run_dir in runs.items():
            rows, _ = curves(run_dir)
            ax.plot(
                [r["step"] for r in rows],
                [r["cooperation_rate"] for r in rows],
                label=f"{algorithm} seed {seed}",
                linestyle="-" if algorithm == "adalign" else "--",
            )
    ax.set_xlabel("training step")
    ax.set_ylabel("cooperation rate (share of A) in self-play rollouts")
    ax.set_ylim(0, 1)
    ax.legend(loc="best")
    paths.append(save(fig, out, "ipd_cooperation_by_step"))
    fig = figure(9, 4)
    for i, algorithm in enumerate(results):
        ax = fig.add_subplot(1, len(results), i + 1)
        for seed, run_dir in results[algorithm].items():
            _, evals = curves(run_dir)
            for opp in sorted({o for e in evals for o in e["against"]}):
                pts = [
                    (e["step"], e["against"][opp]["learner"]) for e in evals if opp in e["against"]
                ]
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"vs {opp} (seed {seed})")
        ax.set_title(algorithm)
        ax.set_xlabel("training step")
        ax.set_ylabel("learner's mean return per match")
        ax.legend(loc="best", fontsize=7)
    paths.append(save(fig, out, "ipd_evaluation_by_step"))
    return paths


def compare(run_dirs: list[Path], out: Path) -> str:
    """Cooperation rate and choice entropy by step of finished or stopped runs, one line each."""
    from backroom.analysis.plotting import figure, save

    fig = figure(10, 4)
    coop, entropy = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for run_dir in run_dirs:
        rows, _ = curves(run_dir)
        steps = [r["step"] for r in rows]
        coop.plot(steps, [r["cooperation_rate"] for r in rows], marker=".", label=run_dir.name)
        entropy.plot(steps, [r["entropy"] for r in rows], marker=".", label=run_dir.name)
    coop.set_ylabel("cooperation rate (share of A) in rollouts")
    coop.set_ylim(0, 1)
    entropy.set_ylabel("entropy of the trained choices (nats; ln 2 = 0.69)")
    for ax in (coop, entropy):
        ax.set_xlabel("training step")
        ax.legend(loc="best", fontsize=7)
    return save(fig, out, "ipd_runs_compared")


def main() -> None:  # noqa: PLR0915 (twenty options, then the runs of each algorithm and seed)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="matches per step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-matches", type=int, default=2)
    p.add_argument("--algorithms", nargs="+", default=["grpo", "adalign"], choices=sorted(EXAMPLES))
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ipd-training")
    p.add_argument(
        "--hyper",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="more overrides of the preset, e.g. beta=2.0 (values as YAML)",
    )
    p.add_argument("--tag", default="", help="appended to the run names, e.g. -beta2")
    p.add_argument("--device", choices=["cpu", "cuda"], help="the model's device (default: auto)")
    p.add_argument(
        "--model",
        type=Path,
        help="a model folder instead of SmolLM2, e.g. bench/ipd_warmup.py's small transformer",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="figure 3 on a CPU: bench/ipd_warmup.py's small transformer with a cooperative "
        "prior (made into OUT/model first, unless there)",
    )
    p.add_argument("--concurrency", type=int, help="matches in flight (default: the example's)")
    p.add_argument("--parallel", action="store_true", help="every run at once (a GPU has room)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads of each process of a run (default: the cores shared by every "
        "trainer and agent host computing at once)",
    )
    p.add_argument(
        "--minutes", type=float, help="stop each run after this long and keep its finished steps"
    )
    p.add_argument(
        "--compare",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="train nothing: draw these runs' cooperation and entropy by step into --out",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        print("plot:", compare(args.compare, args.out))
        return
    if args.small and not args.model:
        args.model = args.out / "model"
        if not (args.model / "config.json").exists():
            warmup = [
                sys.executable,
                str(ROOT / "bench" / "ipd_warmup.py"),
                "--out",
                str(args.model),
            ]
            subprocess.run(warmup, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    print(
        f"scaled from the paper: rounds {args.rounds} (10), batch {args.batch} matches (128), lr {args.lr} "
        f"(3e-6), steps {args.steps}, {args.model or 'SmolLM2-135M'} (2-12B models); seeds {args.seeds}"
    )
    from backroom.model.loading import torch_threads_for, usable_cores

    cores = usable_cores()
    runs_at_once = len(args.seeds) * len(args.algorithms) if args.parallel else 1
    why = "--threads" if args.threads else "default: the cores shared"
    # each run has two torch processes (the trainer and its agent host), all computing at once
    args.threads = args.threads or torch_threads_for(2 * runs_at_once)
    print(
        f"torch threads: {args.threads} in each run's trainer and agent host ({why}); "
        f"{runs_at_once} run(s) at once on {cores} cores"
    )
    results: dict[str, dict[int, Path]] = {a: {} for a in args.algorithms}
    summary: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "threads": args.threads,
        "cores": cores,
        "runs": [],
    }
    jobs = [(seed, algorithm) for seed in args.seeds for algorithm in args.algorithms]
    running: dict[tuple[int, str], Training] = {}

    def report(seed: int, algorithm: str, training: Training, seconds: float) -> None:
        run_dir = args.out / training.run
        rows, evals = curves(run_dir)
        if rows:
            results[algorithm][seed] = run_dir
        final = evals[-1]["against"] if evals else {}
        entry = {
            "algorithm": algorithm,
            "seed": seed,
            "seconds": round(seconds, 1),
            "steps": len(rows),
            "stopped_by_budget": training.stopped,
            "seconds_per_step": round(seconds / len(rows), 2) if rows else None,
            "update_seconds_median": median(rows, "step_seconds"),
            "rollout_seconds_median": median(rows, "rollout_seconds"),
            "cooperation_first": rows[0]["cooperation_rate"] if rows else None,
            "cooperation_last": rows[-1]["cooperation_rate"] if rows else None,
            "cooperation": [round(r["cooperation_rate"], 3) for r in rows],
            "eval_step": evals[-1]["step"] if evals else None,
            "eval": {opp: round(v["learner"], 3) for opp, v in final.items()},
            "eval_cooperation": {opp: v.get("cooperation_rate") for opp, v in final.items()},
        }
        summary["runs"].append(entry)
        print(json.dumps(entry), flush=True)

    try:
        for seed, algorithm in jobs:
            training = start(scaled(EXAMPLES[algorithm], args, seed), args.out)
            running[(seed, algorithm)] = training
            if not args.parallel:
                wait_all([training], args.minutes)
                report(seed, algorithm, training, training.finish())
                del running[(seed, algorithm)]
        wait_all(list(running.values()), args.minutes)
        for (seed, algorithm), training in running.items():
            report(seed, algorithm, training, training.finish())
    finally:  # a failed run, or this bench stopped: no run goes on without it
        for training in running.values():
            training.kill()
    summary["plots"] = plot(results, args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{'algorithm':9} {'seed':>4} {'coop first':>10} {'coop last':>9} {'minutes':>7}  eval (learner's return)"
    )
    for e in summary["runs"]:
        if not e["steps"]:
            print(f"{e['algorithm']:9} {e['seed']:>4}  no step finished in {e['seconds']:.0f} s")
            continue
        print(
            f"{e['algorithm']:9} {e['seed']:>4} {e['cooperation_first']:>10.2f} {e['cooperation_last']:>9.2f} "
            f"{e['seconds'] / 60:>7.1f}  {e['eval']} (step {e['eval_step']}; {e['steps']} steps"
            f"{', stopped by --minutes' if e['stopped_by_budget'] else ''})"
        )
    print("plots:", *summary["plots"], sep="\n  ")


if __name__ == "__main__":
    main()
