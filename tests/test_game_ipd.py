"""IPD engine: the paper's payoffs, hidden framing, stochastic ending, baselines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from backroom.agents import make_agent
from backroom.agents.base import JSON, Agent
from backroom.bus.wire import Turn
from backroom.games import CHANCE, IllegalActionError, make_game

from .gameplay import play

ROOT = Path(__file__).resolve().parents[1]


def moves(state) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return list(state.moves)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("A", "A", [3.0, 3.0]),
        ("A", "B", [0.0, 5.0]),
        ("B", "A", [5.0, 0.0]),
        ("B", "B", [1.0, 1.0]),
    ],
)
def test_payoff_matrix(a: str, b: str, expected: list[float]) -> None:
    state = make_game("ipd", rounds=3).new_initial_state(0)
    state.apply({0: a, 1: b})
    assert state.round_rewards == [expected]
    assert not state.is_terminal()


def test_answers_in_tags_are_accepted_and_anything_else_refused() -> None:
    state = make_game("ipd").new_initial_state(0)
    assert state.check_action(0, "<A>") == "A"
    assert state.check_action(1, " b ") == "B"
    for bad in ("C", "cooperate", 0, None, "AB"):
        with pytest.raises(IllegalActionError):
            state.check_action(0, bad)
    assert state.default_action(0) == "B"


def test_game_lasts_rounds_and_returns_sum_rewards() -> None:
    state = make_game("ipd", rounds=4).new_initial_state(0)
    for a, b in [("A", "A"), ("A", "B"), ("B", "B"), ("B", "A")]:
        assert state.current_players() == {0, 1}
        state.apply({0: a, 1: b})
    assert state.is_terminal()
    assert state.current_players() == frozenset()
    assert state.returns() == [3 + 0 + 1 + 5, 3 + 5 + 1 + 0]


def test_other_move_revealed_after_the_round_only() -> None:
    state = make_game("ipd").new_initial_state(0)
    assert state.observation(0)["last_opponent_move"] is None
    assert "Last round" not in state.prompt(0)
    state.apply({0: "A", 1: "B"})
    assert state.observation(0)["last_opponent_move"] == "B"
    assert state.observation(1)["last_opponent_move"] == "A"
    assert state.prompt(0).endswith("Last round, the other agent played <B>.")
    assert state.observation(0)["info_state"] == "AB"
    assert state.observation(1)["info_state"] == "BA"


def test_prompt_never_names_the_dilemma() -> None:
    state = make_game("ipd", rounds=2).new_initial_state(0)
    texts = [state.prompt(0)]
    state.apply({0: "A", 1: "B"})
    texts.append(state.prompt(1))
    state.apply({0: "B", 1: "B"})
    texts.append(state.prompt(0))
    for text in texts:
        assert not re.search(r"cooperat|defect|prisoner", text, re.I), text
    assert 'you must write "<A>"' in texts[0] and "both receive 3 points" in texts[0]


def test_tit_for_tat_against_always_b_loses_only_the_first_round() -> None:
    state = play(
        make_game("ipd"), [make_agent("tit-for-tat", "tft"), make_agent("always", "b", action="B")]
    )
    assert state.round_rewards[0] == [0.0, 5.0]
    assert all(r == [1.0, 1.0] for r in state.round_rewards[1:])
    assert len(state.round_rewards) == 10
    assert state.returns() == [9.0, 14.0]


def test_grim_trigger_and_tit_for_tat_cooperate_throughout() -> None:
    state = play(
        make_game("ipd"), [make_agent("grim-trigger", "g"), make_agent("tit-for-tat", "t")]
    )
    assert moves(state) == [("A", "A")] * 10
    assert state.returns() == [30.0, 30.0]


class DefectOnce(Agent):
    """A, except B in round 3: separates grim trigger (never forgives) from tit-for-tat."""

    async def act(self, turn: Turn) -> JSON:
        return "B" if turn.observation["round"] == 3 else "A"


def test_grim_trigger_never_forgives_while_tit_for_tat_does() -> None:
    grim = play(make_game("ipd", rounds=8), [make_agent("grim-trigger", "g"), DefectOnce("d")])
    assert [m[0] for m in moves(grim)] == ["A"] * 3 + ["B"] * 5
    tft = play(make_game("ipd", rounds=8), [make_agent("tit-for-tat", "t"), DefectOnce("d")])
    assert [m[0] for m in moves(tft)] == ["A"] * 3 + ["B"] + ["A"] * 4


def test_always_agent_plays_a_and_b() -> None:
    state = play(
        make_game("ipd", rounds=3),
        [make_agent("always", "a", action="A"), make_agent("always", "b", action="B")],
    )
    assert moves(state) == [("A", "B")] * 3


def test_continuation_is_an_explicit_chance_node() -> None:
    game = make_game("ipd", rounds=5, continuation=0.75)
    state = game.new_initial_state(None)
    state.apply({0: "A", 1: "A"})
    assert state.current_players() == {CHANCE}
    assert state.chance_outcomes() == [(True, 0.75), (False, 0.25)]
    state.apply({CHANCE: True})
    state.apply({0: "A", 1: "B"})
    state.apply({CHANCE: False})
    assert state.is_terminal() and len(state.round_rewards) == 2
    json.dumps(state.observation(0))


def test_stochastic_ending_is_seeded_and_geometric() -> None:
    game = make_game("ipd", rounds=50, continuation=0.5)

    def length(seed: int) -> int:
        state = game.new_initial_state(seed)
        while not state.is_terminal():
            state.apply({0: "A", 1: "A"})
        return len(state.round_rewards)

    lengths = [length(s) for s in range(400)]
    assert lengths == [length(s) for s in range(400)]  # same seed, same ending
    assert len(set(lengths)) > 3
    assert 1.7 < sum(lengths) / len(lengths) < 2.3  # mean 1 / (1 - 0.5)


def test_params_round_trip_and_prompt_overrides() -> None:
    game = make_game("ipd", rounds=7, continuation=0.9, prompts={"intro": "Play {reward} or else."})
    again = make_game("ipd", **game.params())
    assert again.params() == game.params()
    assert again.new_initial_state(1).prompt(0) == "Play 3 or else."
    with pytest.raises(ValueError):
        make_game("ipd", prompts={"nope": "x"})
    with pytest.raises(ValueError):
        make_game("ipd", rounds=0)


TFT_P_A = {"first": 1.0, "AA": 1.0, "AB": 0.0, "BA": 1.0, "BB": 0.0}


def test_a_memory_one_policy_of_certainties_plays_as_the_scripted_kind_it_equals() -> None:
    """Ones and zeros leave nothing to chance: tit-for-tat's table is tit-for-tat."""
    game = make_game("ipd", rounds=8)
    table = play(game, [make_agent("memory-one", "m", p_a=TFT_P_A), DefectOnce("d")])
    tft = play(game, [make_agent("tit-for-tat", "t"), DefectOnce("d")])
    assert moves(table) == moves(tft) and moves(table)[3] == ("B", "A")
    never = {state: 0.0 for state in TFT_P_A}
    assert {
        m[0] for m in moves(play(game, [make_agent("memory-one", "n", p_a=never), DefectOnce("d")]))
    } == {"B"}


