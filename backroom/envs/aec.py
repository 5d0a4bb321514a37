"""Any backroom game as a PettingZoo AEC environment: ``pettingzoo_env(game, **params)``.

For a researcher whose trainer speaks PettingZoo: the same engine the referee
runs, played one agent at a time. Agents are ``player_0`` .. ``player_{n-1}``
(seat order). The choices, written down in docs/games.md:

* Observations are backroom's own: ``{"json": <the seat's observation as JSON
  text>}``, plus ``action_mask`` when the action space is ``Discrete``. They
  are structured data (histories, names, messages), not tensors, so they are
  given whole as text; featurise them as your learner needs.
* ``infos[agent]`` of the agent to move holds ``phase`` (``act`` or ``talk``),
  ``legal`` (the engine's ``ActionSpec`` as JSON), ``action_mask`` and, unless
  ``prompts=False``, ``prompt``: the text an LLM agent gets from the referee.
* The action space comes from ``backroom.envs.spaces`` (found by seeded
  playouts); a game with talk phases answers ``{"act": ..., "message": str}``,
  and the phase says which part counts (a bare value is taken for the phase's
  part). An illegal answer raises ``IllegalActionError`` with the engine's reason.
* Simultaneous moves are asked one agent after the other, in seat order,
  from the same state; the move is applied once the last has answered, so no
  one sees another's answer early.
* Rewards are what the engine pays, when it pays it: per-round rewards as
  rounds end, the rest of ``returns()`` at the end. Their sum is the return.
* Chance comes from the reset seed, as for a match's seed: the same seed and
  answers replay the same play. A reset without a seed draws the next one from
  the last seed given (or from fresh entropy before any).
"""

from __future__ import annotations

import json
import random
from typing import Any

import gymnasium
import numpy as np
from pettingzoo import AECEnv

from backroom.envs.spaces import (
    MAX_OBSERVATION_CHARS,
    ActCodec,
    AsciiText,
    act_codec,
    probe,
)
from backroom.games.base import Action, Game, IllegalActionError, State, make_game

#: Seeded playouts that find a game's action space (``probe_playouts``).
PROBE_PLAYOUTS = 16


