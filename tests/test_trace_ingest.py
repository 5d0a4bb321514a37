"""Traces from agents who want to hurt: the trainer's and the runner's intake (issue 22, 2, 7, 9).

Any agent may publish anything on its own ``traces/{agent}`` topic, as fast
as it likes, and a seated agent may publish valid traces without end. These
tests play those agents against a real broker and check what the trainer and
the runner keep, what they count, and that the trainer's loop keeps turning.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from prometheus_client import REGISTRY

from backroom.agents.base import Agent
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus
from backroom.bus.wire import MAX_TRACE_BYTES, MatchSpec, Trace, Turn
from backroom.trainer.bus import MAX_TRACES_PER_MESSAGE, TrainerBus
from backroom.trainer.store import Request, Store
from tests.conftest import eventually, identity, load_factor, stack


def sample(name: str, **labels: str) -> float:
    """A metric's current value in this process (0 when it has no such series yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_junk_and_squatted_traces_cost_the_trainer_no_write_and_no_stall(
    broker: Broker, tmp_path: Path
) -> None:
    """Issue 22, items 2 and 7, as the attacker played them.

    Eve (an agent, seated nowhere) sends on her own traces topic the 63 KB
    array of 31,500 ``1`` that held the trainer's loop for two minutes (one
    fsync'd counter row per bad element, inside the MQTT callback: the
    keepalive lapsed and the broker redelivered it, counted twice), a stream
    of small junk arrays, an array over the element cap, an oversized trace,
    and then her own trace for alice's seat before alice sends hers (match
    ids are predictable): first-come, it made alice's genuine trace a
    "duplicate". Now: no write for any of it (one COMMIT in all, alice's),
    each message counted exactly once, the loop never held 1 s (scaled by
    load), and alice's trace stored.
    """
    store = Store(tmp_path / "store.sqlite")
    spec = MatchSpec(game="ipd", params={"rounds": 2}, seats=["alice", "bob"], seed=1)
    store.add_requests([Request("m1", 0, "g0", "train", spec, (0, 1))])
    commits: list[str] = []
    store._db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    trainer = identity(broker, "trainer", "trainer")
    eve_config, alice_config = identity(broker, "eve"), identity(broker, "alice")
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - t - 0.01)

    squat = Trace(match="m1", agent="eve", turn=0, seat=0, phase="act")
    genuine = Trace(match="m1", agent="alice", turn=0, seat=0, phase="act")
    too_many = "[" + ",".join([genuine.model_dump_json()] * (MAX_TRACES_PER_MESSAGE + 1)) + "]"
    oversized = Trace(
        match="m1", agent="eve", turn=1, seat=0, phase="act", reply="x" * MAX_TRACE_BYTES
    )
    small_junk = 200
    with store:
        async with TrainerBus(trainer, store, "ipd"), Bus(eve_config) as eve:
            tick = asyncio.create_task(ticker())
            try:
                mine = topics.traces("eve")
                await eve.publish(mine, b"[" + b",".join([b"1"] * 31_500) + b"]")
                sent = [eve.publish(mine, b'[1,{"type":"trace"}]') for _ in range(small_junk)]
                await asyncio.gather(*sent)
                await eve.publish(mine, too_many.encode())
                await eve.publish(mine, oversized)
                await eve.publish(mine, squat)
                expect = {
                    "trace_malformed": 1 + small_junk + 1,
                    "trace_oversized": 1,
                    "trace_not_seated": 1,
                }
                await eventually(
                    lambda: store.counters() == expect,
                    30 * load_factor(),
                    lambda: str(store.counters()),
                )
                async with Bus(alice_config) as alice:
                    await alice.publish(topics.traces("alice"), genuine)
                    await eventually(
                        lambda: commits == ["COMMIT"], 30 * load_factor(), lambda: str(commits)
                    )
            finally:
                tick.cancel()
        rows = store._db.execute("SELECT agent, turn, seat FROM traces").fetchall()
        assert rows == [("alice", 0, 0)]
        assert store.counters() == expect  # nothing counted twice
    assert lags and max(lags) < 1.0 * load_factor(), f"the loop was held {max(lags):.2f}s"


