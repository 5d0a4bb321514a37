"""No silent hangs (issue 22, items 5, 6, 10 and 13): write failures, a broker lost early,
two runs under one runner identity, a runner naming another run's directory.

Each test plays through a real Mosquitto and bounds its wait: before the fix each of them
hung, crashed with a traceback, or wrote where it should not have.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from backroom.agents.base import Agent
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus
from backroom.bus.wire import EpisodeRecord, MatchRequest, parse_all
from backroom.cli.run import demo_config
from backroom.referee.episodes import EpisodeLog
from backroom.runner.config import RunConfig, parse_config
from backroom.runner.local import Faults, RunError, run_matches
from backroom.runs import bind_run_dir, new_run_dir, read_episodes, write_all
from tests.conftest import agents, identity, stack

SEATED = ["alice", "bob", "carol"]


def _config(run: str, matches: int, concurrency: int) -> RunConfig:
    data = demo_config().model_dump()
    data.update(run=run, matches=matches, concurrency=concurrency, turn_timeout_s=3.0)
    return parse_config(data, source="test")


def _players() -> list[Agent]:
    return agents(("alice", "kuhn-colluder"), ("bob", "kuhn-colluder"), ("carol", "random"))


def test_a_short_write_is_continued_not_torn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5: ``os.write`` may write less than asked; the rest was dropped, and a torn record
    was fsync'd and reported written. Every record must reach the file whole."""
    real = os.write

    def short(fd: int, data: bytes | memoryview) -> int:
        return real(fd, bytes(data[:7]))  # at most 7 bytes a call

    monkeypatch.setattr(os, "write", short)
    log = EpisodeLog(tmp_path)
    records = [json.dumps({"match": f"m{i}", "pad": "x" * 50}).encode() for i in range(5)]

    async def go() -> None:
        await asyncio.gather(*(log.append("r", rec) for rec in records))

    asyncio.run(go())
    lines = (tmp_path / "r" / "episodes.jsonl").read_bytes().splitlines()
    assert sorted(lines) == sorted(records)
    with (tmp_path / "f").open("wb") as f, pytest.raises(OSError, match="no progress"):
        monkeypatch.setattr(os, "write", lambda fd, data: 0)
        write_all(f.fileno(), b"abc")


async def test_a_run_directory_the_referee_cannot_write_fails_the_run_with_the_reason(
    broker: Broker, tmp_path: Path
) -> None:
    """Item 5: a referee that could not write a record (disk full, read-only run directory)
    logged the OSError per match and never published the episode: the run hung. Tests run as
    root, where chmod stops nothing, so the run's episodes.jsonl is made a directory."""
    runs = tmp_path / "runs"
    stamp = "20260101-000000"
    (runs / "unwritable" / stamp / "episodes.jsonl").mkdir(parents=True)
    async with stack(broker, runs, _players()):
        t0 = time.monotonic()
        with pytest.raises(RunError, match=r"could not write .*episode not written.*IsADirectory"):
            await asyncio.wait_for(
                run_matches(
                    _config("unwritable", 6, 3),
                    identity(broker, "runner", "runner"),
                    SEATED,
                    run_stamp=stamp,
                ),
                60,
            )
        assert time.monotonic() - t0 < 45


async def test_an_episode_that_reached_nobody_is_asked_again_and_published_again(
    broker: Broker, tmp_path: Path
) -> None:
    """Item 6: an episode published while the runner's session was lost (a broker SIGKILLed
    early in a run) reaches nobody, and a referee dropped a request for a match it had
    finished in silence: the run waited for ever (4 of 4 runs killed after 20-140 episodes
    hung). The loss is made certain here: the referee's first episode message is not sent
    (what a broker without the runner's session does with it). Now the runner asks again
    for an accepted match with no episode, and the referee publishes it again: every match
    arrives, none is played twice."""
    faults = Faults()
    async with stack(broker, tmp_path / "runs", _players()) as (ref, _):
        assert ref.bus is not None
        publish = ref.bus.publish
        dropped: list[str] = []

        def lossy(topic: str, payload: Any, **kw: Any) -> Any:
            if topic.startswith(topics.episodes("")) and not dropped:
                dropped.append(topic)
                return None
            return publish(topic, payload, **kw)

        ref.bus.publish = lossy  # type: ignore[method-assign]
        t0 = time.monotonic()
        got = await asyncio.wait_for(
            run_matches(
                _config("lost-episode", 8, 4),
                identity(broker, "runner", "runner"),
                SEATED,
                faults=faults,
                episode_wait_s=1.0,
            ),
            60,
        )
    assert dropped and len(got) == 8 and len({e.match for e in got}) == 8
    assert faults.asked_again >= 1 and faults.rerequested == 0  # published again, not replayed
    assert time.monotonic() - t0 < 30
    played = Counter(e["match"] for e in read_episodes(tmp_path / "runs" / "lost-episode"))
    assert sorted(played.values()) == [1] * 8