class BackroomAEC(AECEnv):
    """A backroom game, one agent at a time; see the module docstring."""

    def __init__(
        self,
        game: Game,
        render_mode: str | None = None,
        prompts: bool = True,
        probe_playouts: int = PROBE_PLAYOUTS,
    ) -> None:
        super().__init__()
        self.game, self.render_mode, self.prompts = game, render_mode, prompts
        self.metadata = {
            "name": f"backroom_{game.name}_v0",
            "render_modes": ["human", "ansi"],
            "is_parallelizable": False,
        }
        self.possible_agents = [f"player_{i}" for i in range(game.num_players)]
        seen = probe(game, probe_playouts)
        self.codec: ActCodec | None = (
            act_codec(game, seen) if seen.choices or seen.schemas else None
        )
        self.talk_chars = seen.talk_chars if seen.talk else 0
        self.action_spaces = {a: self._action_space() for a in self.possible_agents}
        obs: dict[str, gymnasium.Space[Any]] = {"json": AsciiText(MAX_OBSERVATION_CHARS)}
        if self._mask_in_observation:
            assert self.codec is not None
            obs["action_mask"] = gymnasium.spaces.Box(0, 1, (self._mask_size,), dtype=np.int8)
        self.observation_spaces = {a: gymnasium.spaces.Dict(obs) for a in self.possible_agents}
        self._seeder = random.Random()
        self.state: State = game.new_initial_state(0)

    # --- spaces ---------------------------------------------------------------------------

    def _action_space(self) -> gymnasium.Space[Any]:
        message = AsciiText(self.talk_chars)
        if self.codec is None:
            return message
        if not self.talk_chars:
            return self.codec.space
        return gymnasium.spaces.Dict({"act": self.codec.space, "message": message})

    @property
    def _mask_in_observation(self) -> bool:
        return self.codec is not None and self.codec.masked and not self.talk_chars

    @property
    def _mask_size(self) -> int:
        assert self.codec is not None
        return int(self.codec.space.n)  # type: ignore[attr-defined]

    def observation_space(self, agent: str) -> gymnasium.Space[Any]:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.Space[Any]:
        return self.action_spaces[agent]

    # --- the AEC cycle --------------------------------------------------------------------

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        if seed is not None:
            self._seeder = random.Random(seed)
            play_seed = seed
        else:
            play_seed = self._seeder.randrange(2**31)
        self.state = self.game.new_initial_state(play_seed)
        self.agents = self.possible_agents[:]
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.infos: dict[str, dict[str, Any]] = {a: {} for a in self.agents}
        self._paid = [0.0] * self.game.num_players
        self._pending: dict[int, Action] = {}
        self._queue: list[int] = []
        self._next_turn()

    def _next_turn(self) -> None:
        """Queue the state's movers in seat order and select the first."""
        if self.state.is_terminal():
            self.terminations = dict.fromkeys(self.agents, True)
            self.infos = {a: {} for a in self.agents}
            self.agent_selection = self.agents[0]
            return
        self._queue = sorted(self.state.current_players())
        self._select()

    def _select(self) -> None:
        seat = self._queue[0]
        agent = self.possible_agents[seat]
        self.agent_selection = agent
        spec = self.state.action_spec(seat)
        info: dict[str, Any] = {"phase": self.state.phase, "legal": spec.to_json()}
        mask = self._action_mask(seat)
        if mask is not None:
            info["action_mask"] = mask
        if self.prompts:
            info["prompt"] = self.state.prompt(seat)
        self.infos = {a: info if a == agent else {} for a in self.agents}

    def _action_mask(self, seat: int) -> Any:
        """The mask ``action_space.sample`` takes: an array, or a dict of them with talk."""
        act: np.ndarray | None = None
        if self.codec is not None and self.codec.masked:
            if self.state.phase == "talk":  # the act part counts for nothing in a talk phase
                act = np.ones(self._mask_size, dtype=np.int8)
            else:
                act = self.codec.encode_mask(self.state.action_spec(seat))
        if self.talk_chars and self.codec is not None:
            return {"act": act, "message": None}
        return act

    def observe(self, agent: str) -> dict[str, Any]:
        seat = self.possible_agents.index(agent)
        seen = json.dumps(self.state.observation(seat), ensure_ascii=True, sort_keys=True)
        out: dict[str, Any] = {"json": seen}
        if self._mask_in_observation:
            movers = self._queue if not self.state.is_terminal() else []
            if movers and movers[0] == seat:
                out["action_mask"] = self._action_mask(seat)
            else:
                out["action_mask"] = np.zeros(self._mask_size, dtype=np.int8)
        return out

    def step(self, action: Any) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        seat = self._queue[0]
        # checked before anything moves: a refused answer leaves the environment as it was
        self._pending[seat] = self.state.check_action(seat, self.decode(seat, action))
        self._queue.pop(0)
        self._cumulative_rewards[agent] = 0.0
        self._clear_rewards()
        if self._queue:
            self._select()
        else:
            self.state.apply(self._pending)
            self._pending = {}
            self._pay()
            self._next_turn()
        self._accumulate_rewards()

    def decode(self, seat: int, action: Any) -> Action:
        """An answer from the action space as the engine's action, for the phase in play."""
        talk = self.state.phase == "talk"
        if isinstance(action, dict) and {"act", "message"} & set(action):
            action = action.get("message" if talk else "act")
        if talk:
            return "" if action is None else str(action)
        if self.codec is None:
            raise IllegalActionError(f"{self.game.name} has no act phase")
        try:
            return self.codec.decode(action, self.state.action_spec(seat))
        except (TypeError, ValueError, IndexError) as exc:
            raise IllegalActionError(
                f"{action!r} is not in {self.action_spaces[self.possible_agents[seat]]}: {exc}"
            ) from None

    def _pay(self) -> None:
        """Hand out what the engine paid since the last move: rounds as they end, the rest at the end."""
        state = self.state
        if state.is_terminal():
            paid = state.returns()
        else:
            paid = [sum(r[p] for r in state.round_rewards) for p in range(self.game.num_players)]
        for seat, agent in enumerate(self.possible_agents):
            self.rewards[agent] = float(paid[seat] - self._paid[seat])
        self._paid = list(paid)

    # --- rendering ------------------------------------------------------------------------

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() without a render_mode: pass render_mode='ansi'")
            return None
        seat = self.possible_agents.index(self.agent_selection)
        text = (
            self.state.prompt(seat) if not self.state.is_terminal() else str(self.state.returns())
        )
        if self.render_mode == "human":
            print(text)
            return None
        return text

    def close(self) -> None:
        """Nothing to release: the engine holds no resources."""


def pettingzoo_env(
    game: str | Game,
    *,
    render_mode: str | None = None,
    prompts: bool = True,
    probe_playouts: int = PROBE_PLAYOUTS,
    **params: Any,
) -> BackroomAEC:
    """A PettingZoo AEC environment of ``game`` (a registered name, or a built ``Game``).

    ``params`` are the game's parameters, as a config's ``params``.
    """
    if isinstance(game, Game):
        if params:
            raise ValueError(
                "pettingzoo_env got a built game and parameters: pass one or the other"
            )
        built = game
    else:
        built = make_game(game, **params)
    return BackroomAEC(
        built, render_mode=render_mode, prompts=prompts, probe_playouts=probe_playouts
    )
