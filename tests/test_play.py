"""One batch, its callers: a match request lost before any referee takes it is asked again.

A member of the referees' shared group that takes requests and answers
nothing (a referee that dies with them, unacknowledged) gets some of a
batch's requests; the trainer and the league each send those again (the
``MatchLedger``'s ``resend``), count them, and play every match.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus
from backroom.bus.wire import AdapterRef, EpisodeRecord, MatchRequest, MatchSpec, parse_all
from backroom.league.config import parse_league
from backroom.league.play import run_league
from backroom.play.batch import play
from backroom.play.faults import Faults
from backroom.play.ledger import MatchLedger
from backroom.play.loop import Batch, Earlier
from backroom.play.plan import Collect, MatchPlan, PlayOptions, Presence, Waits
from backroom.referee.service import Referee
from backroom.trainer.batch import play_batch
from backroom.trainer.bus import TrainerBus
from backroom.trainer.config import parse_train_config
from backroom.trainer.rollouts import plan_step
from backroom.trainer.store import Store

from .conftest import agents, eventually, identity, load_factor, stack
from .test_trainer import tiny_config_data


@contextlib.asynccontextmanager
async def swallowing(broker: Broker) -> AsyncIterator[list[str]]:
    """Join the referees' group (read from its retained record) and take requests without a
    word until the first one is in; yields the matches it took."""
    swallowed: list[str] = []
    groups: list[str] = []
    leaving: list[asyncio.Task[None]] = []

    def on_group(_topic: str, payload: bytes) -> None:
        if payload:
            groups.append(payload.decode())

    async with Bus(identity(broker, "referee-sink", "referee")) as bus:

        def on_request(_topic: str, payload: bytes) -> None:
            swallowed.extend(m.match for m in parse_all(payload) if isinstance(m, MatchRequest))
            if swallowed and not leaving:  # one is enough: leave the group again
                shared = topics.control_matches_shared(min(groups))
                leaving.append(asyncio.create_task(bus.unsubscribe(shared)))

        await bus.subscribe(topics.REFEREE_GROUPS, on_group)
        await eventually(lambda: bool(groups), 10 * load_factor())
        await bus.subscribe(topics.control_matches_shared(min(groups)), on_request)
        yield swallowed


async def test_the_trainer_sends_again_a_request_a_referee_took_without_a_word(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    config = parse_train_config(
        tiny_config_data(
            tiny_qwen_model, params={"rounds": 1}, hyper={"batch_size": 16, "group_size": 2}
        )
    )
    ref = AdapterRef(policy="pol", version="v0", uri="/nowhere", sha256="0" * 64, size=0)
    planned = [
        replace(r, spec=r.spec.model_copy(update={"adapters": [None, None]}))
        for r in plan_step(config, 0, ref, [])
    ]
    players = agents(("p0", "tit-for-tat"), ("p1", "tit-for-tat"))
    async with stack(broker, tmp_path / "runs", players), swallowing(broker) as swallowed:
        with Store(tmp_path / "store.sqlite") as store:
            async with TrainerBus(identity(broker, "trainer-s", "trainer"), store, "ipd") as tb:
                await eventually(lambda: any(tb.referees.values()), 10 * load_factor())
                played = await asyncio.wait_for(
                    play_batch(tb, store, planned, 600, 16), 30 * load_factor()
                )
            assert swallowed, "no request reached the silent member"
            assert played.summary() == "16 of 16 matches"
            assert played.faults.resubmitted >= len(swallowed)
            assert store.missing_episodes(played.matches) == []


async def test_the_league_sends_again_a_request_a_referee_took_without_a_word(
    broker: Broker, tmp_path: Path
) -> None:
    data = {
        "league": "sink",
        "games": [{"game": "ipd", "params": {"rounds": 2}, "seeds": 4}],
        "entrants": [
            {"id": "tft", "kind": "tit-for-tat"},
            {"id": "defector", "kind": "always", "options": {"action": "B"}},
        ],
        "agent_processes": "single",
        # one request a message: released together they would go out as one (``batch``), to
        # one member of the group
        "concurrency": 1,
    }
    where = {"broker_url": f"mqtt://{broker.host}:{broker.port}"}
    # a referee of the test's own makes the group first, so the silent member is in it
    # before the league's requests go out
    async with Referee(identity(broker, "referee", "referee"), runs_dir=tmp_path / "runs"):
        async with swallowing(broker) as swallowed:
            summary = await run_league(
                parse_league(data),
                tmp_path / "league",
                credentials_dir=broker.credentials.dir,
                **where,  # type: ignore[arg-type]
            )
    assert swallowed, "no request reached the silent member"
    assert summary.played == 1 * 2 * 4 and summary.pending == 0
    assert summary.faults.resubmitted >= len(swallowed)


class _Kept(Collect):
    """A caller's own sink: what it was handed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[EpisodeRecord] = []
        self.slot_of: Mapping[str, str] = {}

    def attempts(self, slot_of: Mapping[str, str]) -> None:
        self.slot_of = slot_of

    def episode(self, record: EpisodeRecord) -> None:
        self.kept.append(record)


