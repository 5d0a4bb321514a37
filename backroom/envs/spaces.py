"""Gymnasium spaces for a backroom game's answers, found by playing it.

A backroom engine describes each state's answers (``ActionSpec``: a finite
list, or a JSON-schema shape), while a PettingZoo agent's action space is one
space fixed before play. So the space is worked out from seeded random
playouts, which see every kind of state the rules produce, and the union of
what they offer becomes the space:

* finite choices: ``Discrete`` over every choice seen (sorted), masked per state;
* an integer range: ``Discrete`` from its low end, masked to the state's range;
* a number range: a one-element ``Box``;
* an object of integer fields (Split No-Comm's proposal): ``MultiDiscrete``;
* a talk phase (a string): ``Text``, the message.

A game with talk phases gets ``Dict({"act": ..., "message": Text})``: one
answer carries both, and the phase (``infos[agent]["phase"]``) says which part
counts. A choice the playouts never met cannot be played through the
environment; the error says so, and more ``probe_playouts`` find it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np

from backroom.games.base import Action, ActionSpec, Game, State

#: What JSON text may hold once ``ensure_ascii`` escapes the rest: printable ASCII.
PRINTABLE = "".join(chr(c) for c in range(32, 127))
#: The longest observation text the observation space admits (an 800-round history fits).
MAX_OBSERVATION_CHARS = 1 << 22


class AsciiText(gymnasium.spaces.Text):
    """``Text`` over printable ASCII, whose membership test runs in C, not per character:
    an observation of an 800-round history is tens of thousands of characters."""

    def __init__(self, max_length: int) -> None:
        super().__init__(max_length, min_length=0, charset=PRINTABLE)

    def contains(self, x: Any) -> bool:
        return (
            isinstance(x, str)
            and len(x) <= self.max_length
            and x.isascii()
            and (x.isprintable() or not x)
        )


def _key(value: Action) -> str:
    return json.dumps(value, sort_keys=True)


@dataclass
class Seen:
    """The answer shapes a game's playouts offered, per phase."""

    choices: dict[str, Action] = field(default_factory=dict)
    schemas: list[dict[str, Any]] = field(default_factory=list)
    talk_chars: int = 0
    talk: bool = False

    def add(self, state: State, player: int) -> None:
        spec = state.action_spec(player)
        if state.phase == "talk":
            self.talk = True
            self.talk_chars = max(self.talk_chars, int(spec.schema.get("maxLength", 500)))
        elif spec.choices:
            self.choices.update((_key(c), c) for c in spec.choices)
        elif spec.schema and spec.schema not in self.schemas:
            self.schemas.append(spec.schema)


def probe(game: Game, playouts: int, seed: int = 0) -> Seen:
    """Play ``playouts`` seeded random plays and collect the answers they offered."""
    seen = Seen()
    for i in range(playouts):
        rng = random.Random(seed + i)
        state = game.new_initial_state(seed + i)
        while not state.is_terminal():
            movers = sorted(state.current_players())
            for p in movers:
                seen.add(state, p)
            state.apply({p: state.action_spec(p).sample(rng) for p in movers})
    return seen


class ActCodec:
    """The act phase's space, and the way between its samples and the engine's actions."""

    space: gymnasium.Space[Any]
    masked = False

    def encode_mask(self, spec: ActionSpec) -> np.ndarray | None:
        return None

    def decode(self, value: Any, spec: ActionSpec) -> Action:
        raise NotImplementedError


class ChoiceCodec(ActCodec):
    masked = True

    def __init__(self, choices: dict[str, Action]) -> None:
        # numbers in their order, then everything else by its JSON: the same index every build
        def order(k: str) -> tuple[int, float, str]:
            c = choices[k]
            number = isinstance(c, int | float) and not isinstance(c, bool)
            return (0, float(c), k) if number else (1, 0.0, k)

        self.keys = sorted(choices, key=order)
        self.actions = [choices[k] for k in self.keys]
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.space = gymnasium.spaces.Discrete(len(self.actions))

    def encode_mask(self, spec: ActionSpec) -> np.ndarray:
        mask = np.zeros(len(self.actions), dtype=np.int8)
        unseen = [c for c in spec.choices if _key(c) not in self.index]
        if unseen and len(unseen) == len(spec.choices):
            raise RuntimeError(
                f"the legal actions {list(spec.choices)} never came up while the environment "
                "was built; build it with more probe_playouts"
            )
        for c in spec.choices:
            if _key(c) in self.index:
                mask[self.index[_key(c)]] = 1
        return mask

    def decode(self, value: Any, spec: ActionSpec) -> Action:
        return self.actions[int(value)]


