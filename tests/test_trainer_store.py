"""The trainer's store: what it accepts, what it drops and counts, and what survives a crash."""

from __future__ import annotations

import math
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backroom.bus.wire import ActionRecord, EpisodeRecord, MatchSpec, Trace
from backroom.trainer.store import SCHEMA_VERSION, Decision, Request, Store

SEATS = ["alice", "bob"]


def spec(seats: list[str] = SEATS, seed: int = 7) -> MatchSpec:
    return MatchSpec(game="ipd", params={"rounds": 2}, seats=seats, seed=seed, crn_group="g0")


def req(
    match: str,
    step: int = 0,
    kind: str = "train",
    trainable: tuple[int, ...] = (0, 1),
    seats: list[str] = SEATS,
    label: str = "self-play",
) -> Request:
    return Request(match, step, "g0", kind, spec(seats), trainable, label)


def act(
    turn: int,
    seat: int,
    rnd: int = 1,
    phase: str = "act",
    timed_out: bool = False,
    seats: list[str] = SEATS,
) -> ActionRecord:
    return ActionRecord(
        turn=turn,
        round=rnd,
        t=float(turn),
        seat=seat,
        agent=seats[seat],
        phase=phase,  # type: ignore[arg-type]
        action="A",
        timed_out=timed_out,
    )


def record(
    match: str,
    actions: list[ActionRecord] | None = None,
    seats: list[str] = SEATS,
    returns: tuple[float, float] = (3.0, 3.0),
) -> EpisodeRecord:
    if actions is None:
        actions = [act(0, 0), act(1, 1), act(2, 0, rnd=2), act(3, 1, rnd=2)]
    return EpisodeRecord(
        match=match,
        run="default",
        referee="referee",
        spec=spec(seats),
        game="ipd",
        params={"rounds": 2},
        seed=7,
        crn_group="g0",
        seats=seats,
        actions=actions,
        deliveries=[],
        round_rewards=[[3.0, 3.0], [3.0, 3.0]],
        raw_returns=list(returns),
        returns=list(returns),
        reason="normal",
        started_at=0.0,
        ended_at=1.0,
    )


def trace(agent: str, match: str, turn: int, seat: int | None, phase: str = "act") -> Trace:
    return Trace(
        agent=agent,
        match=match,
        turn=turn,
        seat=seat,
        phase=phase,  # type: ignore[arg-type]
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        candidates=[[4], [6]],
        candidate_logprobs=[-0.1, -2.3],
        chosen=0,
        temperature=0.7,
        adapter_version="v0",
    )


def full(store: Store, match: str) -> None:
    """A requested match with its episode and every trace of both seats."""
    store.add_requests([req(match)])
    assert store.add_episode(record(match))
    for turn, seat in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        assert store.add_trace(SEATS[seat], trace(SEATS[seat], match, turn, seat))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "store.sqlite")
    yield s
    s.close()


# --- the file ------------------------------------------------------------------------


def test_wal_full_sync_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    with Store(path) as s:
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert s._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    db = sqlite3.connect(path)
    try:
        # journal_mode=WAL is a property of the file: a fresh connection sees it.
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        db.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer"):
        Store(path)


# --- requests ------------------------------------------------------------------------


def test_requests_round_trip_in_order_and_filter(store: Store) -> None:
    made = [
        req("m2", step=0),
        req("m1", step=0, kind="eval", trainable=(0,), label="eval tit-for-tat"),
        req("m3", step=1, trainable=(1,), label="buffer v3"),
    ]
    store.add_requests(made)
    assert store.request("m1") == made[1]
    assert store.request("m1") != made[0]
    assert store.request("nope") is None
    assert store.requests() == made  # insertion order, not match order
    assert store.requests(step=0) == made[:2]
    assert store.requests(step=0, kind="train") == [made[0]]
    assert store.requests(kind="eval") == [made[1]]
    assert store.requests(step=5) == []
    assert isinstance(store.requests()[2].trainable, tuple)


def test_rerequesting_a_match_is_an_error_and_rolls_back_the_batch(store: Store) -> None:
    store.add_requests([req("m1")])
    with pytest.raises(ValueError, match="m1"):
        store.add_requests([req("m2"), req("m1")])
    assert store.request("m2") is None  # one transaction: nothing of the failed batch
    with pytest.raises(ValueError, match="m4"):
        store.add_requests([req("m4"), req("m4")])
    assert store.request("m4") is None


