"""The referee over a real broker: turns, channels, eavesdroppers, bad input, timeouts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backroom.agents import make_agent
from backroom.agents.base import Agent
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, Handler
from backroom.bus.wire import (
    Action,
    Chat,
    Delivery,
    Error,
    MatchEnd,
    MatchStart,
    Status,
    Turn,
    parse_all,
)
from backroom.referee.service import Referee
from backroom.runs import read_episodes

from .conftest import (
    COLLUDE,
    RawAgent,
    Runner,
    agents,
    drained,
    eventually,
    identity,
    load_factor,
    loki_spec,
    play_raw,
    stack,
)


async def test_coalition_match_records_and_transforms(broker: Broker, tmp_path: Path) -> None:
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"), ("c", "random"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        ids = [f"m{i}" for i in range(30)]
        for i, m in enumerate(ids):
            await run.submit(m, loki_spec(["a", "b", "c"], seed=i))
        eps = await run.wait(ids)
    for ep in eps:
        assert ep.reason == "normal"
        assert sum(ep.raw_returns) == 0
        assert (
            ep.returns[0]
            == ep.returns[1]
            == pytest.approx((ep.raw_returns[0] + ep.raw_returns[1]) / 2)
        )
        assert ep.returns[2] == ep.raw_returns[2]
        # one talk turn before each colluder action, each heard by the partner and overheard by c
        talks = [a for a in ep.actions if a.phase == "talk"]
        acts = [a for a in ep.actions if a.phase == "act"]
        assert len(talks) == len([a for a in acts if a.seat in (0, 1)])
        assert len(ep.deliveries) == 2 * len(talks)
    on_disk = list(read_episodes(tmp_path / "runs" / "t"))
    assert sorted(r["match"] for r in on_disk) == sorted(ids)


@pytest.mark.parametrize("eavesdrop", [True, False])
async def test_private_messages_reach_only_members_and_the_eavesdropper(
    broker: Broker, tmp_path: Path, eavesdrop: bool
) -> None:
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    channel = COLLUDE.model_copy(update={"eavesdroppers": [2] if eavesdrop else []})
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with RawAgent(identity(broker, "carol")) as carol:
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(carol, "call", stop))
            ids = [f"p{i}" for i in range(12)]
            for i, m in enumerate(ids):
                await run.submit(m, loki_spec(["a", "b", "carol"], seed=i, channels=[channel]))
            eps = await run.wait(ids)
            # every delivery to carol left before its match's episode; this answer comes after
            await carol.barrier()
            stop.set()
            await driver
    private = [d for ep in eps for d in ep.deliveries if d.channel == "colluders"]
    to_carol = [d for d in private if d.to_seat == 2]
    sent = {(ep.match, d.from_seat, d.text) for ep in eps for d in ep.deliveries}
    heard = [m for m in carol.inbox if isinstance(m, Delivery)]
    if eavesdrop:
        assert len(to_carol) == len(private) // 2 and to_carol  # every message: partner + carol
        assert all(d.overheard for d in to_carol)
        assert len(heard) == len(to_carol) and all(m.overheard for m in heard)
        assert {(m.match, m.sender_seat, m.text) for m in heard} <= sent
    else:
        assert to_carol == [] and heard == []
    # The broker let carol's raw client read nothing but her inbox, her status and public topics.
    for topic, _ in carol.seen:
        assert (
            topic == topics.inbox("carol") or topic.endswith("/public") or topic.endswith("/status")
        ), topic
    # and nothing private travels on public topics
    for topic, payload in carol.seen:
        if topic.endswith("/public"):
            assert b"my card is" not in payload


async def test_bad_input_gets_errors_and_the_match_goes_on(broker: Broker, tmp_path: Path) -> None:
    # a and b call, so the betting reaches mallory (random players could both fold before her turn)
    players = [make_agent("always", "a", action="call"), make_agent("always", "b", action="call")]
    players += agents(("x", "random"), ("y", "random"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with RawAgent(identity(broker, "mallory")) as mal, RawAgent(identity(broker, "zed")):
            # an unrelated match mallory is not in, held open by zed who never answers
            other = loki_spec(
                ["x", "y", "zed"],
                channels=[],
                turn_timeout_s=2,
                params={"variant": "loki", "start": 2},
            )
            await run.submit("other", other)
            await run.submit(
                "mine",
                loki_spec(
                    ["mallory", "a", "b"], channels=[], params={"variant": "loki", "start": 1}
                ),
            )
            turn = await mal.next_of(Turn, timeout=10)
            assert isinstance(turn, Turn)

            async def error_for(payload: bytes | object) -> Error:
                before = len(mal.inbox)
                await mal.send(payload)
                err = await mal.next_of(Error, after=before)
                assert isinstance(err, Error)
                return err

            assert (await error_for(b"{nope")).reason == "malformed"
            assert (await error_for(b"[" * 70000)).reason == "oversized"
            assert (await error_for(b'{"type": "teleport", "v": 1}')).reason == "unknown_type"
            assert (await error_for(b'{"type": "action", "v": 1, "turn": "x"}')).reason == "invalid"
            err = await error_for(Action(match="other", turn=1, action="call"))
            assert err.reason == "not_seated"
            err = await error_for(Action(match="nosuch", turn=1, action="call"))
            assert err.reason == "unknown_match"
            err = await error_for(Action(match="mine", turn=turn.turn, action="shove"))
            assert err.reason == "illegal_action" and "one of" in err.detail
            err = await error_for(Action(match="mine", turn=turn.turn + 5, action="call"))
            assert err.reason == "bad_turn"
            err = await error_for(Chat(match="mine", channel="colluders", text="psst"))
            assert err.reason == "not_a_member"
            # now a good move: the match continues and ends
            await mal.send(Action(match="mine", turn=turn.turn, action="call"))
            err = await error_for(Action(match="mine", turn=turn.turn, action="call"))
            assert err.reason in ("late", "not_your_turn")
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(mal, "call", stop))
            mine, other = await run.wait(["mine", "other"])  # type: ignore[assignment]
            stop.set()
            await driver
            assert mine.reason == "normal" and other.reason == "timeout"
            assert mine.invalid_inputs >= 3
            end = await mal.next_of(MatchEnd)
            assert isinstance(end, MatchEnd) and end.reason == "normal"
            # after the end, an action is late
            err = await error_for(Action(match="mine", turn=turn.turn, action="call"))
            assert err.reason == "late"


def _sample(name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def test_with_two_referees_each_parses_only_its_own_matches_moves(
    broker: Broker, tmp_path: Path
) -> None:
    """An outbox per referee: a seat's moves go to ``agents/{agent}/outbox/{referee}``, the
    referee its ``MatchStart`` names, and each referee reads only those addressed to it.

    Before, each referee read the whole outbox of every agent it seated, so it received
    and parsed the moves of the other referee's matches too (K = 4 on 2 cores: 2.2 times
    one referee's CPU per match); before that, it answered each with ``unknown_match``.
    Counted here: the match of every message each referee's outbox handler was handed.
    """
    unknown = ("backroom_invalid_inputs_total", {"reason": "unknown_match"})
    unknown_before = _sample(*unknown)
    players = [make_agent("always", "a", action="call"), make_agent("always", "b", action="call")]
    parsed: dict[str, list[str | None]] = {}
    async with (
        stack(broker, tmp_path / "runs", players) as (first, _),
        Referee(identity(broker, "referee-2", "referee"), runs_dir=tmp_path / "runs") as second,
        Runner(broker) as run,
        RawAgent(identity(broker, "mallory")) as mal,
    ):
        for ref in (first, second):
            seen = parsed.setdefault(ref.name, [])
            handler = ref.outboxes.on_outbox

            def counting(
                topic: str,
                payload: bytes,
                seen: list[str | None] = seen,
                handler: Handler = handler,
            ) -> None:
                seen.extend(getattr(m, "match", None) for m in parse_all(payload))
                handler(topic, payload)

            ref.outboxes.on_outbox = counting
        await eventually(
            lambda: first.peers.has_peers() and second.peers.has_peers(), 10 * load_factor()
        )
        stop = asyncio.Event()
        driver = asyncio.create_task(play_raw(mal, "call", stop))
        ids = [f"m{i}" for i in range(8)]
        for i, m in enumerate(ids):
            await run.submit(m, loki_spec(["mallory", "a", "b"], seed=i, channels=[]))
        episodes = await run.wait(ids)
        stop.set()
        await driver
        # the broker split the matches (a shared subscription): both referees ran some
        ran = {m: r for r in (first, second) for m in ids if m in r.finished_ids}
        assert set(ran) == set(ids) and {first, second} == set(ran.values()), ran
        assert all(ep.reason == "normal" and ep.invalid_inputs == 0 for ep in episodes)
        for ref in (first, second):  # every move it parsed was one of its own matches'
            own = {m for m, r in ran.items() if r is ref}
            assert parsed[ref.name] and set(parsed[ref.name]) <= own, (ref.name, own)
        assert _sample(*unknown) == unknown_before
        # a move for a match no referee runs reaches only the referee it is addressed to,
        # which runs no such match and says so (no other referee's it could be)
        before = len(parsed[first.name])
        await mal.send(Action(match="nosuch", turn=0, action="call"), referee=second.name)
        err = await mal.next_of(Error, timeout=10 * load_factor())
        assert isinstance(err, Error) and (err.reason, err.match) == ("unknown_match", "nosuch")
        await drained(first)
        assert len(parsed[first.name]) == before


async def test_a_referee_alone_answers_a_seated_agents_move_for_no_match_and_reads_no_unseated_outbox(
    broker: Broker, tmp_path: Path
) -> None:
    """An agent that says ``kind: referee`` in its own status is no peer: no group record.

    And an agent seated in no match here is not read at all, outbox nor status
    (``referee.outboxes``): before, the referee read ``agents/+/outbox`` and
    ``agents/+/status``, and a flood from an unseated identity cost it 0.40 of the
    matches per second the flood cost the machine alone (status flips 0.54).
    """
    players = [make_agent("always", "a", action="call"), make_agent("always", "b", action="call")]
    async with (
        stack(broker, tmp_path / "runs", players) as (ref, _),
        Runner(broker) as run,
        RawAgent(identity(broker, "mallory")) as mal,
    ):
        await mal.published(
            topics.status("mallory"), Status(state="online", kind="referee"), retain=True
        )
        invalid = ("backroom_invalid_inputs_total", {"reason": "malformed"})
        before = _sample(*invalid)
        await mal.send(b"{nope")  # seated nowhere: the broker hands this to nobody
        await drained(ref)
        assert _sample(*invalid) == before and mal.of(Error) == []
        assert "mallory" not in ref.peers.online  # nor its status
        stop = asyncio.Event()
        driver = asyncio.create_task(play_raw(mal, "call", stop))
        await run.submit("m0", loki_spec(["mallory", "a", "b"], channels=[]))
        (ep,) = await run.wait(["m0"])
        stop.set()
        await driver
        assert ep.reason == "normal"
        assert "mallory" in ref.peers.online  # read while seated: it says so, retained
        assert not ref.peers.has_peers()  # but it is no peer
        await mal.send(Action(match="nosuch", turn=0, action="call"))  # read for LINGER_S more
        err = await mal.next_of(Error)
        assert isinstance(err, Error) and err.reason == "unknown_match"


@pytest.mark.parametrize(
    ("on_timeout", "reason"),
    [("default", "timeout"), ("random", "timeout"), ("forfeit", "forfeit")],
)
async def test_silent_seat_gets_the_configured_default(
    broker: Broker, tmp_path: Path, on_timeout: str, reason: str
) -> None:
    players = agents(("a", "random"), ("b", "random"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with RawAgent(identity(broker, "sleepy")):
            spec = loki_spec(
                ["sleepy", "a", "b"],
                channels=[],
                turn_timeout_s=0.3,
                on_timeout=on_timeout,
                params={"variant": "loki", "start": 0},
            )
            await run.submit("s", spec)
            (ep,) = await run.wait(["s"])
    assert ep.reason == reason
    assert 0 in ep.timeouts
    first = next(a for a in ep.actions if a.seat == 0)
    assert first.timed_out
    if on_timeout == "forfeit":
        assert ep.returns == [0.0, 0.0, 0.0] and "seat 0" in ep.detail
        assert first.action is None
    else:
        assert first.action in (0, 1, 2)
        if on_timeout == "default":
            assert first.action == 1  # nothing to call yet: the default checks
        assert sum(ep.raw_returns) == 0


async def test_offline_agent_is_not_waited_for(broker: Broker, tmp_path: Path) -> None:
    players = agents(("a", "random"), ("b", "random"))
    async with stack(broker, tmp_path / "runs", players) as (ref, _), Runner(broker) as run:
        ghost = identity(broker, "ghost")
        async with Bus(ghost) as g:
            await g.publish(topics.status("ghost"), Status(state="offline"), retain=True)
        # Read once seated: its retained status comes with the subscription to it.
        assert "ghost" not in ref.offline
        spec = loki_spec(["ghost", "a", "b"], channels=[], turn_timeout_s=20)
        await run.submit("g", spec)
        (ep,) = await run.wait(["g"], timeout=10)  # far less than one 20 s timeout
    assert ep.reason == "timeout" and 0 in ep.timeouts


async def test_an_agent_back_online_while_not_read_is_not_defaulted_by_its_old_offline(
    broker: Broker, tmp_path: Path
) -> None:
    """Would have caught: a referee reads an agent's status only while it seats it, and kept
    believing the last one it read. Carol went offline, was let go, came back online
    unread; seated again, her first turn opened before her retained ``online`` arrived and
    was defaulted at once (her grace long over). Now an agent let go is forgotten, and
    its status is read anew with the subscription."""
    players = agents(("a", "random"), ("b", "random"))
    async with stack(broker, tmp_path / "runs", players) as (ref, _), Runner(broker) as run:
        ref.outboxes.linger_s = 0.2
        ref.offline_grace_s = 0.0  # an agent believed offline is defaulted at once
        async with RawAgent(identity(broker, "carol")) as carol:
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(carol, "call", stop))
            first = {"variant": "loki", "start": 0}
            await run.submit("m1", loki_spec(["carol", "a", "b"], channels=[], params=first))
            await run.wait(["m1"])
            await carol.published(topics.status("carol"), Status(state="offline"), retain=True)
            await eventually(lambda: "carol" in ref.offline, 10 * load_factor())  # read: lingers
            await eventually(lambda: "carol" not in ref.outboxes.reading, 10 * load_factor())
            await drained(ref)  # the UNSUBSCRIBE is done
            # Forgotten: what her status said is not believed unread. Whether a stale
            # "offline" defaults her first turn depends on which of the SUBACK and her
            # retained status the referee handles first (on a quiet machine, mostly the
            # status: the match below then passes either way), hence this check.
            assert "carol" not in ref.offline
            await carol.published(topics.status("carol"), Status(state="online"), retain=True)
            spec = loki_spec(["carol", "a", "b"], channels=[], turn_timeout_s=20, params=first)
            await run.submit("m2", spec)
            (ep,) = await run.wait(["m2"], timeout=20 * load_factor())
            stop.set()
            await driver
    assert ep.reason == "normal" and not ep.timeouts
    assert not [a for a in ep.actions if a.seat == 0 and a.fallback]


async def test_a_seat_given_up_as_offline_is_not_taken_back_by_a_late_answer(
    broker: Broker, tmp_path: Path
) -> None:
    names = ["lazy", "slow", "idle"]
    configs = [identity(broker, n) for n in names]
    await asyncio.sleep(0.05)
    async with stack(broker, tmp_path / "runs", []), Runner(broker) as run:
        async with (
            RawAgent(configs[0]) as lazy,
            RawAgent(configs[1]) as slow,
            RawAgent(configs[2]) as idle,
        ):
            spec = loki_spec(
                names, channels=[], turn_timeout_s=20, params={"variant": "loki", "start": 0}
            )
            await run.submit("late", spec)
            first = await lazy.next_of(Turn, timeout=10)
            await lazy.bus.publish(topics.status("lazy"), Status(state="offline"), retain=True)
            # the referee gives lazy's turn up after its 1 s grace, not the 20 s timeout, and moves on
            await slow.next_of(Turn, timeout=5)
            await lazy.send(Action(match="late", turn=first.turn, action="call"))  # type: ignore[attr-defined]
            err = await lazy.next_of(Error, timeout=5)
            stop = asyncio.Event()
            players = [asyncio.create_task(play_raw(r, "call", stop)) for r in (slow, idle)]
            (ep,) = await run.wait(["late"], timeout=20)
            stop.set()
            await asyncio.gather(*players)
    assert err.reason == "not_your_turn"  # type: ignore[attr-defined]
    assert ep.reason == "timeout" and 0 in ep.timeouts
    mine = [a for a in ep.actions if a.seat == 0]
    assert mine and all(a.timed_out for a in mine)  # the late "call" was not recorded or applied


async def test_duplicate_and_unrunnable_requests(broker: Broker, tmp_path: Path) -> None:
    players = agents(("a", "random"), ("b", "random"), ("c", "random"))
    async with stack(broker, tmp_path / "runs", players) as (ref, _), Runner(broker) as run:
        spec = loki_spec(["a", "b", "c"], channels=[])
        await run.submit("dup", spec)
        await run.submit("dup", spec)
        await run.submit("bad", spec.model_copy(update={"game": "chess"}))
        await run.submit("short", spec.model_copy(update={"seats": ["a", "b"]}))
        dup, bad, short = await run.wait(["dup", "bad", "short"])
        await drained(ref)  # the second "dup" was handled: a second match would be running or done
    assert dup.reason == "normal"
    assert bad.reason == "error" and "unknown game" in bad.detail
    assert short.reason == "error" and "3 players" in short.detail
    lines = list(read_episodes(tmp_path / "runs" / "t"))
    assert [r["match"] for r in lines].count("dup") == 1


async def test_a_batch_from_an_agent_is_judged_message_by_message(
    broker: Broker, tmp_path: Path
) -> None:
    """A batch with a bad element: that element gets its own error, the good action still counts."""
    players = agents(("a", "random"), ("b", "random"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with RawAgent(identity(broker, "mallory")) as mal:
            await run.submit(
                "batch",
                loki_spec(
                    ["mallory", "a", "b"], channels=[], params={"variant": "loki", "start": 0}
                ),
            )
            turn = await mal.next_of(Turn, timeout=10)
            assert isinstance(turn, Turn)
            good = Action(match="batch", turn=turn.turn, action="call").model_dump_json()
            await mal.send(f'[{{"type": "teleport", "v": 1}}, {good}]'.encode())
            err = await mal.next_of(Error)
            assert isinstance(err, Error) and err.reason == "unknown_type"
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(mal, "call", stop))
            (episode,) = await run.wait(["batch"])
            stop.set()
            await driver
    first = episode.actions[0]
    assert (first.seat, first.action, first.timed_out) == (0, 1, False)  # 1 is "call"
    assert episode.reason == "normal"


class Slow(Agent):
    """Inline, but waits across a loop iteration (the rest runs in a task), and has a broken hook."""

    kind = "slow"
    inline = True

    async def on_match_start(self, start: MatchStart) -> None:
        raise RuntimeError("a bug in a hook")

    async def act(self, turn: Turn) -> object:
        await asyncio.sleep(0.001)
        async with asyncio.timeout(1):  # after the first wait it runs in a real task
            await asyncio.sleep(0)
        return turn.legal["choices"][0]


class Timed(Agent):
    """Not inline (the default): its decision starts in a task, so it may use asyncio.timeout at once."""

    kind = "timed"

    async def act(self, turn: Turn) -> object:
        async with asyncio.timeout(1):
            await asyncio.sleep(0)
        return turn.legal["choices"][-1]


async def test_agents_that_answer_inline_in_a_task_or_later_or_fail_in_a_hook_all_play(
    broker: Broker, tmp_path: Path
) -> None:
    """random answers inside the delivery callback, ``Slow`` starts there and continues in a task,
    ``Timed`` runs in a task from the start. A hook that raises is logged and loses nothing else."""
    players = [Slow("s"), Timed("t"), *agents(("r", "random"))]
    async with stack(broker, tmp_path / "runs", players) as (_ref, runners), Runner(broker) as run:
        ids = [f"e{i}" for i in range(20)]
        for i, m in enumerate(ids):
            await run.submit(m, loki_spec(["s", "t", "r"], seed=i, channels=[]))
        eps = await run.wait(ids)
        # Every decision and hook task finishes and is let go; the last MatchEnd's hook may
        # still be running, or its done callback not yet run, as the last episode arrives.
        for _ in range(100):
            if not runners[0].tasks and not runners[1].tasks:
                break
            await asyncio.sleep(0.01)
        assert not runners[0].tasks and not runners[1].tasks
    assert all(ep.reason == "normal" and not ep.timeouts and ep.invalid_inputs == 0 for ep in eps)
    for seat in (0, 1):
        assert (
            sum(a.seat == seat for ep in eps for a in ep.actions) >= 10
        )  # answered, none timed out
