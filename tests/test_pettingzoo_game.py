"""``game: pettingzoo``: PettingZoo's classic environments seated at the referee.

Rock-paper-scissors and tic-tac-toe keep the game contract (``check_game``),
and play whole matches over a real broker, with a talk channel attached by the
match spec as for a native game; the episode records replay through the
engine. Bad configs are refused at the parameter to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium
import pytest
from pettingzoo import AECEnv

from backroom.agents.base import Agent
from backroom.bus.broker import Broker
from backroom.bus.wire import ChannelSpec, MatchSpec, Turn
from backroom.games import IllegalActionError, make_game
from backroom.games.testing import check_game
from backroom.runner.config import ConfigError, parse_config

from .conftest import Runner, agents, load_factor, stack

RPS = {
    "env": "pettingzoo.classic.rps_v2:env",
    "kwargs": {"max_cycles": 3},
    "action_names": ["rock", "paper", "scissors"],
    "min_utility": -3,
    "max_utility": 3,
    "utility_sum": 0,
}
TICTACTOE = {"env": "pettingzoo.classic.tictactoe_v3", "utility_sum": 0, "max_moves": 9}


@pytest.mark.parametrize("params", [RPS, TICTACTOE], ids=["rps", "tictactoe"])
def test_classic_environments_keep_the_game_contract(params: dict[str, Any]) -> None:
    report = check_game("pettingzoo", playouts=15, **params)
    assert report.seen.sums == {0.0} and report.seen.terminals == 15


def test_rock_paper_scissors_by_name() -> None:
    game = make_game("pettingzoo", **RPS)
    assert game.num_players == 2 and game.info.max_game_length == 10_000
    state = game.new_initial_state(0)
    assert "Legal actions: 0 (rock), 1 (paper), 2 (scissors)" in state.prompt(0)
    while not state.is_terminal():
        (seat,) = state.current_players()
        state.apply({seat: state.check_action(seat, " Paper" if seat == 0 else "0")})
    assert state.returns() == [3.0, -3.0]  # paper covers rock, three cycles
    assert state.observation(1)["returns"] == [3.0, -3.0]
    with pytest.raises(IllegalActionError, match="legal: 0 \\(rock\\), 1 \\(paper\\)"):
        game.new_initial_state(0).check_action(0, "lizard")


def test_a_play_that_reaches_max_moves_ends_truncated() -> None:
    game = make_game("pettingzoo", env=RPS["env"], kwargs={"max_cycles": 50}, max_moves=5)
    state = game.new_initial_state(1)
    moves = 0
    while not state.is_terminal():
        (seat,) = state.current_players()
        state.apply({seat: 0})
        moves += 1
    assert moves == 5 and state.observation(0)["truncated"] is True


class Chatty(Agent):
    """Says what it will play, then plays paper where it can, else the first legal move."""

    async def talk(self, turn: Turn) -> str:
        return f"{self.id} will play paper"

    async def act(self, turn: Turn) -> Any:
        names = turn.legal.get("names", [])
        return "paper" if "paper" in names else turn.legal["choices"][0]


async def test_classic_environments_play_over_the_broker(broker: Broker, tmp_path: Path) -> None:
    table = ChannelSpec(name="table", members=[0, 1], opens="before_act", max_messages=1)
    specs = {
        f"{kind}-{seed}": MatchSpec(
            game="pettingzoo",
            params=params,
            seats=["chatty", "rand"],
            channels=[table],
            seed=seed,
            run="pz",
            turn_timeout_s=5 * load_factor(),
        )
        for kind, params in (("rps", RPS), ("ttt", TICTACTOE))
        for seed in (1, 2)
    }
    players = [Chatty("chatty"), *agents(("rand", "random"))]
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        for match, spec in specs.items():
            await run.submit(match, spec)
        episodes = await run.wait(list(specs), timeout=60 * load_factor())
    for ep in episodes:
        assert ep.reason == "normal", ep.detail
        assert sum(ep.raw_returns) == 0 and not ep.timeouts
        acts = [a for a in ep.actions if a.phase == "act"]
        talk = [a for a in ep.actions if a.phase == "talk"]
        assert talk and all(a.action == f"{a.agent} will play paper" for a in talk if a.seat == 0)
        heard = [d for d in ep.deliveries if d.to_seat == 1 and d.channel == "table"]
        assert any("chatty will play paper" in d.text for d in heard)
        # the record replays through the engine: the same seed and moves, the same returns
        state = make_game(ep.game, **ep.params).new_initial_state(ep.seed)
        for a in acts:
            state.apply({a.seat: a.action})
        assert state.is_terminal() and state.returns() == ep.raw_returns
    rps = [ep for ep in episodes if ep.params["env"] == RPS["env"]]
    assert all(a.action == 1 for ep in rps for a in ep.actions if a.phase == "act" and a.seat == 0)
    assert len({tuple(a.action for a in ep.actions) for ep in rps}) == 2  # seeds differ


class BoxActions(AECEnv):  # type: ignore[misc]
    """An environment whose agents answer with vectors: not seatable."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata = {"name": "box_actions_v0"}
        self.possible_agents = ["player_0", "player_1"]

    def action_space(self, agent: str) -> gymnasium.Space[Any]:
        return gymnasium.spaces.Box(0.0, 1.0, (2,))


def box_env() -> BoxActions:
    return BoxActions()


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (
            {"env": "no_such_package.game:env"},
            "params.env: unknown pettingzoo env 'no_such_package.game:env': register it under "
            "the entry point group backroom.pettingzoo",
        ),
        ({"env": "pettingzoo.classic.rps_v2:nope"}, "unknown pettingzoo env"),
        (
            {"env": RPS["env"], "kwargs": {"num_actions": 4}},
            "params.kwargs: kwargs: the factory refused {'num_actions': 4}",
        ),
        (
            {"env": RPS["env"], "action_names": ["rock"]},
            "params.action_names: action_names: 1 names for 3",
        ),
        ({"env": "box_actions"}, "only Discrete spaces"),
        ({"env": RPS["env"], "max_moves": 0}, "params.max_moves: max_moves must be at least 1"),
        ({"env": "rps", "kwargs": {"render_mode": "human"}}, "rps takes no 'render_mode'"),
        ({"env": "go", "kwargs": {"board_size": 10**6}}, "go's board_size must be a number"),
        ({"env": RPS["env"], "min_utility": 2, "max_utility": 1}, "min_utility > max_utility"),
        ({"env": RPS["env"], "kwarg": {}}, "params.kwarg: pettingzoo has no parameter 'kwarg'"),
    ],
)
def test_bad_configs_are_refused_at_the_parameter(params: dict[str, Any], says: str) -> None:
    data = {
        "run": "t",
        "game": "pettingzoo",
        "params": params,
        "agents": [{"id": "a", "kind": "random"}, {"id": "b", "kind": "random"}],
        # an environment of the config's own, named by the config's author: by name only
        "pettingzoo_envs": {"box_actions": "tests.test_pettingzoo_game:box_env"},
    }
    with pytest.raises(ConfigError) as refused:
        parse_config(data, source="bad.yaml")
    assert says in str(refused.value)
