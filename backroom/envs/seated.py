"""``game: pettingzoo``: a PettingZoo AEC environment seated at backroom's referee.

Any AEC environment whose agents act from ``Discrete`` spaces (the classic
board and card games: ``rps``, ``tictactoe``, ``connect_four``, ...) becomes
a backroom engine, so agents of every kind play it over the bus, with table
talk and private channels attached by the match config as for the native
games. Seat ``i`` is ``possible_agents[i]``.

Why these choices:

* The environment is named, never imported from a path in the parameters
  (``env: tictactoe``): a spec travels in match requests, start messages,
  episode records and league stores, and every reader builds the game from
  it, so a parameter that named code would run that code in every reader.
  A name resolves in the reader's own registry (:func:`resolve_env`): the
  built-in classic environments, the entry point group ``backroom.pettingzoo``
  of the installed distributions, and what the operator registered for this
  process and the processes it starts (a run config's ``pettingzoo_envs``,
  passed on in ``BACKROOM_PETTINGZOO_ENVS``). An unknown name is refused in
  one line, and nothing is imported for it. ``kwargs`` are JSON values
  handed to the registered factory.
* AEC turns are one agent at a time, so ``current_players()`` is that agent;
  terminated or truncated agents are stepped with ``None`` by the engine, as
  AEC requires, and never asked. A seat's return is the sum of every reward
  the environment handed it.
* An environment's chance is inside it: it comes from ``reset(seed)``. There
  are no explicit chance nodes (solvers do not apply), and a state built with
  ``seed=None`` draws a fresh seed. ``clone`` replays the actions on a new
  environment from the same seed, because AEC environments do not deep-copy
  (PettingZoo's pickling rebuilds them fresh); so the environment must be
  deterministic given its seed, which ``check_game`` verifies.
* PettingZoo declares no utility bounds: the config may (``min_utility``,
  ``max_utility``, ``utility_sum``); undeclared bounds are infinite.
  ``max_moves`` bounds a play: one that reaches it ends there, marked
  ``truncated`` in the observation, so ``max_game_length`` holds.

Nothing here imports PettingZoo: the factory does.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backroom.games.base import (
    Action,
    ActionSpec,
    Game,
    GameInfo,
    IllegalActionError,
    State,
    register,
)

EXAMPLE_ENV = "rps"
#: What the ``envs`` extra installs: a missing one is named with the extra to install.
ENVS_EXTRA = ("pettingzoo", "gymnasium", "pygame")
#: Entry point group of environments from other distributions: ``name = "pkg.mod:factory"``.
ENV_ENTRY_POINTS = "backroom.pettingzoo"
#: Environments the operator registered for a process and the processes it starts (JSON
#: ``{name: "pkg.mod:factory"}``): ``backroom run`` sets it from the config's ``pettingzoo_envs``.
ENVS_ENV = "BACKROOM_PETTINGZOO_ENVS"

#: The classic environments, by short name. Their documented import paths
#: (``pettingzoo.classic.rps_v2:env``, ``pettingzoo.classic.rps_v2``) are accepted as
#: names of the same entries (matched as strings, never imported as given), so earlier
#: configs and records still build.
BUILTIN_ENVS: dict[str, str] = {
    "rps": "pettingzoo.classic.rps_v2:env",
    "tictactoe": "pettingzoo.classic.tictactoe_v3:env",
    "connect_four": "pettingzoo.classic.connect_four_v3:env",
    "chess": "pettingzoo.classic.chess_v6:env",
    "go": "pettingzoo.classic.go_v5:env",
    "hanabi": "pettingzoo.classic.hanabi_v5:env",
    "leduc_holdem": "pettingzoo.classic.leduc_holdem_v4:env",
    "texas_holdem": "pettingzoo.classic.texas_holdem_v4:env",
    "texas_holdem_no_limit": "pettingzoo.classic.texas_holdem_no_limit_v6:env",
}
_ALIASES: dict[str, str] = {
    alias: name for name, path in BUILTIN_ENVS.items() for alias in (path, path.partition(":")[0])
}
#: The keyword arguments a built-in environment takes from a spec, each with its bounds:
#: any other (``render_mode``, screen sizes) is refused, so that a spec can neither make a
#: reader draw a window nor build a board of any size (``go``'s ``board_size``).
BUILTIN_KWARGS: dict[str, dict[str, tuple[float, float]]] = {
    "rps": {"num_actions": (3, 5), "max_cycles": (1, 10_000)},
    "go": {"board_size": (2, 19), "komi": (-400, 400)},
    "hanabi": {
        "colors": (1, 5),
        "ranks": (1, 5),
        "players": (2, 5),
        "hand_size": (1, 5),
        "max_information_tokens": (1, 8),
        "max_life_tokens": (1, 3),
    },
    "texas_holdem": {"num_players": (2, 10)},
    "texas_holdem_no_limit": {"num_players": (2, 10)},
}
#: What an operator may register: a name, and an import path ``package.module:factory``.
ENV_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
#: Registered in this process (``register_env``), by name.
_registered: dict[str, str] = {}


def register_env(name: str, path: str) -> None:
    """Make ``name`` build the factory at ``path`` here and in the processes started from here.

    For the operator's own configuration only (a run config's ``pettingzoo_envs``): the
    variable ``ENVS_ENV`` carries the registrations to the referee and agents that
    ``backroom run`` starts, which inherit its environment.
    """
    if not ENV_NAME.match(name) or name in BUILTIN_ENVS or name in _ALIASES:
        raise ValueError(f"pettingzoo_envs: {name!r} is not a free name (letters, digits, _ . -)")
    if not IMPORT_PATH.match(path):
        raise ValueError(f"pettingzoo_envs.{name}: {path!r} is not 'package.module:factory'")
    _registered[name] = path
    exported = {**_from_environment(), name: path}
    os.environ[ENVS_ENV] = json.dumps(exported, sort_keys=True)


def _from_environment() -> dict[str, str]:
    """The registrations this process was started with (``ENVS_ENV``); a bad one is ignored."""
    try:
        data = json.loads(os.environ.get(ENVS_ENV) or "{}")
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: v
        for k, v in data.items()
        if isinstance(k, str) and isinstance(v, str) and ENV_NAME.match(k) and IMPORT_PATH.match(v)
    }


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENV_ENTRY_POINTS)}


def known_envs() -> list[str]:
    """Every name this process resolves: built-ins, entry points, registrations."""
    return sorted({*BUILTIN_ENVS, *_entry_points(), *_from_environment(), *_registered})


def resolve_env(name: object) -> Callable[..., Any]:
    """The factory registered under ``name``; ``ValueError`` in one line for any other name.

    Nothing is imported for a name that is not registered here: ``name`` comes from
    match specs and records, which anyone on the bus or anyone who sent a file may write.
    """
    if not isinstance(name, str):
        raise ValueError(f"env must be a registered pettingzoo env's name, not {name!r:.80}")
    key = _ALIASES.get(name, name)
    if key in BUILTIN_ENVS:
        return _import(BUILTIN_ENVS[key], key)
    eps = _entry_points()
    if key in eps:
        try:
            factory = eps[key].load()
        except ImportError as exc:
            raise ValueError(
                f"pettingzoo env {key!r} (entry point) failed to load: {exc}"
            ) from None
        return _callable(factory, key)
    path = _registered.get(key) or _from_environment().get(key)
    if path is not None:
        return _import(path, key)
    raise ValueError(
        f"unknown pettingzoo env {name!r:.80}: register it under the entry point group "
        f"{ENV_ENTRY_POINTS} (or in the run config's pettingzoo_envs); "
        f"known: {', '.join(known_envs())}"
    )


def check_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """A built-in environment's ``kwargs`` against its declared ones (``BUILTIN_KWARGS``)."""
    key = _ALIASES.get(name, name)
    if key not in BUILTIN_ENVS:
        # The operator's own environment: its factory checks its arguments, but no spec may
        # make a reader draw (a window opened in the referee, ``backroom analyze``, ...).
        if "render_mode" in kwargs:
            raise ValueError(f"kwargs: {name} takes no 'render_mode' from a spec")
        return
    declared = BUILTIN_KWARGS.get(key, {})
    for arg, value in kwargs.items():
        if arg not in declared:
            takes = ", ".join(declared) or "none"
            raise ValueError(f"kwargs: {key} takes no {arg!r} from a spec (it takes: {takes})")
        lo, hi = declared[arg]
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise ValueError(f"kwargs: {key}'s {arg} must be a number from {lo:g} to {hi:g}")


