"""``backroom run`` and presence: a stale retained ``online`` is no agent; a failed run closes its files.

Issue 23, items 1 and 5: only the web applied the heartbeat expiry, so a
retained ``online`` left by an agent that died without its will made the run
start as if it were there (and default its seats in every match).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from backroom.bus.broker import Broker
from backroom.bus.client import Bus
from backroom.bus.topics import status
from backroom.bus.wire import Status
from backroom.cli.run import demo_config
from backroom.runner.config import RunConfig, parse_config
from backroom.runner.local import RunError, run_matches
from tests.conftest import agents, eventually, identity, load_factor, stack


def _config(run: str) -> RunConfig:
    data = demo_config().model_dump()
    data.update(run=run, matches=2, concurrency=2, turn_timeout_s=3.0)
    return parse_config(data, source="test")


async def _leave_stale_online(broker: Broker, name: str, heartbeat_s: float) -> None:
    """Say ``online`` (retained, renewed every ``heartbeat_s``) and vanish without a will or an offline."""
    async with Bus(identity(broker, name)) as bus:
        online = Status(state="online", kind="scripted", heartbeat_s=heartbeat_s)
        await bus.publish(status(name), online, retain=True)


async def test_a_stale_retained_online_of_a_dead_agent_does_not_count_as_present(
    broker: Broker, tmp_path: Path
) -> None:
    await _leave_stale_online(broker, "carol", heartbeat_s=0.05)  # overdue after 0.15 s
    notices: list[str] = []
    timeout = 4.0 * load_factor()
    run = asyncio.create_task(
        run_matches(
            _config("stale"),
            identity(broker, "runner", "runner"),
            ["alice", "bob", "carol"],
            ready_timeout_s=timeout,
            on_notice=notices.append,
            external=["carol"],
        )
    )
    # The runner read carol's retained status, waited 0.2 s, and no longer believes it:
    # it says whom it waits for (a believed "online" says nothing).
    await eventually(lambda: any("carol to connect" in n for n in notices), 10 * load_factor())
    players = agents(("alice", "kuhn-colluder"), ("bob", "kuhn-colluder"))
    async with stack(broker, tmp_path / "runs", players):  # a referee: all but carol is there
        with pytest.raises(RunError, match=r"not online after .*\['carol'\]"):
            await asyncio.wait_for(run, timeout + 30)
    assert not (tmp_path / "runs" / "stale").exists()  # no match was played


async def test_an_agent_that_renews_its_online_counts_as_present(
    broker: Broker, tmp_path: Path
) -> None:
    """The control: the same run with carol alive (renewing) plays its matches."""
    players = agents(("alice", "kuhn-colluder"), ("bob", "kuhn-colluder"), ("carol", "random"))
    async with stack(broker, tmp_path / "runs", players):
        got = await asyncio.wait_for(
            run_matches(
                _config("alive"),
                identity(broker, "runner", "runner"),
                ["alice", "bob", "carol"],
                ready_timeout_s=10 * load_factor(),
            ),
            60 * load_factor(),
        )
    assert [e.reason for e in got] == ["normal", "normal"]


def _open_paths() -> set[str]:
    fds = Path("/proc/self/fd")
    paths = set()
    for fd in fds.iterdir():
        try:
            paths.add(os.readlink(fd))
        except OSError:
            continue
    return paths


async def test_a_failed_run_closes_its_traces_file(broker: Broker, tmp_path: Path) -> None:
    traces = tmp_path / "traces.jsonl"
    with pytest.raises(RunError, match="not online"):
        await run_matches(
            _config("nobody"),
            identity(broker, "runner", "runner"),
            ["alice"],
            ready_timeout_s=0.5,
            traces_path=traces,
        )
    assert traces.exists() and str(traces) not in _open_paths()


async def test_a_run_stopped_mid_play_closes_its_traces_file(
    broker: Broker, tmp_path: Path
) -> None:
    traces = tmp_path / "traces.jsonl"
    stop = asyncio.Event()
    open_at_first_episode: list[bool] = []

    def first_episode(_ep: object, _n: int) -> None:
        open_at_first_episode.append(str(traces) in _open_paths())
        stop.set()

    players = agents(("alice", "kuhn-colluder"), ("bob", "kuhn-colluder"), ("carol", "random"))
    async with stack(broker, tmp_path / "runs", players):
        await asyncio.wait_for(
            run_matches(
                _config("stopped"),
                identity(broker, "runner", "runner"),
                ["alice", "bob", "carol"],
                traces_path=traces,
                on_episode=first_episode,
                stop=stop,
            ),
            60 * load_factor(),
        )
    assert open_at_first_episode[0]  # open while the run played
    assert str(traces) not in _open_paths()
    assert all(json.loads(line) for line in traces.read_text().splitlines())


async def test_the_trainer_does_not_count_a_stale_online_either(
    broker: Broker, tmp_path: Path
) -> None:
    """``backroom train`` waits for its players through the same roster as the run."""
    from backroom.agents.runtime import AgentRunner
    from backroom.trainer.bus import TrainerBus
    from backroom.trainer.store import Store

    await _leave_stale_online(broker, "ghost", heartbeat_s=0.05)
    (live,) = agents(("live", "random"))
    trainer = identity(broker, "trainer", "trainer")
    with Store(tmp_path / "store.sqlite") as store:
        async with (
            AgentRunner(live, identity(broker, "live")),
            TrainerBus(trainer, store, "ipd") as tb,
        ):
            # Its retained "online" counts for one window from its arrival, then lapses.
            await eventually(lambda: "ghost" in tb.presence.names(), 10 * load_factor())
            await eventually(lambda: not tb.presence.is_online("ghost"), 10 * load_factor())
            await eventually(lambda: tb.presence.is_online("live"), 10 * load_factor())
            assert await tb.wait_online(["ghost", "live"], 1.0) == ["ghost"]


async def test_a_trainer_reads_the_statuses_of_its_agents_and_no_others(
    broker: Broker, tmp_path: Path
) -> None:
    """``backroom train`` passes its players, baselines and pool as ``watch``: the status of
    any other identity (a flood of them costs a parse each) never reaches it, even where its
    persistent session still holds an earlier run's subscription to every status."""
    from prometheus_client import REGISTRY

    from backroom.agents.runtime import AgentRunner
    from backroom.bus.topics import checkpoint
    from backroom.trainer.bus import TrainerBus
    from backroom.trainer.store import Store

    from .conftest import round_trip

    def received() -> float:
        labels = {"direction": "in", "role": "trainer"}
        return REGISTRY.get_sample_value("backroom_bus_messages_total", labels) or 0.0

    (live,) = agents(("live", "random"))
    trainer = identity(broker, "trainer", "trainer")
    flood = [Status(state="online", kind="random", heartbeat_s=60) for _ in range(50)]
    with Store(tmp_path / "store.sqlite") as store:
        async with (
            AgentRunner(live, identity(broker, "live")),
            Bus(identity(broker, "other")) as other,
        ):
            await other.publish(status("other"), flood[0], retain=True)
            # an earlier run of this trainer identity read every status (the control)
            async with TrainerBus(trainer, store, "ipd") as every:
                assert await every.wait_online(["live", "other"], 10 * load_factor()) == []
            async with TrainerBus(trainer, store, "ipd", watch=["live"]) as tb:
                assert await tb.wait_online(["live"], 10 * load_factor()) == []
                assert tb.bus is not None
                await round_trip(tb.bus, checkpoint("barrier"), 10 * load_factor())
                before = received()
                for msg in flood:
                    await other.publish(status("other"), msg)
                # once a marker of its own is back, all the broker had for it has come
                await round_trip(tb.bus, checkpoint("barrier"), 10 * load_factor())
                assert received() - before <= 2  # the marker, and nothing of the 50
                assert "other" not in tb.presence.names()


