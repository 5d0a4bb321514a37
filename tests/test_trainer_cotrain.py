"""Co-training and opponent pools end to end: real trainers, a real broker, the tiny random Qwen2.

Two ``train`` loops (an Advantage Alignment learner and a GRPO learner), each
with its own policy, players and run directory, share one broker and one
referee and play each other: each names the other's current adapter on the
opponent seat and trains only its own seat. Then a third learner trains
against a fixed pool (an always-cooperating agent and a frozen adapter of the
first run), whose seats are never trained. Slow: a GRPO learner exploits a
frozen naive policy and not a frozen Advantage Alignment one; two ``backroom train`` processes
co-train from the examples over a shared broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.agents import make_agent
from backroom.agents.base import Agent
from backroom.agents.local_model import LocalAgent
from backroom.bus.broker import Broker
from backroom.bus.wire import Trace
from backroom.model.adapters import adapter_digest
from backroom.trainer import memory_one
from backroom.trainer.config import parse_train_config
from backroom.trainer.loop import TrainError, TrainResult, train
from backroom.trainer.memory_one import Result
from backroom.trainer.opponents import PoolOutcome, Records
from backroom.trainer.store import Store

from .conftest import TEST_DEVICE, agents, identity, load_factor, stack
from .test_trainer import tiny_config_data

ROOT = Path(__file__).resolve().parents[1]


def cotrain_data(model: Path, me: str, other: str, algorithm: str) -> dict[str, Any]:
    """Two one-match-per-seat steps of 2-round IPD against the other policy's current adapter."""
    return tiny_config_data(
        model,
        run=me,
        policy=me,
        algorithm=algorithm,
        params={"rounds": 2},
        hyper={"lr": 1e-2, "batch_size": 2, "group_size": 1},
        players=[f"{me}-0", f"{me}-1"],
        opponents=[{"policy": other}],
        evaluation={"every": 2, "matches": 1},
    )


def learners(model: Path, policy: str) -> list[LocalAgent]:
    return [
        LocalAgent(f"{policy}-{i}", model=str(model), device=TEST_DEVICE, policy=policy, seed=i)
        for i in range(2)
    ]


def stored_traces(store: Store) -> list[tuple[str, int, Trace]]:
    rows = store._db.execute("SELECT match, seat, trace FROM traces").fetchall()
    return [(m, seat, Trace.model_validate_json(t)) for m, seat, t in rows]


def check_own_seat_only(run_dir: Path, me: str, other: str, other_versions: dict[str, str]) -> None:
    """Every training match of ``run_dir``: ``me`` on the trained seat at the step's version,
    ``other`` (a version whose files have ``other_versions``' digests) on the other seat; its
    traces are stored (they were seated) but none is in the batch."""
    with Store(run_dir / "store.sqlite") as store:
        steps = store.steps()
        assert [v for _, v, _ in steps] == ["v1", "v2"]
        for step, _, _ in steps:
            planned = store.requests(step=step, kind="train")
            joined, dropped = store.join([r.match for r in planned])
            assert len(joined) == 2 and sum(dropped.values()) == 0, dropped
            assert {ep.request.trainable for ep in joined} == {(0,), (1,)}
            for ep in joined:
                (mine,) = ep.request.trainable
                own, theirs = ep.request.spec.adapters[mine], ep.request.spec.adapters[1 - mine]
                assert own is not None and (own.policy, own.version) == (me, f"v{step}")
                assert theirs is not None and theirs.policy == other
                assert theirs.sha256 == other_versions[theirs.version]
                assert ep.decisions and {d.seat for d in ep.decisions} == {mine}
                assert {
                    (d.trace.adapter_policy, d.trace.adapter_version) for d in ep.decisions
                } == {(me, f"v{step}")}
        opponent_traces = [
            t
            for match, seat, t in stored_traces(store)
            if (r := store.request(match)) is not None
            and r.kind == "train"
            and seat not in r.trainable
        ]
        # the other policy really played the opponent seat (its traces say so)
        assert opponent_traces and {t.adapter_policy for t in opponent_traces} == {other}


def digests(run_dir: Path) -> dict[str, str]:
    return {p.name: adapter_digest(p)[0] for p in (run_dir / "adapters").iterdir()}


