"""The trainer end to end over a real broker, with a tiny randomly initialised Qwen2.

Rollouts go through the referee to ``local`` agents; the trainer stores
episodes and traces, takes LoRA steps, saves and announces checkpoints; the
agents swap, and the next step's traces carry the new version.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from backroom.agents.base import Agent
from backroom.agents.local_model import LocalAgent
from backroom.analysis import analyze_run
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus
from backroom.bus.wire import Checkpoint, parse
from backroom.model.adapters import adapter_digest
from backroom.model.spec import ModelSpec
from backroom.trainer.config import TrainConfig, parse_train_config
from backroom.trainer.loop import train
from backroom.trainer.store import Store

from .conftest import TEST_DEVICE, agents, eventually, identity, load_factor, stack


def test_training_examples_load_with_the_papers_settings() -> None:
    from backroom.trainer.config import PRESETS, load_train_config

    root = Path(__file__).resolve().parent.parent / "examples"
    for name, algorithm in (("ipd_grpo.yaml", "grpo"), ("ipd_adalign.yaml", "adalign")):
        config = load_train_config(root / name)
        assert config.algorithm == algorithm and config.game == "ipd" and config.hp is not None
        paper = PRESETS["ipd"]
        for key in (
            "reward_norm",
            "entropy_coef",
            "kl_coef",
            "discount",
            "beta",
            "aa_gamma",
            "group_size",
        ):
            assert getattr(config.hp, key) == paper[key], key
    assert load_train_config(root / "kuhn_dpo.yaml").algorithm == "dpo"


def test_train_config_errors_name_the_field(tmp_path: Path) -> None:
    import pytest

    from backroom.runner.config import ConfigError

    base = {"game": "ipd", "algorithm": "grpo", "preset": "ipd"}
    for bad, field in (
        ({"hyper": {"lr": -1}}, "lr"),
        ({"algorithm": "ppo"}, "algorithm"),
        ({"game": "ipdd"}, "game"),
        ({"hyper": {"batch_size": 7, "group_size": 2}}, "batch_size"),
        ({"preset": None}, "hyper"),
    ):
        with pytest.raises(ConfigError, match=field):
            parse_train_config({**base, **bad})


def tiny_config(model: Path, **overrides: Any) -> TrainConfig:
    return parse_train_config(tiny_config_data(model, **overrides))


def tiny_config_data(model: Path, **overrides: Any) -> dict[str, Any]:
    """A two-step Advantage Alignment run of 3-round IPD matches on ``model``, as a config file says it."""
    data: dict[str, Any] = {
        "run": "t",
        "game": "ipd",
        "params": {"rounds": 3},
        "algorithm": "adalign",
        "preset": "ipd",
        "hyper": {"lr": 1e-2, "batch_size": 4, "group_size": 2, "rho": 0.5},
        "steps": 2,
        "policy": "pol",
        "model": {"path": str(model), "device": TEST_DEVICE},  # cpu unless the GPU run says
        "lora": {"rank": 4, "alpha": 8},
        "players": ["p0", "p1"],
        "evaluation": {
            "every": 2,
            "matches": 2,
            "baselines": [{"id": "tft", "kind": "tit-for-tat"}],
        },
        "turn_timeout_s": 30,
        "episode_timeout_s": 120,
    }
    data.update(overrides)
    return data


async def test_training_steps_end_to_end(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    # adapters travel over the trainer's HTTP server, as to agents on other machines
    config = tiny_config(tiny_qwen_model, serve_adapters="127.0.0.1:0")
    learners = [
        LocalAgent(p, model=str(tiny_qwen_model), device=TEST_DEVICE, policy="pol", seed=i)
        for i, p in enumerate(config.players)
    ]
    players: list[Agent] = [*learners, *agents(("tft", "tit-for-tat"))]
    run_dir = tmp_path / "run"
    rows: list[dict[str, Any]] = []
    steps_before = REGISTRY.get_sample_value("backroom_train_steps_total") or 0.0
    async with stack(broker, tmp_path / "runs", players):
        result = await train(
            config,
            run_dir,
            identity(broker, "trainer-t", "trainer"),
            on_step=lambda _s, row: rows.append(row),
        )
        # agents following the policy verified and loaded the last announced adapter
        await eventually(lambda: all(a.version == result.version for a in learners), 30)
    assert result.version == "v2" and [r["step"] for r in rows] == [0, 1]
    with Store(run_dir / "store.sqlite") as store:
        assert [(s, v) for s, v, _ in store.steps()] == [(0, "v1"), (1, "v2")]
        for step in (0, 1):
            requests = store.requests(step=step, kind="train")
            assert (
                len(requests) == 4 and len({r.spec.seed for r in requests}) == 2
            )  # 2 CRN groups of k=2
            joined, dropped = store.join([r.match for r in requests])
            assert sum(dropped.values()) == 0, dropped
            for ep in joined:
                assert ep.record.reason == "normal"
                assert (
                    store.used_in(ep.record.match) == step
                )  # each episode fed exactly its own step
                trained = [d for d in ep.decisions]
                # 3 rounds, one act decision per round per trained seat
                assert len(trained) == 3 * len(ep.request.trainable)
                # the step's rollouts played the adapter trained by the step before
                assert {d.trace.adapter_version for d in trained} == {f"v{step}"}
                for d in trained:
                    assert d.trace.candidates and d.trace.chosen is not None
    for v in ("v0", "v1", "v2"):
        assert (run_dir / "adapters" / v / "adapter_model.safetensors").exists()
    # the retained checkpoint names the last adapter, and its hash is the files' hash
    seen: list[Checkpoint] = []
    async with Bus(identity(broker, "watcher", "observer")) as bus:
        await bus.subscribe(topics.checkpoint("pol"), lambda _t, p: seen.append(parse(p)))  # type: ignore[arg-type]
        await eventually(lambda: bool(seen), 10)
    sha, size = adapter_digest(run_dir / "adapters" / "v2")
    assert seen[-1].version == "v2" and seen[-1].sha256 == sha and seen[-1].size == size
    assert seen[-1].uri.startswith("http://127.0.0.1:") and seen[-1].uri.endswith("/adapters/v2")
    log = list(csv.DictReader((run_dir / "train_log.csv").open()))
    assert [r["version"] for r in log] == ["v1", "v2"]
    assert all(float(r["grad_norm"]) > 0 and float(r["decisions"]) > 0 for r in log)
    # Prometheus: the steps, the last loss, and the evaluation against each opponent
    assert REGISTRY.get_sample_value("backroom_train_steps_total") == steps_before + 2
    assert REGISTRY.get_sample_value("backroom_train_value", {"stat": "loss"}) == float(
        log[-1]["loss"]
    )
    assert REGISTRY.get_sample_value("backroom_train_eval_reward", {"baseline": "tft"}) is not None
    # `backroom analyze RUN_DIR` draws the training curves
    analysis = analyze_run(run_dir)
    assert analysis["training"]["steps"] == 2 and len(analysis["training"]["plots"]) == 3
    assert all(Path(p).stat().st_size > 0 for p in analysis["training"]["plots"])
    evals = [json.loads(line) for line in (run_dir / "evaluations.jsonl").read_text().splitlines()]
    assert evals[-1]["version"] == "v2" and set(evals[-1]["against"]) == {"tft", "self"}
    assert all(v["matches"] == 2 for v in evals[-1]["against"].values())


async def test_trainer_killed_mid_run_resumes_without_loss_or_double_count(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """SIGKILL the trainer process while a step's rollouts are in flight, then ``--resume``.

    How "no episode lost, none counted twice" is checked: every match the
    trainer requested has exactly one stored episode, each train episode fed
    exactly the step it was requested for (the store refuses a second use),
    the steps are 0..2 without gap or repeat, and the episodes that finished
    while the trainer was dead reached it through its persistent MQTT session.
    """
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    import yaml

    config = tiny_config(
        tiny_qwen_model, steps=3, evaluation={"every": 100, "matches": 1, "baselines": []}
    )
    cfg_path = tmp_path / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(config.model_dump(exclude={"hp"}, mode="json")))
    learners: list[Agent] = [
        LocalAgent(p, model=str(tiny_qwen_model), device=TEST_DEVICE, policy="pol", seed=i)
        for i, p in enumerate(config.players)
    ]
    identity(broker, "trainer-t", "trainer")
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "backroom",
        "train",
        str(cfg_path),
        "--run-dir",
        str(run_dir),
        "--no-spawn",
        "--broker",
        f"mqtt://{broker.host}:{broker.port}",
        "--credentials",
        str(broker.credentials.dir),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    runs = tmp_path / "runs"

    def refereed(matches: set[str]) -> set[str]:
        path = runs / "t" / "episodes.jsonl"
        done = (
            {json.loads(line)["match"] for line in path.read_text().splitlines()}
            if path.exists()
            else set()
        )
        return done & matches

    def step_requests(step: int) -> set[str]:
        if not (run_dir / "store.sqlite").exists():
            return set()
        with Store(run_dir / "store.sqlite") as s:
            return {r.match for r in s.requests(step=step, kind="train")}

    async with stack(broker, runs, learners) as (referee, _):

        def with_referee(step: int) -> bool:
            """The step's 4 requests stored *and sent*: the referee has them. Stored alone
            is not enough: a kill between the commit and the sends (a wider window on a
            loaded machine: it failed once at load 11) left matches no referee ever saw,
            and the wait below for all of them to be refereed ran out."""
            matches = step_requests(step)
            seen = referee.matches.keys() | referee.finished_ids.keys()
            return len(matches) == 4 and matches <= seen

        log = (tmp_path / "first.log").open("wb")
        first = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            # step 0 logged and step 1's rollouts sent: kill the trainer in the middle of them
            await eventually(lambda: with_referee(1), 240)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
            log.close()
        pending = step_requests(1)
        with Store(run_dir / "store.sqlite") as s:
            assert s.last_step() == (0, "v1")
            arrived_before = set(pending) - set(s.missing_episodes(sorted(pending)))
        # the referee finishes step 1's matches while no trainer is connected
        await eventually(lambda: refereed(pending) == pending, 120)
        second = await asyncio.create_subprocess_exec(
            *args, "--resume", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        out, _ = await asyncio.wait_for(second.communicate(), 300)
        assert second.returncode == 0, out.decode()[-3000:]
    with Store(run_dir / "store.sqlite") as store:
        assert [(s, v) for s, v, _ in store.steps()] == [(0, "v1"), (1, "v2"), (2, "v3")]
        requested = store.requests(kind="train")
        assert len(requested) == 12 and len({r.match for r in requested}) == 12
        assert store.missing_episodes([r.match for r in requested]) == []  # none lost
        for r in requested:
            assert store.used_in(r.match) == r.step  # each used once, by its own step
        for step, _, row in store.steps():
            assert row["matches"] == 4, (step, row)
    # what finished while the trainer was dead came through its persistent session
    assert pending - arrived_before, "the kill came too late to test the session backlog"


def test_adapter_server_serves_adapter_files_only(tmp_path: Path, tiny_qwen_model: Path) -> None:
    """What agents elsewhere fetch: the two adapter files of a version, verified; nothing else."""
    import httpx

    from backroom.bus.wire import AdapterRef
    from backroom.model.adapters import fetch_adapter
    from backroom.trainer.learner import Learner, LoraSettings
    from backroom.trainer.serving import AdapterServer

    adapters = tmp_path / "adapters"
    Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"), lora=LoraSettings(rank=4, alpha=8)
    ).save(adapters / "v0")
    (adapters / "v0" / "README.md").write_text("not served")
    (tmp_path / "secret").write_text("not served")
    sha, size = adapter_digest(adapters / "v0")
    with AdapterServer(adapters) as server:
        ref = AdapterRef(policy="p", version="v0", uri=server.url_for("v0"), sha256=sha, size=size)
        got = fetch_adapter(ref, tmp_path / "cache")
        assert adapter_digest(got) == (sha, size) and got != adapters / "v0"
        base = server.public_url
        for path in (
            "/adapters/v0/README.md",
            "/adapters/v0/",
            "/adapters/",
            "/adapters/v9/adapter_config.json",
            "/adapters/../secret",
            "/adapters/v0/../../secret",
            "/secret",
        ):
            assert httpx.get(base + path).status_code == 404, path


def test_the_processes_of_backroom_train_share_the_cores(
    tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """torch's default (a thread per core in each process) oversubscribes: the trainer and its
    agent host ask, together, for no more intra-op threads than the machine has cores."""
    import os
    import re
    import subprocess
    import sys

    import yaml

    data = tiny_config_data(
        tiny_qwen_model,
        run="threads",
        params={"rounds": 2},
        algorithm="grpo",
        hyper={"lr": 1e-3, "batch_size": 2, "group_size": 1},
        steps=1,
        evaluation={"every": 100, "matches": 1, "baselines": []},
        turn_timeout_s=60,
    )
    cfg = tmp_path / "threads.yaml"
    cfg.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != "BACKROOM_TORCH_THREADS"}
    done = subprocess.run(
        [sys.executable, "-m", "backroom", "train", str(cfg), "--run-dir", str(tmp_path / "run")],
        env={**env, "BACKROOM_LOG_LEVEL": "INFO", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    pattern = re.compile(r"torch intra-op threads: (\d+)")
    trainer = [int(n) for n in pattern.findall(done.stderr)]
    host = [int(n) for n in pattern.findall((tmp_path / "run" / "logs" / "agents.log").read_text())]
    assert trainer and host, (done.stderr[-2000:], host)
    from backroom.model.loading import usable_cores

    cores = usable_cores()
    assert max(trainer) + max(host) <= max(cores, 2), (trainer, host, cores)
    assert (
        f"torch threads: {max(1, cores // 2)} in each of 1 trainer process(es) and the agent "
        f"host (default: {cores} cores shared)"
    ) in done.stdout


@pytest.mark.slow  # three short training runs
def test_ctrl_c_during_an_update_stops_at_once_and_resume_gives_the_uninterrupted_result(
    tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """SIGINT while the step runs in its worker thread: before, asyncio waited for the whole
    update on the way out (over a minute for SmolLM2 on a CPU, three presses of Ctrl-C).
    Resumed, the run plays and learns as one that ran through."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    # an update of 320 decisions, one micro-batch each: seconds of work to interrupt
    data = tiny_config_data(
        tiny_qwen_model,
        params={"rounds": 10},
        algorithm="grpo",
        hyper={"lr": 1e-3, "batch_size": 16, "group_size": 1},
        steps=2,
        micro_batch_tokens=64,
        evaluation={"every": 100, "matches": 1, "baselines": []},
        turn_timeout_s=60,
    )
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump(data))
    env = {**os.environ, "BACKROOM_LOG_LEVEL": "INFO", "HF_HUB_OFFLINE": "1"}

    def start_training(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "backroom", "train", str(cfg), "--run-dir", str(run_dir)]
        return subprocess.Popen(
            [*argv, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    interrupted = start_training(tmp_path / "cut")
    assert interrupted.stderr is not None
    for line in interrupted.stderr:  # wait for the event: the first update has begun
        if "step 0: updating on" in line:
            break
    else:
        raise AssertionError(f"no update began: {interrupted.communicate()}")
    t0 = time.monotonic()
    interrupted.send_signal(signal.SIGINT)
    out, err = interrupted.communicate(timeout=120)
    seconds = time.monotonic() - t0
    load = load_factor()
    assert interrupted.returncode == 130, out[-2000:] + err[-2000:]
    assert seconds < 5 * load, f"{seconds:.1f} s after SIGINT (load factor {load:.1f})"
    assert "--resume" in out and str(tmp_path / "cut") in out
    with Store(tmp_path / "cut" / "store.sqlite") as store:
        assert store.last_step() is None  # the interrupted update was not applied
    resumed = start_training(tmp_path / "cut", "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-2000:] + err[-2000:]
    whole = start_training(tmp_path / "whole")
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, out[-2000:] + err[-2000:]
    # the same seed: the same play, and the same adapter. Not bit for bit: the agents'
    # batched scoring rounds a log-prob by ~1e-6 depending on which requests share a pass
    # (docs/agents.md), and the update reads those log-probs (TIS)
    logs = [
        list(csv.DictReader((tmp_path / run / "train_log.csv").open())) for run in ("cut", "whole")
    ]
    for key in ("cooperation_rate", "reward_seat0", "reward_seat1", "decisions"):
        assert [r[key] for r in logs[0]] == [r[key] for r in logs[1]], key
    from safetensors.torch import load_file
    from torch.testing import assert_close

    cut, whole = (
        load_file(tmp_path / run / "adapters" / "v2" / "adapter_model.safetensors")
        for run in ("cut", "whole")
    )
    assert cut.keys() == whole.keys()
    for name in cut:
        assert_close(cut[name], whole[name], rtol=1e-3, atol=1e-6)
