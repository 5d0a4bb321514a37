"""Beauty contest: winners, the three reward rules with ties, discussion order, prompts."""

from __future__ import annotations

import json

import pytest

from backroom.agents import make_agent
from backroom.agents.base import JSON, Agent
from backroom.bus.wire import Turn
from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games.beauty_contest import rewards_for, winners_of

from .gameplay import play


def test_winner_is_closest_to_two_thirds_of_the_mean() -> None:
    assert winners_of([0, 10, 20, 30]) == [1]  # mean 15, target 10
    assert winners_of([50, 50, 50]) == [0, 1, 2]  # target 33.3: all equally far
    assert winners_of([10, 10, 40]) == [0, 1]  # target 13.3
    assert winners_of([9, 11, 25]) == [0, 1]  # target exactly 10: both sides tie
    assert winners_of([0, 100]) == [0]  # target 33.3


@pytest.mark.parametrize(
    ("rule", "lone", "tied"),
    [
        ("exclusive", [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
        ("independent", [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0]),
        ("amplified", [0.0, 1.0, 0.0, 0.0], [2.0, 2.0, 0.0]),
    ],
)
def test_reward_rules_with_and_without_ties(
    rule: str, lone: list[float], tied: list[float]
) -> None:
    assert rewards_for(4, winners_of([0, 10, 20, 30]), rule) == lone
    assert rewards_for(3, winners_of([10, 10, 40]), rule) == tied
    state = make_game("beauty_contest", players=3, rule=rule, discussion=False).new_initial_state(0)
    assert state.phase == "act" and state.current_players() == {0, 1, 2}
    state.apply({0: 10, 1: 10, 2: 40})
    assert state.is_terminal() and state.returns() == tied
    assert (
        rewards_for(24, list(range(24)), rule)
        == [{"exclusive": 0.0, "independent": 1.0, "amplified": 24.0}[rule]] * 24
    )


def test_discussion_order_two_turns_and_visible_messages() -> None:
    state = make_game("beauty_contest", players=4).new_initial_state(7)
    speakers = []
    while state.phase == "talk":
        (p,) = state.current_players()
        obs = state.observation(p)
        assert [
            m["player"] for m in obs["messages"]
        ] == speakers  # everything said so far is visible
        if speakers:
            assert f"Player {speakers[-1] + 1}: I am {speakers[-1]}" in state.prompt(p)
        state.apply({p: f"I am {p}"})
        speakers.append(p)
    order = state.observation(0)["order"]
    assert sorted(order) == [0, 1, 2, 3]
    assert speakers == order + order  # two turns, same random order
    assert state.current_players() == {0, 1, 2, 3} and state.phase == "act"
    assert "This is a record of your previous discussions" in state.prompt(2)


def test_order_is_seeded_chance() -> None:
    game = make_game("beauty_contest", players=6)
    orders = [game.new_initial_state(s).order for s in range(8)]
    assert orders == [game.new_initial_state(s).order for s in range(8)]
    assert len({tuple(o) for o in orders}) > 1
    state = game.new_initial_state(None)
    assert state.current_players() == {CHANCE}
    assert state.chance_outcomes() == [(p, pytest.approx(1 / 6)) for p in range(6)]
    for p in (3, 1, 0, 5, 4):
        state.apply({CHANCE: p})
    assert state.chance_outcomes() == [(2, 1.0)]
    with pytest.raises(IllegalActionError):
        state.apply({CHANCE: 3})
    state.apply({CHANCE: 2})
    assert state.phase == "talk" and state.current_players() == {3}


def test_checks_and_defaults() -> None:
    state = make_game("beauty_contest", players=3, max_chars=20).new_initial_state(0)
    (p,) = state.current_players()
    assert state.action_spec(p).to_json() == {"schema": {"type": "string", "maxLength": 20}}
    with pytest.raises(IllegalActionError):
        state.check_action(p, "x" * 21)
    assert state.check_action(p, None) == "" and state.default_action(p) == ""
    while state.phase == "talk":
        state.apply({next(iter(state.current_players())): ""})
    assert state.check_action(0, "33\nbecause 2/3 of 50") == 33
    assert state.check_action(0, 0) == 0 and state.check_action(0, 100.0) == 100
    for bad in (101, -1, "I pick 33, not 50", "", 3.5, False):
        with pytest.raises(IllegalActionError):
            state.check_action(0, bad)
    assert state.default_action(0) == 50
    assert state.action_spec(0).to_json()["schema"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 100,
    }


def test_prompts_follow_the_paper_and_carry_personas() -> None:
    game = make_game(
        "beauty_contest", players=2, rule="exclusive", personas=["agreeable", "a chess coach"]
    )
    state = game.new_initial_state(0)
    (p,) = state.current_players()
    text = state.prompt(p)
    assert text.startswith(
        "Welcome to the game. You players will be asked to choose a number between 0 and 100."
    )
    assert "only by winning alone can one earn 1 mark(s)" in text
    assert "taking two turns to speak" in text
    persona = {0: "an agreeable player participating the number-choosing game", 1: "a chess coach"}[
        p
    ]
    assert f"Player {p + 1}, you are {persona}. Please speak." in text
    assert game.params()["personas"] == ["agreeable", "a chess coach"]
    with pytest.raises(ValueError):
        make_game("beauty_contest", players=3, personas=["x"])
    with pytest.raises(ValueError):
        make_game("beauty_contest", rule="winner-takes-all")


def test_level_k_players_and_results() -> None:
    game = make_game("beauty_contest", players=5, rule="independent")
    agents = [make_agent("level-k", f"l{k}", k=k) for k in range(5)]
    state = play(game, agents, seed=1)
    (result,) = state.results
    assert result["choices"] == [50, 33, 22, 15, 10]
    assert result["winners"] == [3]  # mean 26, target 17.3
    assert state.returns() == [0.0, 0.0, 0.0, 1.0, 0.0]
    final = state.observation(0)
    assert final["results"][0]["choices"] == result["choices"]
    json.dumps(final)


class Copycat(Agent):
    """Picks the closest number of the previous round (or 40 in the first)."""

    async def act(self, turn: Turn) -> JSON:
        history = turn.observation["history"]
        return history[-1]["closest"] if history else 40


def test_multiple_rounds_remind_players_of_their_guesses() -> None:
    game = make_game("beauty_contest", players=3, rounds=2, discussion=False)
    state = play(
        game,
        [Copycat("c"), make_agent("level-k", "l0", k=0), make_agent("level-k", "l2", k=2)],
        seed=0,
    )
    assert len(state.results) == 2 and len(state.round_rewards) == 2
    assert state.results[0]["choices"] == [40, 50, 22]  # target 22.9 -> 22 wins
    assert state.results[1]["choices"] == [22, 50, 22]
    mid = make_game("beauty_contest", players=3, rounds=2, discussion=False).new_initial_state(0)
    mid.apply({0: 40, 1: 50, 2: 22})
    text = mid.prompt(0)
    assert "We are now going to play Round 2." in text
    assert (
        "Your previous guesses were: 40 (Lose, the closest number was 22), where you won 0 time(s)."
        in text
    )
