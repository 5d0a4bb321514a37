"""Bertrand: derived benchmark prices, demand systems, talk phases, bounded memory."""

from __future__ import annotations

import json

import pytest

from backroom.agents import make_agent
from backroom.bus.wire import MAX_PAYLOAD_BYTES
from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games.bertrand_market import best_response, equilibrium_prices, make_market

from .gameplay import play


def test_benchmark_prices_match_the_papers() -> None:
    linear = equilibrium_prices("linear")
    assert linear.nash_price == pytest.approx(6.0, abs=1e-4)
    assert linear.cartel_price == pytest.approx(8.0, abs=1e-4)
    logit = equilibrium_prices("logit")
    assert logit.nash_price == pytest.approx(1.4729, abs=1e-4)
    assert logit.cartel_price == pytest.approx(1.9250, abs=1e-4)


@pytest.mark.parametrize(
    ("demand", "params"),
    [
        ("linear", {}),
        ("linear", {"intercept": 900, "own_slope": 150, "cross_slope": 40, "cost": 1.5}),
        ("logit", {}),
        ("logit", {"a": 2.5, "a0": 0.5, "mu": 0.4, "cost": 0.8}),
    ],
)
def test_benchmarks_are_nash_and_joint_optimum_for_any_parameters(
    demand: str, params: dict[str, float]
) -> None:
    eq = equilibrium_prices(demand, params)
    m = make_market(demand, params)
    # Nash: the best response to the Nash price is the Nash price.
    assert best_response(m, eq.nash_price, 0.0, 20.0) == pytest.approx(eq.nash_price, abs=1e-5)
    # Cartel: no common price earns the pair more.
    joint = 2 * m.profit(eq.cartel_price, eq.cartel_price)
    for dp in (-0.1, -0.01, 0.01, 0.1):
        p = eq.cartel_price + dp
        assert 2 * m.profit(p, p) < joint
    assert eq.nash_price < eq.cartel_price
    assert eq.nash_profit == pytest.approx(m.profit(eq.nash_price, eq.nash_price))
    assert eq.profit_gain(eq.nash_profit) == pytest.approx(0.0)
    assert eq.profit_gain(eq.cartel_profit) == pytest.approx(1.0)


def test_linear_demand_is_the_papers_and_never_negative() -> None:
    m = make_market("linear")
    assert m.quantity(6, 6) == 800 and m.quantity(7, 5) == 1400 - 1400 + 500
    assert m.quantity(14, 0) == 0.0  # priced out, not negative
    assert m.profit(8, 8) == 600 * 6


def test_two_nash_pricers_stay_at_nash_and_two_cartel_pricers_earn_the_cartel_profit() -> None:
    for demand in ("linear", "logit"):
        eq = equilibrium_prices(demand)
        game = make_game("bertrand", demand=demand, rounds=30)
        nash = play(game, [make_agent("nash-pricer", "n0"), make_agent("nash-pricer", "n1")])
        assert all(p == pytest.approx(eq.nash_price) for seat in (0, 1) for p in nash.prices[seat])
        assert all(r == [pytest.approx(eq.nash_profit)] * 2 for r in nash.round_rewards)
        cartel = play(game, [make_agent("cartel-pricer", "c0"), make_agent("cartel-pricer", "c1")])
        assert all(r == [pytest.approx(eq.cartel_profit)] * 2 for r in cartel.round_rewards)
        assert cartel.returns() == [pytest.approx(30 * eq.cartel_profit)] * 2


def test_undercutter_starts_a_price_war_down_to_cost() -> None:
    game = make_game("bertrand", rounds=80)
    state = play(game, [make_agent("undercutter", "u"), make_agent("tft-pricer", "t")])
    assert state.prices[0][0] == pytest.approx(8.0) and state.prices[1][0] == pytest.approx(8.0)
    assert state.prices[0][-1] == pytest.approx(2.0) and min(state.prices[0]) >= 2.0
    assert state.prices[1][1:] == pytest.approx(
        state.prices[0][:-1]
    )  # tit-for-tat copies the rival


def test_prices_are_validated() -> None:
    state = make_game("bertrand", rounds=2).new_initial_state(0)
    assert state.action_spec(0).to_json() == {
        "schema": {"type": "number", "minimum": 0.0, "maximum": 14.0}
    }
    assert state.check_action(0, 6) == 6.0 and state.check_action(1, "6.5") == 6.5
    for bad in (-0.1, 14.01, float("nan"), float("inf"), True, None, "cheap", [6]):
        with pytest.raises(IllegalActionError):
            state.check_action(0, bad)
    assert state.default_action(0) == 2.0  # nothing posted yet: the cost
    state.apply({0: 7.5, 1: 6.0})
    assert state.default_action(0) == 7.5  # keeps its posted price
    assert (
        make_game("bertrand", demand="logit")
        .new_initial_state(0)
        .action_spec(0)
        .to_json()["schema"]["maximum"]
        == 4.0
    )
    with pytest.raises(ValueError):
        make_game("bertrand", demand="cournot")
    with pytest.raises(ValueError):
        make_game("bertrand", demand_params={"slope": 3})


