"""Check a rules engine against the contract of ``backroom/games/base.py``: ``check_game``.

The checks the suite runs over every registered engine, public so that an
engine written outside backroom (registered through the ``backroom.games``
entry point) is held to the same contract before it reaches a referee:

* ``end``: random playouts end, within the declared ``max_game_length`` moves
  and ``max_chance_nodes`` chance nodes (a game that never ends hangs a match);
* ``info``: the declared :class:`GameInfo` holds at every terminal reached
  (bounds, constant sum, length, chance), and chance offers a distribution;
* ``seed``: the same seed and the same answers give the same play (CRN groups
  and replays depend on it);
* ``clone``: ``clone()`` shares the game and plays on independently of the
  original, both ways (solvers clone millions of states);
* ``legal``: every listed legal action, and every sampled answer, is
  accepted; a non-action, a number just past the offered choices or range,
  an answer from a seat not to move, and a move missing a mover are refused with :class:`IllegalActionError` and a reason
  (the referee sends that reason to the agent);
* ``json``: observations, action specs and public parameters are JSON, and
  prompts are text (they travel over the bus as they are).

Each failure raises :class:`GameCheckError` naming the check, the play (seed)
and what was wrong. Random choices come from ``random.Random(seed)``, so a
failure replays.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from backroom.games.base import (
    CHANCE,
    Action,
    ActionSpec,
    Game,
    GameInfo,
    IllegalActionError,
    State,
    make_game,
)

CHECKS = ("end", "info", "seed", "clone", "legal", "json")

#: Chooses a player's action (random unless a test constructs a play).
Act = Callable[[State, int], Action]
#: Chooses a chance outcome from ``chance_outcomes()``.
Pick = Callable[[State, list[tuple[Action, float]]], Action]


class GameCheckError(AssertionError):
    """An engine breaks the game contract; ``check`` names which part."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"[{check}] {detail}")
        self.check = check


@dataclass
class Seen:
    """What plays of a game reached: return range, sums, longest play, most chance."""

    low: float = math.inf
    high: float = -math.inf
    sums: set[float] = field(default_factory=set)
    moves: int = 0
    chance_nodes: int = 0
    chance_outcomes: int = 0
    terminals: int = 0

    def terminal(self, state: State, moves: int, chance: int) -> None:
        returns = state.returns()
        if len(returns) != state.num_players:
            raise GameCheckError(
                "info", f"returns() has {len(returns)} entries for {state.num_players} players"
            )
        self.low, self.high = min(self.low, *returns), max(self.high, *returns)
        self.sums.add(round(sum(returns), 9))
        self.moves, self.chance_nodes = max(self.moves, moves), max(self.chance_nodes, chance)
        self.terminals += 1

    def respects(self, info: GameInfo) -> None:
        """Raise unless what was seen stays inside the declaration."""
        tol = 1e-9 * max(1.0, abs(info.min_utility), abs(info.max_utility))
        wrong = []
        if self.low < info.min_utility - tol or self.high > info.max_utility + tol:
            wrong.append(
                f"returns reached {self.low} .. {self.high}, outside the declared "
                f"{info.min_utility} .. {info.max_utility}"
            )
        if info.utility_sum is not None and self.sums != {round(info.utility_sum, 9)}:
            wrong.append(
                f"returns summed to {sorted(self.sums)}, not the declared {info.utility_sum}"
            )
        if self.moves > info.max_game_length or self.chance_nodes > info.max_chance_nodes:
            wrong.append(
                f"a play took {self.moves} moves and {self.chance_nodes} chance nodes, past the "
                f"declared {info.max_game_length} and {info.max_chance_nodes}"
            )
        if self.chance_outcomes > info.max_chance_outcomes:
            wrong.append(
                f"a chance node offered {self.chance_outcomes} outcomes, "
                f"more than the declared max_chance_outcomes {info.max_chance_outcomes}"
            )
        if wrong:
            raise GameCheckError("info", "; ".join(wrong))


def random_act(rng: random.Random) -> Act:
    return lambda state, player: state.action_spec(player).sample(rng)