def test_bad_requests_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.add_requests([req("m1", kind="play")])
    with pytest.raises(ValueError, match="trainable"):
        store.add_requests([req("m1", trainable=(2,))])
    assert store.requests() == []


def test_outstanding_and_missing_episodes(store: Store) -> None:
    store.add_requests([req("a", step=0), req("b", step=0), req("c", step=1)])
    assert store.outstanding() == ["a", "b", "c"]
    assert store.add_episode(record("b"))
    assert store.outstanding() == ["a", "c"]
    assert store.outstanding(step=0) == ["a"]
    assert store.outstanding(step=1) == ["c"]
    assert store.missing_episodes(["c", "b", "a", "zz"]) == ["c", "a", "zz"]


# --- ingest -------------------------------------------------------------------------------


def test_episode_stored_unrequested_and_duplicate(store: Store) -> None:
    store.add_requests([req("m1")])
    assert store.add_episode(record("m1", returns=(1.0, 2.0)))
    assert not store.add_episode(record("stray"))
    assert store.counters() == {"episode_unrequested": 1}
    assert not store.add_episode(record("m1", returns=(9.0, 9.0)))
    assert not store.add_episode(record("m1", returns=(9.0, 9.0)))
    assert store.counters() == {"episode_unrequested": 1, "episode_duplicate": 2}
    joined, _ = store.join(["m1"])
    assert joined[0].record.returns == [1.0, 2.0]  # the first one stays
    assert store.missing_episodes(["stray"]) == ["stray"]


def test_forged_trace_is_dropped_and_counted(store: Store) -> None:
    store.add_requests([req("m1")])
    # bob publishes on traces/bob a trace that claims to be alice's
    assert not store.add_trace("bob", trace("alice", "m1", 0, 0))
    assert store.counters() == {"trace_forged": 1}
    assert store.add_episode(record("m1"))
    joined, counts = store.join(["m1"])
    assert counts["decision_missing_trace"] == 4  # the forgery did not fill alice's turn 0
    assert joined[0].decisions == []


def test_trace_unrequested_no_seat_and_duplicate(store: Store) -> None:
    store.add_requests([req("m1")])
    assert not store.add_trace("alice", trace("alice", "other", 0, 0))
    no_match = trace("alice", "m1", 0, 0)
    no_match.match = None
    assert not store.add_trace("alice", no_match)
    assert not store.add_trace("alice", trace("alice", "m1", 0, None))
    assert store.add_trace("alice", trace("alice", "m1", 0, 0))
    second = trace("alice", "m1", 0, 0)
    second.logprobs = [-9.0, -9.0]
    assert not store.add_trace("alice", second)
    assert store.counters() == {"trace_unrequested": 2, "trace_no_seat": 1, "trace_duplicate": 1}
    assert store.add_episode(record("m1"))
    joined, _ = store.join(["m1"])
    first = [d for d in joined[0].decisions if (d.turn, d.seat) == (0, 0)]
    assert first[0].trace.logprobs == [-0.5, -0.25]  # the stored row is unchanged


def test_a_trace_for_another_seat_cannot_squat_the_genuine_one(store: Store) -> None:
    """Issue 22, item 7: traces were stored first-come under (match, turn, seat) and the seat
    checked only at join, so eve (unseated, honestly signing her own traces on traces/eve)
    publishing alice's decision first made alice's genuine trace a "duplicate": the decision
    was lost to training. Now the request's seats are checked on arrival."""
    store.add_requests([req("m1")])
    # before the episode is in (match ids are predictable): eve, then bob, claim alice's seat 0
    assert not store.add_trace("eve", trace("eve", "m1", 0, 0))
    assert not store.add_trace("bob", trace("bob", "m1", 0, 0))
    assert not store.add_trace("eve", trace("eve", "m1", 0, 7))  # no such seat
    assert store.add_trace("alice", trace("alice", "m1", 0, 0))  # the genuine one is stored
    assert store.add_trace("bob", trace("bob", "m1", 1, 1))
    assert store.counters() == {"trace_not_seated": 3}
    assert store.add_episode(record("m1"))
    joined, counts = store.join(["m1"])
    assert counts == {"decision_missing_trace": 2}
    assert [(d.turn, d.seat, d.trace.agent) for d in joined[0].decisions] == [
        (0, 0, "alice"),
        (1, 1, "bob"),
    ]


