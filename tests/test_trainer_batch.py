"""The trainer plays its batches by the runner's fault rules (``trainer.batch``).

A stop during rollouts leaves matches *not played*: ``--resume`` asks for
each again (a new id where its referee voided it) and trains on the same
matches as a run that went through; a request no referee took is sent again
and counted; a referee that dies mid-rollout costs seconds, not the episode
timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from backroom.bus.broker import Broker
from backroom.bus.wire import AdapterRef
from backroom.runner.stack import env_for
from backroom.trainer.batch import BatchError, Played, is_attempt, planned_only, play_batch
from backroom.trainer.bus import TrainerBus
from backroom.trainer.config import parse_train_config
from backroom.trainer.rollouts import plan_step
from backroom.trainer.store import Store

from .conftest import RawAgent, agents, eventually, identity, load_factor, stack
from .test_trainer import tiny_config_data

#: Columns that are clocks, not results: they differ between any two runs.
CLOCKS = {"step_seconds", "rollout_seconds", "tokens_per_second"}


def test_the_summary_says_what_was_not_played() -> None:
    played = Played(4, ["a", "b", "c", "d"], [], {"d": "referee shutting down"})
    assert played.summary() == "3 of 4 matches (1 voided: referee shutting down)"
    assert Played(4, ["a", "b", "c", "d"], [], {}).summary() == "4 of 4 matches"
    assert is_attempt("run.s1.g0.m0.r2") and not is_attempt("run.s1.g0.m0")


@pytest.mark.slow  # three short training runs of a tiny model: about 2 min at load 2
def test_a_stop_during_rollouts_resumes_to_the_uninterrupted_train_log(
    tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """SIGINT while step 1's matches are in flight; ``--resume``; the train log equals a run's
    that went through, row for row (the clocks aside). Before, the matches the stop voided were
    never asked for again: the step trained on fewer, or found nothing to learn from."""
    data = tiny_config_data(
        tiny_qwen_model,
        params={"rounds": 8},
        hyper={"lr": 1e-2, "batch_size": 4, "group_size": 2, "rho": 0.5},
        steps=3,
        evaluation={"every": 100, "matches": 1, "baselines": []},
        turn_timeout_s=60,
    )
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump(data))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "backroom", "train", str(cfg), "--run-dir", str(run_dir)]
        return subprocess.Popen(
            [*argv, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    whole = start(tmp_path / "whole")  # meanwhile: the two share the cores, not the broker
    cut = start(tmp_path / "cut")
    store_path = tmp_path / "cut" / "store.sqlite"

    def in_flight() -> bool:
        """Step 1 asked for, a decision of it taken (a trace stored), an episode still missing."""
        if not store_path.exists():
            return False
        with contextlib.closing(sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)) as db:
            try:
                return (
                    db.execute(
                        "SELECT count(*) = 4 AND count(e.match) < 4 AND EXISTS (SELECT 1 FROM traces t"
                        " JOIN requests q ON q.match = t.match WHERE q.step = 1) FROM requests r"
                        " LEFT JOIN episodes e ON e.match = r.match WHERE r.step = 1"
                    ).fetchone()[0]
                    == 1
                )
            except sqlite3.OperationalError:  # its schema not written yet
                return False

    deadline = time.monotonic() + 300 * load_factor()
    while not in_flight():
        assert cut.poll() is None, cut.communicate()
        assert time.monotonic() < deadline, "step 1 never had matches in flight"
        time.sleep(0.05)
    cut.send_signal(signal.SIGINT)
    out, err = cut.communicate(timeout=120)
    assert cut.returncode == 130, out[-2000:] + err[-2000:]
    with Store(store_path) as store:
        assert store.last_step() == (0, "v1")
    resumed = start(tmp_path / "cut", "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-2000:] + err[-3000:]
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, out[-2000:] + err[-3000:]
    logs = [
        [
            {k: v for k, v in row.items() if k not in CLOCKS}
            for row in csv.DictReader((tmp_path / run / "train_log.csv").open())
        ]
        for run in ("cut", "whole")
    ]
    assert len(logs[0]) == 3
    for got, want in zip(*logs, strict=True):
        assert got.keys() == want.keys()
        for key in ("step", "version", "matches", "decisions", "planned", "voided", "dropped"):
            assert got[key] == want[key], (key, got, want)
        for key in ("cooperation_rate", "reward_seat0", "reward_seat1"):
            assert got[key] == want[key], (key, got, want)
        for key in ("loss", "kl", "entropy", "grad_norm"):  # to the agents' scoring precision
            assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-3, abs=1e-6), key
    with Store(store_path) as store:
        step1 = store.requests(step=1, kind="train")
        assert len(planned_only(step1)) == 4
        # every match of the interrupted step fed it once, under its own id or a new one
        used = [r.match for r in step1 if store.used_in(r.match) == 1]
        assert len(used) == 4 and len({m.split(".r")[0] for m in used}) == 4


async def test_a_request_no_referee_took_is_sent_again_and_counted(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """The step's requests go out while no referee is on the bus (a shared subscription keeps
    nothing for nobody): each is sent again until one is there, and counted. Before, the
    trainer waited the episode timeout (600 s by default) and trained on nothing."""
    config = parse_train_config(tiny_config_data(tiny_qwen_model, params={"rounds": 1}))
    ref = AdapterRef(policy="pol", version="v0", uri="/nowhere", sha256="0" * 64, size=0)
    planned = [
        replace(r, spec=r.spec.model_copy(update={"adapters": [None, None]}))
        for r in plan_step(config, 0, ref, [])
    ]
    players = agents(("p0", "tit-for-tat"), ("p1", "tit-for-tat"))
    with Store(tmp_path / "store.sqlite") as store:
        async with TrainerBus(identity(broker, "trainer-b", "trainer"), store, config.game) as tb:
            task = asyncio.create_task(play_batch(tb, store, planned, 60 * load_factor(), 8))
            await eventually(lambda: tb.ledger is not None and len(tb.ledger.sent) == 4, 10)
            await asyncio.sleep(0.2)  # flushed: out to a broker with no referee
            async with stack(broker, tmp_path / "runs", players):
                played = await asyncio.wait_for(task, 60 * load_factor())
        assert played.summary() == "4 of 4 matches"
        assert played.faults.resubmitted >= 4
        assert store.missing_episodes(played.matches) == []


async def test_a_referee_killed_mid_rollout_costs_seconds_not_the_episode_timeout(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """SIGKILL the referee that took the step's matches (its agents were thinking): its status
    goes offline (its will), and after the grace its matches are asked for under new ids and
    played by another referee. Before, the step waited the episode timeout (600 s)."""
    config = parse_train_config(
        tiny_config_data(tiny_qwen_model, params={"rounds": 1}, turn_timeout_s=120)
    )
    ref = AdapterRef(policy="pol", version="v0", uri="/nowhere", sha256="0" * 64, size=0)
    planned = [
        replace(r, spec=r.spec.model_copy(update={"adapters": [None, None]}))
        for r in plan_step(config, 0, ref, [])
    ]
    env = {**os.environ, **env_for(identity(broker, "referee-k", "referee"))}
    argv = [sys.executable, "-m", "backroom", "referee", "--runs-dir", str(tmp_path / "k")]
    doomed = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    load = load_factor()
    try:
        with Store(tmp_path / "store.sqlite") as store:
            async with TrainerBus(identity(broker, "trainer-k", "trainer"), store, "ipd") as tb:
                await eventually(lambda: tb.referees.get("referee-k", False), 60 * load)
                # agents that take the match and never move: the matches stay in the referee's hands
                async with RawAgent(identity(broker, "p0")), RawAgent(identity(broker, "p1")):
                    task = asyncio.create_task(play_batch(tb, store, planned, 600, 8))
                    await eventually(
                        lambda: tb.ledger is not None and len(tb.ledger.owner) == 4, 30 * load
                    )
                doomed.kill()
                t0 = time.monotonic()
                players = agents(("p0", "tit-for-tat"), ("p1", "tit-for-tat"))
                async with stack(broker, tmp_path / "runs", players):
                    played = await asyncio.wait_for(task, 30 * load)
                seconds = time.monotonic() - t0
    finally:
        doomed.kill()
        doomed.wait()
    assert played.summary() == "4 of 4 matches", played
    assert played.faults.referees_lost == ["referee-k"]
    assert played.faults.rerequest_reasons["referee lost"] == 4
    assert seconds < 30 * load, f"{seconds:.1f} s (load factor {load:.1f})"


def test_a_step_short_of_matches_says_so_in_its_line_its_log_and_analyze(tmp_path: Path) -> None:
    """A void that stands (not a stop's: it is not asked for again) is said where a user looks."""
    from backroom.analysis.report import printed_lines
    from backroom.analysis.training import analyze_training
    from backroom.bus.wire import BROKER_LOST
    from backroom.cli.train import _step_line
    from backroom.trainer.loop import TrainLog, _batch_columns

    played = Played(4, ["m0", "m1", "m2", "m3"], [], {"m3": BROKER_LOST})
    row = {
        "step": 0,
        "version": "v1",
        "matches": 3,
        "loss": 0.5,
        "cooperation_rate": 0.5,
        "rollout_seconds": 1.0,
        "step_seconds": 1.0,
        "reward_seat0": 1.0,
        **_batch_columns(played),
    }
    said = f"3 of 4 matches (1 voided: {BROKER_LOST})"
    assert _step_line(row).endswith(f"; {said}")
    TrainLog(tmp_path / "train_log.csv").append(row)
    training = analyze_training(tmp_path, None)
    assert training["unplayed"] == [f"step 0: {said}"]
    assert f"warning: step 0: {said}" in printed_lines({"training": training})


async def test_the_only_referee_killed_mid_rollout_fails_the_batch_with_the_reason(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """No other referee to take them: the batch fails naming the referee, in seconds."""
    config = parse_train_config(
        tiny_config_data(tiny_qwen_model, params={"rounds": 1}, turn_timeout_s=120)
    )
    ref = AdapterRef(policy="pol", version="v0", uri="/nowhere", sha256="0" * 64, size=0)
    planned = plan_step(config, 0, ref, [])
    env = {**os.environ, **env_for(identity(broker, "referee-k", "referee"))}
    argv = [sys.executable, "-m", "backroom", "referee", "--runs-dir", str(tmp_path / "k")]
    doomed = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    load = load_factor()
    try:
        with Store(tmp_path / "store.sqlite") as store:
            async with TrainerBus(identity(broker, "trainer-k", "trainer"), store, "ipd") as tb:
                await eventually(lambda: tb.referees.get("referee-k", False), 60 * load)
                async with RawAgent(identity(broker, "p0")), RawAgent(identity(broker, "p1")):
                    task = asyncio.create_task(play_batch(tb, store, planned, 600, 8))
                    await eventually(
                        lambda: tb.ledger is not None and len(tb.ledger.owner) == 4, 30 * load
                    )
                    doomed.kill()
                    t0 = time.monotonic()
                    with pytest.raises(BatchError, match="referee referee-k is gone") as failed:
                        await asyncio.wait_for(task, 30 * load)
                    seconds = time.monotonic() - t0
    finally:
        doomed.kill()
        doomed.wait()
    assert "4 matches unfinished" in str(failed.value)
    assert seconds < 30 * load, f"{seconds:.1f} s (load factor {load:.1f})"
