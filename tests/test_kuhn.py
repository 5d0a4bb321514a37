"""Kuhn poker engine: classic against OpenSpiel itself, loki against its written rules."""

from __future__ import annotations

import random
from collections import Counter

import pyspiel
import pytest

from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games.kuhn import CALL, FOLD, RAISE, KuhnState


@pytest.mark.parametrize("players", [2, 3, 4])
def test_classic_matches_openspiel_on_every_history(players: int) -> None:
    game = make_game("kuhn", players=players)
    oracle = pyspiel.load_game("kuhn_poker", {"players": players})
    terminals = 0

    def walk(ours: KuhnState, theirs: pyspiel.State) -> None:
        nonlocal terminals
        assert ours.is_terminal() == theirs.is_terminal()
        if theirs.is_terminal():
            assert ours.returns() == pytest.approx(theirs.returns())
            terminals += 1
            return
        if theirs.is_chance_node():
            assert ours.current_players() == {CHANCE}
            assert dict(ours.chance_outcomes()) == pytest.approx(dict(theirs.chance_outcomes()))
            moves = [a for a, _ in theirs.chance_outcomes()]
            mover = CHANCE
        else:
            mover = theirs.current_player()
            assert ours.current_players() == {mover}
            assert list(ours.legal_actions(mover)) == theirs.legal_actions()
            assert ours.information_state(mover) == theirs.information_state_string(mover)
            moves = theirs.legal_actions()
        for a in moves:
            o, t = ours.clone(), theirs.clone()
            o.apply({mover: a})
            t.apply_action(a)
            walk(o, t)

    walk(game.new_initial_state(), oracle.new_initial_state())
    deals = {2: 6, 3: 24, 4: 120}[players]
    assert terminals > deals  # every deal reached several terminal histories


def play(state: KuhnState, moves: list[str]) -> KuhnState:
    for name in moves:
        (p,) = state.current_players()
        state.apply({p: name})
    return state


def loki(cards: list[int], start: int) -> KuhnState:
    state = make_game("kuhn", variant="loki", start=start).new_initial_state()
    for c in cards:
        state.apply({CHANCE: c})
    return state


def test_loki_checks_around_goes_to_showdown() -> None:
    s = play(loki([1, 4, 2], start=0), ["call", "call", "call"])
    assert s.is_terminal()
    assert s.returns() == [-1, 2, -1]


def test_loki_raise_then_calls_and_folds() -> None:
    # seat 2 starts and raises to 2; seat 0 folds, seat 1 calls: showdown 1 vs 2.
    s = play(loki([0, 3, 4], start=2), ["raise", "fold", "call"])
    assert s.is_terminal()
    assert s.contrib == [1, 2, 2]
    assert s.returns() == [-1, -2, 3]


def test_loki_each_player_raises_at_most_once() -> None:
    s = play(loki([0, 1, 2], start=0), ["raise", "raise", "raise"])
    assert s.max_bet == 4  # ante 1 + three raises: the paper's "maximum of four"
    (p,) = s.current_players()
    assert p == 0
    assert list(s.legal_actions(0)) == [FOLD, CALL]
    with pytest.raises(IllegalActionError):
        s.apply({0: RAISE})
    play(s, ["call", "call"])
    assert s.is_terminal()
    assert s.returns() == [-4, -4, 8]


def test_loki_last_player_standing_takes_the_pot() -> None:
    s = play(loki([4, 3, 2], start=1), ["raise", "fold", "fold"])
    assert s.is_terminal() and s.winner == 1
    assert s.returns() == [-1, 2, -1]
    # folded cards are never shown
    assert s.observation(2)["shown"] == {"1": 3}


def test_loki_out_of_turn_and_unknown_actions_are_refused() -> None:
    s = loki([0, 1, 2], start=1)
    with pytest.raises(IllegalActionError, match="expected actions for"):
        s.apply({0: CALL})
    with pytest.raises(IllegalActionError):
        s.apply({1: "shove"})
    with pytest.raises(IllegalActionError):
        s.apply({1: True})


def test_loki_random_play_is_zero_sum_and_seeded() -> None:
    game = make_game("kuhn", variant="loki")
    starts: Counter[int] = Counter()
    for seed in range(600):
        s, t = game.new_initial_state(seed), game.new_initial_state(seed)
        assert (s.cards, s.start) == (t.cards, t.start)
        rng = random.Random(seed)
        while not s.is_terminal():
            (p,) = s.current_players()
            s.apply({p: rng.choice(list(s.legal_actions(p)))})
        assert sum(s.returns()) == 0
        assert len(set(s.cards)) == 3
        starts[s.start or 0] += 1
    assert all(150 < starts[p] < 250 for p in range(3))  # the start seat is uniform


def test_loki_observation_hides_other_cards() -> None:
    s = loki([2, 0, 4], start=0)
    for seat in range(3):
        obs = s.observation(seat)
        assert obs["card"] == s.cards[seat]
        others = [c for i, c in enumerate(s.cards) if i != seat]
        prompt = s.prompt(seat)
        assert "shown" not in obs
        names = ["10", "Jack", "Queen", "King", "Ace"]
        assert f"Your card is the {names[s.cards[seat]]}" in prompt
        assert not any(f"card is the {names[c]}" in prompt for c in others)


def test_bad_parameters_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="3-player"):
        make_game("kuhn", variant="loki", players=4)
    with pytest.raises(ValueError, match="unknown game"):
        make_game("kuhnn")
    with pytest.raises(ValueError, match="bad parameters"):
        make_game("kuhn", colour="red")