def test_refusals_cost_no_write_and_are_committed_with_the_step(tmp_path: Path) -> None:
    """Issue 22, item 2: each refused trace was its own fsync'd transaction (a counter row),
    inside the MQTT callback; an array of 31,500 junk elements blocked the trainer for minutes.
    Refusals are now counted in memory and written with the next step's row."""
    path = tmp_path / "store.sqlite"
    with Store(path) as store:
        store.add_requests([req("m1")])
        commits: list[str] = []
        store._db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
        junk = [trace("eve", "m1", t, 0) for t in range(2000)] + [trace("alice", "m9", 0, 0)]
        assert store.add_traces("eve", junk[:1000]) == {"trace_not_seated": 1000}
        assert store.add_traces("alice", junk[1000:]) == {
            "trace_forged": 1000,
            "trace_unrequested": 1,
        }
        for _ in range(100):
            store.count("trace_malformed")
            assert not store.add_episode(record("stray"))
        assert commits == []  # not one transaction for any of it
        both = [trace("alice", "m1", 0, 0), trace("alice", "m1", 2, 0), trace("alice", "m1", 2, 0)]
        assert store.add_traces("alice", both) == {"stored": 2, "trace_duplicate": 1}
        assert commits == ["COMMIT"]  # the stored ones share one
        expect = {
            "episode_unrequested": 100,
            "trace_duplicate": 1,
            "trace_forged": 1000,
            "trace_malformed": 100,
            "trace_not_seated": 1000,
            "trace_unrequested": 1,
        }
        assert store.counters() == expect  # in memory, seen by a reader of this store
        with Store(path) as other:
            assert other.counters() == {}  # not yet on disk
            assert store.add_episode(record("m1"))
            store.log_step(0, "v1", {}, ["m1"])
            assert other.counters() == expect  # written with the step
        assert store.counters() == expect  # and not counted twice
        store.count("trace_malformed")
    with Store(path) as reopened:  # close writes what is left
        assert reopened.counters() == {**expect, "trace_malformed": 101}


def test_trace_of_another_phase_is_not_joined(store: Store) -> None:
    store.add_requests([req("m1", trainable=(0,))])
    assert store.add_episode(record("m1", actions=[act(0, 0, phase="talk"), act(1, 0)]))
    assert store.add_trace("alice", trace("alice", "m1", 0, 0, phase="act"))
    assert store.add_trace("alice", trace("alice", "m1", 1, 0, phase="act"))
    joined, counts = store.join(["m1"])
    assert counts == {"trace_phase_mismatch": 1}
    assert [d.turn for d in joined[0].decisions] == [1]


def test_a_voided_match_is_dropped_whole_and_counted(store: Store) -> None:
    """A referee that shuts down voids the matches in its hands (on a bus shared by several
    trainers, one run's referee may hold another's): no rounds were played to learn from."""
    store.add_requests([req("m1")])
    store.add_episode(record("m1").model_copy(update={"reason": "voided", "round_rewards": []}))
    full(store, "m2")
    joined, counts = store.join(["m1", "m2"])
    assert [ep.record.match for ep in joined] == ["m2"] and counts == {"episode_voided": 1}
    assert store.counters()["episode_voided"] == 1


# --- join ---------------------------------------------------------------------------------


def test_join_builds_sorted_decisions_with_rounds(store: Store) -> None:
    store.add_requests([req("m1")])
    # actions out of (turn, seat) order, as a simultaneous-move referee may record them
    actions = [act(1, 1), act(0, 0), act(3, 1, rnd=2), act(2, 0, rnd=2)]
    assert store.add_episode(record("m1", actions=actions))
    for turn, seat in [(3, 1), (0, 0), (2, 0), (1, 1)]:
        assert store.add_trace(SEATS[seat], trace(SEATS[seat], "m1", turn, seat))
    joined, counts = store.join(["m1"])
    assert counts == {}
    (ep,) = joined
    assert ep.request == req("m1")
    assert ep.record.match == "m1"
    assert [(d.turn, d.seat, d.round) for d in ep.decisions] == [
        (0, 0, 1),
        (1, 1, 1),
        (2, 0, 2),
        (3, 1, 2),
    ]
    d = ep.decisions[0]
    sent = trace("alice", "m1", 0, 0).model_copy(update={"ts": d.trace.ts})
    assert d == Decision("m1", 0, 0, 1, "act", sent)
    assert d.trace.candidate_logprobs == [-0.1, -2.3]
    assert d.trace.chosen == 0


