"""The game interface every rules engine implements.

Modelled on OpenSpiel's ``State``: a game is a small state machine with the
current players, their legal actions, ``apply`` and ``returns``. Two choices
differ from OpenSpiel, both because backroom's games are played over a bus by
agents that talk:

* ``current_players()`` is a *set*: simultaneous moves (IPD, Bertrand, the
  beauty contest) are first-class, and a turn-based game returns one player.
* ``phase`` is ``"talk"`` or ``"act"``: in a talk phase the "action" is a text
  message, which the referee routes by channel.

Chance is explicit. A state built with ``new_initial_state(seed=None)`` stops
at chance nodes (``current_players() == {CHANCE}``) so solvers can enumerate
``chance_outcomes()``; with an integer seed the state resolves chance itself
from ``random.Random(seed)``, so the same seed replays the same chance — which
is what a common-random-numbers (CRN) group needs.

Every game declares its facts in a :class:`GameInfo` (``Game.info``), as
OpenSpiel's ``GameInfo`` / ``GameType`` do: players, utility bounds, whether
the returns have a constant sum, the longest play. They follow from the rules
and parameters, so the engine that owns the rules states them once, and
solvers and analyses read them instead of working them out again.

Engines are pure: no I/O, no asyncio, no clocks. Everything here must be
deterministic given the seed and the actions.
"""

from __future__ import annotations

import copy
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

#: The pseudo-player that moves at chance nodes (OpenSpiel uses -1 too).
CHANCE = -1

Phase = Literal["talk", "act"]
#: An action is any JSON value: an int or name for card games, a number for a
#: price, a dict for a proposal, a string for a message in a talk phase.
Action = Any
JSON = Any


class IllegalActionError(ValueError):
    """The action is not allowed here; the message says why, for the agent."""


@dataclass(frozen=True)
class GameInfo:
    """What the rules and parameters of a game guarantee about every play of it.

    The fields are OpenSpiel's (``GameInfo`` and ``GameType.utility``), so a
    solver written against OpenSpiel reads them the same way:

    * ``min_utility`` / ``max_utility`` bound every seat's return (``State.returns()``)
      at every terminal state. They are bounds, tight where the engine says so
      in its docstring, so a normalisation or a plot axis can rely on them.
    * ``utility_sum`` is the sum of the returns when it is the same at every
      terminal (0: zero-sum; OpenSpiel's ``CONSTANT_SUM`` otherwise) and ``None``
      for a general-sum game.
    * ``max_game_length`` counts the moves of the longest play, a move being one
      ``apply`` by the players (a simultaneous move and a talk message are one
      move each); chance is counted apart, in ``max_chance_nodes``, with
      ``max_chance_outcomes`` the most outcomes of any one chance node (0 and 0
      for a game without chance), as in OpenSpiel.
    """

    num_players: int
    min_utility: float
    max_utility: float
    utility_sum: float | None
    max_game_length: int
    max_chance_nodes: int = 0
    max_chance_outcomes: int = 0

    def __post_init__(self) -> None:
        # A declaration that contradicts itself is a bug in the engine: say so at import.
        if self.num_players < 1 or self.max_game_length < 0 or self.max_chance_nodes < 0:
            raise ValueError(f"impossible game facts: {self}")
        if not self.min_utility <= self.max_utility:
            raise ValueError(f"min_utility > max_utility in {self}")
        if (self.max_chance_nodes == 0) != (self.max_chance_outcomes == 0):
            raise ValueError(f"chance nodes and chance outcomes disagree in {self}")
        if self.utility_sum is not None and not (
            self.num_players * self.min_utility
            <= self.utility_sum
            <= self.num_players * self.max_utility
        ):
            raise ValueError(f"utility_sum outside what the bounds allow in {self}")

    @property
    def zero_sum(self) -> bool:
        """Returns always sum to 0 (two-player: one's gain is the other's loss)."""
        return self.utility_sum == 0.0

    @property
    def constant_sum(self) -> bool:
        """Returns always sum to ``utility_sum``; zero-sum games are constant-sum too."""
        return self.utility_sum is not None


