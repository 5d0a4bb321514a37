"""Any OpenSpiel game as a backroom engine: ``game: openspiel``, ``params: {name: leduc_poker, ...}``.

OpenSpiel's ``State`` has backroom's shape already (current players, legal
actions, chance outcomes, ``apply``, ``returns``), so the adapter is thin and
adds only what a table of talking agents needs:

* **Actions** are OpenSpiel's action numbers, listed with OpenSpiel's own names
  (``action_to_string``): ``ActionSpec(choices=(0, 1, 2), names=("Fold", "Call",
  "Raise"))``. An agent may answer with either; ``check_action`` turns a name
  into its number, so the record and the solvers see numbers, as OpenSpiel does.
* **What a seat knows** is OpenSpiel's ``information_state_string`` (the key a
  ``table`` or ``cfr`` policy is looked up by, exactly as in OpenSpiel, so
  policies and NashConv compare by key) and ``observation_string``, with the
  tensors where the game has them and they are small (``MAX_TENSOR``).
* **Chance** stops the state for solvers (``seed=None``) and is sampled from
  ``random.Random(seed)`` otherwise, as for native engines: the same match seed
  deals the same cards, so CRN groups and replays work unchanged.
* **Simultaneous** nodes are backroom's simultaneous moves: every seat moves at
  once and ``apply`` hands OpenSpiel the joint action.
* :class:`GameInfo` is OpenSpiel's (utility bounds, constant sum, longest play,
  chance nodes and outcomes).

Talk is not the engine's business: a run's channels (``opens: before_act``,
private channels, eavesdroppers) attach to an OpenSpiel game as to any other.

Parameters come from match requests and records, so a game is vetted before it
is built (``openspiel_bounds``): parameters that name files are refused unless
the operator allowed the file, and parameters other than the defaults are built
first in a child process under a time and size bound.

``pyspiel`` is imported when an OpenSpiel game is first built, so importing
``backroom.games`` stays light and backroom runs without OpenSpiel installed.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from backroom.games.base import (
    CHANCE,
    JSON,
    Action,
    ActionSpec,
    Game,
    GameInfo,
    IllegalActionError,
    State,
    register,
)
from backroom.games.openspiel_bounds import vet
from backroom.games.openspiel_rules import RULES

#: Tensors with more entries than this stay out of the observation (Hearts'
#: information-state tensor has 5,088): they would dwarf every turn message. The
#: observation then lists them under ``tensors_left_out``.
MAX_TENSOR = 4096

#: Where OpenSpiel's ``max_chance_nodes_in_history`` is wrong, the right count from
#: the loaded game's parameters (the tests found both). Leduc deals one card per
#: player and one public card, but OpenSpiel says 3 whatever the number of players;
#: cooperative box-pushing draws three chance outcomes after every joint move (the
#: order of the two moves, then whether each succeeds) but OpenSpiel says one.
CHANCE_NODES_FIX: dict[str, Callable[[dict[str, Any]], int]] = {
    "leduc_poker": lambda params: int(params["players"]) + 1,
    "coop_box_pushing": lambda params: 3 * int(params["horizon"]),
}

#: Observation key -> the pyspiel ``State`` method that gives that tensor.
TENSOR_METHODS = {
    "info_state_tensor": "information_state_tensor",
    "observation_tensor": "observation_tensor",
}

#: The game ``game: openspiel`` plays without ``params.name`` (recorded in ``params()``
#: like any other): the suite's checks over every registered engine build each
#: engine with no parameters, and Leduc is the game the adapter was first built to seat.
DEFAULT_GAME = "leduc_poker"

#: OpenSpiel ids of the pseudo-players (``open_spiel/spiel_utils.h``).
_SIMULTANEOUS, _TERMINAL = -2, -4


def _pyspiel() -> Any:
    try:
        import pyspiel
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ValueError(
            "game openspiel needs OpenSpiel: pip install open_spiel (or backroom[openspiel])"
        ) from None
    return pyspiel


@cache
def game_types() -> dict[str, Any]:
    """OpenSpiel's registered game types by short name."""
    return {t.short_name: t for t in _pyspiel().registered_games()}


def refusal(name: str) -> str | None:
    """Why the registered OpenSpiel game ``name`` cannot be seated (None when it can)."""
    gtype = game_types()[name]
    if gtype.dynamics == _pyspiel().GameType.Dynamics.MEAN_FIELD:
        return "a mean-field game plays a population, not seats"
    if any(isinstance(v, dict) for v in gtype.parameter_specification.values()):
        return "a wrapper around another game: seat that game instead"
    if gtype.action_structs_only:
        return "its moves are action structs, not numbered actions for an agent to pick from"
    return None


