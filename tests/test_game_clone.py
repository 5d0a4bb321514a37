"""``State.clone`` copies the play, never the rules: solvers clone millions of states."""

from __future__ import annotations

import random

import pytest

from backroom.games import State, make_game, registered_games


@pytest.mark.parametrize("name", sorted(registered_games()))
def test_clone_shares_the_game_and_plays_on_independently(name: str) -> None:
    game = make_game(name)
    state = game.new_initial_state(3)
    rng = random.Random(0)

    def step(s: State) -> None:
        s.apply({p: s.action_spec(p).sample(rng) for p in s.current_players()})

    if not state.is_terminal():
        step(state)
    copy = state.clone()
    assert copy.game is state.game
    before = state.observation(0)
    while not copy.is_terminal():
        step(copy)
    assert state.observation(0) == before  # the original did not move
