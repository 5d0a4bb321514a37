"""One agent's traces cannot crowd out another's, nor fill a disk with turns that never
happened; a failed write leaves no torn record (issue 35, items 4 and 7).

Every test plays the flooding agent as a seated player on a real broker (or,
for the torn tail, makes the operating system refuse a write), and checks
what the runner and the trainer keep, what they count, and whom they name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from backroom.agents.base import Agent
from backroom.bus.broker import Broker
from backroom.bus.wire import MatchSpec, Trace, Turn
from backroom.runner.config import RunConfig
from backroom.runner.local import run_matches
from backroom.runner.results import Faults
from backroom.trainer.bus import TrainerBus
from backroom.trainer.store import STORED, Request, Store
from tests.conftest import eventually, identity, load_factor, stack


class Honest(Agent):
    """Traces each of its decisions once, as a ``local`` agent does."""

    traces_decisions = True

    async def act(self, turn: Turn) -> object:
        await self.publish_trace(
            Trace(match=turn.match, agent=self.id, turn=turn.turn, seat=turn.seat, phase="act")
        )
        return "A"  # IPD's first answer


class Flood(Agent):
    """A seated agent that traces its decision and then, at its first turn of each match,
    sends ``extra`` valid padded traces for turns that never happen."""

    extra = 40
    pad = 2000
    seat_named = False  # the runner takes a trace with no seat; the trainer does not

    def __init__(self, agent_id: str) -> None:
        super().__init__(agent_id)
        self.sent = 0

    async def act(self, turn: Turn) -> object:
        mine = Trace(match=turn.match, agent=self.id, turn=turn.turn, seat=turn.seat, phase="act")
        await self.publish_trace(mine)
        self.sent += 1
        if turn.turn <= 1:
            seat = turn.seat if self.seat_named else None
            for k in range(self.extra):
                bogus = {"turn": 1000 + k, "seat": seat, "reply": "x" * self.pad}
                await self.publish_trace(mine.model_copy(update=bogus))
                self.sent += 1
        return "A"  # IPD's first answer


async def test_an_honest_agent_keeps_every_trace_while_another_floods_the_runner(
    broker: Broker, tmp_path: Path
) -> None:
    """Issue 35, item 4: a seated agent filled the run's traces.jsonl bound and an honest agent
    kept 16 of its 240 traces; the warning named only the attacker. Now the bound is shared out
    per seated agent: the flood costs only the flooder's own traces, and the run names it (and
    the decisions it lost), never the honest agent."""
    honest, flood = Honest("honest"), Flood("flood")
    config = RunConfig.model_validate(
        {
            "run": "flood-share",
            "game": "ipd",
            "params": {"rounds": 4},
            "matches": 2,
            "agents": [{"id": a.id, "kind": "external"} for a in (honest, flood)],
        }
    )
    bound = 60_000  # under one match's flood (40 x 2 KB): the whole bound, on the old code
    notices: list[str] = []
    faults = Faults()
    path = tmp_path / "traces.jsonl"
    async with stack(broker, tmp_path / "runs", [honest, flood]):
        eps = await run_matches(
            config,
            identity(broker, "runner", "runner"),
            [],
            traces_path=path,
            on_notice=notices.append,
            faults=faults,
            traces_max_bytes=bound,
            trace_wait_s=10 * load_factor(),
        )
    assert len(eps) == 2 and all(e.reason == "normal" for e in eps)
    written = path.read_bytes()
    assert len(written) <= bound
    kept = [json.loads(line) for line in written.splitlines()]
    honest_kept = {(t["match"], t["turn"], t["seat"]) for t in kept if t["agent"] == "honest"}
    decided = {(e.match, a.turn, a.seat) for e in eps for a in e.actions if a.agent == "honest"}
    assert len(decided) == 8 and honest_kept == decided  # every one of its traces
    assert faults.traces_missing == 0
    assert list(faults.traces_over_share) == ["flood"]
    over, lost = faults.traces_over_share["flood"]
    assert over > 0 and lost > 0  # its own later decisions went untraced: its flood's cost
    said = [n for n in notices if "reached its share" in n]
    assert len(said) == 1 and "flood" in said[0] and f"{bound // 2:,} of {bound:,}" in said[0]
    summary = [n for n in notices if n.startswith("traces past an agent's share")]
    assert len(summary) == 1 and "flood:" in summary[0] and "honest" not in summary[0], notices


async def test_the_trainer_stores_only_requested_decisions_within_each_agents_budget(
    broker: Broker, tmp_path: Path
) -> None:
    """Issue 35, item 4: the trainer's store took 145 MB of one seated agent's traces for turns
    that never happened. Now a trace is stored only for a match the trainer requested, a seat
    its request gives the sender, a (turn, seat) the referee's episode records (those that came
    first are deleted when it comes), and within the agent's budget for the step, whose
    overflow is counted and named per agent; the honest agent's traces are all kept."""
    flood = Flood("eve")
    flood.seat_named = True
    honest = Honest("alice")
    budget = 50_000
    spec = MatchSpec(game="ipd", params={"rounds": 3}, seats=["alice", "eve"], seed=3)
    requests = [Request("tb.m1", 0, "g0", "train", spec, (0,))]  # alice trains
    with Store(tmp_path / "store.sqlite", trace_budget_bytes=budget) as store:
        store.add_requests(requests)
        trainer = identity(broker, "trainer", "trainer")
        async with stack(broker, tmp_path / "runs", [honest, flood]):
            async with TrainerBus(trainer, store, "ipd") as tb:
                await tb.request(requests)
                assert await tb.wait_episodes(["tb.m1"], 60 * load_factor()) == []

                def accounted() -> int:
                    rows = store._db.execute("SELECT count(*) FROM traces WHERE agent = 'eve'")
                    c = store.counters()
                    refused = ("trace_over_budget", "trace_no_decision", "trace_duplicate")
                    return int(rows.fetchone()[0]) + sum(c.get(r, 0) for r in refused)

                await eventually(
                    lambda: accounted() == flood.sent and not store.missing_traces(["tb.m1"]),
                    30 * load_factor(),
                    lambda: f"{accounted()} of {flood.sent}: {store.counters()}",
                )
        record = store._load("tb.m1")
        assert record is not None
        decided = {(a.turn, a.seat) for a in record[1].actions}
        rows = store._db.execute("SELECT agent, turn, seat, length(trace) FROM traces").fetchall()
        assert {(t, s) for a, t, s, _ in rows if a == "alice"} == {
            (t, s) for t, s in decided if s == 0
        }
        assert all((t, s) in decided for _, t, s, _ in rows)  # no turn that never happened
        assert sum(n for a, _, _, n in rows if a == "eve") <= budget
        counters = store.counters()
        assert counters["trace_over_budget"] > 0 and counters["trace_no_decision"] > 0
        assert store.over_budget_text(0) == f"eve={counters['trace_over_budget']}"
        # after the episode: a turn it does not record, another's seat, an unrequested match
        late = Trace(match="tb.m1", agent="eve", turn=1001, seat=1, phase="act")
        assert store.add_traces("eve", [late]) == {"trace_no_decision": 1}
        assert store.add_traces("eve", [late.model_copy(update={"turn": 1, "seat": 0})]) == {
            "trace_not_seated": 1
        }
        stray = late.model_copy(update={"match": "tb.other", "turn": 1})
        assert store.add_traces("eve", [stray]) == {"trace_unrequested": 1}