class Flooder(Agent):
    """A seated agent that traces each decision, then repeats it, sends one over the size cap,
    and writes valid traces (no seat named) for turns that never happen."""

    extra = 40  # bogus traces per decision
    pad = 2000  # bytes of padding in each

    async def act(self, turn: Turn) -> object:
        mine = Trace(match=turn.match, agent=self.id, turn=turn.turn, seat=turn.seat, phase="act")
        await self.publish_trace(mine)
        for _ in range(3):
            await self.publish_trace(mine)  # a replay of the same decision
        await self.publish_trace(
            mine.model_copy(update={"turn": 10**6, "reply": "x" * MAX_TRACE_BYTES})
        )
        for k in range(self.extra):
            bogus = mine.model_copy(
                update={"turn": 1000 + turn.turn * 100 + k, "seat": None, "reply": "x" * self.pad}
            )
            await self.publish_trace(bogus)
        names = turn.legal["names"]
        return "call" if "call" in names else names[0]


async def test_the_runner_writes_each_decision_once_and_no_more_than_its_bound(
    broker: Broker, tmp_path: Path
) -> None:
    """Issue 22, item 9: a seated agent wrote 245 MB of valid traces in 14 s into the runner's
    traces.jsonl. Now a trace over ``MAX_TRACE_BYTES`` is dropped, a decision is written once
    however often it is sent, and the run writes at most ``traces_max_bytes``, each agent at most
    its share of it, saying so once per agent (issue 35, item 4)."""
    from backroom.runner.config import RunConfig
    from backroom.runner.local import run_matches
    from backroom.runner.results import Faults

    reasons = ("duplicate", "oversized", "agent_bound")
    before = {r: sample("backroom_traces_rejected_total", reason=r) for r in reasons}
    players: list[Agent] = [Flooder("t0"), Flooder("t1"), Flooder("t2")]
    config = RunConfig.model_validate(
        {
            "run": "flooded",
            "game": "kuhn",
            "params": {"variant": "loki"},
            "matches": 3,
            "agents": [{"id": p.id, "kind": "external"} for p in players],
        }
    )
    bound = 100_000  # less than the bogus traces (~3 x 3 x 40 x 2 KB), more than the genuine ones
    notices: list[str] = []
    path = tmp_path / "traces.jsonl"
    faults = Faults()
    async with stack(broker, tmp_path / "runs", players):
        t0 = time.monotonic()
        eps = await run_matches(
            config,
            identity(broker, "runner", "runner"),
            [],
            traces_path=path,
            on_notice=notices.append,
            traces_max_bytes=bound,
            faults=faults,
        )
    assert time.monotonic() - t0 < 120 * load_factor()
    written = path.read_bytes()
    assert 0 < len(written) <= bound
    traces = [json.loads(line) for line in written.splitlines()]
    keys = [(t["match"], t["turn"], t["seat"]) for t in traces]
    assert len(keys) == len(set(keys))  # each decision once
    acts = {(e.match, a.turn, a.seat) for e in eps for a in e.actions if a.phase == "act"}
    genuine = [k for k in keys if k in acts]
    assert genuine  # the first decisions came before the bound was reached
    assert all(t["turn"] != 10**6 for t in traces)  # the oversized one never
    got = {r: sample("backroom_traces_rejected_total", reason=r) - before[r] for r in reasons}
    assert got["oversized"] == len(acts)
    assert got["duplicate"] == 3 * len(genuine)  # each replay of a decision written
    assert got["agent_bound"] > 0
    said = [n for n in notices if "reached its share" in n]
    assert len(said) == 3 and all(f"{bound:,} bytes" in n for n in said), notices
    assert sorted(faults.traces_over_share) == ["t0", "t1", "t2"]


class LateTracer(Agent):
    """Answers at once and sends the decision's trace ``lag`` seconds later: a trace that
    trails its move, as one can when the machine is busy or the agent's link is slow."""

    lag = 0.6
    traces_decisions = True  # said in its status: the runner knows to wait for its traces

    def __init__(self, agent_id: str, skip_turn: int | None = None) -> None:
        super().__init__(agent_id)
        self.skip_turn = skip_turn  # a turn it never traces (an agent that lost a trace)
        self.sent: list[asyncio.Task[None]] = []

    async def act(self, turn: Turn) -> object:
        if turn.turn != self.skip_turn:
            trace = Trace(
                match=turn.match, agent=self.id, turn=turn.turn, seat=turn.seat, phase="act"
            )
            self.sent.append(asyncio.create_task(self._later(trace)))
        return "A"

    async def _later(self, trace: Trace) -> None:
        await asyncio.sleep(self.lag)  # the lag being simulated, not a wait in the test
        await self.publish_trace(trace)


