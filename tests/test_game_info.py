"""Every engine's declared ``GameInfo`` holds on its plays, and is exact where it says so.

Kuhn is small enough to enumerate: there the bounds, the sum and the lengths
must be *attained*, not just respected, and classic Kuhn's must be
OpenSpiel's. The other engines have huge or continuous trees, so random
playouts check that nothing breaks the declaration, and a constructed play
per game reaches each bound.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

import pyspiel
import pytest

from backroom.games import CHANCE, Action, GameInfo, State, make_game, registered_games
from backroom.games.bertrand import Bertrand
from backroom.games.bertrand_market import best_response
from backroom.games.kuhn import ClassicKuhnState, KuhnPoker, LokiKuhnState
from backroom.games.split_nocomm import ITEMS, SplitNoComm
from backroom.games.testing import Act, Pick, Seen, check_game, playout
from backroom.games.trust_and_split import DEALS, TrustAndSplit, is_upper
from backroom.solvers.tree import build_tree


@pytest.mark.parametrize("name", sorted(registered_games()))
def test_every_engine_declares_frozen_facts(name: str) -> None:
    game = make_game(name)
    info = game.info
    assert isinstance(info, GameInfo)
    assert info.num_players == game.num_players == game.new_initial_state(0).num_players
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_utility = 0.0  # type: ignore[misc]
    assert info.zero_sum == (info.utility_sum == 0.0)
    assert info.constant_sum == (info.utility_sum is not None)


def test_contradictory_declarations_are_refused() -> None:
    with pytest.raises(ValueError, match="min_utility > max_utility"):
        GameInfo(2, 1.0, -1.0, None, 3)
    with pytest.raises(ValueError, match="chance"):
        GameInfo(2, -1.0, 1.0, None, 3, max_chance_nodes=2)
    with pytest.raises(ValueError, match="utility_sum"):
        GameInfo(2, 0.0, 1.0, -1.0, 3)


# --- Kuhn: exhaustive ---------------------------------------------------------------------


def enumerate_plays(state: State, seen: Seen, moves: int = 0, chance: int = 0) -> None:
    if state.is_terminal():
        seen.terminal(state, moves, chance)
        return
    (mover,) = state.current_players()
    if mover == CHANCE:
        outcomes = state.chance_outcomes()
        seen.chance_outcomes = max(seen.chance_outcomes, len(outcomes))
        steps = [({CHANCE: o}, moves, chance + 1) for o, _ in outcomes]
    else:
        steps = [({mover: a}, moves + 1, chance) for a in state.legal_actions(mover)]
    for move, m, c in steps:
        child = state.clone()
        child.apply(move)
        enumerate_plays(child, seen, m, c)


KUHN = [
    {"variant": "classic", "players": 2},
    {"variant": "classic", "players": 3},
    {"variant": "classic", "players": 4},
    {"variant": "loki"},
    {"variant": "loki", "start": 1},
    # a fixed deal: each card a certain outcome, the bounds and length still reached
    {"variant": "classic", "players": 3, "deal": [2, 0, 3]},
    {"variant": "loki", "deal": [3, 4, 0]},
    {"variant": "loki", "start": 1, "deal": [0, 1, 4]},
]


@pytest.mark.parametrize("params", KUHN, ids=lambda p: "-".join(map(str, p.values())))
def test_kuhn_info_is_exact_over_every_play(params: dict[str, Any]) -> None:
    game = make_game("kuhn", **params)
    info = game.info
    seen = Seen()
    enumerate_plays(game.new_initial_state(), seen)
    seen.respects(info)
    # Every declared fact is attained by some play: the declaration is tight.
    assert (seen.low, seen.high) == (info.min_utility, info.max_utility)
    assert seen.sums == {0.0} and info.zero_sum
    assert seen.moves == info.max_game_length
    assert seen.chance_nodes == info.max_chance_nodes
    assert seen.chance_outcomes == info.max_chance_outcomes


@pytest.mark.parametrize("players", [2, 3, 4])
def test_classic_kuhn_info_is_openspiels(players: int) -> None:
    ours = make_game("kuhn", players=players).info
    theirs = pyspiel.load_game("kuhn_poker", {"players": players})
    assert ours == GameInfo(
        num_players=theirs.num_players(),
        min_utility=theirs.min_utility(),
        max_utility=theirs.max_utility(),
        utility_sum=theirs.utility_sum(),
        max_game_length=theirs.max_game_length(),
        max_chance_nodes=theirs.max_chance_nodes_in_history(),
        max_chance_outcomes=theirs.max_chance_outcomes(),
    )
    assert theirs.get_type().utility == pyspiel.GameType.Utility.ZERO_SUM


def test_each_variant_has_its_own_state() -> None:
    """One rule set per class: a variant's bookkeeping does not exist in the other."""
    classic = make_game("kuhn").new_initial_state(0)
    loki = make_game("kuhn", variant="loki").new_initial_state(0)
    assert type(classic) is ClassicKuhnState and type(loki) is LokiKuhnState
    assert hasattr(classic, "first_bettor") and not hasattr(classic, "raised")
    assert hasattr(loki, "raised") and not hasattr(loki, "first_bettor")


