"""Every registered engine keeps the game contract, checked by the public ``check_game``.

Clone independence (solvers clone millions of states), ``GameInfo`` at every
terminal, same seed same play, random playouts that end, legal actions
accepted and others refused with a reason, JSON on the wire: the checks a
third-party engine is held to (docs/games.md, "Bring a game") are the ones
every engine here passes. That each check catches its fault is
tests/test_check_game.py.
"""

from __future__ import annotations

import pytest

from backroom.games import make_game, registered_games
from backroom.games.testing import CHECKS, check_game


@pytest.mark.parametrize("name", sorted(registered_games()))
def test_every_engine_keeps_the_contract(name: str) -> None:
    report = check_game(name, playouts=10)
    assert report.checks == CHECKS and report.seen.terminals == 10


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("kuhn", {"variant": "loki"}),
        ("kuhn", {"players": 4}),
        ("ipd", {"rounds": 6, "continuation": 0.7}),
        ("trust_and_split", {"rounds": 2, "messages_per_round": 2, "first_speaker": 1}),
        ("beauty_contest", {"players": 3, "rule": "exclusive", "discussion": False}),
        ("bertrand", {"demand": "logit", "rounds": 10, "talk_rounds": 1}),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())),
)
def test_variants_keep_the_contract(name: str, params: dict[str, object]) -> None:
    check_game(name, playouts=10, **params)
    assert check_game(make_game(name, **params), checks=["clone"], playouts=2).checks == ("clone",)