def test_the_roster_holds_an_online_for_three_periods_and_an_offline_not_at_all() -> None:
    from backroom.bus import presence
    from backroom.bus.wire import dump

    now = [0.0]
    roster = presence.Roster(default_heartbeat_s=10.0, clock=lambda: now[0])
    renewing = dump(Status(state="online", kind="random", heartbeat_s=1.0))
    silent = dump(Status(state="online", kind="raw"))
    roster.see(status("alice"), renewing)
    roster.see(status("mute"), silent)
    now[0] = 2.9
    assert roster.online() == {"alice", "mute"} and roster.kind("alice") == "random"
    now[0] = 3.0  # three of alice's periods: gone; mute is held to the default
    assert roster.missing(["alice", "mute", "nobody"]) == ["alice", "nobody"]
    roster.see(status("alice"), renewing)  # renewed: counts again from its arrival
    assert roster.is_online("alice")
    roster.see(status("alice"), dump(Status(state="offline", kind="random")))
    assert not roster.is_online("alice") and roster.names() == {"alice", "mute"}
    now[0] = 30.0
    assert not roster.is_online("mute")
    forever = presence.Roster(default_heartbeat_s=None, clock=lambda: now[0])
    forever.see(status("referee"), dump(Status(state="online", kind="referee")))
    now[0] = 1e9  # declares no period, and this reader assumes none: it never lapses
    assert forever.is_online("referee")
    dropped: list[str] = []
    assert presence.read(status("x"), b"{not json", lambda e: dropped.append(e.reason)) is None
    assert presence.read("backroom/v1/control/matches", renewing) is None
    assert dropped == ["malformed"]


