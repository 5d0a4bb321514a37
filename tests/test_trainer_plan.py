"""What a step asks for, and what a resumed run finds in its run directory.

Pure functions of the config, the step and the buffer (``trainer.rollouts``),
and the run directory's files that a SIGKILL can leave one step apart
(``trainer.loop``): the CSV log, the evaluations, the optimizer state.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from backroom.bus.wire import AdapterRef
from backroom.trainer.config import parse_train_config
from backroom.trainer.loop import TrainLog, evaluated_steps, evaluation_due, optimizer_path
from backroom.trainer.rollouts import AgentBuffer, plan_evaluation, plan_step


def ref(version: str) -> AdapterRef:
    return AdapterRef(
        policy="p", version=version, uri=f"/adapters/{version}", sha256="0" * 64, size=1
    )


def config(algorithm: str = "adalign", **hyper: object):  # type: ignore[no-untyped-def]
    return parse_train_config(
        {
            "game": "ipd",
            "params": {"rounds": 3},
            "algorithm": algorithm,
            "preset": "ipd",
            "hyper": {"batch_size": 64, "group_size": 4, **hyper},
            "players": ["alice", "bob"],
            "evaluation": {
                "matches": 3,
                "baselines": [
                    {"id": "always-b", "kind": "always", "options": {"action": "B"}},
                    {"id": "tft", "kind": "tit-for-tat"},
                ],
            },
        }
    )


def test_crn_groups_share_one_seed_and_groups_differ() -> None:
    plan = plan_step(config(), step=3, current=ref("v3"), buffer=[])
    assert len(plan) == 64
    groups: dict[str, set[int]] = {}
    for r in plan:
        groups.setdefault(r.group, set()).add(r.spec.seed)
    assert len(groups) == 16
    assert all(len(seeds) == 1 for seeds in groups.values())  # chance identical inside a group
    assert len({next(iter(s)) for s in groups.values()}) == 16  # and different across groups
    assert len({r.match for r in plan}) == 64
    # no buffer yet: every match is self-play with the current adapter, both seats trained
    assert {(r.label, r.trainable) for r in plan} == {("self-play", (0, 1))}
    assert all(r.spec.adapters == [ref("v3"), ref("v3")] for r in plan)


def test_buffer_opponents_come_with_probability_rho_and_play_whole_groups() -> None:
    buffer = [ref("v0"), ref("v1"), ref("v2")]
    groups: dict[str, set[str]] = {}
    for step in range(8):
        for r in plan_step(config(), step=step, current=ref("v9"), buffer=buffer):
            groups.setdefault(r.group, set()).add(r.label)
            if r.label.startswith("buffer"):
                (mine,) = r.trainable  # only the current adapter's seat learns
                assert r.spec.adapters[mine] == ref("v9")
                assert r.spec.adapters[1 - mine] in buffer
                assert r.label == f"buffer {r.spec.adapters[1 - mine].version}"  # type: ignore[union-attr]
            else:
                assert r.trainable == (0, 1)
    assert all(len(labels) == 1 for labels in groups.values())  # a group never mixes opponents
    share = sum(next(iter(v)).startswith("buffer") for v in groups.values()) / len(groups)
    assert 0.3 < share < 0.7  # rho = 0.5 over 128 groups


def test_grpo_uses_no_buffer_unless_asked() -> None:
    buffer = [ref("v0")]
    grpo = plan_step(config("grpo"), step=1, current=ref("v1"), buffer=buffer)
    assert config("grpo").hp.rho == 0.0  # type: ignore[union-attr]
    assert all(r.label == "self-play" for r in grpo)
    asked = plan_step(config("grpo", rho=1.0), step=1, current=ref("v1"), buffer=buffer)
    assert all(r.label == "buffer v0" for r in asked)


def test_the_plan_is_a_function_of_config_step_and_buffer() -> None:
    buffer = [ref("v0"), ref("v1")]
    a = plan_step(config(), 5, ref("v5"), buffer)
    b = plan_step(config(), 5, ref("v5"), buffer)
    assert [(r.match, r.spec, r.trainable) for r in a] == [
        (r.match, r.spec, r.trainable) for r in b
    ]
    other = plan_step(config(), 6, ref("v5"), buffer)
    assert {r.spec.seed for r in a}.isdisjoint({r.spec.seed for r in other})


def test_buffer_keeps_every_nth_and_drops_the_oldest() -> None:
    buf = AgentBuffer(every=2, size=2)
    gone = [r.version for step in range(7) for r in buf.offer(step, ref(f"v{step}"))]
    assert [r.version for r in buf.refs] == ["v4", "v6"]
    assert gone == ["v0", "v2"]  # what the trainer retracts (TrainerBus.retract)


def test_evaluation_plays_each_baseline_and_itself_on_seat_0() -> None:
    plan = plan_evaluation(config(), step=4, current=ref("v5"))
    by_label = Counter(r.label for r in plan)
    assert by_label == {"always-b": 3, "tft": 3, "self": 3}
    assert all(r.trainable == () and r.spec.adapters[0] == ref("v5") for r in plan)
    assert {r.spec.seats[1] for r in plan if r.label == "self"} == {"bob"}
    assert evaluation_due(config(), 4) and not evaluation_due(config(), 3)


def test_train_log_catches_up_the_rows_a_kill_cost_it(tmp_path: Path) -> None:
    log = TrainLog(tmp_path / "train_log.csv")
    log.append({"step": 0, "version": "v1", "loss": 0.5})
    # the store logged steps 0 and 1; the kill came before step 1's row
    stored = [(0, "v1", {"step": 0, "loss": 0.5}), (1, "v2", {"step": 1, "loss": 0.25})]
    assert log.catch_up(stored) == 1
    assert log.catch_up(stored) == 0  # nothing twice
    lines = (tmp_path / "train_log.csv").read_text().splitlines()
    assert lines == ["step,version,loss", "0,v1,0.5", "1,v2,0.25"]


def test_evaluated_steps_skip_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "evaluations.jsonl"
    path.write_text(json.dumps({"step": 4}) + "\n" + '{"step": 9, "aga')
    assert evaluated_steps(tmp_path) == {4}


def test_optimizer_state_is_kept_per_version(tmp_path: Path) -> None:
    # resume loads the moments of the last *logged* version, not of a step saved but never logged
    assert optimizer_path(tmp_path, "v3") != optimizer_path(tmp_path, "v4")
    assert optimizer_path(tmp_path, "v3").name == "v3.pt"


@pytest.mark.parametrize("bad", [{"batch_size": 6, "group_size": 4}, {"rho": 2}])
def test_bad_hyperparameters_name_the_field(bad: dict[str, object]) -> None:
    from backroom.runner.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=r"batch_size|rho"):
        config(**bad)
