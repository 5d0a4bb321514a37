"""CFR family, evaluation and tree building, checked against known values and OpenSpiel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from backroom.agents.kinds import make_agent
from backroom.bus.wire import Turn
from backroom.cli.solve import solve_app
from backroom.games import make_game
from backroom.games.base import CHANCE, Action, Game, GameInfo, State
from backroom.solvers.cfr import ALGOS, CFRSolver, policy_document, solve, solve_game
from backroom.solvers.evaluate import (
    best_response,
    best_response_values,
    expected_returns,
    exploitability,
    nash_conv,
)
from backroom.solvers.policy_file import read_policy
from backroom.solvers.tree import (
    GameTree,
    NotPerfectRecallError,
    TreeTooLargeError,
    build_tree,
    estimate_tree_size,
)

pyspiel = pytest.importorskip("pyspiel")
from open_spiel.python.algorithms import expected_game_score  # noqa: E402
from open_spiel.python.algorithms import exploitability as os_exploitability  # noqa: E402

from backroom.solvers.openspiel_compat import (  # noqa: E402
    from_openspiel_policy,
    to_tabular_policy,
)


def classic(players: int) -> GameTree:
    return build_tree(make_game("kuhn", variant="classic", players=players))


def random_profile(tree: GameTree, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = rng.random(tree.num_slots) ** 3  # skewed, with near-zero probabilities
    return r / np.bincount(tree.slot_infoset, r)[tree.slot_infoset]


# --- two-player Kuhn: the known game value -------------------------------------------------


@pytest.mark.parametrize(
    ("algo", "iterations"), [("cfr", 3000), ("cfr+", 1000), ("linear", 3000), ("dcfr", 1000)]
)
def test_two_player_kuhn_value_and_exploitability(algo: str, iterations: int) -> None:
    tree = classic(2)
    result = solve(tree, iterations, algo)
    values = expected_returns(tree, result.average)
    assert values[0] == pytest.approx(-1 / 18, abs=1e-3)  # Kuhn 1950: the first player loses 1/18
    assert values.sum() == pytest.approx(0.0, abs=1e-12)
    assert exploitability(tree, result.average) < 1e-3
    assert exploitability(tree, result.average) == pytest.approx(
        nash_conv(tree, result.average) / 2
    )


def test_exploitability_falls_with_iterations() -> None:
    tree = classic(2)
    solver = CFRSolver(tree, "cfr")
    seen = [exploitability(tree, solver.average_policy())]
    for _ in range(3):
        solver.run(300)
        seen.append(exploitability(tree, solver.average_policy()))
    assert seen == sorted(seen, reverse=True)
    assert seen[0] > 0.4  # the uniform profile is far from equilibrium


# --- three-player Kuhn: NashConv, and agreement with OpenSpiel -----------------------------


def test_three_player_kuhn_nash_conv() -> None:
    tree = classic(3)
    result = solve(tree, 3000, "cfr+")
    assert nash_conv(tree, result.average) < 1e-3
    assert expected_returns(tree, result.average).sum() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("players", [2, 3])
def test_nash_conv_matches_openspiel(players: int) -> None:
    tree = classic(players)
    game = pyspiel.load_game("kuhn_poker", {"players": players})
    profiles = {
        "uniform": tree.uniform(),
        "random": random_profile(tree, 7),
        "random2": random_profile(tree, 8),
        "cfr": solve(tree, 200, "cfr").average,
        "cfr+": solve(tree, 500, "cfr+").average,
    }
    seen = set()
    for name, sigma in profiles.items():
        tab = to_tabular_policy(tree, sigma, game)
        theirs = os_exploitability.nash_conv(game, tab, return_only_nash_conv=False)
        ours = nash_conv(tree, sigma)
        assert ours == pytest.approx(theirs.nash_conv, abs=1e-9), name
        mine = best_response_values(tree, sigma) - expected_returns(tree, sigma)
        np.testing.assert_allclose(mine, theirs.player_improvements, atol=1e-9, err_msg=name)
        value = expected_game_score.policy_value(game.new_initial_state(), [tab] * players)
        np.testing.assert_allclose(expected_returns(tree, sigma), value, atol=1e-12, err_msg=name)
        seen.add(round(ours, 9))
    assert len(seen) == len(profiles)  # the profiles really differ


def test_policy_file_roundtrip_keeps_nash_conv() -> None:
    tree = classic(3)
    sigma = random_profile(tree, 3)
    game = pyspiel.load_game("kuhn_poker", {"players": 3})
    policy = json.loads(json.dumps(tree.policy_dict(sigma)))
    back = tree.sigma_from_policy(policy)
    np.testing.assert_allclose(back, sigma, atol=1e-15)
    assert nash_conv(tree, policy) == pytest.approx(
        os_exploitability.nash_conv(game, to_tabular_policy(tree, back, game)), abs=1e-9
    )


@pytest.mark.parametrize(
    ("players", "algo", "os_name"),
    [(2, "cfr", "CFRSolver"), (3, "cfr", "CFRSolver"), (3, "cfr+", "CFRPlusSolver")],
)
def test_iterates_match_openspiel_solver(players: int, algo: str, os_name: str) -> None:
    """Alternating CFR is OpenSpiel's algorithm: the average policies agree to rounding error."""
    tree = classic(players)
    game = pyspiel.load_game("kuhn_poker", {"players": players})
    theirs = getattr(pyspiel, os_name)(game)
    ours = CFRSolver(tree, algo)
    for _ in range(150):
        theirs.evaluate_and_update_policy()
    ours.run(150)
    diff = np.abs(from_openspiel_policy(tree, theirs.average_policy()) - ours.average_policy())
    assert diff.max() < 1e-10
    assert np.abs(ours.average_policy() - tree.uniform()).max() > 0.1  # it moved


