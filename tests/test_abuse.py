"""What a hostile agent (or a bad disk) does to the referee, the runner and the metrics, over a real broker.

Each test is one finding of the abuse review: a flood of bad batches, deep
JSON, invented status kinds, metrics on every interface, torn episode lines,
forged traces, an agent joining the referees' shared subscription, and roles
wider than their job (a referee writing the checkpoint every agent loads).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
import yaml
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from backroom import metrics
from backroom.agents import make_agent
from backroom.agents.base import Agent
from backroom.bus import topics
from backroom.bus.auth import ROLE_RULES, ROLES, Credential, render_acl, rules_for
from backroom.bus.broker import Broker, free_port
from backroom.bus.client import Bus, NotAuthorizedError
from backroom.bus.wire import (
    Action,
    Chat,
    Checkpoint,
    Error,
    MatchRequest,
    Status,
    Trace,
    Turn,
    WireError,
    parse_all,
)
from backroom.games import make_game
from backroom.referee.service import Referee
from backroom.runs import read_episodes

from .conftest import (
    RawAgent,
    Runner,
    agents,
    drained,
    eventually,
    identity,
    loki_spec,
    round_trip,
    stack,
)
from .gameplay import episode

ROOT = Path(__file__).resolve().parent.parent


def sample(name: str, **labels: str) -> float:
    """A metric's current value in this process (0 when it has no such series yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def referee(broker: Broker, runs: Path, **options: Any) -> AsyncIterator[Referee]:
    """A referee of our own, with options the shared ``stack`` fixture does not pass."""
    config = identity(broker, "referee", "referee")
    async with Referee(config, runs_dir=runs, **options) as ref:
        # as if seated in a match here: a referee reads only its seated agents' outboxes
        await ref.outboxes.seat(["mallory", "trent"])
        yield ref


# --- 1. one error per payload, and a budget per identity ---------------------------


async def test_a_batch_of_21000_bad_messages_gets_one_error_back(
    broker: Broker, tmp_path: Path
) -> None:
    """Ten 63 KB arrays of ``{}``: ten errors back (not 210,000), each array one refusal,
    counted once: a batch is refused whole at its first bad message (issue 22)."""
    bad = b"[" + b",".join([b"{}"] * 21_000) + b"]"
    assert 60_000 < len(bad) < 64 * 1024
    before = sample("backroom_invalid_inputs_total", reason="unknown_type")
    async with (
        referee(broker, tmp_path / "runs"),
        RawAgent(identity(broker, "mallory")) as mal,
    ):
        for _ in range(10):
            await mal.send(bad)
        await mal.barrier()  # the referee has answered all ten: no eleventh error is on its way
        errors = mal.of(Error)
    assert len(errors) == 10
    assert {e.reason for e in errors} == {"unknown_type"}
    assert all("message 0 of the batch" in e.detail for e in errors)
    assert sample("backroom_invalid_inputs_total", reason="unknown_type") - before == 10


async def test_errors_to_one_identity_are_rate_limited_and_the_excess_counted(
    broker: Broker, tmp_path: Path
) -> None:
    """Past its token bucket an identity's errors are dropped, counted; another identity still gets its own."""
    dropped = sample("backroom_errors_dropped_total")
    async with (
        referee(broker, tmp_path / "runs", error_burst=3, error_rate_per_s=0.001) as ref,
        RawAgent(identity(broker, "mallory")) as mal,
        RawAgent(identity(broker, "trent")) as trent,
    ):
        for i in range(20):
            await mal.send(b"{nope %d" % i)
        await trent.send(b"{nope")
        # mallory's budget is spent, so no answer of the referee's can mark the end of
        # its answers to her: it is drained, and its own connection carries the marker
        await mal.barrier(ref)
        await trent.barrier()
        assert ref.budgets.error_burst == 3
    assert len(mal.of(Error)) == 3
    assert [e.reason for e in trent.of(Error)] == ["malformed"]
    assert sample("backroom_errors_dropped_total") - dropped == 17


# --- 2. deep JSON ------------------------------------------------------------------