@dataclass(frozen=True)
class ActionSpec:
    """How an agent may answer: a finite list of choices, or a described shape.

    Finite games list ``choices``; games with a continuous or very large action
    set (a price, a three-way split) leave ``choices`` empty and describe the
    value in ``schema`` (a small JSON-schema-like dict) instead.
    """

    choices: tuple[Action, ...] = ()
    schema: dict[str, JSON] = field(default_factory=dict)
    names: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, JSON]) -> ActionSpec:
        return cls(
            choices=tuple(data.get("choices", ())),
            schema=dict(data.get("schema", {})),
            names=tuple(data.get("names", ())),
        )

    def sample(self, rng: random.Random) -> Action:
        """A uniformly random legal answer: a random agent, or a seat timed out with ``random``."""
        if self.choices:
            return rng.choice(self.choices)
        return _sample_schema(self.schema, rng)

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {}
        if self.choices:
            out["choices"] = list(self.choices)
        if self.names:
            out["names"] = list(self.names)
        if self.schema:
            out["schema"] = self.schema
        return out


def _sample_schema(schema: dict[str, JSON], rng: random.Random) -> Action:
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(int(schema.get("minimum", 0)), int(schema.get("maximum", 100)))
    if kind == "number":
        return rng.uniform(float(schema.get("minimum", 0.0)), float(schema.get("maximum", 1.0)))
    if kind == "object":
        return {k: _sample_schema(v, rng) for k, v in schema.get("properties", {}).items()}
    if kind == "string":
        return ""
    raise ValueError(f"cannot sample an action from schema {schema!r}")


class State(ABC):
    """One point of play. Subclasses implement the ``_``-prefixed hooks."""

    game: Game
    phase: Phase = "act"

    def __init__(self, game: Game, seed: int | None) -> None:
        self.game = game
        self.seed = seed
        self._rng = random.Random(seed) if seed is not None else None
        #: Per-round rewards, appended by engines that pay out during play.
        self.round_rewards: list[list[float]] = []

    # --- the public interface ------------------------------------------------

    @abstractmethod
    def current_players(self) -> frozenset[int]:
        """Players who must move now; ``{CHANCE}`` at a chance node; empty when over."""

    @abstractmethod
    def legal_actions(self, player: int) -> Sequence[Action]:
        """The finite set of legal actions (games with infinite sets override ``action_spec``)."""

    @abstractmethod
    def observation(self, player: int) -> dict[str, JSON]:
        """What ``player`` may know now, as JSON-able data for non-LLM agents."""

    @abstractmethod
    def prompt(self, player: int) -> str:
        """The same information as text, for an LLM."""

    def rules(self, player: int) -> str:
        """The rules as ``player``'s prompt states them, before anything of a play.

        The opening of ``prompt``, reused so that a person (``backroom.human``)
        reads at a match's start the rules the models are given. It must not
        depend on chance: it is called on a state nothing was dealt to. Empty
        when an engine has no such text.
        """
        return ""

    @abstractmethod
    def is_terminal(self) -> bool: ...

    def returns(self) -> list[float]:
        """Total reward of each player: the sum of the per-round rewards, unless a game says otherwise."""
        return [sum(r[p] for r in self.round_rewards) for p in range(self.num_players)]

    def current_round(self) -> int:
        """The round in play, counted from 1; once the game is over, the last one played.

        Engines that pay out per round keep one ``round_rewards`` entry per
        finished round, so the count is taken from there, and every such game's
        observation reports the same number.
        """
        return len(self.round_rewards) + (0 if self.is_terminal() else 1)

    def information_state(self, player: int) -> str:
        """A string that identifies what ``player`` knows; policies are keyed by it."""
        raise NotImplementedError(f"{type(self).__name__} defines no information-state strings")

    def action_spec(self, player: int) -> ActionSpec:
        return ActionSpec(choices=tuple(self.legal_actions(player)))

    def require_mover(self, player: int) -> None:
        """Raise unless ``player`` (never chance) is to move now."""
        if player == CHANCE or player not in self.current_players():
            raise IllegalActionError(f"player {player} is not to move")

    def check_action(self, player: int, action: Action) -> Action:
        """Validate one player's action; return its canonical form or raise ``IllegalActionError``."""
        self.require_mover(player)
        legal = self.legal_actions(player)
        if action in legal:
            return action
        raise IllegalActionError(f"{action!r} is not legal here; legal: {list(legal)}")

    def default_action(self, player: int) -> Action:
        """What the referee plays for a seat that timed out (a fold, a pass, a no-op)."""
        return self.legal_actions(player)[0]

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        raise NotImplementedError(f"{type(self).__name__} has no chance node here")

    def apply(self, actions: Mapping[int, Action]) -> None:
        """Apply one move: an action for every current player (or ``{CHANCE: outcome}``)."""
        movers = self.current_players()
        if set(actions) != set(movers):
            raise IllegalActionError(
                f"expected actions for {sorted(movers)}, got {sorted(actions)}"
            )
        if movers == {CHANCE}:
            self._apply_chance(actions[CHANCE])
        else:
            checked = {p: self.check_action(p, a) for p, a in actions.items()}
            self._apply(checked)
        self._resolve_chance()

    def clone(self) -> State:
        """An independent copy of the play so far; the ``Game`` (rules, parameters) is shared."""
        return copy.deepcopy(self, memo={id(self.game): self.game})

    @property
    def num_players(self) -> int:
        return self.game.num_players

    # --- hooks for engines ---------------------------------------------------

    @abstractmethod
    def _apply(self, actions: Mapping[int, Action]) -> None: ...

    def _apply_chance(self, outcome: Action) -> None:
        raise NotImplementedError

    def _resolve_chance(self) -> None:
        """With a seed, sample chance nodes away so agents never see them."""
        if self._rng is None:
            return
        while self.current_players() == {CHANCE}:
            outcomes = self.chance_outcomes()
            values = [o for o, _ in outcomes]
            weights = [p for _, p in outcomes]
            self._apply_chance(self._rng.choices(values, weights)[0])