def test_talk_rounds_random_order_one_speaker_at_a_time() -> None:
    game = make_game("bertrand", rounds=3, talk_rounds=3)
    state = game.new_initial_state(None)
    assert state.current_players() == {CHANCE} and state.chance_outcomes() == [(0, 0.5), (1, 0.5)]
    state.apply({CHANCE: 1})
    said = []
    while state.phase == "talk":
        (p,) = state.current_players()
        assert state.action_spec(p).to_json()["schema"] == {"type": "string", "maxLength": 500}
        if said:
            assert state.observation(p)["conversation"][-1]["text"] == said[-1][1]
            assert f"Firm {game.firm_names[said[-1][0]]}: {said[-1][1]}" in state.prompt(p)
        state.apply({p: f"message {len(said)}"})
        said.append((p, f"message {len(said)}"))
    assert [p for p, _ in said] == [1, 0, 1, 0, 1, 0]
    assert "Conversation in Phase 1" in state.prompt(
        0
    ) and "We are currently in Phase 2." in state.prompt(0)
    talky = make_game("bertrand", talk_rounds=1).new_initial_state(0)
    with pytest.raises(IllegalActionError):
        talky.check_action(next(iter(talky.current_players())), "x" * 501)
    state.apply({0: 6.0, 1: 6.0})
    assert state.current_players() == {CHANCE}  # a fresh order for the next round
    assert state.observation(0)["conversation"] == []

    seeded = [make_game("bertrand", rounds=40, talk_rounds=1).new_initial_state(s) for s in (0, 0)]
    firsts: list[list[int]] = [[], []]
    for i, st in enumerate(seeded):
        while not st.is_terminal():
            if st.phase == "talk" and not st.conversation:
                firsts[i].append(next(iter(st.current_players())))
            st.apply({p: ("" if st.phase == "talk" else 6.0) for p in st.current_players()})
    assert firsts[0] == firsts[1] and set(firsts[0]) == {0, 1}


def test_observation_window_prompt_window_and_terminal_history() -> None:
    game = make_game("bertrand", rounds=30, history_window=5)
    state = game.new_initial_state(0)
    for i in range(25):
        state.apply({0: 6.0 + i / 100, 1: 7.0})
    hist = state.observation(0)["history"]
    assert hist["start"] == 21 and len(hist["prices"]) == 5
    assert hist["prices"][-1] == pytest.approx(6.24) and hist["rival_prices"][-1] == 7.0
    assert state.observation(1)["history"]["rival_prices"][-1] == pytest.approx(6.24)
    text = state.prompt(0)
    assert "past 20 rounds'" in text and "Round #6: [" in text and "Round #5: [" not in text
    assert "You are Firm Ed. This is Round #26." in text
    for _ in range(5):
        state.apply({0: 6.0, 1: 6.0})
    final = state.observation(0)["history"]
    assert state.is_terminal() and final["start"] == 1 and len(final["prices"]) == 30


def test_memory_grows_only_in_the_history_lists_and_observations_stay_small() -> None:
    game = make_game("bertrand", rounds=800, talk_rounds=1)

    def sizes(state) -> dict[str, int]:  # type: ignore[no-untyped-def]
        return {
            k: len(json.dumps(v, default=str))
            for k, v in vars(state).items()
            if k not in ("game", "_rng")
        }

    state = game.new_initial_state(0)
    snapshots = []
    for r in range(800):
        while state.phase == "talk":
            state.apply({next(iter(state.current_players())): "let us keep prices high " * 5})
        state.apply({0: 7.123456789 + r % 7, 1: 6.987654321})
        if r + 1 in (100, 200):
            snapshots.append(sizes(state))
    grew = {k for k in snapshots[0] if snapshots[1][k] > snapshots[0][k]}
    assert grew == {"prices", "demands", "profits", "round_rewards"}
    assert state.is_terminal()
    # The biggest turn an agent gets (a full 800-round history) fits a bus message.
    assert len(json.dumps(state.observation(0))) + len(state.prompt(0)) < MAX_PAYLOAD_BYTES


def test_personas_and_params_round_trip() -> None:
    game = make_game("bertrand", demand="logit", rounds=5, personas=["uncooperative", "none"])
    state = game.new_initial_state(0)
    assert "You are selfish and dishonest to other players." in state.prompt(0)
    assert "selfish" not in state.prompt(1)
    assert "between 0 and 4" in state.prompt(1)
    again = make_game("bertrand", **game.params())
    assert again.params() == game.params()
    assert again.equilibrium == game.equilibrium
