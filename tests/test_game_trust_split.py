"""Trust-and-Split: private hands, one message each, alternating starter, split rule."""

from __future__ import annotations

import json

import pytest

from backroom.agents import make_agent
from backroom.agents.base import JSON, Agent
from backroom.bus.wire import Turn
from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games.trust_and_split import DEALS, is_upper

from .gameplay import play


def dealt(deal: tuple[str, str], first: int = 0, **params):  # type: ignore[no-untyped-def]
    state = make_game("trust_and_split", **params).new_initial_state(None)
    assert state.current_players() == {CHANCE}
    state.apply({CHANCE: first})  # who opens round 1
    state.apply({CHANCE: deal})
    return state


def view(state, seat: int) -> str:  # type: ignore[no-untyped-def]
    return json.dumps(state.observation(seat), sort_keys=True) + state.prompt(seat)


def test_other_hand_never_leaks_before_the_reveal() -> None:
    # Two worlds that differ only in seat 1's hand (and so in seat 0's value):
    # until the round ends, seat 0 must not be able to tell them apart.
    a = dealt(("rock", "paper"))  # seat 0 lower
    b = dealt(("rock", "scissors"))  # seat 0 upper
    assert view(a, 0) == view(b, 0)
    for state in (a, b):
        state.apply({0: "Let us split fairly."})
        state.apply({1: "Agreed."})
    assert a.phase == b.phase == "act"
    assert view(a, 0) == view(b, 0)
    for state in (a, b):
        state.apply({0: 5, 1: 5})
        state.apply({CHANCE: ("paper", "rock")})
    # Round over: the reveal tells them apart, and names seat 1's old hand.
    assert view(a, 0) != view(b, 0)
    assert a.observation(0)["history"][0]["hands"] == ["rock", "paper"]
    assert "had a upper hand" in a.prompt(0) and "had a lower hand" in b.prompt(0)


def test_hand_absent_from_seat_views_in_played_games() -> None:
    for seed in range(5):
        state = make_game("trust_and_split").new_initial_state(seed)
        while not state.is_terminal():
            assert state.hands is not None
            for seat in (0, 1):
                obs = state.observation(seat)
                assert obs["hand"] == state.hands[seat]
                assert len(obs["history"]) == obs["round"] - 1
                current = state.prompt(seat).split("A New Round Begins")[-1]
                assert state.hands[1 - seat] not in current
                assert state.hands[1 - seat] not in json.dumps(
                    {k: v for k, v in obs.items() if k != "history"}
                )
            movers = sorted(state.current_players())
            state.apply({p: (None if state.phase == "talk" else 5) for p in movers})


def test_payoffs_split_rule_and_values() -> None:
    state = dealt(("scissors", "paper"), messages_per_round=0, rounds=3)
    assert state.phase == "act"
    state.apply({0: 10, 1: 10})  # both over-claim: 5 coins each; scissors is upper
    assert state.round_rewards[-1] == [50.0, 5.0]
    state.apply({CHANCE: ("paper", "scissors")})
    state.apply({0: 7, 1: 6})
    assert state.round_rewards[-1] == [pytest.approx(10 * 7 / 13), pytest.approx(10 * 6 / 13 * 10)]
    state.apply({CHANCE: ("rock", "paper")})
    state.apply({0: 3, 1: 4})  # fits: granted
    assert state.round_rewards[-1] == [3.0, 40.0]
    assert state.is_terminal()


def test_one_message_each_and_the_starter_alternates() -> None:
    state = dealt(("rock", "scissors"), first=1, rounds=3)
    starters = []
    for _ in range(3):
        assert state.phase == "talk"
        first = next(iter(state.current_players()))
        starters.append(first)
        state.apply({first: "hi"})
        assert state.current_players() == {1 - first}
        assert state.observation(1 - first)["messages"] == [{"seat": first, "text": "hi"}]
        assert "said: <<message_start>>hi<<message_end>>" in state.prompt(1 - first)
        state.apply({1 - first: ""})
        assert state.phase == "act" and state.current_players() == {0, 1}
        state.apply({0: 0, 1: 10})
        if not state.is_terminal():
            state.apply({CHANCE: DEALS[0]})
    assert starters == [1, 0, 1]