def test_deeply_nested_json_is_one_invalid_input_not_a_recursion_error() -> None:
    for payload in (b"[" * 10_000, b"[" * 5_000 + b"]" * 5_000, b'{"a":' * 5_000 + b"1"):
        (err,) = parse_all(payload)
        assert isinstance(err, WireError) and err.reason == "too_deep", err
        assert "nested deeper than" in err.detail
    # valid JSON, each element too deep for the message parser: still too_deep, not malformed
    (err,) = parse_all(b"[" + b"[" * 300 + b"]" * 300 + b"]")
    assert isinstance(err, WireError) and err.reason == "too_deep"


async def test_a_10kb_nested_array_gets_an_error_reply_and_is_counted(
    broker: Broker, tmp_path: Path
) -> None:
    before = sample("backroom_invalid_inputs_total", reason="too_deep")
    async with (
        referee(broker, tmp_path / "runs"),
        RawAgent(identity(broker, "mallory")) as mal,
    ):
        await mal.send(b"[" * 10_000)
        err = await mal.next_of(Error)
        assert isinstance(err, Error) and err.reason == "too_deep"
        # and the referee goes on answering
        await mal.send(b"{nope")
        err = await mal.next_of(Error, after=mal.inbox.index(err) + 1)
        assert isinstance(err, Error) and err.reason == "malformed"
    assert sample("backroom_invalid_inputs_total", reason="too_deep") - before == 1


# --- 3. metric labels from a closed set --------------------------------------------


def registered_kinds() -> set[str]:
    """Every ``@register_agent("...")`` in backroom/agents and backroom/human (the ``human``
    kind), read from the source (no heavy imports)."""
    kinds: set[str] = set()
    paths = [
        *(ROOT / "backroom" / "agents").rglob("*.py"),
        *(ROOT / "backroom" / "human").rglob("*.py"),
    ]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "register_agent"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                kinds.add(node.args[0].value)
    return kinds


def test_the_closed_set_of_kinds_is_the_registry() -> None:
    assert registered_kinds() == metrics.KNOWN_AGENT_KINDS
    assert metrics.kind_label("random") == "random"
    assert metrics.kind_label("unknown") == "unknown"
    assert metrics.kind_label("kind-123") == "other"


