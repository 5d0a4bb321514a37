"""Split No-Comm: value generation, the split rule, proposals, baselines."""

from __future__ import annotations

import json

import pytest

from backroom.agents import make_agent
from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games._common import split_allocation
from backroom.games.split_nocomm import ITEMS, value_outcomes

from .gameplay import play


def props(hats: int, books: int, balls: int) -> dict[str, int]:
    return {"hats": hats, "books": books, "balls": balls}


def test_value_outcomes_are_the_papers_conditions() -> None:
    outcomes = value_outcomes(1, 10)
    assert len(outcomes) == len(set(outcomes)) == 12
    for a, b in outcomes:
        assert set(a) | set(b) <= {1, 10}
        assert sum(a) == sum(b)  # equal total value
        assert a != b  # at least one category valued differently


def test_split_rule_grants_fitting_proposals_and_scales_overclaims() -> None:
    assert split_allocation(10, 3, 4) == 3  # fits: granted, the rest is lost
    assert split_allocation(10, 6, 8) == pytest.approx(10 * 6 / 14)
    assert split_allocation(10, 8, 6) == pytest.approx(10 * 8 / 14)
    assert split_allocation(10, 10, 10) == 5
    assert split_allocation(10, 0, 0) == 0


def start(values: tuple[tuple[int, ...], tuple[int, ...]]):  # type: ignore[no-untyped-def]
    state = make_game("split_nocomm", rounds=2).new_initial_state(None)
    assert state.current_players() == {CHANCE}
    state.apply({CHANCE: values})
    return state


def test_payoffs_hand_computed_exact_and_proportional() -> None:
    v0, v1 = (10, 1, 1), (1, 10, 1)
    state = start((v0, v1))
    # Cooperative: each takes what it values more, half of the tie.
    state.apply({0: props(10, 0, 5), 1: props(0, 10, 5)})
    assert state.round_rewards[-1] == [pytest.approx(105), pytest.approx(105)]
    state.apply({CHANCE: (v0, v1)})
    # Over-claims: hats 10 vs 5 -> 6.67 / 3.33; books 10 vs 10 -> 5 / 5; balls 10 vs 10 -> 5 / 5.
    state.apply({0: props(10, 10, 10), 1: props(5, 10, 10)})
    r0 = 10 * 10 / 15 * 10 + 5 * 1 + 5 * 1
    r1 = 10 * 5 / 15 * 1 + 5 * 10 + 5 * 1
    assert state.round_rewards[-1] == [pytest.approx(r0), pytest.approx(r1)]
    assert state.is_terminal()
    hist = state.observation(1)["history"]
    assert hist[1]["proposals"] == [[10, 10, 10], [5, 10, 10]]
    assert hist[1]["allocations"][0][0] == pytest.approx(20 / 3)


def test_proposals_accept_text_and_mappings_and_refuse_the_rest() -> None:
    state = start(((10, 1, 1), (1, 10, 1)))
    assert state.check_action(0, "Proposal: 5 hats, 0 books, 5 balls") == props(5, 0, 5)
    assert state.check_action(0, "Proposal: 10 hats") == props(
        10, 0, 0
    )  # left out = 0, as the paper's parser
    assert state.check_action(1, {"hats": 1.0, "books": 2, "balls": 3}) == props(1, 2, 3)
    for bad in (
        props(11, 0, 0),
        props(-1, 0, 0),
        {"hats": 1, "books": 1},
        {**props(1, 1, 1), "coins": 1},
        {"hats": True, "books": 0, "balls": 0},
        {"hats": 1.5, "books": 0, "balls": 0},
        "ten",
        7,
        None,
    ):
        with pytest.raises(IllegalActionError):
            state.check_action(0, bad)
    assert state.default_action(0) == props(0, 0, 0)
    spec = state.action_spec(0).to_json()
    assert spec["schema"]["required"] == list(ITEMS)
    assert spec["schema"]["properties"]["hats"]["maximum"] == 10


def test_values_are_public_and_in_the_prompt() -> None:
    state = start(((10, 1, 10), (10, 10, 1)))
    obs = state.observation(1)
    assert obs["my_values"] == {"hats": 10, "books": 10, "balls": 1}
    assert obs["other_values"] == {"hats": 10, "books": 1, "balls": 10}
    text = state.prompt(0)
    assert (
        "Your per-item values are hats=10, books=1, balls=10 and Bob's per-item values are hats=10, books=10, balls=1."
        in text
    )
    assert "Respond as Proposal: x hats, y books, z balls" in text
    state.apply({0: props(5, 0, 10), 1: props(5, 10, 0)})
    assert "Last Round Summary" in state.prompt(
        0
    ) and "Bob proposed: 5 hats, 10 books, 0 balls" in state.prompt(0)


def test_seeded_values_are_deterministic_and_vary() -> None:
    game = make_game("split_nocomm")

    def values(seed: int) -> list[object]:
        state = game.new_initial_state(seed)
        out = []
        while not state.is_terminal():
            out.append(state.observation(0)["my_values"])
            state.apply({0: props(0, 0, 0), 1: props(0, 0, 0)})
        return out

    assert values(3) == values(3)
    assert len({json.dumps(values(s)) for s in range(5)}) > 1
    assert len({json.dumps(v) for v in values(3)}) > 1  # new values every round


def test_cooperative_pair_reaches_the_optimum_and_defector_exploits() -> None:
    game = make_game("split_nocomm")
    coop = play(
        game, [make_agent("split-cooperative", "c1"), make_agent("split-cooperative", "c2")], seed=4
    )
    for h, r in zip(coop.history, coop.round_rewards, strict=True):
        best = sum(10 * max(a, b) for a, b in zip(*h["values"], strict=True))
        assert sum(r) == pytest.approx(best)
    mixed = play(
        game, [make_agent("split-cooperative", "c"), make_agent("split-defect", "d")], seed=4
    )
    assert all(p == [10, 10, 10] for p in (h["proposals"][1] for h in mixed.history))
    assert mixed.returns()[1] > mixed.returns()[0]
    assert sum(mixed.returns()) < sum(coop.returns())
