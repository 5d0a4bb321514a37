"""The runner's fault rules (docs/operations.md, "Faults"), one a test, without a broker.

``MatchLedger`` is told what arrived and what time it is, and asks for
matches through ``publish``: here a list, and a clock the test moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from backroom.bus.wire import SHUTTING_DOWN, EpisodeRecord, MatchRequest
from backroom.cli.run import demo_config, report
from backroom.runner.dispatch import AGAIN_TRIES, RERUNS, MatchLedger
from backroom.runner.results import Faults, RunResult, finished_on_disk


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ledger:
    """A ledger of ``n`` matches with what it published and said."""

    def __init__(self, n: int = 3, grace_s: float = 5.0, wait_s: float = 10.0) -> None:
        config = demo_config()
        self.clock = Clock()
        self.sent: list[MatchRequest] = []
        self.notices: list[str] = []
        self.faults = Faults()
        specs = [spec for _, spec in config.match_specs()][:n]
        self.requests = [
            MatchRequest(match=f"run.1.{i}", spec=spec, reply_to="runner")
            for i, spec in enumerate(specs)
        ]
        self.ledger = MatchLedger(
            [r.match for r in self.requests],
            self.sent.append,
            self.faults,
            self.notices.append,
            agents=["alice", "bob", "carol"],
            referee_grace_s=grace_s,
            episode_wait_s=wait_s,
            clock=self.clock,
            wall=self.clock,
        )

    def ask_all(self) -> None:
        for r in self.requests:
            self.ledger.ask(r)

    def names(self) -> list[str]:
        return [r.match for r in self.sent]

    def record(
        self, attempt: str, reason: str = "normal", detail: str = "", **kw: object
    ) -> EpisodeRecord:
        spec = self.requests[0].spec
        data = {
            "match": attempt,
            "run": "run",
            "referee": "ref-a",
            "spec": spec,
            "game": spec.game,
            "params": {},
            "seed": 0,
            "crn_group": None,
            "seats": spec.seats,
            "actions": [],
            "deliveries": [],
            "round_rewards": [],
            "raw_returns": [0.0] * len(spec.seats),
            "returns": [0.0] * len(spec.seats),
            "reason": reason,
            "detail": detail,
            "started_at": self.clock.now,
            "ended_at": self.clock.now,
            **kw,
        }
        return EpisodeRecord.model_validate(data)


def _running(t: Ledger, *referees: str) -> None:
    for r in referees:
        t.ledger.referee_online(r)


def test_a_match_is_asked_under_its_own_id_and_resent_until_acknowledged() -> None:
    t = Ledger(n=2)
    t.ask_all()
    assert t.names() == ["run.1.0", "run.1.1"]
    t.ledger.acknowledged("run.1.0")
    t.clock.now += 1.0
    assert t.ledger.resend(ack_timeout_s=2.0) == 0  # not yet
    t.clock.now += 1.5
    assert t.ledger.resend(ack_timeout_s=2.0) == 1
    assert t.names()[-1] == "run.1.1" and t.faults.resubmitted == 1


def test_a_lost_referee_s_unfinished_matches_are_asked_again_under_new_ids() -> None:
    t = Ledger()
    _running(t, "ref-a", "ref-b")
    t.ask_all()
    t.ledger.accepted("run.1.0", "ref-a")
    t.ledger.accepted("run.1.1", "ref-a")
    t.ledger.accepted("run.1.2", "ref-b")
    assert t.ledger.episode(t.record("run.1.1"))  # finished: not asked again
    again = t.ledger.lose("ref-a", "its process referee exited with -9")
    assert again == ["run.1.0"] and t.names()[-1] == "run.1.0.r1"
    assert t.faults.rerequest_reasons == {"referee lost": 1}
    assert t.faults.reruns == {"run.1.0.r1": "run.1.0"} and t.faults.referees_lost == ["ref-a"]
    assert t.notices[-1] == (
        "referee ref-a is gone (its process referee exited with -9); "
        "asked again for its 1 unfinished match"
    )
    assert t.ledger.lose("ref-a", "again") == [] and t.faults.referees_lost == ["ref-a"]
    assert t.ledger.live_referees == {"ref-b"}


def test_an_offline_referee_is_lost_only_after_its_grace_counted_while_connected() -> None:
    t = Ledger(grace_s=5.0)
    _running(t, "ref-a")
    t.ask_all()
    t.ledger.accepted("run.1.0", "ref-a")
    t.ledger.referee_offline("ref-a")
    t.clock.now += 4.0
    t.ledger.expire(connected=True)
    assert not t.faults.referees_lost
    t.clock.now += 3.0
    t.ledger.expire(connected=False)  # the runner itself is cut off: the grace starts over
    t.ledger.expire(connected=True)
    assert not t.faults.referees_lost
    t.clock.now += 4.0
    t.ledger.reconnected()  # back on the broker: starts over again
    t.clock.now += 4.9
    t.ledger.expire(connected=True)
    assert not t.faults.referees_lost
    t.clock.now += 0.1
    t.ledger.expire(connected=True)
    assert t.faults.referees_lost == ["ref-a"] and t.names()[-1] == "run.1.0.r1"
    assert "offline for 5s" in t.notices[-1]


def test_a_referee_back_online_within_its_grace_keeps_its_matches() -> None:
    t = Ledger()
    _running(t, "ref-a")
    t.ask_all()
    t.ledger.accepted("run.1.0", "ref-a")
    t.ledger.referee_offline("ref-a")
    t.clock.now += 3.0
    t.ledger.referee_online("ref-a")
    t.clock.now += 10.0
    t.ledger.expire(connected=True)
    assert not t.faults.referees_lost and t.ledger.owner == {"run.1.0": "ref-a"}


def test_the_retained_offline_of_a_referee_the_run_never_knew_is_ignored() -> None:
    t = Ledger()
    _running(t, "ref-a")
    t.ledger.referee_offline("someone-elses-referee")
    t.clock.now += 60.0
    t.ledger.expire(connected=True)
    assert not t.faults.referees_lost and t.ledger.live_referees == {"ref-a"}


def test_an_acknowledgement_that_trails_a_referee_s_death_is_asked_again() -> None:
    """Causality: the request went out before the referee was given up, so it may have taken
    it before it died; the match is asked for again, and the referee stays lost."""
    t = Ledger()
    _running(t, "ref-a", "ref-b")
    t.ask_all()
    t.clock.now += 1.0
    t.ledger.lose("ref-a", "offline for 5s")
    t.ledger.accepted("run.1.0", "ref-a")
    assert t.names()[-1] == "run.1.0.r1"
    assert t.faults.rerequest_reasons == {"accepted by a lost referee": 1}
    assert not t.faults.referees_revived and "ref-a" not in t.ledger.live_referees
    t.ledger.accepted("run.1.0", "ref-b")  # the old attempt: forgotten, owns nothing
    assert "run.1.0" not in t.ledger.owner


def test_a_lost_referee_that_takes_a_request_sent_after_it_was_lost_is_revived() -> None:
    """Causality: a request first sent after the referee was given up can only have been
    taken by a live referee; it owns the match, and counts again."""
    t = Ledger(n=2)
    _running(t, "ref-a", "ref-b")
    t.ledger.ask(t.requests[0])
    t.ledger.lose("ref-a", "offline for 5s")
    t.clock.now += 0.5
    t.ledger.ask(t.requests[1])
    t.ledger.accepted("run.1.1", "ref-a")
    assert t.faults.referees_revived == ["ref-a"] and t.ledger.owner == {"run.1.1": "ref-a"}
    assert t.ledger.live_referees == {"ref-a", "ref-b"} and not t.faults.rerequest_reasons
    assert t.notices[-1] == "referee ref-a is alive after all (it took run.1.1): counted on again"


def test_a_request_sent_in_the_same_instant_as_the_loss_does_not_revive() -> None:
    t = Ledger(n=1)
    _running(t, "ref-a", "ref-b")
    t.ledger.lose("ref-a", "offline for 5s")
    t.ledger.ask(t.requests[0])  # same clock reading: not provably after
    t.ledger.accepted("run.1.0", "ref-a")
    assert not t.faults.referees_revived and t.names()[-1] == "run.1.0.r1"


def test_the_first_episode_of_a_match_is_kept_under_any_of_its_ids() -> None:
    t = Ledger(n=1)
    _running(t, "ref-a", "ref-b")
    t.ask_all()
    t.ledger.accepted("run.1.0", "ref-a")
    t.ledger.lose("ref-a", "gone")
    assert t.ledger.episode(t.record("run.1.0.r1", referee="ref-b"))
    assert not t.ledger.episode(t.record("run.1.0"))  # the first referee finished it after all
    assert not t.ledger.episode(t.record("run.1.0.r1"))  # a redelivery
    assert t.faults.duplicates == 2 and t.ledger.done
    assert [e.match for e in t.ledger.result()] == ["run.1.0.r1"]
    assert not t.ledger.episode(t.record("other-run.7"))  # someone else's run
    assert t.faults.duplicates == 2


def test_a_match_voided_by_its_referee_stopping_is_asked_again_then_the_void_stands() -> None:
    t = Ledger(n=1)
    _running(t, "ref-a")
    t.ask_all()
    attempt = "run.1.0"
    for n in range(1, RERUNS + 1):
        assert not t.ledger.episode(t.record(attempt, "voided", SHUTTING_DOWN))
        attempt = f"run.1.0.r{n}"
        assert t.names()[-1] == attempt
    assert t.faults.rerequest_reasons == {"voided": RERUNS}
    assert t.ledger.episode(t.record(attempt, "voided", SHUTTING_DOWN))
    assert t.ledger.result()[0].reason == "voided"


def test_a_void_of_an_attempt_already_asked_again_asks_nothing() -> None:
    t = Ledger(n=1)
    _running(t, "ref-a")
    t.ask_all()
    t.ledger.ask_again("run.1.0", "referee lost")
    before = len(t.sent)
    assert not t.ledger.episode(t.record("run.1.0", "voided", SHUTTING_DOWN))
    assert len(t.sent) == before and t.faults.rerequest_reasons == {"referee lost": 1}


def test_a_referee_that_cannot_write_the_run_s_file_ends_the_run() -> None:
    t = Ledger(n=3)
    _running(t, "ref-a")
    t.ask_all()
    assert t.ledger.episode(
        t.record("run.1.1", "error", "episode not written to /x: OSError()", not_written=True)
    )
    assert t.ledger.done and t.ledger.unfinished == 2
    assert t.ledger.failure is not None and "could not write match run.1.1" in t.ledger.failure


def test_an_accepted_match_silent_too_long_is_asked_again_then_under_a_new_id() -> None:
    t = Ledger(n=1, wait_s=10.0)
    _running(t, "ref-a", "ref-b")
    t.ask_all()
    t.ledger.accepted("run.1.0", "ref-a")
    t.clock.now += 9.0
    t.ledger.ask_silent_again()
    assert t.faults.asked_again == 0
    t.clock.now += 1.0
    t.ledger.ask_silent_again()
    assert t.faults.asked_again == 1 and t.sent[-1].again and t.sent[-1].match == "run.1.0"
    t.ledger.running("run.1.0")  # its referee still plays it: the count starts over
    asks = AGAIN_TRIES * 2  # per live referee: an ask reaches one referee of the group
    for _ in range(asks):
        t.clock.now += 10.0
        t.ledger.ask_silent_again()
    assert t.faults.asked_again == 1 + asks and not t.faults.rerequest_reasons
    t.clock.now += 10.0
    t.ledger.ask_silent_again()
    assert t.faults.rerequest_reasons == {"no episode": 1} and t.names()[-1] == "run.1.0.r1"
    assert not t.sent[-1].again


def test_a_referee_that_forgot_a_finished_match_gets_it_asked_under_a_new_id_at_once() -> None:
    t = Ledger(n=1)
    _running(t, "ref-a")
    t.ask_all()
    t.ledger.forgotten("run.1.0")  # not accepted by it: nothing to do
    assert not t.faults.rerequest_reasons
    t.ledger.accepted("run.1.0", "ref-a")
    t.ledger.forgotten("run.1.0")
    assert t.faults.rerequest_reasons == {"no episode": 1} and t.names()[-1] == "run.1.0.r1"


def test_the_time_without_a_referee_is_measured_from_the_first_look() -> None:
    t = Ledger()
    assert t.ledger.without_referee() == 0.0
    t.clock.now += 7.0
    assert t.ledger.without_referee() == 7.0
    _running(t, "ref-a")
    assert t.ledger.without_referee() is None
    t.ledger.lose("ref-a", "gone")
    assert t.ledger.without_referee() == 0.0


def test_an_agent_that_goes_offline_mid_run_is_told_and_counted_at_the_end() -> None:
    t = Ledger(n=2)
    t.ask_all()
    t.ledger.agent_status("alice", online=False)  # before play: not a departure
    assert not t.faults.departures
    t.ledger.playing = True
    t.ledger.agent_status("mallory", online=False)  # not the run's agent
    t.ledger.agent_status("carol", online=False)
    t.ledger.agent_status("carol", online=False)  # said once
    assert len(t.faults.departures) == 1 and "agent carol went offline" in t.notices[-1]
    gone = t.clock.now
    seats = t.requests[0].spec.seats
    t.clock.now += 1.0
    t.ledger.episode(t.record("run.1.0", "timeout", timeouts=[seats.index("carol")]))
    t.ledger.agent_status("carol", online=True)
    assert "agent carol is back online" in t.notices[-1]
    t.clock.now += 1.0
    t.ledger.episode(t.record("run.1.1", "timeout", timeouts=[seats.index("carol")]))
    (departure,) = t.faults.departures
    assert departure.at == gone and departure.back_at == gone + 1.0
    t.ledger.result()
    assert departure.defaulted == 1 and t.notices[-1].endswith(
        "(its seats got defaults in 1 match)"
    )


def test_a_stopped_run_counts_the_matches_its_file_holds_that_never_reached_it(
    tmp_path: Path,
) -> None:
    """Ctrl-C: a referee writes a record, then publishes it, so the file may hold finished
    matches whose episode was still on its way (the summary said 4 with 5 in the file).
    ``finished_on_disk`` adds those, each match once, under any of its ids; a void of a
    referee stopping is no result; a match the runner has is not added twice; a torn line,
    a line of no episode and a run's other lines are passed over."""
    t = Ledger(n=3)
    kept = [t.record("run.1.0")]
    on_disk = [
        t.record("run.1.0"),  # the runner has it
        t.record("run.1.1", "voided", SHUTTING_DOWN),  # stopped with the referees: no result
        t.record("run.1.2.r1", "normal", seed=7),  # a rerun id, finished, never arrived
        t.record("run.1.2", "normal", seed=8),  # a later record of the same match
        t.record("run.1.1.r1", "voided", "agent alice went away"),  # a void that stands
    ]
    path = tmp_path / "episodes.jsonl"
    lines = [r.model_dump_json().encode() + b"\n" for r in on_disk]
    path.write_bytes(
        lines[0] + b'{"not": "an episode"}\n' + b"".join(lines[1:]) + b'{"match": "run.1.'
    )
    reruns = {"run.1.2.r1": "run.1.2", "run.1.1.r1": "run.1.1"}
    late = finished_on_disk(path, kept, reruns)
    assert [(r.match, r.seed) for r in late] == [("run.1.2.r1", 7), ("run.1.1.r1", 0)]
    assert late[1].reason == "voided"
    assert finished_on_disk(tmp_path / "none.jsonl", kept, reruns) == []


def test_a_stopped_run_says_how_many_of_its_matches_were_read_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``backroom run`` prints after a Ctrl-C: the matches finished, those read back
    from the file among them, and exit 130; nothing said of a read-back when there was none."""
    t = Ledger(n=3)
    episodes = [t.record("run.1.0"), t.record("run.1.1")]
    for late, said in ((1, "(1 of them read back from episodes.jsonl"), (0, None)):
        faults = Faults(interrupted=True, read_back=late)
        result = RunResult(demo_config(), episodes, 1.0, tmp_path, "mqtt://x", 1.0, faults)
        with pytest.raises(typer.Exit) as stop:
            report(result, None)
        assert stop.value.exit_code == 130
        out = " ".join(capsys.readouterr().out.split())
        assert "interrupted: Ctrl-C after 2 of 200 matches; everything above is of those 2" in out
        assert (said in out) if said else "read back" not in out