@pytest.mark.parametrize("variant", ["classic", "loki"])
def test_segment_sum_paths_agree(variant: str) -> None:
    """The bincount (small trees) and reduceat (large trees) scatters give the same iterates."""
    tree = build_tree(make_game("kuhn", variant=variant, players=3))
    a, b = CFRSolver(tree, "cfr"), CFRSolver(tree, "cfr")
    b._use_runs = not a._use_runs
    assert any(slots is not None for _, slots in a._runs) or variant == "loki"
    a.run(40)
    b.run(40)
    np.testing.assert_allclose(a.average_policy(), b.average_policy(), atol=1e-12)
    assert np.abs(a.regret).max() > 0


def test_best_response_is_a_best_response() -> None:
    tree = classic(3)
    sigma = random_profile(tree, 11)
    for p in range(3):
        value, response = best_response(tree, sigma, p, with_response=True)
        assert response is not None
        assert expected_returns(tree, response)[p] == pytest.approx(value, abs=1e-12)
        # no single-information-set deviation from the pure response does better
        for i in tree.real_infosets():
            if tree.infoset_player[i] != p:
                continue
            s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
            for a in range(k):
                dev = response.copy()
                dev[s : s + k] = 0.0
                dev[s + a] = 1.0
                assert expected_returns(tree, dev)[p] <= value + 1e-12


@pytest.mark.parametrize("algo", ALGOS)
def test_simultaneous_updates_converge_too(algo: str) -> None:
    tree = classic(2)
    result = solve(tree, 3000, algo, alternating=False)
    assert exploitability(tree, result.average) < 5e-3


# --- Loki Kuhn -----------------------------------------------------------------------------


def test_loki_tree_and_progress() -> None:
    tree = build_tree(make_game("kuhn", variant="loki"))
    assert tree.chance_path_prob.sum() == pytest.approx(1.0)
    assert len(tree.chance_paths) == 60 * 3  # 5*4*3 deals x 3 first players
    np.testing.assert_allclose(tree.term_returns.sum(axis=1), 0.0, atol=1e-12)  # zero-sum
    assert tree.term_returns.max() <= 8 and tree.term_returns.min() >= -4  # bets cap at 4
    solver = CFRSolver(tree, "cfr+")
    nc = [nash_conv(tree, solver.average_policy())]
    for _ in range(2):
        solver.run(150)
        nc.append(nash_conv(tree, solver.average_policy()))
    assert nc[0] > nc[1] > nc[2]
    keys = set(tree.policy_dict(solver.average_policy()))
    # keys are the engine's strings: play a hand and check the table covers it
    state = make_game("kuhn", variant="loki").new_initial_state(seed=5)
    while not state.is_terminal():
        (p,) = state.current_players()
        assert state.information_state(p) in keys
        state.apply({p: state.legal_actions(p)[-1]})


# --- size limits, perfect recall, simultaneous moves ---------------------------------------


def test_too_large_is_refused_before_and_during_enumeration() -> None:
    game = make_game("kuhn", variant="classic", players=4)
    est = estimate_tree_size(game, samples=200)
    assert 4000 < est < 16000  # 7,886 histories
    with pytest.raises(TreeTooLargeError, match="estimated"):
        build_tree(game, max_nodes=1000)
    with pytest.raises(TreeTooLargeError, match="more than max_nodes=7,000"):
        build_tree(game, max_nodes=7000, estimate_samples=0)
    assert build_tree(game, max_nodes=8000).num_nodes == 7886