def test_join_only_trainable_seats(store: Store) -> None:
    store.add_requests([req("m1", trainable=(1,))])
    assert store.add_episode(record("m1"))
    for turn, seat in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        assert store.add_trace(SEATS[seat], trace(SEATS[seat], "m1", turn, seat))
    joined, counts = store.join(["m1"])
    assert counts == {}
    assert [d.seat for d in joined[0].decisions] == [1, 1]


def test_missing_traces_timeouts_and_episodes_are_counted_never_guessed(store: Store) -> None:
    store.add_requests([req("m1"), req("m2"), req("m3")])
    actions = [act(0, 0), act(1, 1, timed_out=True), act(2, 0, rnd=2), act(3, 1, rnd=2)]
    assert store.add_episode(record("m1", actions=actions))
    assert store.add_trace("alice", trace("alice", "m1", 0, 0))
    assert store.add_trace("bob", trace("bob", "m1", 1, 1))  # late answer to a timed-out turn
    assert store.add_trace("bob", trace("bob", "m1", 3, 1))
    assert store.add_episode(record("m3"))
    assert store.missing_traces(["m1", "m2", "m3"]) == [
        ("m1", 2, 0),
        ("m3", 0, 0),
        ("m3", 1, 1),
        ("m3", 2, 0),
        ("m3", 3, 1),
    ]
    joined, counts = store.join(["m3", "m2", "m1"])
    assert [j.record.match for j in joined] == ["m3", "m1"]  # order of the call, m2 left out
    assert counts == {"episode_missing": 1, "decision_timed_out": 1, "decision_missing_trace": 5}
    assert joined[0].decisions == []
    assert [(d.turn, d.seat) for d in joined[1].decisions] == [(0, 0), (3, 1)]
    assert store.counters() == counts
    _, again = store.join(["m2"])
    assert again == {"episode_missing": 1}  # this call's counts only
    assert store.counters()["episode_missing"] == 2  # but added to the persistent ones


def test_join_refuses_a_match_listed_twice(store: Store) -> None:
    full(store, "m1")
    with pytest.raises(ValueError, match="m1"):
        store.join(["m1", "m1"])


# --- used episodes and the training log --------------------------------------------------------


def test_mark_used_refuses_double_use_all_or_nothing(store: Store) -> None:
    for m in ("a", "b", "c"):
        full(store, m)
    assert store.used_in("a") is None
    assert store.used_in("nope") is None
    store.mark_used(["a"], 3)
    assert store.used_in("a") == 3
    with pytest.raises(ValueError, match="a already fed step 3"):
        store.mark_used(["b", "a"], 4)
    assert store.used_in("b") is None  # rolled back with the failure
    assert store.used_in("a") == 3
    with pytest.raises(ValueError, match="c"):
        store.mark_used(["c", "c"], 4)
    assert store.used_in("c") is None
    with pytest.raises(ValueError, match="no episode"):
        store.mark_used(["b", "nope"], 4)
    assert store.used_in("b") is None


def test_log_step_is_one_transaction(store: Store) -> None:
    for m in ("a", "b", "c"):
        full(store, m)
    assert store.last_step() is None
    store.log_step(0, "v1", {"loss": 0.5, "matches": 2, "coop": math.nan}, ["a", "b"])
    assert store.used_in("a") == 0 and store.used_in("b") == 0
    with pytest.raises(ValueError, match="step 0"):
        store.log_step(0, "v1b", {}, ["c"])
    assert store.used_in("c") is None  # the refused step marked nothing
    with pytest.raises(ValueError, match="a already fed"):
        store.log_step(1, "v2", {"loss": 0.1}, ["c", "a"])
    assert store.last_step() == (0, "v1")  # the step row went with the failed marking
    assert store.used_in("c") is None
    store.log_step(1, "v2", {"loss": 0.25}, ["c"])
    assert store.last_step() == (1, "v2")
    (s0, v0, m0), (s1, v1, m1) = store.steps()
    assert (s0, v0, s1, v1) == (0, "v1", 1, "v2")
    assert m0["loss"] == 0.5 and m0["matches"] == 2.0 and isinstance(m0["matches"], float)
    assert math.isnan(m0["coop"])
    assert m1 == {"loss": 0.25}


