"""Whole runs with every part a separate OS process, as `backroom run` starts them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from backroom.bus.wire import EpisodeRecord
from backroom.cli.run import demo_config
from backroom.runner.config import ConfigError, RunConfig, load_config
from backroom.runner.local import Stack, identities, run_local, run_matches, start_processes
from backroom.runs import read_episodes


def test_demo_config_200_matches_through_separate_processes(tmp_path: Path) -> None:
    config = demo_config()
    assert config.matches == 200
    result = asyncio.run(run_local(config, runs_dir=tmp_path))
    eps = result.episodes
    assert len(eps) == 200 and len({e.match for e in eps}) == 200
    for ep in eps:
        assert ep.reason == "normal", ep.detail
        assert sum(ep.raw_returns) == 0  # chips are zero-sum before the transform
        assert ep.returns[0] == ep.returns[1]  # the coalition shares its rewards
        assert ep.returns[2] == ep.raw_returns[2]
        overheard = [d for d in ep.deliveries if d.to_seat == 2]
        assert all(d.overheard for d in overheard)
        assert len(overheard) == len([d for d in ep.deliveries if d.to_seat != 2])
    on_disk = list(read_episodes(result.run_dir))
    assert len(on_disk) == 200
    # the rate counts play (first request to last episode), not the processes starting up
    first_start = min(e.started_at for e in eps)
    last_end = max(e.ended_at for e in eps)
    assert last_end - first_start <= result.play_seconds < result.seconds
    assert result.matches_per_second == pytest.approx(200 / result.play_seconds)
    # asyncio.run formats its result's repr twice on 3.11 (CPython #112559): it must not list every episode
    assert "episodes=200" in repr(result) and len(repr(result)) < 200


def test_cli_demo_prints_the_results_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "backroom", "demo", "--matches", "20", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "alice" in out.stdout and "carol" in out.stdout and "normal: 20" in out.stdout
    assert len(list(read_episodes(tmp_path / "demo"))) == 20


def test_bad_config_names_the_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("game: kuhn\nagents:\n  - {id: a}\n")
    out = subprocess.run(
        [sys.executable, "-m", "backroom", "run", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "agents.0.kind" in out.stdout


def _small_config(tmp_path: Path, matches: int, timeout_s: float = 3.0) -> RunConfig:
    return demo_config().model_copy(
        update={"matches": matches, "concurrency": 5, "turn_timeout_s": timeout_s, "run": "e2e"}
    )


def test_killed_agent_times_out_with_the_default_and_the_run_finishes(tmp_path: Path) -> None:
    config = _small_config(tmp_path, 60)
    stack = Stack(tmp_path / "e2e")
    killed_at: list[int] = []

    def on_episode(_rec: EpisodeRecord, n: int) -> None:
        if n == 10 and not killed_at:
            os.kill(stack.procs["carol"].pid, signal.SIGKILL)
            killed_at.append(n)

    async def go() -> list[EpisodeRecord]:
        stack.start_broker(None, None, identities(config))
        waiting = start_processes(stack, config, tmp_path)
        return await run_matches(
            config, stack.identity("runner", "runner"), waiting, None, on_episode
        )

    try:
        eps = asyncio.run(go())
    finally:
        stack.stop()
    assert killed_at
    reasons = Counter(e.reason for e in eps)
    assert len(eps) == 60 and reasons["normal"] >= 10
    late = eps[-20:]
    # after the kill carol's seat is played by the referee's default and the record says so
    assert all(e.reason == "timeout" and 2 in e.timeouts for e in late)
    for e in late:
        carol = [a for a in e.actions if a.seat == 2 and a.phase == "act"]
        assert carol and all(a.timed_out for a in carol)
        assert sum(e.raw_returns) == 0


@pytest.mark.slow
def test_broker_restart_mid_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    config = _small_config(tmp_path, 150)
    stack = Stack(tmp_path / "e2e")
    restarted: list[int] = []

    def on_episode(_rec: EpisodeRecord, n: int) -> None:
        if n == 40 and not restarted:
            restarted.append(n)
            assert stack.broker is not None
            asyncio.get_running_loop().run_in_executor(None, stack.broker.restart, 0.5)

    async def go() -> list[EpisodeRecord]:
        stack.start_broker(None, None, identities(config))
        waiting = start_processes(stack, config, tmp_path)
        return await run_matches(
            config, stack.identity("runner", "runner"), waiting, stack, on_episode
        )

    try:
        eps = asyncio.run(go())
    finally:
        stack.stop()
    assert restarted
    ids = [e.match for e in eps]
    assert len(ids) == 150 == len(set(ids))
    on_disk = [r["match"] for r in read_episodes(tmp_path / "e2e")]
    assert sorted(on_disk) == sorted(ids)  # written exactly once each
    reasons = Counter(e.reason for e in eps)
    assert set(reasons) <= {"normal", "voided"}, reasons
    assert reasons["normal"] >= 100
    for e in eps:
        if e.reason == "voided":
            assert "broker" in e.detail


def test_example_configs_parse() -> None:
    """Every example loads: run configs as runs, training configs (they name an algorithm) as training."""
    import yaml

    from backroom.trainer.config import load_train_config

    for path in sorted(Path(__file__).parent.parent.joinpath("examples").glob("*.yaml")):
        if "league" in yaml.safe_load(path.read_text()):
            continue  # league configs: tests/test_league.py
        if "algorithm" in yaml.safe_load(path.read_text()):
            try:
                load_train_config(path)
            except ConfigError as exc:
                # Trains against the adapters of examples/ipd_adalign.yaml's run: until that
                # run exists, loading refuses it and says which run is missing (docs/training.md).
                assert path.name == "ipd_grpo_vs_pool.yaml", exc
                assert "opponents[1].run: runs/ipd-adalign holds no adapters" in str(exc)
        else:
            load_config(path)