def test_tree_builder_refuses_a_false_declaration() -> None:
    class Boastful(KuhnPoker):
        @property
        def info(self) -> GameInfo:
            return dataclasses.replace(super().info, max_utility=1.0)

    with pytest.raises(ValueError, match="declares"):
        build_tree(Boastful(), estimate_samples=0)
    assert build_tree(make_game("kuhn")).info == make_game("kuhn").info


# --- the other engines: random playouts and constructed extremes -------------------------

OTHERS: list[tuple[str, dict[str, Any]]] = [
    ("ipd", {}),
    ("ipd", {"rounds": 6, "continuation": 0.7}),
    ("ipd", {"rounds": 4, "reward": 0, "temptation": 1, "sucker": -1, "punishment": 0}),
    ("split_nocomm", {"rounds": 3}),
    ("trust_and_split", {"rounds": 3}),
    ("trust_and_split", {"rounds": 2, "messages_per_round": 2, "first_speaker": 1}),
    ("beauty_contest", {"players": 5}),
    ("beauty_contest", {"players": 3, "rule": "exclusive", "discussion": False, "rounds": 3}),
    ("bertrand", {"rounds": 30}),
    ("bertrand", {"demand": "logit", "rounds": 10, "talk_rounds": 1}),
]


@pytest.mark.parametrize(
    ("name", "params"), OTHERS, ids=[f"{n}{i}" for i, (n, _) in enumerate(OTHERS)]
)
def test_random_plays_keep_the_declaration(name: str, params: dict[str, Any]) -> None:
    game = make_game(name, **params)
    seen = check_game(game, checks=["end", "info"], playouts=40, seed=7).seen
    if game.info.max_chance_nodes and not params.get("continuation"):
        assert seen.chance_nodes == game.info.max_chance_nodes  # chance every round, as declared
    if not params.get("continuation"):
        assert seen.moves == game.info.max_game_length  # fixed-length games last exactly that


def test_the_constant_sum_ipd_is_declared_zero_sum() -> None:
    info = make_game("ipd", reward=0, temptation=1, sucker=-1, punishment=0).info
    assert info.zero_sum and not make_game("ipd").info.constant_sum


def extremes(
    game_name: str, params: Mapping[str, Any], act: Act, pick: Pick | None = None
) -> list[float]:
    game = make_game(game_name, **params)
    seen = Seen()
    returns = playout(game.new_initial_state(), seen, random.Random(0), act, pick).returns()
    seen.respects(game.info)
    return returns


def test_ipd_bounds_are_attained() -> None:
    info = make_game("ipd", rounds=5).info
    low, high = extremes("ipd", {"rounds": 5}, lambda s, p: "A" if p == 0 else "B")
    assert (low, high) == (info.min_utility, info.max_utility) == (0.0, 25.0)


def test_split_bound_is_attained() -> None:
    game = SplitNoComm(rounds=2)

    def richest(state: State, outcomes: list[tuple[Action, float]]) -> Action:
        return max((o for o, _ in outcomes), key=lambda o: sum(o[0]))

    def greedy(state: State, p: int) -> Action:
        return {k: game.quantity if p == 0 else 0 for k in ITEMS}

    mine, theirs = extremes("split_nocomm", {"rounds": 2}, greedy, richest)
    assert (theirs, mine) == (game.info.min_utility, game.info.max_utility)


def test_trust_and_split_bound_is_attained() -> None:
    params = {"rounds": 2, "first_speaker": 0}
    game = TrustAndSplit(rounds=2, first_speaker=0)

    def upper_for_seat_0(state: State, outcomes: list[tuple[Action, float]]) -> Action:
        return next(d for d in DEALS if is_upper(d[0], d[1]))

    def act(state: State, p: int) -> Action:
        return "" if state.phase == "talk" else (game.coins if p == 0 else 0)

    mine, theirs = extremes("trust_and_split", params, act, upper_for_seat_0)
    assert (theirs, mine) == (game.info.min_utility, game.info.max_utility)


def test_amplified_beauty_contest_pays_everyone_n_when_all_agree() -> None:
    params = {"players": 4, "discussion": False, "rounds": 2}
    returns = extremes("beauty_contest", params, lambda s, p: 0)
    assert set(returns) == {make_game("beauty_contest", **params).info.max_utility} == {8.0}


@pytest.mark.parametrize("demand", ["linear", "logit"])
def test_bertrand_bounds_are_attained(demand: str) -> None:
    game = Bertrand(demand=demand, rounds=3)  # type: ignore[arg-type]
    top = game.max_price
    br = best_response(game.market, top, 0.0, top)
    low, _ = extremes(
        "bertrand", {"demand": demand, "rounds": 3}, lambda s, p: 0.0 if p == 0 else top
    )
    high, _ = extremes(
        "bertrand", {"demand": demand, "rounds": 3}, lambda s, p: br if p == 0 else top
    )
    assert low == pytest.approx(game.info.min_utility, rel=1e-12)
    assert high == pytest.approx(game.info.max_utility, rel=1e-12)
    assert low < 0 < high