class Game(ABC):
    """A game with fixed parameters; ``new_initial_state`` starts a play."""

    name: ClassVar[str]
    num_players: int
    #: The ``State`` subclass a play starts from; an engine sets it below its state class,
    #: or per instance when a parameter picks between rule sets (Kuhn's ``variant``).
    state_class: type[State]

    @property
    @abstractmethod
    def info(self) -> GameInfo:
        """This game's facts (players, utility bounds and sum, longest play); see :class:`GameInfo`."""

    def new_initial_state(self, seed: int | None = None) -> State:
        """A fresh play. With a seed, chance is sampled at once, so agents never see it."""
        state = self.state_class(self, seed)
        state._resolve_chance()
        return state

    def params(self) -> dict[str, JSON]:
        """The parameters that made this game, for the episode record."""
        return {}

    def public_params(self) -> dict[str, JSON]:
        """The parameters every player is told at the start (the referee's ``match_start``).

        All of ``params()`` unless a parameter fixes what chance would hide
        (Kuhn's ``deal`` holds every seat's card); the episode record keeps them all.
        """
        return self.params()


_REGISTRY: dict[str, type[Game]] = {}

#: Entry-point group of engines defined outside this package (another distribution's
#: game, or one that builds on backroom's upper layers): each entry names a module,
#: whose import registers its engines, or a ``Game`` class. Read from the installed
#: metadata, as agent kinds' ``backroom.agents`` is, so games never import them.
GAME_ENTRY_POINTS = "backroom.games"
#: Entry points that failed to load, by name: an unknown game's error names them.
_plugin_errors: dict[str, str] = {}
_plugins_loaded = False


def register(cls: type[Game]) -> type[Game]:
    """Class decorator: make a game constructible by name from a config."""
    _REGISTRY[cls.name] = cls
    return cls


def _load_plugin_games() -> None:
    """Import each ``backroom.games`` entry point once; one that fails is recorded, not raised."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=GAME_ENTRY_POINTS):
        if ep.name in _REGISTRY:
            continue
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken plugin must not take the built-in games down
            _plugin_errors[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
            continue
        if isinstance(loaded, type) and issubclass(loaded, Game):
            _REGISTRY.setdefault(ep.name, loaded)
        if ep.name not in _REGISTRY:
            _plugin_errors[ep.name] = f"{ep.value} registered no game named {ep.name!r}"


def make_game(name: str, /, **params: Any) -> Game:
    """Build a registered game; unknown names and bad parameters raise ``ValueError``."""
    try:
        cls = _REGISTRY[name] if name in _REGISTRY else _registry()[name]
    except KeyError:
        broken = (
            f"; entry point {name!r} failed: {_plugin_errors[name]}"
            if name in _plugin_errors
            else ""
        )
        raise ValueError(f"unknown game {name!r}; known: {sorted(_REGISTRY)}{broken}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for game {name!r}: {exc}") from None


def _registry() -> dict[str, type[Game]]:
    from backroom import games as _games  # noqa: F401  (imports register the engines)

    _load_plugin_games()
    return _REGISTRY


def registered_games() -> list[str]:
    return sorted(_registry())
