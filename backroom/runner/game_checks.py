"""A run config checked against its game before anything starts: parameters, actions.

Every match of a run shares its game and parameters, so a parameter the engine
refuses, or an ``always`` agent naming no action of the game, would end every
match in ``error`` or play a move nobody chose: each is refused at load, at the
field to fix, in the engine's own words where it has them.
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from backroom.runner.config_errors import field_errors

if TYPE_CHECKING:
    from backroom.games.base import Game, State

#: States of a game visited for the actions it has (``act_states``).
EXPLORED_STATES = 200


def engine_params(game: str) -> list[str] | None:
    """The keyword parameters a registered engine takes; None when it takes any.

    Read from the engine's constructor, so the list cannot drift from what the
    referee will accept.
    """
    from backroom.games.base import _REGISTRY

    signature = inspect.signature(_REGISTRY[game])
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return [
        name
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def act_states(game: Game, seed: int, limit: int = EXPLORED_STATES) -> Iterator[tuple[State, int]]:
    """(state, seat) of the act turns in the first ``limit`` states of ``game``, breadth first.

    A game declares its actions per state (``State.action_spec``), not once, so
    the states are visited: every choice is followed (at most 16 combinations
    of a simultaneous move), a described answer (a price, a proposal) and a
    message by the engine's default.
    """
    from collections import deque

    queue = deque([game.new_initial_state(seed)])
    visited = 0
    while queue and visited < limit:
        state = queue.popleft()
        visited += 1
        if state.is_terminal():
            continue
        players = sorted(state.current_players())
        options: list[list[Any]] = []
        for p in players:
            if state.phase == "act":
                yield state, p
            spec = state.action_spec(p)
            choices = list(spec.choices) if state.phase == "act" else []
            options.append(choices or [state.default_action(p)])
        for combo in itertools.islice(itertools.product(*options), 16):
            child = state.clone()
            try:
                child.apply(dict(zip(players, combo, strict=True)))
            except ValueError:  # IllegalActionError: a combination the rules refuse
                continue
            queue.append(child)


def always_refusal(game: Game, action: Any, seed: int = 0) -> str | None:
    """Why an ``always`` agent's ``action`` is no action of ``game`` (None when it is one).

    As the agent plays it: a listed choice, or its name, exactly (``A``, not
    ``a``); where the game describes its answers instead (a price, a number),
    what the engine accepts (``State.check_action``) in some act turn.
    """
    legal = _answers_unless(game, action, seed)
    if legal is None:
        return None
    what = " or ".join(legal) or "no act turn in its first states"
    if action is None:
        return f"`always` needs `action`; {game.name} takes {what}"
    return f"{game.name} has no action {action!r}; it takes {what}"


def _answers_unless(game: Game, action: Any, seed: int) -> list[str] | None:
    """What ``game``'s act turns take, in words; None as soon as one takes ``action``.

    The listed choices (or their names) of every turn that lists them, then a
    description of each answer schema of the turns that describe theirs.
    """
    from backroom.games.base import IllegalActionError

    names: list[Any] = []
    schemas: list[dict[str, Any]] = []
    for state, seat in act_states(game, seed):
        spec = state.action_spec(seat)
        if spec.choices:
            if action is not None and (action in spec.choices or action in spec.names):
                return None
            for x in spec.names or spec.choices:
                if x not in names:
                    names.append(x)
            continue
        try:
            state.check_action(seat, action)
            return None
        except IllegalActionError:
            if spec.schema not in schemas:
                schemas.append(spec.schema)
    legal = [", ".join(str(x) for x in names)] if names else []
    return legal + [_describe_schema(s) for s in schemas]


def _describe_schema(schema: dict[str, Any]) -> str:
    """``a number from 0 to 10``, ``an integer from 0 to 100``, ``an object (hats, books)``."""
    kind = schema.get("type")
    if kind in ("integer", "number"):
        word = "an integer" if kind == "integer" else "a number"
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and hi is not None:
            return f"{word} from {lo} to {hi}"
        return word
    if kind == "object":
        return f"an object ({', '.join(schema.get('properties', {}))})"
    return f"a {kind or 'value'}"


def build_game(game: str, params: dict[str, Any]) -> Game:
    """The game as the referee will build it, or errors at the parameter to fix.

    Every match of a run shares the game and its parameters, so parameters the
    engine refuses would end every match in ``error``. Error paths are relative
    to ``params`` (``roundz``), and each says what the engine accepts.
    """
    from backroom.games import make_game

    allowed = engine_params(game)
    listed = ", ".join(allowed) if allowed is not None else "any"
    if allowed is not None and (unknown := [k for k in params if k not in allowed]):
        raise field_errors(
            [((k,), f"{game} has no parameter {k!r}; its parameters: {listed}") for k in unknown]
        )
    try:
        return make_game(game, **params)
    except Exception as exc:  # the engine's own check, in its words
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        named = [k for k in params if re.search(rf"\b{re.escape(k)}\b", reason)]
        loc: tuple[str | int, ...] = (named[0],) if len(named) == 1 else ()
        raise field_errors([(loc, f"{reason} (parameters of {game}: {listed})")]) from None