def test_the_trainer_budget_is_per_agent_and_per_step(tmp_path: Path) -> None:
    """One agent's budget spent leaves another's, and the next step's, whole; a restarted store
    counts what the file already holds against the budget."""
    spec = MatchSpec(game="ipd", params={"rounds": 9}, seats=["alice", "eve"], seed=1)
    pad = "x" * 400
    # a fixed timestamp: the size is exact (a float's digits vary), "alice" two bytes longer
    size = len(
        Trace(
            match="s0", agent="alice", turn=1, seat=1, phase="act", reply=pad, ts=1.5
        ).model_dump_json()
    )
    path = tmp_path / "store.sqlite"
    with Store(path, trace_budget_bytes=3 * size + 10) as store:
        store.add_requests([Request(f"s{i}", i, f"g{i}", "train", spec, (0, 1)) for i in (0, 1)])

        def traces(agent: str, seat: int, match: str) -> list[Trace]:
            return [
                Trace(match=match, agent=agent, turn=t, seat=seat, phase="act", reply=pad, ts=1.5)
                for t in range(1, 6)
            ]

        assert store.add_traces("eve", traces("eve", 1, "s0")) == {
            STORED: 3,
            "trace_over_budget": 2,
        }
        assert store.add_traces("alice", traces("alice", 0, "s0"))[STORED] == 3
        assert store.add_traces("eve", traces("eve", 1, "s1"))[STORED] == 3
        assert store.over_budget_text(0) == "alice=2 eve=2"
        assert store.over_budget_text(1) == "eve=2"
    with Store(path, trace_budget_bytes=4 * size + 10) as store:
        late = Trace(match="s0", agent="eve", turn=7, seat=1, phase="act", reply=pad, ts=1.5)
        assert store.add_traces("eve", [late, late.model_copy(update={"turn": 8})]) == {
            STORED: 1,
            "trace_over_budget": 1,
        }