class IntegerCodec(ActCodec):
    masked = True

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.space = gymnasium.spaces.Discrete(high - low + 1, start=low)

    def encode_mask(self, spec: ActionSpec) -> np.ndarray:
        mask = np.zeros(self.high - self.low + 1, dtype=np.int8)
        lo = max(self.low, int(spec.schema.get("minimum", self.low)))
        hi = min(self.high, int(spec.schema.get("maximum", self.high)))
        mask[lo - self.low : hi - self.low + 1] = 1
        return mask

    def decode(self, value: Any, spec: ActionSpec) -> Action:
        return int(value)


class NumberCodec(ActCodec):
    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high
        self.space = gymnasium.spaces.Box(low, high, (1,), dtype=np.float32)

    def decode(self, value: Any, spec: ActionSpec) -> Action:
        # float32 rounding may step past the range by an ulp: the state's own bounds hold
        low = float(spec.schema.get("minimum", self.low))
        high = float(spec.schema.get("maximum", self.high))
        return min(max(float(np.asarray(value, dtype=np.float64).reshape(-1)[0]), low), high)


class ObjectCodec(ActCodec):
    def __init__(self, fields: dict[str, tuple[int, int]]) -> None:
        self.fields = list(fields)
        lows = np.array([lo for lo, _ in fields.values()], dtype=np.int64)
        sizes = np.array([hi - lo + 1 for lo, hi in fields.values()], dtype=np.int64)
        self.space = gymnasium.spaces.MultiDiscrete(sizes, start=lows)

    def decode(self, value: Any, spec: ActionSpec) -> Action:
        return {k: int(v) for k, v in zip(self.fields, np.asarray(value).reshape(-1), strict=True)}


def act_codec(game: Game, seen: Seen) -> ActCodec:
    """The act phase's codec for what the playouts offered; a shape with none is refused."""
    if seen.choices and not seen.schemas:
        return ChoiceCodec(seen.choices)
    codec = None if seen.choices else _schema_codec(seen.schemas)  # choices and schemas: mixed
    if codec is None:
        raise _unplayable(game, seen)
    return codec


def _schema_codec(schemas: list[dict[str, Any]]) -> ActCodec | None:
    """One bounded range, or one object of bounded integers, covering every schema seen."""
    kinds = {s.get("type") for s in schemas}
    bounded = all("maximum" in s for s in schemas)  # a space needs both ends
    if kinds == {"integer"} and bounded:
        return IntegerCodec(
            min(int(s.get("minimum", 0)) for s in schemas),
            max(int(s["maximum"]) for s in schemas),
        )
    if kinds == {"number"} and bounded:
        return NumberCodec(
            min(float(s.get("minimum", 0.0)) for s in schemas),
            max(float(s["maximum"]) for s in schemas),
        )
    if kinds == {"object"} and (fields := _integer_fields(schemas)):
        return ObjectCodec(fields)
    return None


def _unplayable(game: Game, seen: Seen) -> ValueError:
    """Why no PettingZoo space holds what ``game`` answers with, naming the shapes seen."""
    shapes = [*(["finite choices"] if seen.choices else []), *map(str, seen.schemas)]
    return ValueError(
        f"game {game.name!r} answers with {shapes or 'nothing'}; a PettingZoo action space "
        "is made of finite choices, one bounded integer or number range, or an object of "
        "bounded integer ranges (not mixed)"
    )


def _integer_fields(schemas: list[dict[str, Any]]) -> dict[str, tuple[int, int]] | None:
    """The union of object schemas whose fields are all bounded integers (same fields in each)."""
    fields: dict[str, tuple[int, int]] = {}
    for schema in schemas:
        props = schema.get("properties", {})
        if not props or (fields and set(props) != set(fields)):
            return None
        for k, p in props.items():
            if p.get("type") != "integer" or "maximum" not in p:
                return None
            lo, hi = int(p.get("minimum", 0)), int(p["maximum"])
            old = fields.get(k, (lo, hi))
            fields[k] = (min(lo, old[0]), max(hi, old[1]))
    return fields