def test_last_step_is_the_highest_not_the_latest(store: Store) -> None:
    store.log_step(5, "v6", {}, [])
    store.log_step(2, "v3", {}, [])
    assert store.last_step() == (5, "v6")
    assert [s for s, _, _ in store.steps()] == [2, 5]


def test_counters(store: Store) -> None:
    assert store.counters() == {}
    store.count("trace_malformed")
    store.count("trace_malformed", 4)
    store.count("other", 2)
    assert store.counters() == {"other": 2, "trace_malformed": 5}


# --- what survives -----------------------------------------------------------------------


def _everything(store: Store) -> None:
    full(store, "a")
    store.add_requests([req("b", step=1, kind="eval", trainable=(0,))])
    store.count("trace_malformed", 3)  # refusals are written with the next step
    assert not store.add_episode(record("stray"))
    store.log_step(0, "v1", {"loss": 1.0}, ["a"])


def _check_everything(store: Store) -> None:
    assert store.requests() == [req("a"), req("b", step=1, kind="eval", trainable=(0,))]
    assert store.outstanding() == ["b"]
    assert store.used_in("a") == 0
    assert store.last_step() == (0, "v1")
    assert store.steps() == [(0, "v1", {"loss": 1.0})]
    assert store.counters() == {"trace_malformed": 3, "episode_unrequested": 1}
    assert not store.add_episode(record("a"))  # still deduplicated
    assert not store.add_trace("alice", trace("alice", "a", 0, 0))
    joined, counts = store.join(["a"])
    assert counts == {}
    assert len(joined[0].decisions) == 4


def test_reopened_after_close_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    with Store(path) as s:
        _everything(s)
    with Store(path) as s:
        _check_everything(s)


def test_a_second_store_on_an_open_file_sees_every_commit(tmp_path: Path) -> None:
    """What a killed process leaves: committed rows, with the first connection never closed."""
    path = tmp_path / "store.sqlite"
    first = Store(path)
    try:
        _everything(first)
        second = Store(path)
        try:
            _check_everything(second)
        finally:
            second.close()
    finally:
        first.close()


def test_a_reader_does_not_block_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    with Store(path) as writer:
        writer.add_requests([req("m1"), req("m2")])
        reader = sqlite3.connect(path, isolation_level=None)
        try:
            reader.execute("BEGIN")
            assert reader.execute("SELECT count(*) FROM episodes").fetchone()[0] == 0
            t0 = time.monotonic()
            assert writer.add_episode(record("m1"))  # with a rollback journal this would wait
            assert time.monotonic() - t0 < 2.0
            # the reader keeps its snapshot until it ends its transaction
            assert reader.execute("SELECT count(*) FROM episodes").fetchone()[0] == 0
            reader.execute("COMMIT")
            assert reader.execute("SELECT count(*) FROM episodes").fetchone()[0] == 1
        finally:
            reader.close()


def test_a_sigkilled_writer_loses_no_committed_row(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    code = textwrap.dedent(
        f"""
        import os, signal
        from tests.test_trainer_store import _everything
        from backroom.trainer.store import Store
        store = Store({str(path)!r})
        _everything(store)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert Path(f"{path}-wal").exists()  # killed before any checkpoint folded the WAL away
    with Store(path) as s:
        _check_everything(s)


def test_a_match_where_a_seat_refused_its_adapter_is_dropped_whole(store: Store) -> None:
    """Issue 22 item 4: a ``local`` seat that refused an unannounced adapter played no policy
    (every decision a fallback marked ``adapter_refused``); the other seat's decisions are
    trained on nothing true about the opponent it faced. Before the fix they were kept."""
    store.add_requests([req("m1", trainable=(0,)), req("m2", trainable=(0,))])
    refused = [act(0, 0), act(1, 1), act(2, 0, rnd=2), act(3, 1, rnd=2)]
    for a in refused:
        if a.seat == 1:
            a.fallback = "adapter_refused"
    assert store.add_episode(record("m1", actions=refused))
    assert store.add_episode(record("m2"))
    for m in ("m1", "m2"):
        for turn in (0, 2):
            assert store.add_trace("alice", trace("alice", m, turn, 0))
    joined, counts = store.join(["m1", "m2"])
    assert [j.record.match for j in joined] == ["m2"]
    assert counts == {"adapter_refused": 1}
    assert [(d.turn, d.seat) for d in joined[0].decisions] == [(0, 0), (2, 0)]