async def test_a_run_whose_runner_identity_is_held_elsewhere_stops_at_once(
    broker: Broker, tmp_path: Path
) -> None:
    """Item 10: two runs under the fixed ``runner`` name (compose, copied credentials) threw
    each other off the broker: both hung, or one died with a raw ``MqttError`` traceback.
    Now the run that comes second stops at once with a clear error, and the one holding the
    name keeps it (thrown off once, it reconnects)."""
    runner = identity(broker, "runner", "runner")
    async with stack(broker, tmp_path / "runs", _players()), Bus(runner) as holder:
        await holder.subscribe(topics.inbox("runner"), lambda *_: None)
        t0 = time.monotonic()
        with pytest.raises(RunError, match=r"runner identity 'runner' is in use"):
            await asyncio.wait_for(
                run_matches(_config("second", 4, 2), runner, SEATED, claim_window_s=1.0), 30
            )
        assert time.monotonic() - t0 < 15
        await asyncio.wait_for(holder.connected.wait(), 10)
        reconnects = holder.reconnects
        await asyncio.sleep(1.0)  # the second run is gone: no more takeovers
        assert holder.connected.is_set() and holder.reconnects == reconnects


async def test_a_runner_cannot_make_a_referee_write_into_another_runs_directory(
    broker: Broker, tmp_path: Path
) -> None:
    """Item 13: any runner-role identity could make a referee append into another run's
    episodes.jsonl by naming its run and stamp (both are in every episode it publishes).
    The run's directory is bound to its key, which only requests carry: a request naming it
    without the key gets an ``error`` episode, published and not written there."""
    runs = tmp_path / "runs"
    run_dir = new_run_dir(runs, "victim")
    bind_run_dir(run_dir, "the-victims-key")
    async with stack(broker, runs, _players()):
        got = await asyncio.wait_for(
            run_matches(
                _config("victim", 2, 2),
                identity(broker, "runner", "runner"),
                SEATED,
                run_stamp=run_dir.name,
                run_key="the-victims-key",
            ),
            60,
        )
        assert [e.reason for e in got] == ["normal", "normal"]
        episodes: dict[str, EpisodeRecord] = {}
        arrived = asyncio.Event()

        def on_episode(_topic: str, payload: bytes) -> None:
            for msg in parse_all(payload):
                record = getattr(msg, "record", None)
                if record is not None:
                    episodes[record.match] = record
                    arrived.set()

        spec = got[0].spec
        async with Bus(identity(broker, "mallory-runner", "runner")) as bus:
            await bus.subscribe(topics.ALL_EPISODES, on_episode)
            for match, key in (("forged.nokey", None), ("forged.guess", "a-guess")):
                request = MatchRequest(match=match, spec=spec, run_key=key)
                await bus.publish(topics.CONTROL_MATCHES, request)
            while not {"forged.nokey", "forged.guess"} <= episodes.keys():
                arrived.clear()
                await asyncio.wait_for(arrived.wait(), 30)
    for match in ("forged.nokey", "forged.guess"):
        assert episodes[match].reason == "error"
        assert "belongs to another run" in episodes[match].detail
    written = [str(e["match"]) for e in read_episodes(run_dir)]
    assert sorted(written) == sorted(e.match for e in got)  # nothing of mallory's


async def test_only_the_asker_gets_a_finished_match_published_again(
    broker: Broker, tmp_path: Path
) -> None:
    """Review of item 6: any runner-role identity could name a finished match (ids are in every
    episode) and make its referee broadcast the record, up to 16 MB, to every episode reader,
    as often as it liked. Now only the asker's own `again` (same reply_to and run key) gets
    it, at most every REPUBLISH_EVERY_S."""
    from backroom import metrics

    def republished() -> float:
        return metrics.EPISODES_REPUBLISHED._value.get()

    async with stack(broker, tmp_path / "runs", _players()) as (ref, _):
        runner = identity(broker, "runner", "runner")
        (done,) = await asyncio.wait_for(run_matches(_config("asked", 1, 1), runner, SEATED), 60)
        request = MatchRequest(match=done.match, spec=done.spec, reply_to="runner", again=True)
        before = republished()
        ref.requests.take(request.model_copy(update={"reply_to": "mallet"}))  # someone else
        ref.requests.take(request.model_copy(update={"again": False}))  # a plain redelivery
        assert republished() == before
        ref.requests.take(request)  # the asker's own again: once, then not within the window
        ref.requests.take(request)
        assert republished() == before + 1
