"""Helpers shared by the text-prompted engines (IPD, splits, beauty contest, Bertrand).

They exist so every engine parses agent answers the same lenient way (an LLM
may answer ``"<A>"``, ``"7"`` or ``"<<proposal_start>> 7 <<proposal_end>>"``)
while still rejecting anything ambiguous with an ``IllegalActionError`` that
tells the agent what was expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from backroom.games.base import ActionSpec, IllegalActionError, State

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_MESSAGE = re.compile(r"<<message_start>>(.*?)(?:<<message_end>>|$)", re.S)
_PROPOSAL = re.compile(r"<<proposal_start>>(.*?)<<proposal_end>>", re.S)


class _Keep(dict[str, Any]):
    """A format mapping that leaves unknown ``{fields}`` as they are.

    An overridden template may drop or add placeholders; rendering it should not
    crash a match halfway through.
    """

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def fill(template: str, **values: Any) -> str:
    return template.format_map(_Keep(values))


def merge_prompts(
    defaults: Mapping[str, str], overrides: Mapping[str, str] | None, game: str
) -> dict[str, str]:
    """Default templates with a config's overrides on top; unknown keys are a config error."""
    merged = dict(defaults)
    if overrides:
        unknown = sorted(set(overrides) - set(defaults))
        if unknown:
            raise ValueError(f"{game}: unknown prompt templates {unknown}; known: {sorted(defaults)}")
        for key, text in overrides.items():
            if not isinstance(text, str):
                raise ValueError(f"{game}: prompt template {key!r} must be a string")
            merged[key] = text
    return merged


class TalkState(State):
    """A state whose game has talk phases: in ``talk`` the answer is a message, in ``act`` a move.

    Subclasses describe and check their moves in ``act_spec`` and
    ``check_act``; messages are handled here, the same way for every game.
    """

    @property
    def max_chars(self) -> int:
        # Every game with talk phases has a max_chars parameter.
        return int(self.game.max_chars)  # type: ignore[attr-defined]

    def action_spec(self, player: int) -> ActionSpec:
        if self.phase == "talk":
            return talk_spec(self.max_chars)
        return self.act_spec(player)

    def check_action(self, player: int, action: Any) -> Any:
        self.require_mover(player)
        if self.phase == "talk":
            return check_message(action, self.max_chars)
        return self.check_act(player, action)

    def act_spec(self, player: int) -> ActionSpec:
        raise NotImplementedError

    def check_act(self, player: int, action: Any) -> Any:
        raise NotImplementedError


def talk_spec(max_chars: int) -> ActionSpec:
    return ActionSpec(schema={"type": "string", "maxLength": max_chars})


def check_message(action: Any, max_chars: int) -> str:
    """Canonical text of a talk-phase message; None or "" is silence.

    The paper's agents wrap messages in ``<<message_start>>...<<message_end>>``;
    the markers are stripped so the other player reads only the message.
    """
    if action is None:
        return ""
    if not isinstance(action, str):
        raise IllegalActionError(f"a message must be text, not {type(action).__name__}")
    text = action
    m = _MESSAGE.search(text)
    if m:
        text = m.group(1)
    text = text.strip()
    if len(text) > max_chars:
        raise IllegalActionError(f"message of {len(text)} characters exceeds the limit of {max_chars}")
    return text


def parse_int(action: Any, lo: int, hi: int, what: str) -> int:
    """An integer in [lo, hi] from an int, an integral float or a short text answer."""
    value: Any = action
    if isinstance(value, str):
        text = value
        m = _PROPOSAL.search(text)
        if m:
            text = m.group(1)
        lines = [line for line in text.splitlines() if line.strip()]
        # Only the first line counts (the paper's prompts ask for the number
        # there, the reason after it), and it must hold exactly one number:
        # "I pick 33, not 50" is ambiguous and is refused rather than guessed.
        found = _NUMBER.findall(lines[0]) if lines else []
        if len(found) != 1:
            raise IllegalActionError(f"{what} must be an integer in [{lo}, {hi}], got {action!r}")
        value = float(found[0])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise IllegalActionError(f"{what} must be an integer in [{lo}, {hi}], got {action!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise IllegalActionError(f"{what} must be a whole number in [{lo}, {hi}], got {action!r}")
        value = int(value)
    if not lo <= value <= hi:
        raise IllegalActionError(f"{what} must be in [{lo}, {hi}], got {value}")
    return int(value)


def parse_float(action: Any, lo: float, hi: float, what: str) -> float:
    """A finite number in [lo, hi] from a number or a text answer (the first number in it)."""
    value: Any = action
    if isinstance(value, str):
        m = _NUMBER.search(value)
        if not m:
            raise IllegalActionError(f"{what} must be a number in [{lo}, {hi}], got {action!r}")
        value = float(m.group())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise IllegalActionError(f"{what} must be a number in [{lo}, {hi}], got {action!r}")
    value = float(value)
    if not math.isfinite(value):
        raise IllegalActionError(f"{what} must be finite, got {action!r}")
    if not lo <= value <= hi:
        raise IllegalActionError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


def split_allocation(quantity: float, mine: float, theirs: float) -> float:
    """The split rule of the negotiation game: q_a = q * p_a / max(q, p_a + p_b).

    Proposals that fit are granted; over-claims are scaled down proportionally,
    so both players always get a learning signal (no "no deal" outcome).
    """
    denom = max(quantity, mine + theirs)
    return quantity * mine / denom if denom > 0 else 0.0
