"""backroom's games as PettingZoo AEC environments (``backroom.envs.pettingzoo_env``).

PettingZoo's own ``api_test`` on every registered game at its defaults (the
``pettingzoo`` engine included: rock-paper-scissors, PettingZoo to backroom
and back) and on the talk variants; then what api_test does not look at: the
rewards add up to the engine's returns, a seed replays, simultaneous answers
stay hidden until the move, talk is text that reaches the other seats, and a
bad answer is refused with the engine's reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from pettingzoo.test import api_test

from backroom.envs import pettingzoo_env
from backroom.envs.aec import BackroomAEC
from backroom.games import (
    CHANCE,
    ActionSpec,
    Game,
    GameInfo,
    IllegalActionError,
    State,
    make_game,
    registered_games,
)
from backroom.games.testing import check_game

from .test_user_paths import without_modules

#: Variants beside the defaults: the engines' talk phases (the action space gets a
#: Text message) and Loki's three-player Kuhn.
TALK = [
    ("trust_and_split", {"rounds": 2}),
    ("beauty_contest", {"players": 4, "rounds": 2}),
    ("bertrand", {"rounds": 5, "talk_rounds": 1}),
]
VARIANTS = [*TALK, ("kuhn", {"variant": "loki"})]


def quiet_api_test(env: BackroomAEC) -> None:
    # api_test warns where an environment departs from Box/Discrete conventions
    # (text observations, Dict actions): those departures are the design, documented.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(env, num_cycles=1000)


@pytest.mark.parametrize("name", sorted(registered_games()))
def test_api_test_passes_on_every_game(name: str) -> None:
    quiet_api_test(pettingzoo_env(name))


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=[n for n, _ in VARIANTS])
def test_api_test_passes_on_variants(name: str, params: dict[str, Any]) -> None:
    env = pettingzoo_env(name, **params)
    quiet_api_test(env)
    space = env.action_space("player_0")
    if (name, params) in TALK:
        assert isinstance(space, gymnasium.spaces.Dict)
        assert isinstance(space["message"], gymnasium.spaces.Text)
    else:
        assert space == gymnasium.spaces.Discrete(3)  # fold, call, raise


#: OpenSpiel games through the same wrapper (``game: openspiel``; Leduc, its default, is
#: in the registered sweep above): chance with a hidden die, a simultaneous game, a
#: perfect-information board game.
OPENSPIEL = [
    {"name": "liars_dice", "numdice": 1, "dice_sides": 3},
    {"name": "goofspiel", "num_cards": 3, "imp_info": True},
    {"name": "tic_tac_toe"},
]


@pytest.mark.parametrize("params", OPENSPIEL, ids=[p["name"] for p in OPENSPIEL])
def test_api_test_passes_on_openspiel_games(params: dict[str, Any]) -> None:
    env = pettingzoo_env("openspiel", **params)
    quiet_api_test(env)
    assert isinstance(env.action_space("player_0"), gymnasium.spaces.Discrete)


def play(env: BackroomAEC, seed: int, sample_seed: int) -> tuple[dict[str, float], list[Any]]:
    """One whole play with masked random answers; the rewards each agent got, and what it saw."""
    env.reset(seed=seed)
    for agent in env.possible_agents:
        env.action_space(agent).seed(sample_seed)
    totals = dict.fromkeys(env.possible_agents, 0.0)
    seen: list[Any] = []
    for agent in env.agent_iter():
        obs, reward, terminated, truncated, info = env.last()
        totals[agent] += reward
        seen.append((agent, obs["json"], info.get("phase")))
        done = terminated or truncated
        env.step(None if done else env.action_space(agent).sample(info.get("action_mask")))
    return totals, seen


@pytest.mark.parametrize(
    ("name", "params"),
    [("kuhn", {}), ("ipd", {"rounds": 5}), ("split_nocomm", {"rounds": 3}), *VARIANTS],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_rewards_add_up_to_the_returns_and_a_seed_replays(
    name: str, params: dict[str, Any]
) -> None:
    env = pettingzoo_env(name, prompts=False, **params)
    totals, seen = play(env, seed=3, sample_seed=5)
    returns = env.state.returns()
    assert env.state.is_terminal()
    assert [totals[a] for a in env.possible_agents] == pytest.approx(returns)
    assert play(env, seed=3, sample_seed=5) == (totals, seen)
    others = [play(env, seed=s, sample_seed=s)[1] for s in (4, 6)]
    assert any(o != seen for o in others)  # the comparison could fail


def test_infos_carry_the_prompt_and_the_legal_answers() -> None:
    env = pettingzoo_env("kuhn")
    env.reset(seed=0)
    _, _, _, _, info = env.last()
    state = env.state
    seat = env.possible_agents.index(env.agent_selection)
    assert info["prompt"] == state.prompt(seat)
    assert info["legal"] == {"choices": [0, 1], "names": ["pass", "bet"]}
    assert info["action_mask"].tolist() == [1, 1] and info["phase"] == "act"
    assert json.loads(env.observe(env.agent_selection)["json"]) == state.observation(seat)
    # reset(seed=s) deals what a referee's match with seed s deals
    assert state.observation(seat) == make_game("kuhn").new_initial_state(0).observation(seat)


def test_simultaneous_answers_stay_hidden_until_all_have_answered() -> None:
    env = pettingzoo_env("ipd", rounds=3)
    env.reset(seed=1)
    assert env.agent_selection == "player_0"
    before = env.observe("player_1")["json"]
    env.step(1)  # player_0's answer waits for player_1's
    assert env.agent_selection == "player_1"
    assert env.observe("player_1")["json"] == before and env.state.current_round() == 1
    env.step(0)
    history = json.loads(env.observe("player_1")["json"])["history"]
    assert [(h["mine"], h["theirs"]) for h in history] == [("A", "B")]
    assert env.rewards == {"player_0": 5.0, "player_1": 0.0}


def test_talk_is_text_and_reaches_the_other_seat() -> None:
    env = pettingzoo_env("trust_and_split", rounds=1, first_speaker=0)
    env.reset(seed=2)
    _, _, _, _, info = env.last()
    assert info["phase"] == "talk" and info["action_mask"]["message"] is None
    speaker = env.agent_selection
    env.step({"act": 0, "message": "I hold scissors; split 5-5?"})
    other = env.agent_selection
    assert other != speaker
    assert (
        "I hold scissors; split 5-5?"
        in json.loads(env.observe(other)["json"])["messages"][0].values()
    )
    env.step("fine by me")  # a bare string in a talk phase is the message


def test_a_bad_answer_is_refused_with_the_engines_reason() -> None:
    env = pettingzoo_env("trust_and_split", rounds=1, first_speaker=0)
    env.reset(seed=2)
    with pytest.raises(IllegalActionError, match="500"):
        env.step("x" * 501)  # longer than the talk phase allows
    env.step("")
    env.step("")
    assert env.last()[4]["phase"] == "act"
    with pytest.raises(IllegalActionError):
        env.step({"act": 11, "message": ""})  # 10 coins to split
    with pytest.raises(ValueError, match="a built game and parameters"):
        pettingzoo_env(make_game("ipd"), rounds=3)


def test_spaces_follow_the_games_answers() -> None:
    assert pettingzoo_env("kuhn").action_space("player_0") == gymnasium.spaces.Discrete(2)
    split = pettingzoo_env("split_nocomm").action_space("player_1")
    assert isinstance(split, gymnasium.spaces.MultiDiscrete) and split.nvec.tolist() == [11] * 3
    box = pettingzoo_env("bertrand", rounds=3).action_space("player_0")
    assert isinstance(box, gymnasium.spaces.Box) and box.high.tolist() == [14.0]
    env = pettingzoo_env("bertrand", rounds=2)
    env.reset(seed=0)
    env.step(np.array([15.0], dtype=np.float32))  # clipped into the state's own range
    env.step(np.array([6.0], dtype=np.float32))
    history = json.loads(env.observe("player_0")["json"])["history"]
    assert (history["prices"], history["rival_prices"]) == ([14.0], [6.0])


def test_without_the_extra_the_import_says_what_to_install(tmp_path: Path) -> None:
    env = without_modules(tmp_path, "pettingzoo")
    code = "from backroom.envs import pettingzoo_env"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 1
    assert (
        'ImportError: backroom.envs needs the "envs" extra (pettingzoo not installed): '
        "pip install 'backroom[envs]'" in out.stderr
    )
    code = "from backroom.games import make_game; make_game('pettingzoo')"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True
    )
    assert "cannot import 'pettingzoo.classic.rps_v2' (No module named 'pettingzoo') " in out.stderr
    assert "(PettingZoo's: pip install 'backroom[envs]')" in out.stderr


class Echo(Game):
    """Chance draws 0..9; the one player must say it back: one legal choice, seed-dependent."""

    name = "echo"
    num_players = 1
    info = GameInfo(1, 0.0, 0.0, 0.0, 1, 1, 10)

    def __init__(self) -> None:
        self.state_class = EchoState


class EchoState(State):
    def __init__(self, game: Game, seed: int | None) -> None:
        super().__init__(game, seed)
        self.drawn: int | None = None
        self.said: int | None = None

    def current_players(self) -> frozenset[int]:
        if self.said is not None:
            return frozenset()
        return frozenset({CHANCE} if self.drawn is None else {0})

    def chance_outcomes(self) -> list[tuple[Any, float]]:
        return [(n, 0.1) for n in range(10)]

    def _apply_chance(self, outcome: Any) -> None:
        self.drawn = outcome

    def legal_actions(self, player: int) -> list[int]:
        return [self.drawn] if self.drawn is not None else []

    def _apply(self, actions: Mapping[int, Any]) -> None:
        self.said = actions[0]

    def is_terminal(self) -> bool:
        return self.said is not None

    def observation(self, player: int) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def prompt(self, player: int) -> str:
        return f"Say {self.drawn}."


def test_a_choice_the_probe_never_met_says_to_probe_more() -> None:
    check_game(Echo, playouts=5)
    env = pettingzoo_env(Echo(), probe_playouts=1)
    assert env.action_space("player_0") == gymnasium.spaces.Discrete(1)
    seen = Echo().new_initial_state(0).drawn
    other = next(s for s in range(1, 50) if Echo().new_initial_state(s).drawn != seen)
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match=r"never came up .* more probe_playouts"):
        env.reset(seed=other)
    wide = pettingzoo_env(Echo(), probe_playouts=100)
    assert wide.action_space("player_0") == gymnasium.spaces.Discrete(10)
    wide.reset(seed=other)
    wide.step(wide.last()[4]["action_mask"].argmax())
    assert wide.state.is_terminal()


def test_answers_of_mixed_shapes_are_refused() -> None:
    class Mixed(Echo):
        def __init__(self) -> None:
            self.state_class = MixedState

    class MixedState(EchoState):
        def action_spec(self, player: int) -> ActionSpec:
            if self.drawn is not None and self.drawn % 2:
                return ActionSpec(schema={"type": "integer", "minimum": 0, "maximum": 9})
            return super().action_spec(player)

        def check_action(self, player: int, action: Any) -> Any:
            return action  # whatever the spec offered

    with pytest.raises(ValueError, match=r"answers with .*not mixed"):
        pettingzoo_env(Mixed())
