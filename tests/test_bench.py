"""The benchmarks still run and report what they promise (no timing is asserted: speed lives in bench/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import load_factor

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a whole benchmark run: CI runs it with the slow set
def test_the_league_bench_prints_its_three_parts(tmp_path: Path) -> None:
    """Play beside ``backroom run`` (the same matches counted by both, else it stops),
    rating from the store, and an adaptive schedule's ratings brought up to date beside
    rated again (the same numbers, else it stops)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "league.py"), "--quick", "--results", "5000"],
        capture_output=True,
        text=True,
        timeout=600 * load_factor(),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"league / run = [0-9.]+ \(target >= 0.9\)", text), text
    assert re.search(r"rating: 5,000 results.*\n  from the store: [0-9.]+ s", text), text
    assert re.search(r"head to head: from every result [0-9.]+ s, from the cells", text), text
    m = re.search(r"adaptive: 500 results in rounds of 16: .*again / up to date = \d+x", text)
    assert m, text  # the ratio is read, not asserted: speed lives in bench/


@pytest.mark.slow  # a whole benchmark run: CI runs it with the slow set
def test_bus_overhead_quick_run_prints_its_ratios_and_the_cpu_bound(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bus_overhead.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for label in (
        "ratio move / raw",
        "ratio moves / raw round trips at 100 in flight",
        "throughput ratio N=100 / N=1",
        "ratio in-process loop / N=100",
    ):
        m = re.search(rf"{re.escape(label)}\s+([0-9.]+)x", text)
        assert m and float(m.group(1)) > 0, f"{label!r} missing from:\n{text}"
    # The CPU table has a row per N, with a referee, three agents, the broker and the runner, each
    # of which did some work per match; the bound line names the referee's share.
    header = next(
        line for line in text.splitlines() if line.strip().startswith("N ") and "referee" in line
    )
    assert all(role in header for role in ("referee", "agent t0", "agent t2", "broker", "runner"))
    rows = {
        int(line.split()[0]): [float(v) for v in line.split()[1:]]
        for line in text.splitlines()
        if re.match(r"\s+(1|10|100)\s+[0-9.]+\s", line)
    }
    assert sorted(rows) == [1, 10, 100]
    assert all(v > 0 for row in rows.values() for v in row)
    assert re.search(
        r"N=100 bound: one referee core \([0-9.]+ ms/match\).*allow at most \d+ matches/s", text
    )
    # The target read backwards: 20x the N=1 rate, and the CPU per match that rate leaves on these cores.
    need = re.search(
        r"20x N=1 needs (\d+) matches/s: at most ([0-9.]+) ms/match for all processes "
        r"\(they spend ([0-9.]+); the agents alone ([0-9.]+)\) and ([0-9.]+) for the referee",
        text,
    )
    assert need, text
    one = re.search(r"\s1 concurrent matches:\s+([0-9.]+) matches/s", text)
    assert one, text
    rate_1 = float(one.group(1))
    rate, budget, spent, agents, per_core = (float(v) for v in need.groups())
    cores = os.cpu_count() or 1
    assert abs(rate - 20 * rate_1) <= 1.5  # the N=1 rate is printed to 0.1
    assert abs(per_core - 1e3 / (20 * rate_1)) <= per_core * 0.05 / rate_1 + 5e-4
    assert abs(budget - cores * per_core) <= (cores + 1) * 5e-4
    assert (
        abs(spent - rows[100][-2]) <= 1e-3
    )  # the table's "all" column (the last one is wall time)
    assert 0 < agents < spent


@pytest.mark.slow  # starts K referees and 12 agents per K
def test_referee_scaling_prints_a_row_per_referee_count(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "bus_overhead.py")),
            *("--only", "scaling", "--quick", "--referees", "1", "2", "--in-flight", "50"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        int(m.group(1)): [float(x) for x in m.group(2).split()]
        for m in re.finditer(r"^\s+(\d)\s+([0-9.x ]+)$", out.stdout.replace("x", ""), re.M)
    }
    assert set(rows) == {1, 2}, out.stdout
    for k, row in rows.items():
        rate, _ratio, goal, broker, busiest, referees, agents, runner, ref_ms, run_ms, heard = row
        assert rate > 0 and goal == pytest.approx(0.7 * k), out.stdout
        # every kind of process worked, and the referees' total is at least the busiest one's
        assert min(broker, busiest, agents, runner) > 0 and referees >= busiest, out.stdout
        assert ref_ms > 0 and run_ms > 0, out.stdout  # CPU ms per match: referees, runner
        # the runner read its episodes and acknowledgements: at most one of each a match
        # and a few statuses (batched, fewer)
        assert 0 < heard < 3, out.stdout
    assert rows[1][1] == 1.0
    assert re.search(r"CPU per match, K=2 vs K=1: referees [0-9.]+x .*runner [0-9.]+x", out.stdout)


