"""backroom's solvers on OpenSpiel games (``game: openspiel``) give OpenSpiel's own numbers.

The tree is enumerated from the adapter, so its information sets are keyed by
OpenSpiel's strings and a policy converts by key
(``backroom.solvers.openspiel_compat``). Simultaneous games (Goofspiel, matrix
games) are compared on OpenSpiel's turn-based wrapper, which sequentialises
a joint move as backroom's tree does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from backroom.agents.kinds import make_agent
from backroom.bus.wire import Turn
from backroom.cli.solve import solve_app
from backroom.games import make_game
from backroom.solvers.cfr import CFRSolver
from backroom.solvers.evaluate import best_response_values, expected_returns, nash_conv
from backroom.solvers.tree import GameTree, NotPerfectRecallError, build_tree

pyspiel = pytest.importorskip("pyspiel")
from open_spiel.python.algorithms import exploitability as os_exploitability  # noqa: E402

from backroom.solvers.openspiel_compat import (  # noqa: E402
    from_openspiel_policy,
    openspiel_game,
    to_tabular_policy,
)

#: Small games the tree builder takes, of each kind the issue names.
SMALL: list[tuple[str, dict[str, Any]]] = [
    ("kuhn_poker", {}),
    ("kuhn_poker", {"players": 3}),
    ("leduc_poker", {}),
    ("liars_dice", {"dice_sides": 3}),
    ("goofspiel", {"num_cards": 3, "imp_info": True}),
    ("matrix_rps", {}),
    ("matrix_pd", {}),
    ("matrix_mp", {}),
]
SMALL_IDS = [f"{n}-{json.dumps(p)}" for n, p in SMALL]


def tree_of(name: str, **params: Any) -> GameTree:
    return build_tree(make_game("openspiel", name=name, **params))


def random_profile(tree: GameTree, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = rng.random(tree.num_slots) ** 3
    return r / np.bincount(tree.slot_infoset, r)[tree.slot_infoset]


@pytest.mark.parametrize(("name", "params"), SMALL, ids=SMALL_IDS)
def test_nash_conv_and_best_responses_are_openspiels(name: str, params: dict[str, Any]) -> None:
    tree = tree_of(name, **params)
    game = openspiel_game(tree)
    seen = set()
    for seed in (1, 2, 3):
        sigma = random_profile(tree, seed)
        theirs = os_exploitability.nash_conv(
            game, to_tabular_policy(tree, sigma, game), return_only_nash_conv=False
        )
        assert nash_conv(tree, sigma) == pytest.approx(theirs.nash_conv, abs=1e-9)
        mine = best_response_values(tree, sigma) - expected_returns(tree, sigma)
        np.testing.assert_allclose(mine, theirs.player_improvements, atol=1e-9)
        seen.add(round(theirs.nash_conv, 9))
    assert len(seen) == 3


#: Leduc's CFR has its own test below; Liar's Dice with a six-sided die is the slow one.
ITERATES = [(n, p) for n, p in SMALL if n != "leduc_poker"] + [
    pytest.param("liars_dice", {}, marks=pytest.mark.slow, id="liars_dice-six-sided")
]


@pytest.mark.parametrize(("name", "params"), ITERATES)
@pytest.mark.parametrize(("algo", "os_name"), [("cfr", "CFRSolver"), ("cfr+", "CFRPlusSolver")])
def test_cfr_iterates_are_openspiels(
    name: str, params: dict[str, Any], algo: str, os_name: str
) -> None:
    tree = tree_of(name, **params)
    game = openspiel_game(tree)
    theirs, ours = getattr(pyspiel, os_name)(game), CFRSolver(tree, algo)
    for _ in range(30):
        theirs.evaluate_and_update_policy()
    ours.run(30)
    ours_avg = ours.average_policy()
    diff = np.abs(from_openspiel_policy(tree, theirs.average_policy(), game) - ours_avg)
    assert diff.max() < 1e-9
    assert nash_conv(tree, ours_avg) == pytest.approx(
        pyspiel.nash_conv(game, theirs.average_policy()), abs=1e-9
    )


def test_cfr_on_leduc_reaches_openspiels_nash_conv() -> None:
    """The issue's check: the same NashConv as OpenSpiel's CFR after the same iterations, to 1e-9."""
    tree = tree_of("leduc_poker")
    assert tree.describe()["infosets"] == 936  # Leduc's 936 information sets
    game = pyspiel.load_game("leduc_poker")
    theirs, ours = pyspiel.CFRSolver(game), CFRSolver(tree, "cfr")
    for target in (10, 100):
        while ours.iteration < target:
            theirs.evaluate_and_update_policy()
            ours.run(1)
        their_nc = pyspiel.nash_conv(game, theirs.average_policy())
        assert nash_conv(tree, ours.average_policy()) == pytest.approx(their_nc, abs=1e-9)
    assert their_nc < 0.5  # it learned: uniform play is exploitable by about 4.7


def test_a_game_without_perfect_recall_is_refused() -> None:
    """Perfect-information Goofspiel's strings forget the order of one's own bids."""
    with pytest.raises(NotPerfectRecallError, match="perfect recall"):
        tree_of("goofspiel", num_cards=4, points_order="descending")


def test_solve_cli_and_the_cfr_and_table_agents_play_leduc(tmp_path: Path) -> None:
    out = tmp_path / "leduc.json"
    result = CliRunner().invoke(
        solve_app,
        [
            "game",
            "openspiel",
            "-p",
            "name=leduc_poker",
            "-n",
            "200",
            "--algo",
            "cfr+",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "NashConv" in result.output and "'infosets': 936" in result.output
    doc = json.loads(out.read_text())
    assert doc["game"] == "openspiel" and doc["params"] == {"name": "leduc_poker"}
    assert doc["meta"]["nash_conv"] < 0.2
    # the file plays at the table: keyed by OpenSpiel's information states
    table = make_agent("table", "t", policy=str(out))
    cfr = make_agent("cfr", "c", game="openspiel", params={"name": "leduc_poker"}, iterations=50)
    import asyncio

    asyncio.run(cfr.setup())
    state = make_game("openspiel", name="leduc_poker").new_initial_state(seed=4)
    while not state.is_terminal():
        (seat,) = state.current_players()
        agent = (table, cfr)[seat]
        turn = Turn(
            match="m",
            turn=1,
            seat=seat,
            phase="act",
            observation=state.observation(seat),
            legal=state.action_spec(seat).to_json(),
            deadline_s=5,
        )
        state.apply({seat: asyncio.run(agent.act(turn))})
    assert table.misses == 0 and cfr.misses == 0  # every information state was in the tables


def test_solve_cli_names_the_bad_game() -> None:
    result = CliRunner().invoke(solve_app, ["game", "openspiel", "-p", "name=leduk_poker"])
    assert result.exit_code == 2 and "did you mean leduc_poker" in result.output