def test_a_mixed_memory_one_policy_draws_its_probabilities_from_the_match_seed() -> None:
    p_a = {"first": 0.3, "AA": 0.3, "AB": 0.3, "BA": 0.3, "BB": 0.3}

    def first_moves(seed: int) -> list[str]:
        agents = [make_agent("memory-one", "m", p_a=p_a), make_agent("always", "a", action="A")]
        return [m[0] for m in moves(play(make_game("ipd", rounds=10), agents, seed=seed))]

    played = [first_moves(seed) for seed in range(200)]
    assert played == [first_moves(seed) for seed in range(200)]  # same seed, same moves
    assert len({tuple(m) for m in played}) > 150  # different seeds, different draws
    share = sum(m.count("A") for m in played) / 2000
    assert 0.25 < share < 0.35  # 2,000 draws of P(A) 0.3: five standard errors either side


def test_a_memory_one_training_run_is_played_as_its_final_policy(tmp_path: Path) -> None:
    from backroom.trainer.config import parse_train_config
    from backroom.trainer.memory_one import run

    data = yaml.safe_load((ROOT / "examples" / "ipd_memory_one.yaml").read_text())
    result = run(parse_train_config({**data, "steps": 20}), tmp_path / "m1")
    agent = make_agent("memory-one", "frozen", run=str(tmp_path / "m1"))
    assert agent.p_a == result.p_a  # type: ignore[attr-defined]
    assert 0.0 < min(result.p_a.values()) < max(result.p_a.values()) < 1.0


def test_a_memory_one_policy_that_is_not_one_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of run=DIR"):
        make_agent("memory-one", "m")
    with pytest.raises(ValueError, match="exactly one of run=DIR"):
        make_agent("memory-one", "m", run=str(tmp_path), p_a=TFT_P_A)
    with pytest.raises(
        ValueError, match=r"memory_one.json .*backroom train examples/ipd_memory_one"
    ):
        make_agent("memory-one", "m", run=str(tmp_path / "none"))
    (tmp_path / "memory_one.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a final policy"):
        make_agent("memory-one", "m", run=str(tmp_path))
    with pytest.raises(ValueError, match=r"exactly the states .*got \['AA', 'first'\]"):
        make_agent("memory-one", "m", p_a={"first": 1.0, "AA": 1.0})
    with pytest.raises(ValueError, match=r"p_a\['BB'\] = 1.5 is not in \[0, 1\]"):
        make_agent("memory-one", "m", p_a={**TFT_P_A, "BB": 1.5})
    with pytest.raises(ValueError, match=r"p_a\['AB'\] is not a number: 'x'"):
        make_agent("memory-one", "m", p_a={**TFT_P_A, "AB": "x"})