def playout(
    state: State,
    seen: Seen,
    rng: random.Random,
    act: Act | None = None,
    pick: Pick | None = None,
) -> State:
    """Play ``state`` to its end, counting into ``seen``; random unless ``act`` / ``pick`` say.

    Raises ``GameCheckError("end")`` as soon as the play runs past the declared
    longest play or the declared chance nodes, so a game that never ends fails
    instead of hanging.
    """
    info = state.game.info
    choose = act or random_act(rng)
    moves = chance = 0
    while not state.is_terminal():
        movers = state.current_players()
        if not movers:
            raise GameCheckError("end", "a state that is not terminal has nobody to move")
        if movers == {CHANCE}:
            outcomes = state.chance_outcomes()
            _check_distribution(outcomes)
            seen.chance_outcomes = max(seen.chance_outcomes, len(outcomes))
            if pick is not None:
                outcome = pick(state, outcomes)
            else:
                outcome = rng.choices([o for o, _ in outcomes], [p for _, p in outcomes])[0]
            state.apply({CHANCE: outcome})
            chance += 1
        else:
            random_move(state, rng, choose)
            moves += 1
        if moves > info.max_game_length or chance > info.max_chance_nodes:
            raise GameCheckError(
                "end",
                f"a play ran past the declaration: {moves} moves (max_game_length "
                f"{info.max_game_length}), {chance} chance nodes (max_chance_nodes "
                f"{info.max_chance_nodes}), and it is not over",
            )
    seen.terminal(state, moves, chance)
    return state


def random_move(state: State, rng: random.Random, act: Act | None = None) -> None:
    """Apply one move of sampled answers; an engine refusing what it offered fails ``legal``."""
    choose = act or random_act(rng)
    move = {p: choose(state, p) for p in sorted(state.current_players())}
    try:
        state.apply(move)
    except IllegalActionError as exc:
        raise GameCheckError(
            "legal", f"apply({move!r}) refused answers the action specs offered: {exc}"
        ) from None


def _check_distribution(outcomes: list[tuple[Action, float]]) -> None:
    probs = [p for _, p in outcomes]
    if not outcomes or min(probs) <= 0 or abs(sum(probs) - 1.0) > 1e-9:
        raise GameCheckError(
            "info", f"chance_outcomes() is not a distribution (probabilities {probs})"
        )


# --- the checks ----------------------------------------------------------------------------


def check_end_and_info(game: Game, playouts: int, seed: int, info_too: bool = True) -> Seen:
    """Random playouts (chance explicit, ``seed=None``) end, and (``info_too``) keep ``game.info``."""
    info = game.info
    if not isinstance(info, GameInfo):
        raise GameCheckError("info", f"game.info is a {type(info).__name__}, not a GameInfo")
    if info.num_players != game.num_players:
        raise GameCheckError(
            "info", f"info.num_players {info.num_players} != game.num_players {game.num_players}"
        )
    seen = Seen()
    for i in range(playouts):
        playout(game.new_initial_state(None), seen, random.Random(seed + i))
    if info_too:
        seen.respects(info)
    return seen


#: Steps of one play that the costly checks look at closely (every step of a shorter play):
#: an 800-round game's observation holds its history, so checking each step is quadratic.
DETAILED_STEPS = 16


def detailed(game: Game, rng: random.Random) -> Callable[[int], bool]:
    """Which steps of a play to check closely: the first ones, then a random sample."""
    share = DETAILED_STEPS / max(1, game.info.max_game_length)
    return lambda step: step < DETAILED_STEPS // 2 or rng.random() < share


def trace(game: Game, seed: int, answers: int) -> list[Any]:
    """What a seeded play shows, with answers drawn from ``Random(answers)``.

    Every step's movers, phase and action specs; every seat's observation at
    the first steps and at the end (an observation holds the history before it).
    """
    state = game.new_initial_state(seed)
    rng = random.Random(answers)
    seen: list[Any] = []
    longest = game.info.max_game_length  # read once: an engine may work its facts out per call
    while not state.is_terminal() and len(seen) <= longest:
        movers = sorted(state.current_players())
        specs = [state.action_spec(p).to_json() for p in movers]
        shown = [_snapshot(state, p) for p in range(game.num_players)] if len(seen) < 10 else []
        seen.append((movers, state.phase, specs, shown))
        random_move(state, rng)
    seen.append(("end", state.returns(), [_snapshot(state, p) for p in range(game.num_players)]))
    return seen