_TORN = textwrap.dedent(
    """
    import asyncio, json, resource, signal, sys
    from pathlib import Path

    from backroom.bus.wire import Trace, dump
    from backroom.referee.episodes import EpisodeLog
    from backroom.runner.traces import TraceLog

    root = Path(sys.argv[1])
    # the writes past this size fail as on a full disk (EFBIG, not the killing SIGXFSZ)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
    out = {"episodes": [], "traces": [], "notices": []}

    async def episodes() -> None:
        log = EpisodeLog(root)
        for i in range(8):
            record = json.dumps({"match": f"m{i}", "pad": "x" * 150}).encode()
            try:
                await log.append("r", record)
                out["episodes"].append("ok")
            except OSError as exc:
                out["episodes"].append(type(exc).__name__ + str(exc.errno))

    asyncio.run(episodes())
    with TraceLog(root / "traces.jsonl", lambda m: ["a"], notice=out["notices"].append) as log:
        for turn in range(1, 9):
            trace = Trace(match="m", agent="a", turn=turn, seat=0, phase="act", reply="y" * 150)
            log.on_trace("backroom/v1/traces/a", dump(trace))
        out["traces"] = [log.written["a"], log.write_failed]
    print(json.dumps(out))
    """
)


def test_a_failed_write_leaves_the_file_at_its_last_whole_record(tmp_path: Path) -> None:
    """Issue 35, item 7: a full disk left a torn last line in episodes.jsonl (and the next
    append would have continued it). A real failing write: a child process whose files may not
    grow past 1,000 bytes (RLIMIT_FSIZE), so the record that crosses it is written in part and
    then refused by the kernel. The file must end at the last whole record, the failed append
    must say so (the referee then publishes an ``error`` episode), and traces.jsonl the same."""
    done = subprocess.run(
        [sys.executable, "-c", _TORN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60 * load_factor(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    ok = out["episodes"].count("ok")
    assert 0 < ok < 8 and all(r.startswith("OSError") for r in out["episodes"][ok:]), out
    for name in ("r/episodes.jsonl", "traces.jsonl"):
        data = (tmp_path / name).read_bytes()
        assert data.endswith(b"\n"), f"{name} ends in a torn record: {data[-40:]!r}"
        for line in data.splitlines():
            json.loads(line)  # every line whole
    assert len((tmp_path / "r/episodes.jsonl").read_bytes().splitlines()) == ok
    written, failed = out["traces"]
    assert failed > 0 and written == len((tmp_path / "traces.jsonl").read_bytes())
    assert len(out["notices"]) == 1 and "could not be written" in out["notices"][0]


def test_a_torn_tail_left_by_a_killed_writer_is_cut_before_the_next_record(
    tmp_path: Path,
) -> None:
    """A writer killed mid-record left a torn line, and the next append continued it: the good
    record after it was unreadable too. The next append cuts the torn tail off first."""
    from backroom.runs import append_records, read_episodes

    path = tmp_path / "episodes.jsonl"
    path.write_bytes(b'{"match": "m0"}\n{"match": "m1", "pa')
    append_records(path, b'{"match": "m2"}\n')
    stats: dict[str, int] = {}
    assert [r["match"] for r in read_episodes(path, stats)] == ["m0", "m2"] and not stats
