"""How long ``backroom --help`` and ``backroom run --help`` take, beside ``python -c pass``.

    .venv/bin/python bench/cli_startup.py              # 15 rounds
    .venv/bin/python bench/cli_startup.py --rounds 30

Issue 37's target: each help at most 0.4 s more than starting Python itself.
Measured side by side: every round runs the three commands in turn (their
order rotated each round), each a fresh process as a user's typo starts it,
so a machine that drifts (other processes, a cold disk cache) costs all three
alike. Printed: each command's median and best wall time, and its difference
from ``python -c pass`` (median of the per-round differences), against the
target. The first round warms the disk cache and is not counted.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

TARGET_S = 0.4

COMMANDS: dict[str, list[str]] = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "backroom --help": [sys.executable, "-m", "backroom", "--help"],
    "backroom run --help": [sys.executable, "-m", "backroom", "run", "--help"],
}


def wall(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds from start to exit of ``cmd``; a failing command fails the bench."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"})
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    names = list(COMMANDS)
    for name in names:  # warm-up, not counted
        wall(COMMANDS[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            seconds, cpu = wall(COMMANDS[name])
            times[name].append(seconds)
            cpus[name].append(cpu)
    base = times["python -c pass"]
    load = os.getloadavg()[0]
    print(f"{args.rounds} rounds on {os.cpu_count()} cores, load {load:.1f} (1 min)")
    for name in names:
        med, best = statistics.median(times[name]), min(times[name])
        cpu = statistics.median(cpus[name])
        line = f"{name:22s} median {med:.3f} s  best {best:.3f} s  cpu {cpu:.3f} s"
        if name != "python -c pass":
            diff = statistics.median(t - b for t, b in zip(times[name], base, strict=True))
            verdict = "ok" if diff <= TARGET_S else "over"
            line += f"  +{diff:.3f} s over python -c pass (target <= +{TARGET_S} s: {verdict})"
        print(line)


if __name__ == "__main__":
    main()