def test_talk_checks() -> None:
    state = dealt(("rock", "paper"))
    assert state.legal_actions(0) == []
    assert state.action_spec(0).to_json() == {"schema": {"type": "string", "maxLength": 500}}
    assert state.check_action(0, None) == ""
    assert (
        state.check_action(0, "<<message_start>> My hand is rock. <<message_end>>")
        == "My hand is rock."
    )
    assert state.check_action(0, "x" * 500) == "x" * 500
    with pytest.raises(IllegalActionError):
        state.check_action(0, "x" * 501)
    with pytest.raises(IllegalActionError):
        state.check_action(0, 5)
    with pytest.raises(IllegalActionError):
        state.check_action(1, "not my turn")
    assert state.default_action(0) == ""
    state.apply({0: ""})
    state.apply({1: ""})
    assert state.check_action(0, "<<proposal_start>> 7 <<proposal_end>>") == 7
    for bad in (11, -1, "seven", 2.5, True):
        with pytest.raises(IllegalActionError):
            state.check_action(0, bad)
    assert state.default_action(1) == 0


def test_deals_give_each_seat_the_upper_hand_half_the_time() -> None:
    state = make_game("trust_and_split", first_speaker=0).new_initial_state(None)
    outcomes = state.chance_outcomes()
    assert sorted(o for o, _ in outcomes) == sorted(DEALS) and len(DEALS) == 6
    assert all(a != b for a, b in DEALS)
    assert sum(p for (a, b), p in outcomes if is_upper(a, b)) == pytest.approx(0.5)
    assert sum(p for _, p in outcomes) == pytest.approx(1.0)


def test_seeded_deals_are_deterministic() -> None:
    game = make_game("trust_and_split")

    def hands(seed: int) -> list[tuple[str, str]]:
        state = game.new_initial_state(seed)
        out = []
        while not state.is_terminal():
            if state.phase == "act":
                out.append(state.hands)
            state.apply({p: ("" if state.phase == "talk" else 0) for p in state.current_players()})
        return out

    assert hands(11) == hands(11)
    assert len({tuple(hands(s)) for s in range(6)}) > 1


def test_honest_pair_reaches_the_optimum_and_greedy_exploits_by_lying() -> None:
    game = make_game("trust_and_split")
    honest = play(game, [make_agent("ts-honest", "h0"), make_agent("ts-honest", "h1")], seed=2)
    assert all(sum(r) == 100.0 for r in honest.round_rewards)
    mixed = play(game, [make_agent("ts-honest", "h"), make_agent("ts-greedy", "g")], seed=2)
    hist = mixed.history
    assert all(h["proposals"][1] == 10 for h in hist)
    lied = [
        h for h in hist if h["starter"] == 0
    ]  # greedy speaks second and claims the winning hand
    assert lied and all(h["proposals"][0] == 0 for h in lied)
    assert mixed.returns()[1] > mixed.returns()[0]


class Echo(Agent):
    async def talk(self, turn: Turn) -> str | None:
        return "hello there"

    async def act(self, turn: Turn) -> JSON:
        return 5


def test_messages_are_kept_in_the_revealed_history() -> None:
    state = play(make_game("trust_and_split", rounds=2), [Echo("e0"), Echo("e1")], seed=0)
    assert [len(h["messages"]) for h in state.history] == [2, 2]
    assert state.history[0]["messages"][0]["text"] == "hello there"
    assert state.returns() == [
        sum(r[0] for r in state.round_rewards),
        sum(r[1] for r in state.round_rewards),
    ]