def _snapshot(state: State, player: int) -> str:
    return json.dumps(state.observation(player), sort_keys=True, default=repr)


def check_same_seed(game: Game, playouts: int, seed: int) -> None:
    for i in range(playouts):
        first, second = trace(game, seed + i, seed + i), trace(game, seed + i, seed + i)
        if first != second:
            step = next(k for k, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
            raise GameCheckError(
                "seed",
                f"seed {seed + i} with the same answers played differently from step {step}: "
                f"{str(first[step])[:300]} then {str(second[step])[:300]}",
            )


def check_clone(game: Game, playouts: int, seed: int) -> None:
    for i in range(playouts):
        rng = random.Random(seed + i)
        state = game.new_initial_state(seed + i)
        if not state.is_terminal():
            random_move(state, rng)
        copy = state.clone()
        if copy.game is not state.game:
            raise GameCheckError("clone", "clone() copied the Game; it must share it")
        before = [_snapshot(state, p) for p in range(game.num_players)]
        playout(copy, Seen(), rng)
        if [_snapshot(state, p) for p in range(game.num_players)] != before:
            raise GameCheckError("clone", f"playing a clone changed the original (seed {seed + i})")
        copy = state.clone()
        before = [_snapshot(copy, p) for p in range(game.num_players)]
        playout(state, Seen(), rng)
        if [_snapshot(copy, p) for p in range(game.num_players)] != before:
            raise GameCheckError(
                "clone", f"playing the original changed its clone (seed {seed + i})"
            )


NOT_AN_ACTION = {"backroom.games.testing": "not an action"}


def check_legal(game: Game, playouts: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(playouts):
        state = game.new_initial_state(seed + i)
        closely = detailed(game, rng)
        step = 0
        while not state.is_terminal():
            movers = sorted(state.current_players())
            if closely(step):
                _legal_accepted(state, movers, rng)
                _illegal_refused(state, movers, rng)
            random_move(state, rng)
            step += 1


def _legal_accepted(state: State, movers: list[int], rng: random.Random) -> None:
    """Each mover's legal actions and a sampled answer pass ``check_action``; ``apply`` takes them."""
    offered = {p: [*state.legal_actions(p), state.action_spec(p).sample(rng)] for p in movers}
    canonical: dict[int, list[Action]] = {}
    for p, answers in offered.items():
        canonical[p] = []
        for action in answers:
            try:
                canonical[p].append(state.check_action(p, action))
            except IllegalActionError as exc:
                raise GameCheckError(
                    "legal",
                    f"seat {p} was refused {action!r}, which its legal actions / action spec "
                    f"offer ({exc})",
                ) from None
    # one joint move per offered index: every legal action is applied once, in few clones
    for k in range(max(len(a) for a in canonical.values())):
        move = {p: answers[k % len(answers)] for p, answers in canonical.items()}
        try:
            state.clone().apply(move)
        except IllegalActionError as exc:
            raise GameCheckError(
                "legal", f"apply({move!r}) refused checked actions: {exc}"
            ) from None


def _illegal_refused(state: State, movers: list[int], rng: random.Random) -> None:
    for p in movers:
        what = f"the non-action {NOT_AN_ACTION} from seat {p}"
        _refused(state, what, partial(state.check_action, p, NOT_AN_ACTION))
        for wrong in _out_of_range(state.action_spec(p)):
            what = f"{wrong!r} from seat {p}, outside what its action spec offers"
            _refused(state, what, partial(state.check_action, p, wrong))
    if idle := [p for p in range(state.num_players) if p not in movers]:
        answer = state.action_spec(movers[0]).sample(rng)
        what = f"an answer from seat {idle[0]}, not to move"
        _refused(state, what, lambda: state.check_action(idle[0], answer))
    _refused(state, "a move that names no mover", lambda: state.clone().apply({}))


def _out_of_range(spec: ActionSpec) -> list[Action]:
    """Answers of the right type just past what ``spec`` offers: numbers, the common case."""
    if spec.choices:
        numbers = [c for c in spec.choices if isinstance(c, int) and not isinstance(c, bool)]
        return [max(numbers) + 1] if len(numbers) == len(spec.choices) else []
    kind, low, high = (
        spec.schema.get("type"),
        spec.schema.get("minimum"),
        spec.schema.get("maximum"),
    )
    if kind not in ("integer", "number"):
        return []
    step = 1 if kind == "integer" else 1.0
    return [
        v
        for v in (None if low is None else low - step, None if high is None else high + step)
        if v is not None
    ]


def _refused(state: State, what: str, attempt: Callable[[], object]) -> None:
    try:
        attempt()
    except IllegalActionError as exc:
        if not str(exc).strip():
            raise GameCheckError("legal", f"{what} was refused without a reason") from None
        return
    except Exception as exc:
        raise GameCheckError(
            "legal", f"{what} raised {type(exc).__name__}: {exc}, not IllegalActionError"
        ) from None
    raise GameCheckError("legal", f"{what} was accepted (phase {state.phase})")


def check_json(game: Game, playouts: int, seed: int) -> None:
    _json("public_params()", game.public_params())
    _json("params()", game.params())
    rng = random.Random(seed)
    for i in range(playouts):
        state = game.new_initial_state(seed + i)
        closely = detailed(game, rng)
        step = 0
        while not state.is_terminal():
            if closely(step):
                _json_state(state)
            random_move(state, rng)
            step += 1
        _json_state(state)


def _json_state(state: State) -> None:
    for p in range(state.num_players):
        _json(f"observation({p})", state.observation(p))
    if state.is_terminal():
        return
    for p in state.current_players():
        _json(f"action_spec({p})", state.action_spec(p).to_json())
        if not isinstance(prompt := state.prompt(p), str):
            raise GameCheckError("json", f"prompt({p}) is a {type(prompt).__name__}, not text")


def _json(what: str, value: Any) -> None:
    try:
        again = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise GameCheckError("json", f"{what} is not JSON: {exc}") from None
    if again != value and not _tuples_only(value, again):
        raise GameCheckError("json", f"{what} does not survive a JSON round trip: {value!r}")


def _tuples_only(value: Any, again: Any) -> bool:
    """JSON turns tuples into lists; that difference is allowed."""
    return json.dumps(value, sort_keys=True) == json.dumps(again, sort_keys=True)


@dataclass
class GameReport:
    """What ``check_game`` played: the engine passed every check listed."""

    game: str
    checks: tuple[str, ...]
    playouts: int
    seen: Seen


def check_game(
    engine: type[Game] | Game | str,
    *,
    checks: Iterable[str] = CHECKS,
    playouts: int = 20,
    seed: int = 0,
    **params: Any,
) -> GameReport:
    """Hold ``engine`` (a Game class, a built game, or a registered name) to the game contract.

    ``params`` build the game (as a config's ``params`` would); ``playouts``
    random plays per check, from seeds ``seed``, ``seed + 1``, ... Raises
    :class:`GameCheckError` at the first fault; returns what was played.
    """
    wanted = tuple(checks)
    if unknown := [c for c in wanted if c not in CHECKS]:
        raise ValueError(f"unknown checks {unknown}; known: {list(CHECKS)}")
    game = _build(engine, params)
    steps: Mapping[str, Callable[[Game, int, int], object]] = {
        "seed": check_same_seed,
        "clone": check_clone,
        "legal": check_legal,
        "json": check_json,
    }
    seen = Seen()
    if "end" in wanted or "info" in wanted:
        seen = check_end_and_info(game, playouts, seed, info_too="info" in wanted)
    for name in wanted:
        if name in steps:
            steps[name](game, playouts, seed)
    return GameReport(getattr(game, "name", type(game).__name__), wanted, playouts, seen)


def _build(engine: type[Game] | Game | str, params: dict[str, Any]) -> Game:
    if isinstance(engine, Game):
        if params:
            raise ValueError("check_game got a built game and parameters: pass one or the other")
        return engine
    if isinstance(engine, str):
        return make_game(engine, **params)
    return engine(**params)