async def test_two_trainers_co_train_on_one_bus_each_training_only_its_own_policy(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    aa = parse_train_config(cotrain_data(tiny_qwen_model, "aa", "gr", "adalign"))
    gr = parse_train_config(cotrain_data(tiny_qwen_model, "gr", "aa", "grpo"))
    players: list[Agent] = [*learners(tiny_qwen_model, "aa"), *learners(tiny_qwen_model, "gr")]
    async with stack(broker, tmp_path / "runs", players):
        results: list[TrainResult] = await asyncio.gather(
            train(aa, tmp_path / "aa", identity(broker, "trainer-aa", "trainer")),
            train(gr, tmp_path / "gr", identity(broker, "trainer-gr", "trainer")),
        )
    assert [r.version for r in results] == ["v2", "v2"]
    aa_files, gr_files = digests(tmp_path / "aa"), digests(tmp_path / "gr")
    assert sorted(aa_files) == sorted(gr_files) == ["v0", "v1", "v2"]  # each saved its own only
    assert set(aa_files.values()).isdisjoint(gr_files.values())
    check_own_seat_only(tmp_path / "aa", "aa", "gr", gr_files)
    check_own_seat_only(tmp_path / "gr", "gr", "aa", aa_files)
    # evaluation played the other policy too
    assert set(results[0].evaluations[-1]["against"]) == {"self", "policy-gr"}
    assert set(results[1].evaluations[-1]["against"]) == {"self", "policy-aa"}


async def test_a_co_trained_policy_nobody_trains_stops_the_run_saying_so(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    config = parse_train_config(cotrain_data(tiny_qwen_model, "solo", "ghost", "grpo"))
    async with stack(broker, tmp_path / "runs", [*learners(tiny_qwen_model, "solo")]):
        with pytest.raises(TrainError, match=r"opponents: no checkpoint of policies \['ghost'\]"):
            await train(
                config,
                tmp_path / "solo",
                identity(broker, "trainer-solo", "trainer"),
                online_timeout_s=2 * load_factor(),
            )
    with Store(tmp_path / "solo" / "store.sqlite") as store:
        assert store.requests() == []  # nothing was asked for


async def test_a_fixed_pool_is_played_and_never_trained(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    # the frozen run: one GRPO step in self-play (its adapters v0 and v1)
    base = parse_train_config(
        {**cotrain_data(tiny_qwen_model, "g", "x", "grpo"), "opponents": [], "steps": 1}
    )
    players: list[Agent] = [*learners(tiny_qwen_model, "g")]
    frozen = tmp_path / "frozen"
    async with stack(broker, tmp_path / "runs", players):
        await train(base, frozen, identity(broker, "trainer-g", "trainer"))
    before = digests(frozen)
    config = parse_train_config(
        {
            **cotrain_data(tiny_qwen_model, "learner", "x", "grpo"),
            "hyper": {"lr": 1e-2, "batch_size": 4, "group_size": 1},
            "buffer": {"sample": "pfsp"},
            "opponents": [
                {"agent": {"id": "coop", "kind": "always", "options": {"action": "A"}}},
                {"run": str(frozen), "versions": ["v1"], "policy": "naive"},
            ],
        }
    )
    players = [*learners(tiny_qwen_model, "learner"), *agents(("coop", "always"))]
    run_dir = tmp_path / "learner"
    async with stack(broker, tmp_path / "runs", players):
        result = await train(config, run_dir, identity(broker, "trainer-learner", "trainer"))
    assert result.version == "v2"
    assert digests(frozen) == before  # the frozen run's adapters are untouched
    with Store(run_dir / "store.sqlite") as store:
        labels = set()
        for step in (0, 1):
            planned = store.requests(step=step, kind="train")
            joined, dropped = store.join([r.match for r in planned])
            assert len(joined) == 4 and sum(dropped.values()) == 0, dropped
            for ep in joined:
                labels.add(ep.request.label)
                (mine,) = ep.request.trainable
                assert {d.seat for d in ep.decisions} == {mine}
                assert {d.trace.adapter_policy for d in ep.decisions} == {"learner"}
                other = ep.request.spec.adapters[1 - mine]
                if ep.request.label == "agent coop":
                    assert ep.record.seats[1 - mine] == "coop" and other is None
                    assert {a.action for a in ep.record.actions if a.seat != mine} == {"A"}
                else:
                    assert other is not None and (other.policy, other.version) == ("naive", "v1")
                    assert other.sha256 == before["v1"]
        assert labels == {"agent coop", "frozen naive v1"}
        # PFSP's record: every training match against a pool member, as used by the steps
        record = Records.from_store(store, before_step=2)
        assert set(record.matches) == labels and sum(record.matches.values()) == 8
        # the frozen seat was played by the named version (its traces say so), and never trained
        frozen_seats = [
            t
            for match, seat, t in stored_traces(store)
            if (r := store.request(match))
            and r.label == "frozen naive v1"
            and seat not in r.trainable
        ]
        assert frozen_seats
        assert {(t.adapter_policy, t.adapter_version) for t in frozen_seats} == {("naive", "v1")}
    assert set(result.evaluations[-1]["against"]) == {"self", "agent-coop", "frozen-naive-v1"}


async def exploit_run(
    broker: Broker, tmp_path: Path, model: Path, opponent: dict[str, Any], name: str
) -> tuple[list[float], dict[int, tuple[float, float]]]:
    """A GRPO learner trained against one frozen opponent (an agent spec) as
    ``bench/ipd_exploitability_bus.py`` trains it: its share of A by step, and step ->
    (the learner's, the opponent's) mean reward per round in that step's matches."""
    config = parse_train_config(
        {
            **cotrain_data(model, name, "x", "grpo"),
            "params": {"rounds": 10},
            "hyper": {"lr": 1e-4, "batch_size": 8, "group_size": 1},
            "lora": {"rank": 32, "alpha": 64},
            "steps": EXPLOIT_STEPS,
            "opponents": [{"agent": opponent}],
            "evaluation": {"every": EXPLOIT_STEPS, "matches": 1},
            # a default move would fail the test; a busy machine must not cause one
            "turn_timeout_s": 30 * load_factor(),
            "episode_timeout_s": 300 * load_factor(),
        }
    )
    frozen = make_agent(opponent["kind"], opponent["id"], **opponent.get("options", {}))
    coop: list[float] = []
    async with stack(broker, tmp_path / "runs", [*learners(model, name), frozen]):
        await train(
            config,
            tmp_path / name,
            identity(broker, f"trainer-{name}", "trainer"),
            on_step=lambda _s, row: coop.append(row["cooperation_rate"]),
        )
    with Store(tmp_path / name / "store.sqlite") as store:
        outcome = PoolOutcome.from_store(store)
    # every training match ended normally, and every move was its agent's own
    assert outcome.abnormal == 0 and outcome.fallbacks == 0, outcome
    rewards = outcome.by_step
    return coop, rewards


EXPLOIT_STEPS = 30


def memory_one_run(tmp_path: Path, name: str, **overrides: Any) -> tuple[Path, Result]:
    """``backroom train examples/ipd_memory_one.yaml`` with ``overrides``: a frozen policy's run."""
    data = yaml.safe_load((ROOT / "examples" / "ipd_memory_one.yaml").read_text())
    run_dir = tmp_path / name
    return run_dir, memory_one.run(parse_train_config({**data, **overrides}), run_dir)


@pytest.mark.slow  # a warm-up and two 30-step runs of 10-round matches, about 2.5 min
async def test_grpo_exploits_a_frozen_naive_policy_not_a_frozen_advantage_alignment_one(
    broker: Broker, tmp_path: Path
) -> None:
    """The paper's experiment (figure 6), end to end: an LLM learner over the real stack.

    Both opponents are trained by backroom and frozen: Advantage Alignment and
    the sum-of-rewards GRPO cooperator on the memory-one harness (seconds,
    ``examples/ipd_memory_one.yaml``; no LLM a CPU can train becomes an AA
    agent), played on the bus by the ``memory-one`` kind from their run
    directories, as ``opponents:`` members the learner never trains. The
    learner is a GRPO LoRA on the small random Qwen2 with SmolLM2's cooperative
    prior (P(A) 0.95, ``bench/ipd_warmup.py``), through ``train``, the referee
    and ``local`` agents: ``bench/ipd_exploitability_bus.py``'s run, for one
    seed and 30 steps (docs/training.md has three seeds of 40).
    """
    aa_dir, aa = memory_one_run(tmp_path, "m1-adalign")  # the example: AA, 400 steps
    naive_dir, naive_policy = memory_one_run(tmp_path, "m1-naive", algorithm="grpo_sum", steps=150)
    assert aa.verdict == "tit-for-tat" and naive_policy.verdict == "always-A"
    model = tmp_path / "model"
    warm = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ipd_warmup.py"), "--out", str(model)],
        capture_output=True,
        text=True,
        timeout=300 * load_factor(),
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    outcomes = {}
    for name, run_dir in (("naive", naive_dir), ("adalign", aa_dir)):
        spec = {"id": name, "kind": "memory-one", "options": {"run": str(run_dir)}}
        outcomes[name] = await exploit_run(broker, tmp_path, model, spec, f"vs-{name}")
    summary = {}
    for name, (coop, rewards) in outcomes.items():
        assert len(coop) == EXPLOIT_STEPS and sorted(rewards) == list(range(EXPLOIT_STEPS))
        last = range(EXPLOIT_STEPS - 3, EXPLOIT_STEPS)
        learner = sum(rewards[s][0] for s in last) / 3
        opponent = sum(rewards[s][1] for s in last) / 3
        summary[name] = {
            "start": coop[0],
            "coop": sum(coop[s] for s in last) / 3,
            "gap": learner - opponent,  # the learner's reward per round minus the opponent's
            "drop": rewards[0][1] - opponent,  # what the learner's training cost the opponent
        }
    naive, adalign = summary["naive"], summary["adalign"]
    # both start where the prior is: cooperating
    assert naive["start"] > 0.85 and adalign["start"] > 0.85, summary
    # against the frozen cooperator defection pays (5 against 3 a round): it learns always-B,
    # and exploits it as bench/ipd_exploitability.py defines it (gap and drop both above 1)
    assert naive["coop"] < 0.3 and naive["gap"] > 1 and naive["drop"] > 1, summary
    # against the frozen AA policy defection is answered: it keeps cooperating, and the
    # opponent gets about what it got at the start (no exploitation)
    assert adalign["coop"] > 0.85 and abs(adalign["gap"]) < 0.5, summary
    assert adalign["drop"] < 0.5, summary


@pytest.mark.slow  # two `backroom train` processes with their referees and agent hosts, ~1 min
def test_two_backroom_train_processes_co_train_from_the_examples(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """The commands docs/training.md gives, shortened: each process starts its own referee and
    agents on the shared broker, trains its own policy against the other's, and hands its
    checkpoints to the league directory."""
    root = Path(__file__).resolve().parent.parent / "examples"
    league = tmp_path / "league"
    short = [
        f"model.path={tiny_qwen_model}",
        f"model.device={TEST_DEVICE}",
        "steps=2",
        "hyper.batch_size=2",
        "params.rounds=2",
        "evaluation.every=2",
        "evaluation.matches=1",
        "lora.rank=4",
        "lora.alpha=8",
        f"league.dir={league}",
        "league.every=1",
    ]
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "backroom", "train", str(root / f"ipd_cotrain_{name}.yaml")]
            + ["--broker", broker.url, "--credentials", str(broker.dir), "--threads", "1"]
            + ["--run-dir", str(tmp_path / name)]
            + [arg for s in short for arg in ("--set", s)],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("adalign", "grpo")
    }
    try:
        outputs = {name: p.communicate(timeout=400 * load_factor())[0] for name, p in procs.items()}
    finally:
        for p in procs.values():  # a timeout must not leave trainers on the shared broker
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs.items():
        assert p.returncode == 0, outputs[name][-3000:]
    for name, other in (("adalign", "cotrain-grpo"), ("grpo", "cotrain-aa")):
        evaluation = json.loads(
            (tmp_path / name / "evaluations.jsonl").read_text().splitlines()[-1]
        )
        assert f"policy-{other}" in evaluation["against"], evaluation
        with Store(tmp_path / name / "store.sqlite") as store:
            assert [v for _, v, _ in store.steps()] == ["v1", "v2"]
    assert sorted(p.name for p in (league / "entrants.d").iterdir()) == [
        "cotrain-aa.v1.yaml",
        "cotrain-aa.v2.yaml",
        "cotrain-grpo.v1.yaml",
        "cotrain-grpo.v2.yaml",
    ]