def test_the_warm_up_gives_a_small_transformer_the_cooperative_prior(tmp_path: Path) -> None:
    """bench/ipd_warmup.py: a random Qwen2 of hidden 128 leaves it playing A with P about 0.95,
    as the local agent scores it (a fresh backend on the saved folder, prompts it never saw)."""
    import asyncio
    import random

    from backroom.games import make_game
    from backroom.model.backend import Backend, ModelSpec, softmax

    model = tmp_path / "model"
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ipd_warmup.py"), "--out", str(model)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "random small Qwen2: P(A) 0." in out.stdout and "warm-up done" in out.stdout
    backend = Backend(ModelSpec(path=str(model), device="cpu")).load()
    assert backend.model.config.hidden_size == 128
    cands = [backend.completion_ids("<A>"), backend.completion_ids("<B>")]
    game, rng = make_game("ipd", rounds=10), random.Random(7)
    probs = []
    for seat in (0, 1):
        state = game.new_initial_state(99 + seat)
        for _ in range(rng.randrange(1, 9)):
            state.apply({0: rng.choice("AB"), 1: rng.choice("AB")})
        ids = backend.encode_chat([{"role": "user", "content": state.prompt(seat)}])
        scored = asyncio.run(backend.score(ids, cands))
        probs.append(softmax([s.total for s in scored])[0])
    assert all(0.9 < p < 0.99 for p in probs), probs


@pytest.mark.slow  # two short `backroom train` runs with their processes, about a minute
def test_the_exploitability_bench_on_the_bus_prints_a_row_per_opponent(tmp_path: Path) -> None:
    """bench/ipd_exploitability_bus.py trains its frozen opponents, runs a learner against each
    through `backroom train`, and reads the outcome back from the run's store."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "ipd_exploitability_bus.py"),
            *("--seeds", "0", "--steps", "2", "--batch", "2", "--rounds", "2"),
            *("--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=900 * load_factor(),
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [
        line for line in out.stdout.splitlines() if line.startswith("| ") and "seed" not in line
    ]
    assert [r.split(" | ")[0] for r in rows] == [
        "| Advantage Alignment (memory-one, frozen: tit-for-tat)",
        "| GRPO sum-of-rewards (memory-one, frozen: always-A)",
    ], out.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        learner, opponent, gap = float(cells[3]), float(cells[4]), float(cells[5])
        assert (
            0 <= learner <= 5
            and 0 <= opponent <= 5
            and gap == pytest.approx(learner - opponent, abs=0.011)
        )
        assert cells[-1] == "0 / 0 / 0", row  # nothing voided, no fallback, nothing dropped
    assert (tmp_path / "m1-adalign-s0" / "memory_one.json").exists()


@pytest.mark.slow  # a whole benchmark run: CI runs it with the slow set
def test_the_mqtt_client_bench_prints_both_clients_and_their_ratio(tmp_path: Path) -> None:
    """backroom's Bus beside gmqtt, round trips and 100 in flight (issue 37's decision)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mqtt_clients.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300 * load_factor(),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for kind in ("bus", "gmqtt"):
        assert re.search(rf"^{kind} +[0-9.]+ ms +[0-9,]+ /s$", out.stdout, re.M), out.stdout
    assert re.search(
        r"gmqtt / bus: round trip [0-9.]+x the time, 100 in flight [0-9.]+x", out.stdout
    )