class _Rps(Game):
    """Rock-paper-scissors with simultaneous moves, optionally with a forgetful second round."""

    name = "test-rps"

    def __init__(self, forget: bool = False) -> None:
        self.num_players = 2
        self.forget = forget

    @property
    def info(self) -> GameInfo:
        rounds = 2 if self.forget else 1
        return GameInfo(2, -1.0, 1.0, utility_sum=0.0, max_game_length=rounds)

    def new_initial_state(self, seed: int | None = None) -> _RpsState:
        return _RpsState(self, seed)


class _RpsState(State):
    game: _Rps

    def __init__(self, game: _Rps, seed: int | None) -> None:
        super().__init__(game, seed)
        self.moves: list[dict[int, int]] = []

    def current_players(self) -> frozenset[int]:
        rounds = 2 if self.game.forget else 1
        return frozenset() if len(self.moves) >= rounds else frozenset({0, 1})

    def legal_actions(self, player: int) -> Sequence[Action]:
        return [0, 1, 2] if self.current_players() else []

    def observation(self, player: int) -> dict[str, Any]:
        return {}

    def prompt(self, player: int) -> str:
        return ""

    def is_terminal(self) -> bool:
        return not self.current_players()

    def returns(self) -> list[float]:
        a, b = self.moves[-1][0], self.moves[-1][1]
        r = 0.0 if a == b else (1.0 if (a - b) % 3 == 1 else -1.0)
        return [r, -r]

    def information_state(self, player: int) -> str:
        if self.game.forget:  # forgets its own first move: not perfect recall
            return f"round {len(self.moves)}"
        return "".join(str(m[player]) for m in self.moves)

    def _apply(self, actions: Mapping[int, Action]) -> None:
        self.moves.append(dict(actions))


def test_simultaneous_moves_are_sequentialised_without_leaking() -> None:
    tree = build_tree(_Rps())
    assert tree.num_infosets - tree.num_players == 2  # one information set per player
    result = solve(tree, 2000, "cfr+")
    real = np.isin(tree.slot_infoset, tree.real_infosets())
    assert real.sum() == 6
    np.testing.assert_allclose(result.average[real], 1 / 3, atol=0.02)
    assert exploitability(tree, result.average) < 1e-2
    assert CHANCE not in tree.node_seat


def test_imperfect_recall_is_rejected() -> None:
    with pytest.raises(NotPerfectRecallError):
        build_tree(_Rps(forget=True))


# --- policy files, the cfr agent, the CLI --------------------------------------------------


def _turn(state: Any, seat: int) -> Turn:
    spec = state.action_spec(seat)
    return Turn(
        turn=0,
        seat=seat,
        phase="act",
        observation=state.observation(seat),
        legal=spec.to_json(),
        deadline_s=5.0,
    )


def test_policy_document_plays_in_table_and_cfr_agents(tmp_path: Path) -> None:
    doc = policy_document(solve_game("kuhn", {"variant": "classic", "players": 2}, 500, "cfr+"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    data = read_policy(path)
    assert data["game"] == "kuhn" and data["params"]["players"] == 2
    assert data["meta"]["nash_conv"] < 0.01
    state = make_game("kuhn", variant="classic", players=2).new_initial_state(seed=1)
    for kind in ("table", "cfr"):
        agent = make_agent(kind, "a", policy=str(path), seed=0)
        asyncio.run(agent.setup())
        assert asyncio.run(agent.act(_turn(state, 0))) in (0, 1)
        assert agent.misses == 0  # type: ignore[attr-defined]


def test_cfr_agent_solves_on_start() -> None:
    agent = make_agent("cfr", "c", variant="loki", iterations=50, seed=0)
    asyncio.run(agent.setup())
    assert agent.meta["iterations"] == 50  # type: ignore[attr-defined]
    state = make_game("kuhn", variant="loki").new_initial_state(seed=3)
    (p,) = state.current_players()
    assert asyncio.run(agent.act(_turn(state, p))) in state.legal_actions(p)
    assert agent.misses == 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="iterations"):
        make_agent("cfr", "c", variant="loki", iterations=10**9)


def test_cli_solve_and_evaluate(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "k3.json"
    res = runner.invoke(
        solve_app, ["kuhn", "--players", "3", "--iterations", "400", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "NashConv" in res.output and out.exists()
    res = runner.invoke(solve_app, ["evaluate", str(out)])
    assert res.exit_code == 0, res.output
    reported = float(res.output.split("NashConv:")[1].split()[0])
    assert reported == pytest.approx(json.loads(out.read_text())["meta"]["nash_conv"], rel=1e-5)
    res = runner.invoke(
        solve_app,
        ["game", "kuhn", "-p", "variant=classic", "-p", "players=5", "--max-nodes", "10000"],
    )
    assert res.exit_code == 2 and "too large" in res.output
