"""Kuhn poker engine: classic against OpenSpiel itself, loki against its written rules."""

from __future__ import annotations

import copy
import math
import random
from collections import Counter

import pyspiel
import pytest

from backroom.games import CHANCE, IllegalActionError, State, make_game
from backroom.games.kuhn import BET, CALL, FOLD, PASS, RAISE, KuhnState


@pytest.mark.parametrize("players", [2, 3, 4])
def test_classic_matches_openspiel_on_every_history(players: int) -> None:
    game = make_game("kuhn", players=players)
    oracle = pyspiel.load_game("kuhn_poker", {"players": players})
    terminals = 0

    def walk(ours: State, theirs: pyspiel.State) -> None:
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
    assert isinstance(state, KuhnState)
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
        assert isinstance(s, KuhnState) and isinstance(t, KuhnState)
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


def classic_expected(
    n: int, cards: list[int], moves: list[int], player: int
) -> tuple[dict[str, object], bool]:
    """What seat ``player`` should see, from the written rules alone (never the engine's fields).

    Classic Kuhn: ante 1 each; seats act 0, 1, ... in turn; pass or bet 1; after the
    first bet every other seat acts once, a bet then being a call and a pass a fold.
    """
    first_bet = moves.index(BET) if BET in moves else None
    terminal = len(moves) == (n if first_bet is None else first_bet + n)
    # the k-th move is seat k % n's: no seat is skipped before the hand ends
    bet = [any(a == BET and k % n == p for k, a in enumerate(moves)) for p in range(n)]
    folded = [
        first_bet is not None
        and any(a == PASS and k % n == p and k > first_bet for k, a in enumerate(moves))
        for p in range(n)
    ]
    contributions = [1 + int(b) for b in bet]
    dealt = len(cards) == n
    expected: dict[str, object] = {
        "game": "kuhn",
        "variant": "classic",
        "player": player,
        "card": cards[player] if len(cards) > player else None,
        "start": 0,
        "history": [{"player": k % n, "action": ("pass", "bet")[a]} for k, a in enumerate(moves)],
        "pot": n + sum(bet),
        "contributions": contributions,
        "folded": folded,
        # chips to match the highest bet: 1 for a seat that has not bet once anyone has
        "to_call": int(first_bet is not None and not bet[player]),
        "info_state": str(cards[player]) + "".join("pb"[a] for a in moves) if dealt else None,
    }
    if terminal:
        live = [p for p in range(n) if not folded[p]]
        winner = max(live, key=lambda p: cards[p])
        pot = n + sum(bet)
        expected["winner"] = winner
        expected["shown"] = {str(p): cards[p] for p in live}
        expected["returns"] = [
            float(pot - c if p == winner else -c) for p, c in enumerate(contributions)
        ]
    return expected, terminal


@pytest.mark.parametrize("players", [2, 3])
def test_classic_observation_on_every_history(players: int) -> None:
    """to_call, pot, contributions, folded, ... of every seat on every history, chance ones included.

    Expected values come from the rules (``classic_expected``); the contributions are
    also checked against OpenSpiel's observation tensor, whose last n entries are them.
    """
    n = players
    game = make_game("kuhn", players=n)
    oracle = pyspiel.load_game("kuhn_poker", {"players": n})
    seen = Counter[str]()

    def walk(ours: State, theirs: pyspiel.State, cards: list[int], moves: list[int]) -> None:
        terminal = False
        for p in range(n):
            expected, terminal = classic_expected(n, cards, moves, p)
            assert ours.observation(p) == expected, (cards, moves, p)
            tensor = theirs.observation_tensor(p)
            assert tensor[-n:] == expected["contributions"], (cards, moves, p)
        assert ours.is_terminal() == terminal == theirs.is_terminal()
        if terminal:
            seen["terminal"] += 1
            return
        if len(cards) < n:
            seen["chance"] += 1
            assert ours.current_players() == {CHANCE}
            for card in sorted(set(range(n + 1)) - set(cards)):
                o, t = ours.clone(), theirs.clone()
                o.apply({CHANCE: card})
                t.apply_action(card)
                walk(o, t, [*cards, card], moves)
            return
        seen["decision"] += 1
        mover = len(moves) % n
        assert ours.current_players() == {mover}
        assert list(ours.legal_actions(mover)) == [PASS, BET]
        for a in (PASS, BET):
            o, t = ours.clone(), theirs.clone()
            o.apply({mover: a})
            t.apply_action(a)
            walk(o, t, cards, [*moves, a])

    walk(game.new_initial_state(), oracle.new_initial_state(), [], [])
    deals = math.perm(n + 1, n)
    # per deal: one pass-around, and for each first bettor 2**(n-1) answers of the others
    assert seen["terminal"] == deals * (1 + n * 2 ** (n - 1))
    assert seen["chance"] == sum(math.perm(n + 1, k) for k in range(n))
    assert seen["decision"] > 0


def test_classic_bet_is_to_be_called() -> None:
    """The case people saw in the terminal: after seat 0 bets, seat 1 has 1 to call."""
    s = make_game("kuhn").new_initial_state()
    for c in (2, 0):
        s.apply({CHANCE: c})
    s.apply({0: "bet"})
    assert (s.observation(0)["to_call"], s.observation(1)["to_call"]) == (0, 1)
    assert s.observation(1)["pot"] == 3


@pytest.mark.parametrize("params", [{"players": 3}, {"variant": "loki"}])
def test_clone_copies_every_field_and_shares_the_game(params: dict[str, object]) -> None:
    """Kuhn's own fast ``clone`` (lists copied, no deep copy) leaves the original as it was."""
    state = make_game("kuhn", **params).new_initial_state(4)
    snapshot = {k: copy.deepcopy(v) for k, v in vars(state).items() if k not in ("game", "_rng")}
    twin = state.clone()
    assert type(twin) is type(state) and twin.game is state.game
    assert twin._rng is not state._rng
    while not twin.is_terminal():
        (p,) = twin.current_players()
        twin.apply({p: twin.legal_actions(p)[-1]})  # bet / raise whenever allowed
    assert {k: v for k, v in vars(state).items() if k not in ("game", "_rng")} == snapshot
    assert isinstance(state, KuhnState) and state.history == [] and not state.is_terminal()
