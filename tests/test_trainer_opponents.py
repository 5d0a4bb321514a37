"""Opponent pools, PFSP weighting and the league hand-off, as the trainer plans and records them.

Pure functions of the config, the step and the records (no broker): the
training runs over a real broker are in tests/test_trainer_cotrain.py.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.bus.wire import AdapterRef
from backroom.model.adapters import AdapterRejected
from backroom.runner.config import ConfigError
from backroom.trainer.config import PfspSpec, parse_train_config
from backroom.trainer.entrants import entrant_due, send_entrant
from backroom.trainer.opponents import (
    Opponent,
    Records,
    draw,
    pfsp_weights,
    resolve_pool,
    with_current,
)
from backroom.trainer.rollouts import plan_evaluation, plan_step
from backroom.trainer.store import Request, Store

from .test_trainer_store import record, spec


def ref(version: str, policy: str = "p") -> AdapterRef:
    return AdapterRef(
        policy=policy, version=version, uri=f"/adapters/{version}", sha256="0" * 64, size=1
    )


def data(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run": "r",
        "game": "ipd",
        "params": {"rounds": 3},
        "algorithm": "grpo",
        "preset": "ipd",
        "hyper": {"batch_size": 16, "group_size": 2},
        "players": ["alice", "bob"],
        "policy": "p",
    }
    base.update(extra)
    return base


def test_pfsp_weights_follow_alphastar() -> None:
    hard = pfsp_weights([0.0, 0.5, 1.0, 0.8], PfspSpec(weighting="hard", exponent=2))
    assert hard == pytest.approx([1.0, 0.25, 0.0, 0.04])
    var = pfsp_weights([0.0, 0.5, 0.9], PfspSpec(weighting="variance"))
    assert var == pytest.approx([0.0, 0.25, 0.09])


def test_records_count_wins_ties_half_and_ignore_self_play() -> None:
    r = Records()
    r.add("tft", (0,), [3.0, 1.0])  # won
    r.add("tft", (1,), [3.0, 1.0])  # lost (the learner sat in seat 1)
    r.add("tft", (0,), [2.0, 2.0])  # tie
    r.add("self-play", (0, 1), [5.0, 0.0])  # says nothing about an opponent
    assert r.matches == {"tft": 3} and r.wins == {"tft": 1.5}
    assert r.win_rate("tft") == pytest.approx((1.5 + 1) / (3 + 2))
    assert r.win_rate("never-met") == 0.5  # the Beta(1, 1) prior


def test_pfsp_draws_those_that_beat_the_learner_uniform_does_not() -> None:
    config = parse_train_config(data(buffer={"sample": "pfsp"}))
    uniform = parse_train_config(data())
    r = Records()
    for _ in range(20):
        r.add("strong", (0,), [0.0, 5.0])
        r.add("weak", (0,), [5.0, 0.0])
    labels = ["strong", "weak"]
    picks = Counter(draw(random.Random(i), labels, labels, config, r) for i in range(2000))
    # hard weights: (1 - 1/22)^2 against (1/22)^2, about 437 to 1
    assert picks["strong"] > 1980
    flat = Counter(draw(random.Random(i), labels, labels, uniform, r) for i in range(2000))
    assert 900 < flat["strong"] < 1100
    # the same seed draws the same opponent
    assert draw(random.Random(5), labels, labels, config, r) == draw(
        random.Random(5), labels, labels, config, r
    )


def test_pfsp_buffer_step_plans_against_the_version_the_learner_loses_to() -> None:
    config = parse_train_config(
        data(
            algorithm="adalign",
            hyper={"batch_size": 64, "group_size": 2, "rho": 1.0},
            buffer={"sample": "pfsp"},
        )
    )
    r = Records()
    for _ in range(30):
        r.add("buffer v1", (0,), [0.0, 5.0])
        r.add("buffer v2", (1,), [0.0, 5.0])  # the learner, seat 1, won
    plan = plan_step(config, 4, ref("v4"), [ref("v1"), ref("v2")], records=r)
    labels = Counter(req.label for req in plan)
    assert labels["buffer v1"] > 56 and labels["buffer v1"] + labels["buffer v2"] == 64
    # without records (uniform, the default) the same plan as before pfsp existed
    plain = plan_step(config, 4, ref("v4"), [ref("v1"), ref("v2")])
    assert 16 < Counter(q.label for q in plain)["buffer v1"] < 48


def test_a_pool_seats_its_members_and_trains_only_the_learner() -> None:
    config = parse_train_config(
        data(opponents=[{"agent": {"id": "coop", "kind": "always", "options": {"action": "A"}}}])
    )
    frozen = Opponent("frozen q v3", ref=ref("v3", "q"))
    pool = [Opponent("agent coop", agent="coop"), frozen]
    plan = plan_step(config, 2, ref("v2"), [ref("v1")], pool)
    assert plan == plan_step(config, 2, ref("v2"), [ref("v1")], pool)  # a function of its input
    assert {q.label for q in plan} == {"agent coop", "frozen q v3"}
    for q in plan:
        mine = q.trainable[0]
        assert len(q.trainable) == 1 and q.spec.adapters[mine] == ref("v2")
        assert q.spec.seats[mine] == ["alice", "bob"][mine]  # the learner's own player
        other = 1 - mine
        if q.label == "agent coop":
            assert q.spec.seats[other] == "coop" and q.spec.adapters[other] is None
        else:  # the learner's other player plays the frozen version
            assert q.spec.seats[other] == ["alice", "bob"][other]
            assert q.spec.adapters[other] == ref("v3", "q")
    assert {q.trainable for q in plan} == {(0,), (1,)}  # the learner takes both seats in turn
    evaluation = plan_evaluation(config, 2, ref("v2"), pool)
    assert {q.label for q in evaluation} == {"self", "agent-coop", "frozen-q-v3"}
    assert all(q.trainable == () for q in evaluation)


def test_a_live_member_plays_the_current_checkpoint_of_its_policy() -> None:
    pool = [Opponent("policy other", live="other"), Opponent("agent coop", agent="coop")]
    now = with_current(pool, {"other": ref("v7", "other")})
    assert now[0].ref == ref("v7", "other") and now[1] == pool[1]


def test_opponent_config_errors_name_the_field() -> None:
    coop = {"id": "coop", "kind": "always"}
    for bad, words in (
        ({"opponents": [{}]}, "exactly one of agent"),
        ({"opponents": [{"agent": coop, "policy": "x", "run": "d"}]}, "exactly one"),
        ({"opponents": [{"versions": ["v1"], "policy": "x"}]}, "versions: only with run"),
        ({"opponents": [{"agent": {"id": "alice", "kind": "always"}}]}, "used twice"),
        ({"opponents": [{"agent": coop}, {"agent": coop}]}, "used twice"),
        ({"opponents": [{"policy": "p"}]}, "this run's own policy"),
        ({"opponents": [{"run": "d", "policy": "p"}]}, "this run's own policy"),
        ({"opponents": [{"run": "frozen-x"}], "policy": "frozen-frozen-x"}, "own policy"),
        ({"opponents": [{"run": "a/x"}, {"run": "b/x"}]}, r"announced as \['frozen-x'\]"),
        ({"opponents": [{"agent": {"id": "c", "kind": "nope"}}]}, "unknown agent kind"),
        ({"buffer": {"sample": "best"}}, "buffer.sample"),
        ({"buffer": {"pfsp": {"exponent": 0}}}, "buffer.pfsp.exponent"),
        ({"league": {"every": 5}}, "league.dir"),
        ({"league": {"dir": "l", "every": 0}}, "league.every"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse_train_config(data(**bad))
    live = data(opponents=[{"policy": "other"}])
    del live["run"]
    with pytest.raises(ConfigError, match="own run name"):
        parse_train_config(live)


def fake_adapter(folder: Path, text: str) -> None:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(text.encode())


def test_frozen_run_versions_resolve_with_digests_under_their_own_policy(tmp_path: Path) -> None:
    run = tmp_path / "ipd adalign"
    for v in ("v0", "v2", "v10"):
        fake_adapter(run / "adapters" / v, v)
    last = parse_train_config(data(opponents=[{"run": str(run)}]))
    (member,) = resolve_pool(last)
    assert member.ref is not None and member.ref.version == "v10"  # by number, not by text
    assert member.ref.policy == "frozen-ipd-adalign" and member.agent is None
    named = parse_train_config(
        data(opponents=[{"run": str(run), "versions": ["v0", "v2"], "policy": "aa"}])
    )
    pool = resolve_pool(named)
    assert [o.label for o in pool] == ["frozen aa v0", "frozen aa v2"]
    assert pool[0].ref is not None and pool[1].ref is not None
    assert pool[0].ref.sha256 != pool[1].ref.sha256
    # refused when the config is read, naming the field
    with pytest.raises(ConfigError, match=r"opponents\[0\]\.versions: \['v3'\]"):
        parse_train_config(data(opponents=[{"run": str(run), "versions": ["v3"]}]))
    with pytest.raises(ConfigError, match=r"opponents\[0\]\.run: .* holds no adapters"):
        parse_train_config(data(opponents=[{"run": str(tmp_path / "none")}]))
    (run / "adapters" / "v11").mkdir()  # a version folder without its files (a torn copy)
    with pytest.raises(ConfigError, match=r"opponents\[0\]\.run: .*v11 lacks adapter_"):
        parse_train_config(data(opponents=[{"run": str(run)}]))
    # and if the files go after that, when the run starts
    (run / "adapters" / "v11").rmdir()
    (run / "adapters" / "v10" / "adapter_config.json").unlink()
    with pytest.raises(AdapterRejected, match="missing_files"):
        resolve_pool(last)


def test_records_rebuilt_from_the_store_count_only_used_matches(tmp_path: Path) -> None:
    with Store(tmp_path / "store.sqlite") as store:
        requests = [
            Request("m0", 0, "g0", "train", spec(), (0,), "agent coop"),
            Request("m1", 0, "g0", "train", spec(), (1,), "agent coop"),
            Request("m2", 1, "g1", "train", spec(), (0,), "agent coop"),  # step 1: not yet used
            Request("m3", 0, "g0", "train", spec(), (0, 1), "self-play"),
        ]
        store.add_requests(requests)
        for match, returns in (
            ("m0", (5.0, 0.0)),
            ("m1", (5.0, 0.0)),
            ("m2", (5.0, 0.0)),
            ("m3", (1.0, 1.0)),
        ):
            store.add_episode(record(match, returns=returns))
        store.log_step(0, "v1", {}, ["m0", "m1", "m3"])
        r = Records.from_store(store, before_step=1)
    assert r.matches == {"agent coop": 2} and r.wins == {"agent coop": 1.0}


def test_every_nth_checkpoint_becomes_a_league_entrant_file(tmp_path: Path) -> None:
    league = tmp_path / "league"
    config = parse_train_config(data(league={"dir": str(league), "every": 2, "name": "grpo"}))
    assert [s for s in range(6) if entrant_due(config, s)] == [1, 3, 5]  # v2, v4, v6
    assert not entrant_due(parse_train_config(data()), 1)
    run_dir = tmp_path / "run"
    fake_adapter(run_dir / "adapters" / "v2", "x")
    path = send_entrant(config, run_dir, 1, ref("v2"))
    assert path == league / "entrants.d" / "grpo.v2.yaml"
    assert [p.name for p in path.parent.iterdir()] == ["grpo.v2.yaml"]  # no temporary left
    entrant = yaml.safe_load(path.read_text())
    # a checkpoint and nothing else (no agent entry: the league seats it as its `model:` plays)
    assert entrant == {
        "format": 2,
        "name": "grpo.v2",
        "policy": "p",
        "version": "v2",
        "adapter": str((run_dir / "adapters" / "v2").resolve()),
        "sha256": "0" * 64,
        "size": 1,
        "step": 1,
    }


def test_backroom_train_starts_the_pools_agents() -> None:
    from backroom.trainer.launch import agent_entries

    config = parse_train_config(
        data(
            opponents=[
                {"agent": {"id": "coop", "kind": "always", "options": {"action": "A"}}},
                {"policy": "other"},
            ]
        )
    )
    entries = agent_entries(config)
    assert [e["id"] for e in entries] == ["alice", "bob", "coop"]
    assert entries[-1] == {"id": "coop", "kind": "always", "options": {"action": "A"}}