def _import(path: str, name: str) -> Callable[..., Any]:
    """Import a registered factory (a path from the operator or backroom, never the wire)."""
    module_name, _, attribute = path.partition(":")
    try:
        with warnings.catch_warnings():
            # PettingZoo warns on importing an environment's module directly; the
            # registry names them so, so the warning would only be noise.
            warnings.filterwarnings(
                "ignore", "The old environment creation API", DeprecationWarning
            )
            module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = " (PettingZoo's: pip install 'backroom[envs]')" if exc.name in ENVS_EXTRA else ""
        raise ValueError(
            f"pettingzoo env {name!r}: cannot import {module_name!r} ({exc}){extra}"
        ) from None
    return _callable(getattr(module, attribute or "env", None), name)


def _callable(factory: object, name: str) -> Callable[..., Any]:
    if not callable(factory):
        raise ValueError(f"pettingzoo env {name!r} is registered to something not callable")
    return factory


def to_json(value: Any) -> Any:
    """An observation as JSON: arrays to lists, NumPy scalars to numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


@register
class PettingZooGame(Game):
    name = "pettingzoo"

    def __init__(
        self,
        env: str = EXAMPLE_ENV,
        kwargs: dict[str, Any] | None = None,
        action_names: list[str] | None = None,
        rules: str = "",
        max_moves: int = 10_000,
        min_utility: float | None = None,
        max_utility: float | None = None,
        utility_sum: float | None = None,
    ) -> None:
        self.env_path, self.kwargs = env, dict(kwargs or {})
        self.factory = resolve_env(env)
        check_kwargs(env, self.kwargs)
        if max_moves < 1:
            raise ValueError(f"max_moves must be at least 1, not {max_moves}")
        self.max_moves, self.rules_text = int(max_moves), rules
        self.bounds = (min_utility, max_utility, utility_sum)
        probe = self.make_env()
        self.agents: list[str] = list(probe.possible_agents)
        self.env_name = str(getattr(probe, "metadata", {}).get("name", env))
        self.num_players = len(self.agents)
        self.num_actions = self._discrete_actions(probe)
        self.action_names = list(action_names or [])
        if self.action_names and len(self.action_names) != self.num_actions:
            raise ValueError(
                f"action_names: {len(self.action_names)} names for {self.num_actions} actions"
            )
        self.state_class = PettingZooState
        self._info = GameInfo(  # built here, so that contradictory bounds fail the config
            num_players=self.num_players,
            min_utility=-math.inf if min_utility is None else float(min_utility),
            max_utility=math.inf if max_utility is None else float(max_utility),
            utility_sum=None if utility_sum is None else float(utility_sum),
            max_game_length=self.max_moves,
        )

    def make_env(self) -> Any:
        try:
            return self.factory(**self.kwargs)
        except (TypeError, AssertionError, ValueError) as exc:
            raise ValueError(f"kwargs: the factory refused {self.kwargs}: {exc}") from None

    def _discrete_actions(self, probe: Any) -> int:
        sizes = set()
        for agent in self.agents:
            space = probe.action_space(agent)
            n = getattr(space, "n", None)
            if n is None or type(space).__name__ != "Discrete" or int(getattr(space, "start", 0)):
                raise ValueError(
                    f"env: {self.env_name} gives {agent} the action space {space}; only "
                    "Discrete spaces from 0 can be seated (each action an integer)"
                )
            sizes.add(int(n))
        return max(sizes)

    @property
    def info(self) -> GameInfo:
        return self._info

    def default_rules(self) -> str:
        """What a prompt says of an environment that no ``rules`` parameter describes."""
        names = f" ({', '.join(self.action_names)})" if self.action_names else ""
        return (
            f"You play {self.env_name}, a PettingZoo environment: {self.num_players} players "
            f"({', '.join(self.agents)}) move one at a time. A move is one of the actions "
            f"0..{self.num_actions - 1}{names}; the legal ones are listed at each turn. "
            "Your observation is the environment's own."
        )

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"env": self.env_path, "kwargs": self.kwargs}
        if self.action_names:
            out["action_names"] = self.action_names
        if self.rules_text:
            out["rules"] = self.rules_text
        out["max_moves"] = self.max_moves
        for key, value in zip(
            ("min_utility", "max_utility", "utility_sum"), self.bounds, strict=True
        ):
            if value is not None:
                out[key] = value
        return out


class PettingZooState(State):
    game: PettingZooGame

    def __init__(self, game: Game, seed: int | None) -> None:
        super().__init__(game, seed)
        # The environment's chance comes from its reset seed; without one, a fresh seed
        # is drawn (and kept, so that a clone replays the same chance).
        self.env_seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        self.env = self.game.make_env()
        self.env.reset(seed=self.env_seed)
        self.totals = [0.0] * self.game.num_players
        self.history: list[tuple[int, int]] = []
        self.truncated = False
        self._settle()

    def _seat(self, agent: str) -> int:
        return self.game.agents.index(agent)

    def _count_rewards(self) -> None:
        for agent, reward in self.env.rewards.items():
            self.totals[self._seat(agent)] += float(reward)

    def _settle(self) -> None:
        """Step the agents that are done out of the environment, as AEC requires."""
        env = self.env
        while env.agents and (
            env.terminations[env.agent_selection] or env.truncations[env.agent_selection]
        ):
            env.step(None)
            self._count_rewards()

    # --- the engine interface ------------------------------------------------------------

    def is_terminal(self) -> bool:
        return self.truncated or not self.env.agents

    def current_players(self) -> frozenset[int]:
        if self.is_terminal():
            return frozenset()
        return frozenset({self._seat(self.env.agent_selection)})

    def _mask(self, agent: str) -> list[int] | None:
        seen = self.env.observe(agent)
        mask = seen.get("action_mask") if isinstance(seen, Mapping) else None
        if mask is None:
            mask = self.env.infos.get(agent, {}).get("action_mask")
        return None if mask is None else [int(m) for m in mask]

    def legal_actions(self, player: int) -> Sequence[Action]:
        if player not in self.current_players():
            return []
        agent = self.game.agents[player]
        n = int(self.env.action_space(agent).n)
        mask = self._mask(agent)
        return [a for a in range(n) if mask is None or mask[a]]

    def action_spec(self, player: int) -> ActionSpec:
        legal = tuple(self.legal_actions(player))
        names = tuple(self.game.action_names[a] for a in legal) if self.game.action_names else ()
        return ActionSpec(choices=legal, names=names)

    def check_action(self, player: int, action: Action) -> Action:
        self.require_mover(player)
        legal = self.legal_actions(player)
        names = self.game.action_names
        choice: Any = action
        if isinstance(action, str):
            text = action.strip()
            if text.lower() in [n.lower() for n in names]:
                choice = [n.lower() for n in names].index(text.lower())
            elif text.lstrip("-").isdigit():
                choice = int(text)
        if isinstance(choice, bool) or not isinstance(choice, int) or choice not in legal:
            said = [f"{a} ({names[a]})" if names else str(a) for a in legal]
            raise IllegalActionError(f"{action!r} is not legal here; legal: {', '.join(said)}")
        return choice

    def _apply(self, actions: Mapping[int, Action]) -> None:
        ((seat, action),) = actions.items()
        self.env.step(int(action))
        self.history.append((seat, int(action)))
        self._count_rewards()
        self._settle()
        if self.env.agents and len(self.history) >= self.game.max_moves:
            self.truncated = True

    def returns(self) -> list[float]:
        return list(self.totals)

    def clone(self) -> PettingZooState:
        copy = PettingZooState(self.game, self.env_seed)
        for seat, action in self.history:
            copy.apply({seat: action})
        copy.seed, copy.truncated = self.seed, self.truncated
        return copy

    def observation(self, player: int) -> dict[str, Any]:
        agent = self.game.agents[player]
        try:
            seen = to_json(self.env.observe(agent))
        except (
            KeyError,
            IndexError,
            AttributeError,
        ):  # an environment that forgets agents once done
            seen = None
        out: dict[str, Any] = {
            "game": self.game.name,
            "env": self.game.env_name,
            "player": player,
            "agent": agent,
            "moves": len(self.history),
            "observation": seen.get("observation") if isinstance(seen, dict) else seen,
        }
        if isinstance(seen, dict) and "action_mask" in seen:
            out["action_mask"] = seen["action_mask"]
        if self.is_terminal():
            out["returns"] = self.returns()
            out["truncated"] = self.truncated
        return out

    def rules(self, player: int) -> str:
        text = self.game.rules_text or self.game.default_rules()
        return f"{text}\nYou are {self.game.agents[player]} (seat {player})."

    def prompt(self, player: int) -> str:
        seen = self.observation(player)
        lines = [self.rules(player), f"Your observation: {json.dumps(seen['observation'])}"]
        if player in self.current_players():
            spec = self.action_spec(player)
            offered = (
                [f"{a} ({n})" for a, n in zip(spec.choices, spec.names, strict=True)]
                if spec.names
                else [str(a) for a in spec.choices]
            )
            lines.append(f"Legal actions: {', '.join(offered)}. Answer with one of them.")
        return "\n".join(lines)