async def test_a_playing_runner_reads_no_status_of_an_identity_it_does_not_seat(
    broker: Broker, tmp_path: Path
) -> None:
    """Would have caught: the runner read ``agents/+/status`` for the whole run, so a flat-out
    flood of status flips from any identity cost it a third of its matches per second
    (``bench/abuse.py``, ``flip_status``: 0.62 of calm). Once the run plays it reads only
    its agents' and its referees' statuses: 2,000 statuses mallory sends mid-run never
    reach it, while carol's (seated) still does."""
    from prometheus_client import REGISTRY

    from backroom.bus.wire import Turn

    from .conftest import RawAgent, play_raw

    def runner_in() -> float:
        labels = {"direction": "in", "role": "runner"}
        return REGISTRY.get_sample_value("backroom_bus_messages_total", labels) or 0.0

    config = parse_config(
        {
            "run": "narrow",
            "game": "kuhn",
            "params": {"variant": "loki"},
            "agents": [
                {"id": "alice", "kind": "random"},
                {"id": "bob", "kind": "random"},
                {"id": "carol", "kind": "external"},
            ],
            "matches": 2,
            "concurrency": 1,
            "turn_timeout_s": 60,
        },
        source="test",
    )
    notices: list[str] = []
    players = agents(("alice", "random"), ("bob", "random"))
    async with (
        stack(broker, tmp_path / "runs", players),
        RawAgent(identity(broker, "carol")) as carol,
        RawAgent(identity(broker, "mallory")) as mal,
    ):
        run = asyncio.create_task(
            run_matches(
                config,
                identity(broker, "runner", "runner"),
                ["alice", "bob", "carol"],
                on_notice=notices.append,
                external=["carol"],
            )
        )
        await carol.next_of(Turn, timeout=30 * load_factor())  # the run plays, waiting on carol
        before = runner_in()
        for i in range(2000):
            state = "offline" if i % 2 else "online"
            await mal.bus.publish(status("mallory"), Status(state=state, kind="raw"))
        # Behind mallory's statuses in every reader's queue, one the runner acts on.
        await carol.bus.publish(status("carol"), Status(state="offline", kind="raw"))
        await eventually(lambda: any("carol went offline" in n for n in notices), 30)
        assert runner_in() - before < 100  # carol's status, acks: not mallory's 2,000
        await carol.bus.publish(status("carol"), Status(state="online", kind="raw"))
        stop = asyncio.Event()
        driver = asyncio.create_task(play_raw(carol, "call", stop))
        episodes = await asyncio.wait_for(run, 60 * load_factor())
        stop.set()
        await driver
    assert len(episodes) == 2