async def test_play_puts_a_plan_through_a_callers_own_sink_with_the_fault_rules(
    broker: Broker, tmp_path: Path
) -> None:
    """``play(plan, bus, sink, options)`` with neither a run config nor a run directory: every
    planned match comes back once, to the sink and in plan order, the request a silent
    referee took is sent again and counted in the caller's ``Faults``."""
    specs = [
        (f"sink-plan.{i}", MatchSpec(game="ipd", params={"rounds": 2}, seats=["p0", "p1"], seed=i))
        for i in range(8)
    ]
    plan = MatchPlan.of("ipd", specs, agents=["p0", "p1"])
    faults, sink = Faults(), _Kept()
    options = PlayOptions(
        concurrency=1,  # one request a message, so the group shares them out
        presence=Presence(wait_for=("p0", "p1")),
        waits=Waits(ack_s=0.5),
        faults=faults,
    )
    players = agents(("p0", "tit-for-tat"), ("p1", "tit-for-tat"))
    async with stack(broker, tmp_path / "runs", players), swallowing(broker) as swallowed:
        episodes = await asyncio.wait_for(
            play(plan, identity(broker, "runner-p", "runner"), sink, options), 30 * load_factor()
        )
    assert swallowed, "no request reached the silent member"
    assert [sink.slot_of[e.match] for e in episodes] == plan.ids
    assert sorted(sink.slot_of[e.match] for e in sink.kept) == sorted(plan.ids)
    assert faults.resubmitted >= len(swallowed)
    assert options.clock.ended > options.clock.started > 0


class _Recorded:
    """A session that keeps what the batch sends (``loop.Session``), always connected."""

    me = "trainer-x"

    def __init__(self) -> None:
        self.sent: list[MatchRequest] = []

    def send(self, request: MatchRequest) -> None:
        self.sent.append(request)

    def connected(self) -> bool:
        return True


class _NoneDead:
    def dead(self) -> list[tuple[str, str]]:
        return []

    def none_left(self, gap_s: float, ledger: MatchLedger) -> None:
        return None


def _episode(
    match: str, spec: MatchSpec, reason: str = "normal", detail: str = ""
) -> EpisodeRecord:
    return EpisodeRecord.model_validate(
        {
            "match": match,
            "run": "run",
            "referee": "ref-a",
            "spec": spec,
            "game": spec.game,
            "params": {},
            "seed": spec.seed,
            "crn_group": None,
            "seats": spec.seats,
            "actions": [],
            "deliveries": [],
            "round_rewards": [],
            "raw_returns": [0.0, 0.0],
            "returns": [0.0, 0.0],
            "reason": reason,
            "detail": detail,
            "started_at": 0.0,
            "ended_at": 0.0,
        }
    )


async def test_a_batch_on_a_callers_session_starts_where_its_earlier_attempts_left_it() -> None:
    """A resumed batch (``Earlier``) on a session the caller holds, told what arrives by hand:
    a match kept before is not asked for, one a stop voided is asked under a new id, one asked
    before with no episode yet under its last id, a new one under its own; ``concurrency``
    of them at a time, the next once a kept episode frees a place. The kept episodes reach
    the sink in the callback that brings them."""
    specs = [
        (f"step.{i}", MatchSpec(game="ipd", params={"rounds": 1}, seats=["p0", "p1"], seed=i))
        for i in range(4)
    ]
    plan = MatchPlan.of("ipd", specs)
    spec = dict(specs)
    earlier = {
        "step.0": Earlier(("step.0",), kept=_episode("step.0", spec["step.0"])),
        "step.1": Earlier(("step.1", "step.1.r1"), stopped=True),
        "step.2": Earlier(("step.2",)),
    }
    session, sink = _Recorded(), _Kept()
    options = PlayOptions(concurrency=2)
    batch = Batch(plan, session, sink, options, _NoneDead(), earlier)
    batch.referee("ref-a", True)
    playing = asyncio.create_task(batch.play())
    await eventually(lambda: len(session.sent) == 2, 5)
    assert [r.match for r in session.sent] == ["step.1.r2", "step.2"]
    assert all(r.reply_to == "trainer-x" for r in session.sent)
    assert batch.ledger.faults.rerequest_reasons == {"voided by a stop": 1}
    assert batch.episode(_episode("step.1.r1", spec["step.1"])) is True  # an earlier attempt counts
    await eventually(lambda: len(session.sent) == 3, 5)
    assert session.sent[-1].match == "step.3"
    for match in ("step.2", "step.3"):
        assert batch.episode(_episode(match, spec[match])) is True
    await asyncio.wait_for(playing, 5)
    assert sorted(e.match for e in sink.kept) == ["step.1.r1", "step.2", "step.3"]
    assert sorted(batch.ledger.episodes) == plan.ids