async def test_the_runner_waits_for_the_traces_of_the_last_decisions_and_counts_those_missing(
    broker: Broker, tmp_path: Path
) -> None:
    """The last episode can come before the last decisions' traces (they travel to the runner
    by another path than the moves to the referee). The runner waits for exactly the traces
    still due, not a fixed 0.2 s that lost them; one never sent is counted and said."""
    from backroom.runner.config import RunConfig
    from backroom.runner.local import run_matches
    from backroom.runner.results import Faults

    late, forgetful = LateTracer("late"), LateTracer("forgetful", skip_turn=2)
    config = RunConfig.model_validate(
        {
            "run": "late-traces",
            "game": "ipd",
            "params": {"rounds": 2},
            "matches": 3,
            "agents": [{"id": a.id, "kind": "external"} for a in (late, forgetful)],
        }
    )
    notices: list[str] = []
    faults = Faults()
    path = tmp_path / "traces.jsonl"
    async with stack(broker, tmp_path / "runs", [late, forgetful]):
        eps = await run_matches(
            config,
            identity(broker, "runner", "runner"),
            [],
            traces_path=path,
            on_notice=notices.append,
            faults=faults,
            trace_wait_s=3 * load_factor(),
        )
    assert len(eps) == 3 and all(e.reason == "normal" for e in eps)
    written = {
        (t["match"], t["agent"], t["turn"]) for t in map(json.loads, path.read_bytes().splitlines())
    }
    decided = {(e.match, a.agent, a.turn) for e in eps for a in e.actions}
    # every trace sent was written, the last ones 0.6 s after the last episode included
    assert written == {d for d in decided if not (d[1] == "forgetful" and d[2] == 2)}
    # the forgetful agent's untraced second turn in each match: counted and said
    assert faults.traces_missing == 3
    said = [n for n in notices if "have no trace" in n]
    assert len(said) == 1 and said[0].startswith("3 decisions") and "forgetful" in said[0]
    assert "late" not in said[0].split("agents:")[1]


async def test_a_version_the_buffer_let_go_is_no_longer_announced(
    broker: Broker, tmp_path: Path
) -> None:
    """Every ``local`` agent reads every retained version announcement when it starts: kept for
    ever, a run of N steps left N+1. The trainer deletes the ones its buffer let go."""
    from backroom.bus.wire import AdapterRef

    trainer = identity(broker, "trainer", "trainer")
    reader = identity(broker, "reader", "observer")
    refs = [
        AdapterRef(policy="pol", version=v, uri=f"/a/{v}", sha256="0" * 64, size=1)
        for v in ("v0", "v1")
    ]
    with Store(tmp_path / "store.sqlite") as store:
        async with TrainerBus(trainer, store, "ipd") as tb:
            for r in refs:
                await tb.announce(r)
            await tb.retract(refs[0])
    seen: dict[str, bytes] = {}
    async with Bus(reader) as bus:
        await bus.subscribe(
            topics.ALL_MODEL_VERSIONS, lambda t, p: seen.__setitem__(t.rsplit("/", 1)[-1], p)
        )
        # the SUBACK of a second subscription comes after the first one's retained messages
        await bus.subscribe(topics.ALL_STATUS, lambda *_: None)
        await eventually(lambda: "v1" in seen, 10)
    assert list(seen) == ["v1"]  # v0's retained message is gone: a new reader never sees it


def test_a_trace_counts_for_its_own_seat_only_where_one_agent_holds_two(tmp_path: Path) -> None:
    """In a simultaneous game both seats of one agent decide on the same turn: the trace of
    seat 0 must not stand for seat 1's (``TraceLog`` keys a decision by seat too)."""
    from backroom.agents import make_agent
    from backroom.bus.wire import EpisodeRecord, dump
    from backroom.games import make_game
    from backroom.runner.traces import TraceLog

    from .gameplay import episode

    game = make_game("ipd", rounds=1)
    record = EpisodeRecord.model_validate(
        episode(game, [make_agent("always", "alice"), make_agent("always", "alice")])
    )
    assert {(a.seat, a.turn) for a in record.actions} == {(0, 1), (1, 1)}
    with TraceLog(
        tmp_path / "traces.jsonl", lambda m: ["alice", "alice"] if m == "m0" else None
    ) as log:
        trace = Trace(match="m0", agent="alice", turn=1, seat=0, phase="act")
        log.on_trace(topics.traces("alice"), dump(trace))
        assert log.missing([record]) == [("m0", "alice", 1, 1)]
        log.on_trace(topics.traces("alice"), dump(trace.model_copy(update={"seat": 1})))
        assert log.missing([record]) == []