async def test_a_new_status_kind_before_every_move_adds_no_series(
    broker: Broker, tmp_path: Path
) -> None:
    players = agents(("a", "random"), ("b", "random"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with RawAgent(identity(broker, "mallory")) as mal:
            await run.submit(
                "kinds", loki_spec(["mallory", "a", "b"], channels=[], params={"variant": "loki"})
            )
            stop = asyncio.Event()

            async def play() -> None:
                answered: set[int] = set()
                while not stop.is_set():
                    for msg in list(mal.inbox):
                        if isinstance(msg, Turn) and msg.turn not in answered:
                            answered.add(msg.turn)
                            kind = f"kind-{len(answered)}"
                            # back from the broker: the referee, which reads statuses and
                            # outboxes on one connection, gets it before the move sent next
                            await mal.published(
                                topics.status("mallory"),
                                Status(state="online", kind=kind),
                                retain=True,
                            )
                            if msg.phase == "talk":
                                await mal.send(
                                    Chat(match=msg.match, turn=msg.turn, channel="", text="")
                                )
                            else:
                                names = msg.legal["names"]
                                pick = "call" if "call" in names else names[0]
                                await mal.send(Action(match=msg.match, turn=msg.turn, action=pick))
                    mal.new.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(mal.new.wait(), 0.2)

            driver = asyncio.create_task(play())
            (ep,) = await run.wait(["kinds"])
            stop.set()
            await driver
    assert ep.reason == "normal"
    assert any(a.agent == "mallory" for a in ep.actions)
    kinds = {
        s.labels["kind"] for m in metrics.TURN_LATENCY.collect() for s in m.samples if s.labels
    }
    assert not [k for k in kinds if k.startswith("kind-")], kinds  # one series per move, before
    assert kinds <= metrics.KNOWN_AGENT_KINDS | {"unknown", "other"}, kinds
    assert "other" in kinds  # mallory's moves were measured, under "other"


# --- 4. metrics listen on localhost ------------------------------------------------


def test_metrics_listen_on_localhost_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BACKROOM_METRICS_HOST", raising=False)
    server = metrics.serve(free_port())
    assert server is not None
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("BACKROOM_METRICS_HOST", "0.0.0.0")
    server = metrics.serve(free_port())
    assert server is not None
    try:
        assert server.server_address[0] == "0.0.0.0"
    finally:
        server.shutdown()
        server.server_close()
    assert metrics.serve(0) is None


def test_compose_services_serve_metrics_on_the_compose_network() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    backroom = {  # every service that serves /metrics
        n: s for n, s in compose["services"].items() if "--metrics-port" in str(s.get("command"))
    }
    assert backroom
    for name, svc in backroom.items():
        assert svc.get("environment", {}).get("BACKROOM_METRICS_HOST") == "0.0.0.0", name
        assert "9100" not in str(svc.get("ports", "")), name  # scraped inside, not published


# --- 5. torn lines anywhere in episodes.jsonl ----------------------------------------


def torn_run(tmp_path: Path) -> Path:
    """An episodes.jsonl with a torn line that later appends continued, garbage, and a non-object."""
    game = make_game("ipd")
    eps = [
        episode(
            game,
            [make_agent("tit-for-tat", "t"), make_agent("always", "d", action="B")],
            match=f"m{i}",
        )
        for i in range(3)
    ]
    lines = [json.dumps(e) for e in eps]
    path = tmp_path / "episodes.jsonl"
    path.write_bytes(
        (lines[0] + "\n").encode()
        + lines[1][: len(lines[1]) // 2].encode()  # the writer died here...
        + (lines[2] + "\n").encode()  # ...and the next append went on on the same line
        + b"\xff\xfe not utf-8\n"
        + b"[1, 2]\n"
        + (lines[2] + "\n").encode()
        + lines[0][:40].encode()  # torn again, at the very end
    )
    return path


def test_read_episodes_skips_and_counts_bad_lines_anywhere(tmp_path: Path) -> None:
    stats: dict[str, int] = {}
    records = list(read_episodes(torn_run(tmp_path), stats))
    assert len(records) == 2
    assert stats == {"unreadable_lines": 4}


def test_analyze_says_how_many_lines_it_skipped(tmp_path: Path) -> None:
    from backroom.cli import app

    path = torn_run(tmp_path)
    res = CliRunner().invoke(app, ["analyze", str(tmp_path)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert f"skipped 4 unreadable lines in {path}" in res.output
    assert json.loads((tmp_path / "analysis.json").read_text())["unreadable_lines"] == 4


# --- 6. forged traces ----------------------------------------------------------------


async def test_the_runner_records_traces_only_as_their_topic_and_seat_say(
    broker: Broker, tmp_path: Path
) -> None:
    """An unseated agent signs traces as a seated one; a seated one claims another's seat: dropped."""
    from backroom.runner.config import RunConfig
    from backroom.runner.local import run_matches

    forged = {"forged": 0, "not_seated": 0}
    before = {r: sample("backroom_traces_rejected_total", reason=r) for r in forged}

    class Traced(Agent):
        async def act(self, turn: Turn) -> object:
            async def trace(bus: Bus, sender: str, agent: str, seat: int | None) -> None:
                msg = Trace(match=turn.match, agent=agent, turn=turn.turn, seat=seat, phase="act")
                await bus.publish(topics.traces(sender), msg)

            # the genuine trace, then the lies
            await self.publish_trace(
                Trace(match=turn.match, agent=self.id, turn=turn.turn, seat=turn.seat, phase="act")
            )
            for _ in range(5):
                await trace(eve, "eve", "t0", turn.seat)  # eve, unseated, signs as t0
                forged["forged"] += 1
            await trace(eve, "eve", "eve", None)  # eve as herself: not seated
            forged["not_seated"] += 1
            await self.publish_trace(  # a seated agent claiming the next seat
                Trace(
                    match=turn.match,
                    agent=self.id,
                    turn=turn.turn,
                    seat=(turn.seat + 1) % 3,
                    phase="act",
                )
            )
            forged["not_seated"] += 1
            names = turn.legal["names"]
            return "call" if "call" in names else names[0]

    players: list[Agent] = [Traced("t0"), Traced("t1"), Traced("t2")]
    config = RunConfig.model_validate(
        {
            "run": "traced",
            "game": "kuhn",
            "params": {"variant": "loki"},
            "matches": 3,
            "agents": [{"id": p.id, "kind": "external"} for p in players],
        }
    )
    eve_config = identity(broker, "eve")
    async with stack(broker, tmp_path / "runs", players), Bus(eve_config) as eve:
        path = tmp_path / "traces.jsonl"
        eps = await run_matches(config, identity(broker, "runner", "runner"), [], traces_path=path)
    traces = [json.loads(line) for line in path.read_text().splitlines()]
    seats = {e.match: e.seats for e in eps}
    acts = sorted((e.match, a.turn, a.seat) for e in eps for a in e.actions if a.phase == "act")
    liars = [t for t in traces if t["seat"] is None or t["agent"] != seats[t["match"]][t["seat"]]]
    assert liars == [] and len(traces) == len(acts)
    assert sorted((t["match"], t["turn"], t["seat"]) for t in traces) == acts
    got = {r: sample("backroom_traces_rejected_total", reason=r) - before[r] for r in forged}
    assert got == forged and forged["forged"] >= 20


# --- 7. the referees' shared subscription --------------------------------------------


def test_only_referees_may_read_or_write_where_the_group_name_is_kept() -> None:
    creds = [Credential(f"x-{role}", "pw", role) for role in ROLES]
    acl = render_acl(creds)
    group_topic = topics.referee_group("referee")
    for cred in creds:
        block = acl.split(f"user {cred.username}\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert block == rules_for(cred)
        reaches = [r for r in block if paho.topic_matches_sub(r.split()[-1], group_topic)]
        if cred.role == "referee":
            assert reaches == [f"topic read {topics.PREFIX}/control/referees/+/group"]
        else:
            assert reaches == [], (cred.role, reaches)
    assert all("$share" not in rule for rules in ROLE_RULES.values() for rule in rules)


async def test_an_agent_in_the_referees_group_takes_no_requests(
    broker: Broker, tmp_path: Path
) -> None:
    """Eve subscribes to the old well-known group and to everything she can: the referees get all 20.

    The requests name a game nobody registered (refused at once, one episode
    each): the made-up name must not become a metric label either.
    """
    chess_before = sample("backroom_matches_finished_total", game="chess", outcome="error")
    other_before = sample("backroom_matches_finished_total", game="other", outcome="error")
    eve_config = identity(broker, "eve")
    stolen: list[tuple[str, bytes]] = []
    async with (
        referee(broker, tmp_path / "runs") as ref,
        Bus(eve_config) as eve,
        Runner(broker) as run,
        RawAgent(identity(broker, "mallory")) as mal,  # logs all it may read, backroom/v1/#
    ):
        for topic_filter in (
            f"$share/referees/{topics.CONTROL_MATCHES}",
            f"$share/referees/{topics.PREFIX}/#",
            f"$share/referees/{topics.PREFIX}/control/#",
        ):
            await eve.subscribe(topic_filter, lambda t, p: stolen.append((t, p)))
        spec = loki_spec(["x", "y", "z"], game="chess")  # refused at once: an episode per request
        matches = [f"steal-{i}" for i in range(20)]
        for m in matches:
            await run.bus.publish(topics.CONTROL_MATCHES, MatchRequest(match=m, spec=spec))
        eps = await run.wait(matches, timeout=20)
        # every request was taken (each publish awaited its PUBACK) before these markers:
        # once each is back, any copy of a request the broker had for eve or mallory is too
        await round_trip(eve, topics.status("eve"))
        await mal.echo()
    assert [e.match for e in eps] == matches
    assert all(e.reason == "error" and "unknown game" in e.detail for e in eps)
    assert not any("/control/" in t for t, _ in stolen)  # statuses she may read anyway
    assert sample("backroom_matches_finished_total", game="chess", outcome="error") == chess_before
    assert (
        sample("backroom_matches_finished_total", game="other", outcome="error") - other_before
        == 20
    )
    assert ref.group is not None and ref.group not in str(mal.seen)
    assert not any("/control/" in t for t, _ in mal.seen)


async def requests_run_once_each(broker: Broker, refs: list[Referee], n: int, runs: Path) -> None:
    """Send n match requests and check each ran once, on one referee: none got a copy each."""
    async with Runner(broker) as run:
        spec = loki_spec(["x", "y", "z"], game="chess")
        matches = [f"m-{i}" for i in range(n)]
        for m in matches:
            await run.bus.publish(topics.CONTROL_MATCHES, MatchRequest(match=m, spec=spec))
        await run.wait(matches, timeout=20)
        for r in refs:  # each has handled every request it got, and written its episodes
            await drained(r)
    lines = [str(r["match"]) for r in read_episodes(runs / "t")]
    assert sorted(lines) == sorted(matches)


async def test_referees_started_together_share_one_secret_group(
    broker: Broker, tmp_path: Path
) -> None:
    configs = [identity(broker, name, "referee") for name in ("ref-a", "ref-b", "ref-c")]
    await asyncio.sleep(0.05)
    refs = [Referee(c, runs_dir=tmp_path / "runs") for c in configs]
    await asyncio.gather(*(r.open() for r in refs))
    try:
        # on a busy machine a proposal can come after a rival's settling time:
        # that referee then moves (the next test), so wait for all to agree
        await eventually(
            lambda: len({r.group for r in refs}) == 1,
            10,
            lambda: f"{len({r.group for r in refs})} groups",
        )
        groups = {r.group for r in refs}
        assert None not in groups
        await requests_run_once_each(broker, refs, 30, tmp_path / "runs")
        # a referee started later joins the same group
        late = identity(broker, "ref-d", "referee")
        await asyncio.sleep(0.05)
        async with Referee(late, runs_dir=tmp_path / "runs") as d:
            assert d.group in groups
    finally:
        await asyncio.gather(*(r.__aexit__(None, None, None) for r in refs))


async def test_referees_move_to_a_smaller_group_proposed_late(
    broker: Broker, tmp_path: Path
) -> None:
    """A proposal that comes after the others settled (a loaded machine) is not a split.

    Two referees settle in one group; a third identity's record then names a
    smaller group, as a rival started at the same moment but slowed down
    would. Both referees move there (their records say so), and the requests
    sent after that run once each, read in the new group.
    """
    refs = [
        Referee(identity(broker, name, "referee"), runs_dir=tmp_path / "runs")
        for name in ("ref-a", "ref-b")
    ]
    late = Bus(identity(broker, "ref-z", "referee"))
    for r in refs:
        await r.open()
    try:
        first = refs[0].group
        assert first is not None and refs[1].group == first
        smaller = "referees-" + "0" * 32
        records: dict[str, str] = {}
        async with late:
            await late.subscribe(
                topics.REFEREE_GROUPS,
                lambda t, p: records.__setitem__(t.split("/")[-2], p.decode()),
            )
            await late.publish(topics.referee_group("ref-z"), smaller.encode(), retain=True)
            await eventually(
                lambda: (
                    all(r.group == smaller for r in refs)
                    and records.get("ref-a") == records.get("ref-b") == smaller
                ),
                10,
                lambda: str(records),
            )
            await late.publish(topics.referee_group("ref-z"), b"", retain=True)
        # once each: nothing reads in the old group any more
        await requests_run_once_each(broker, refs, 20, tmp_path / "runs")
    finally:
        await asyncio.gather(*(r.__aexit__(None, None, None) for r in refs))


# --- 8. each role only what its job needs ----------------------------------------------


async def test_a_referee_cannot_write_the_checkpoint_every_agent_loads(broker: Broker) -> None:
    """A referee's retained checkpoint is refused and reaches no agent; the trainer's does."""
    ref = identity(broker, "referee", "referee")
    trainer = identity(broker, "trainer", "trainer")
    agent = identity(broker, "alice")
    forged = Checkpoint(
        policy="pol", version="evil", uri="http://attacker/adapter", sha256="0" * 64
    )
    real = Checkpoint(policy="pol", version="v1", uri="http://trainer/adapters/v1", sha256="1" * 64)
    seen: list[bytes] = []
    async with Bus(ref) as r, Bus(trainer) as t:
        with pytest.raises(NotAuthorizedError):
            await r.publish(topics.checkpoint("pol"), forged, retain=True)
        async with Bus(agent) as a:  # subscribes after: a retained copy would come now
            await a.subscribe(topics.checkpoint("pol"), lambda _t, p: seen.append(p))
            await round_trip(a, topics.status("alice"))  # after any retained copy
            assert seen == []
            with pytest.raises(NotAuthorizedError):  # live, not only retained
                await r.publish(topics.checkpoint("pol"), forged)
            await t.publish(topics.checkpoint("pol"), real, retain=True)
            await eventually(lambda: bool(seen), timeout=5)
            await round_trip(a, topics.status("alice"))  # nothing else came, before it or after
    assert [parse_all(p)[0] for p in seen] == [real]


async def test_each_role_reads_and_writes_exactly_the_topics_of_its_job(broker: Broker) -> None:
    """Every role tries every kind of topic on a real broker: what goes through is its job, no more."""
    ids = {"agent": "ag", "referee": "ref", "runner": "run", "trainer": "tr", "observer": "obs"}
    configs = {role: identity(broker, name, role) for role, name in ids.items()}
    p = topics
    probes = [
        *(p.inbox(name) for name in ("ag", "run", "tr")),
        p.outbox("ag", "ref"),
        p.outbox("ag", "ref-other"),  # to another referee: not ref's to read
        p.outbox("ag", None),  # the old shared outbox: no referee reads it now
        *(p.status(name) for name in ids.values()),
        p.traces("ag"),
        p.traces("ref"),
        p.public("m1"),
        p.episodes("kuhn"),
        p.checkpoint("pol"),
        p.model_version("pol", "v1"),
        p.CONTROL_MATCHES,
        p.referee_group("ref"),
        p.referee_probe("ref"),
        p.referee_group("ref-other"),
        p.referee_roster("ref"),
        p.referee_roster("ref-other"),
    ]
    writes = {
        "agent": {
            p.outbox("ag", "ref"),
            p.outbox("ag", "ref-other"),
            p.outbox("ag", None),
            p.status("ag"),
            p.traces("ag"),
        },
        "referee": {
            *(p.inbox(name) for name in ("ag", "run", "tr")),
            p.status("ref"),
            p.public("m1"),
            p.episodes("kuhn"),
            p.referee_group("ref"),
            p.referee_probe("ref"),
            p.referee_roster("ref"),
        },
        "runner": {p.CONTROL_MATCHES},
        "trainer": {p.CONTROL_MATCHES, p.checkpoint("pol"), p.model_version("pol", "v1")},
        "observer": set(),
    }
    statuses = {p.status("ag"), p.status("ref")}  # the statuses somebody may write
    reads = {
        "agent": {
            p.inbox("ag"),
            *statuses,
            p.public("m1"),
            p.checkpoint("pol"),
            p.model_version("pol", "v1"),
        },
        "referee": {
            *statuses,
            p.outbox("ag", "ref"),  # only its own: no referee reads another's moves
            p.CONTROL_MATCHES,
            p.referee_group("ref"),
            p.referee_probe("ref"),
        },
        "runner": {
            p.inbox("run"),
            *statuses,
            p.traces("ag"),
            p.episodes("kuhn"),
            p.referee_roster("ref"),
        },
        "trainer": {
            p.inbox("tr"),
            *statuses,
            p.traces("ag"),
            p.episodes("kuhn"),
            p.referee_roster("ref"),
            p.checkpoint("pol"),  # co-training: it follows the policy another trainer trains
        },
        "observer": {
            *statuses,
            p.public("m1"),
            p.episodes("kuhn"),
            p.checkpoint("pol"),
            p.model_version("pol", "v1"),
            p.referee_roster("ref"),
        },
    }
    wrote: dict[str, set[str]] = {role: set() for role in ids}
    got: dict[str, set[str]] = {role: set() for role in ids}
    marked: set[str] = set()
    marker = b"barrier"

    def on(role: str, topic: str, payload: bytes) -> None:
        got[role].add(topic)
        if payload == marker:
            marked.add(role)

    async with contextlib.AsyncExitStack() as stack_:
        buses = {role: await stack_.enter_async_context(Bus(c)) for role, c in configs.items()}
        for role, bus in buses.items():
            await bus.subscribe(f"{topics.PREFIX}/#", functools.partial(on, role))
        for role, bus in buses.items():
            for topic in probes:
                try:
                    await bus.publish(topic, b"probe")
                except NotAuthorizedError:
                    continue
                wrote[role].add(topic)
        # Every probe was taken (each publish awaited its PUBACK) before this marker, which
        # every role may read: the broker sends a client its messages in the order it took
        # them, so once a role has the marker it has every probe it was going to get.
        await buses["agent"].publish(p.status("ag"), marker)
        await eventually(lambda: marked == set(ids), 10)
    assert wrote == writes
    assert got == reads