def supported_games() -> list[str]:
    """Every OpenSpiel game the adapter will build (some still need a parameter, e.g. a file)."""
    return sorted(n for n in game_types() if refusal(n) is None)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"openspiel's params.name must name an OpenSpiel game, not {name!r}; "
            f"known: {', '.join(supported_games())}"
        )
    if name not in game_types():
        close = difflib.get_close_matches(name, supported_games(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"unknown OpenSpiel game {name!r}{hint}; known: {', '.join(supported_games())}"
        )
    if why := refusal(name):
        raise ValueError(f"OpenSpiel game {name!r} is not supported: {why}")
    return name


def _check_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` as OpenSpiel's typed game parameters, or a ``ValueError`` naming the known ones."""
    spec = dict(game_types()[name].parameter_specification)
    known = ", ".join(f"{k} (default {v!r})" for k, v in sorted(spec.items())) or "none"
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in spec:
            raise ValueError(
                f"OpenSpiel game {name} has no parameter {key!r}; its parameters: {known}"
            )
        default = spec[key]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ValueError(
                f"OpenSpiel game {name}: parameter {key!r} must be of type {type(default).__name__}, "
                f"like its default {default!r}, not {value!r}"
            )
        out[key] = value
    return out


def checked(params: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``game: openspiel``'s params as (OpenSpiel's name, its declared parameters, the
    given ones typed): what ``openspiel_bounds`` vets before anything is built."""
    rest = dict(params)
    name = _check_name(rest.pop("name", DEFAULT_GAME))
    return name, dict(game_types()[name].parameter_specification), _check_params(name, rest)


@functools.lru_cache(maxsize=32)
def load(name: str, params_json: str) -> Any:
    """``pyspiel.load_game``, once per game and parameters in this process: a game is
    immutable (states are made from it), and building one may take up to ``MAX_BUILD_S``
    of C++ that holds the GIL, which a referee must not pay for every match."""
    return _pyspiel().load_game(name, json.loads(params_json))


@register
class OpenSpielGame(Game):
    """The ``openspiel`` config name: ``name`` picks the OpenSpiel game, the rest are its parameters."""

    name = "openspiel"

    def __init__(self, name: str = DEFAULT_GAME, **params: Any) -> None:
        self.os_name = _check_name(name)
        self.os_params = _check_params(self.os_name, params)
        # Files, size and build time, before any C++ runs here (openspiel_bounds.py).
        vet(self.os_name, game_types()[self.os_name].parameter_specification, self.os_params)
        try:
            self.os_game = load(self.os_name, json.dumps(self.os_params, sort_keys=True))
        except Exception as exc:  # pyspiel raises a bare RuntimeError/SpielError
            raise ValueError(f"OpenSpiel refused {self.os_name} {self.os_params}: {exc}") from None
        self.os_type = self.os_game.get_type()
        self.num_players = self.os_game.num_players()
        self.state_class = OpenSpielState
        self._info = self._game_info()
        self.tensors = self._tensors()

    def _game_info(self) -> GameInfo:
        """OpenSpiel's facts, in backroom's fields (see :class:`~backroom.games.base.GameInfo`)."""
        g, t, ps = self.os_game, self.os_type, _pyspiel().GameType
        utility_sum: float | None = None
        if t.utility == ps.Utility.ZERO_SUM:
            utility_sum = 0.0
        elif t.utility == ps.Utility.CONSTANT_SUM:
            utility_sum = float(g.utility_sum())
        chance_nodes = outcomes = 0
        if t.chance_mode != ps.ChanceMode.DETERMINISTIC:
            outcomes = max(1, g.max_chance_outcomes())
            fix = CHANCE_NODES_FIX.get(self.os_name)
            said = fix(g.get_parameters()) if fix else g.max_chance_nodes_in_history()
            chance_nodes = max(1, said)
        return GameInfo(
            num_players=self.num_players,
            min_utility=float(g.min_utility()),
            max_utility=float(g.max_utility()),
            utility_sum=utility_sum,
            max_game_length=int(g.max_game_length()),
            max_chance_nodes=chance_nodes,
            max_chance_outcomes=outcomes,
        )

    def _tensors(self) -> dict[str, bool]:
        """The tensors the game has, each with whether it goes into observations (``MAX_TENSOR``)."""
        g, t, out = self.os_game, self.os_type, {}
        for key, provided, size in (
            (
                "info_state_tensor",
                t.provides_information_state_tensor,
                g.information_state_tensor_size,
            ),
            ("observation_tensor", t.provides_observation_tensor, g.observation_tensor_size),
        ):
            if provided:
                out[key] = size() <= MAX_TENSOR
        return out

    @property
    def info(self) -> GameInfo:
        return self._info

    def params(self) -> dict[str, JSON]:
        return {"name": self.os_name, **self.os_params}  # name always: the record says what played

    def rules_text(self) -> str:
        """The rules as a prompt states them: backroom's short text, or OpenSpiel's long name."""
        text = RULES.get(self.os_name)
        if text is None:
            return (
                f"You are playing {self.os_type.long_name} (OpenSpiel's {self.os_name}) with "
                f"{self.num_players} players. The state below is written as OpenSpiel writes it."
            )
        return text.format_map({**self.os_game.get_parameters(), "players": self.num_players})


class OpenSpielState(State):
    """A pyspiel state behind backroom's interface; ``os`` is the OpenSpiel state itself."""

    game: OpenSpielGame

    def __init__(self, game: OpenSpielGame, seed: int | None) -> None:
        super().__init__(game, seed)
        self.os = game.os_game.new_initial_state()

    def clone(self) -> OpenSpielState:
        new = object.__new__(type(self))
        new.__dict__ = dict(self.__dict__)
        new.os = self.os.clone()
        new.round_rewards = [r[:] for r in self.round_rewards]
        if self._rng is not None:
            new._rng = random.Random()
            new._rng.setstate(self._rng.getstate())
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> OpenSpielState:
        return self.clone()

    # --- who moves, and what they may do -----------------------------------

    def current_players(self) -> frozenset[int]:
        player = self.os.current_player()
        if player == _TERMINAL or self.os.is_terminal():
            return frozenset()
        if player == CHANCE:
            return frozenset({CHANCE})
        if player == _SIMULTANEOUS:
            return frozenset(range(self.num_players))
        return frozenset({player})

    def legal_actions(self, player: int) -> Sequence[Action]:
        if player == CHANCE or player not in self.current_players():
            return []
        return list(self.os.legal_actions(player))

    def action_spec(self, player: int) -> ActionSpec:
        legal = self.legal_actions(player)
        return ActionSpec(
            choices=tuple(legal),
            names=tuple(self.os.action_to_string(player, a) for a in legal),
        )

    def check_action(self, player: int, action: Action) -> Action:
        """A legal action number, from the number or OpenSpiel's name for it (case and spaces aside)."""
        self.require_mover(player)
        number = isinstance(action, int) and not isinstance(action, bool)
        if number and action in self.os.legal_actions(player):  # no names: solvers walk this
            return action
        spec = self.action_spec(player)
        if isinstance(action, str):
            wanted = action.strip()
            for exact in (True, False):
                hits = [
                    c
                    for c, n in zip(spec.choices, spec.names, strict=True)
                    if (n == wanted if exact else n.strip().lower() == wanted.lower())
                ]
                if len(hits) == 1:
                    return hits[0]
        shown = ", ".join(f"{n} ({c})" for c, n in zip(spec.choices, spec.names, strict=True))
        raise IllegalActionError(f"{action!r} is not legal here; legal: {shown}")

    def default_action(self, player: int) -> Action:
        """The lowest-numbered legal action: a fold or check in OpenSpiel's poker games."""
        return self.legal_actions(player)[0]

    def _apply(self, actions: Mapping[int, Action]) -> None:
        if self.os.is_simultaneous_node():
            self.os.apply_actions([int(actions[p]) for p in range(self.num_players)])
        else:
            ((_, action),) = actions.items()
            self.os.apply_action(int(action))

    # --- chance -----------------------------------------------------------

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if not self.os.is_chance_node():
            raise NotImplementedError("not a chance node")
        return [(int(a), float(p)) for a, p in self.os.chance_outcomes()]

    def _apply_chance(self, outcome: Action) -> None:
        if outcome not in [a for a, _ in self.chance_outcomes()]:
            raise IllegalActionError(f"{outcome!r} is not a chance outcome here")
        self.os.apply_action(int(outcome))

    # --- outcomes ---------------------------------------------------------

    def is_terminal(self) -> bool:
        return bool(self.os.is_terminal())

    def returns(self) -> list[float]:
        return [float(r) for r in self.os.returns()]

    # --- what a seat knows ------------------------------------------------

    def information_state(self, player: int) -> str:
        if not self.game.os_type.provides_information_state_string:
            raise NotImplementedError(
                f"OpenSpiel's {self.game.os_name} has no information-state strings"
            )
        return str(self.os.information_state_string(player))

    def observation(self, player: int) -> dict[str, JSON]:
        t = self.game.os_type
        obs: dict[str, JSON] = {
            "game": "openspiel",
            "name": self.game.os_name,
            "player": player,
            "to_move": sorted(self.current_players()),
            "info_state": self.information_state(player)
            if t.provides_information_state_string
            else None,
            "observation": str(self.os.observation_string(player))
            if t.provides_observation_string
            else None,
        }
        left_out = []
        for key, fits in self.game.tensors.items():
            if fits:
                obs[key] = list(getattr(self.os, TENSOR_METHODS[key])(player))
            else:
                left_out.append(key)
        if left_out:
            obs["tensors_left_out"] = left_out
        if self.is_terminal():
            obs["returns"] = self.returns()
        return obs

    def rules(self, player: int) -> str:
        return self.game.rules_text()

    def prompt(self, player: int) -> str:
        obs = self.observation(player)
        lines = [self.rules(player), f"You are player {player}."]
        if obs["info_state"] is not None:
            lines.append(
                f"What you know so far (OpenSpiel's information state):\n{obs['info_state']}"
            )
        if obs["observation"] is not None and obs["observation"] != obs["info_state"]:
            lines.append(f"What you see now (OpenSpiel's observation):\n{obs['observation']}")
        if self.is_terminal():
            lines.append(f"The game is over. Returns: {self.returns()}.")
        elif player in self.current_players():
            names = self.action_spec(player).names
            lines.append(f"It is your turn. Choose one action: {', '.join(names)}.")
        return "\n\n".join(lines)
