"""Helpers shared by the text-prompted engines (IPD, splits, beauty contest, Bertrand).

They exist so every engine parses agent answers the same lenient way (an LLM
may answer ``"<A>"``, ``"7"`` or ``"<<proposal_start>> 7 <<proposal_end>>"``)
while still rejecting anything ambiguous with an ``IllegalActionError`` that
tells the agent what was expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from backroom.games.base import CHANCE, JSON, Action, ActionSpec, IllegalActionError, State

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
            raise ValueError(
                f"{game}: unknown prompt templates {unknown}; known: {sorted(defaults)}"
            )
        for key, text in overrides.items():
            if not isinstance(text, str):
                raise ValueError(f"{game}: prompt template {key!r} must be a string")
            merged[key] = text
    return merged


def require_count(game: str, what: str, value: Any) -> None:
    """Refuse a count (rounds, coins, ...) that is not a positive integer.

    Every engine words this error the same way, naming itself and the parameter,
    so a bad config reads alike whichever game it is for.
    """
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{game}: {what} must be a positive integer")


def seat_names(
    game: str,
    names: Sequence[str] | None,
    default: Sequence[str],
    what: str = "names",
    seats: str = "players",
) -> list[str]:
    """The two seats' names as the prompts print them; a missing or empty list means the defaults.

    ``what`` and ``seats`` only word the error, so that Bertrand can say
    ``firm_names`` and "firms" as its config does.
    """
    out = list(names or default)
    if len(out) != 2:
        raise ValueError(f"{game}: {what} must name both {seats}")
    return out


def persona_texts(
    personas: Sequence[str] | None, shorthands: Mapping[str, str], seats: int
) -> list[str]:
    """Each seat's persona as prompt text: a shorthand expands, anything else is used as written.

    No personas at all means the ``"none"`` shorthand for every seat, which is
    how the papers' persona ablations name their baseline.
    """
    return [shorthands.get(str(p).lower(), str(p)) for p in (personas or ["none"] * seats)]


def number_text(x: float, spec: str = "g") -> str:
    """A number for a prompt: whole numbers without a decimal point, others formatted by ``spec``.

    The papers print payoffs such as 3 or 10 as integers, but disagree on
    fractions (the IPD prompt shows ``2.5`` as ``g`` does, Trust-and-Split one
    decimal); the spec is a parameter so that each game's pinned prompt stays as it is.
    """
    return str(int(x)) if float(x).is_integer() else format(x, spec)


def observation_head(state: State, player: int, rounds: int) -> dict[str, JSON]:
    """The fields a round-based game's observation opens with, named and ordered alike.

    Agents that play several games, and the analysis, find the game, the round
    and the phase in the same place whatever the game.
    """
    return {
        "game": state.game.name,
        "round": state.current_round(),
        "rounds": rounds,
        "player": player,
        "phase": state.phase,
    }


def totals_fields(
    totals: Sequence[float], player: int, fmt: Callable[[float], Any] | None = None
) -> dict[str, Any]:
    """``my_total`` and ``other_total`` of a two-player game, for an observation or a template.

    Observations carry the raw sums; a prompt passes ``fmt`` to print them the
    way its paper does, which differs between games.
    """
    mine, theirs = totals[player], totals[1 - player]
    if fmt is None:
        return {"my_total": mine, "other_total": theirs}
    return {"my_total": fmt(mine), "other_total": fmt(theirs)}


def name_fields(names: Sequence[str], player: int) -> dict[str, str]:
    """The papers' templates name both players; ``player`` reads itself as ``{agent}``."""
    return {"agent": names[player], "other_agent": names[1 - player]}


class TalkState(State):
    """A state whose game has talk phases: in ``talk`` the answer is a message, in ``act`` a move.

    Who moves, the phase, the default answer and the split of ``apply`` between
    messages and moves are the same in every game with talk, so they live here.
    Subclasses say who has the floor (``speaker``), whether chance is still to
    draw (``_at_chance``), and describe, check, default and apply their moves
    (``act_spec``, ``check_act``, ``default_act``, ``_apply_act``); a message is
    stored by ``_add_message``.
    """

    @property
    def max_chars(self) -> int:
        # Every game with talk phases has a max_chars parameter.
        return int(self.game.max_chars)  # type: ignore[attr-defined]

    def speaker(self) -> int | None:
        """The one seat that talks now; None outside a talk phase."""
        raise NotImplementedError

    def _at_chance(self) -> bool:
        """Whether chance must draw (a speaking order, a deal) before anyone can move."""
        raise NotImplementedError

    def _sync_phase(self) -> None:
        # The phase follows from the state; every change of the state ends here.
        self.phase = "talk" if self.speaker() is not None else "act"

    def current_players(self) -> frozenset[int]:
        if self.is_terminal():
            return frozenset()
        if self._at_chance():
            return frozenset({CHANCE})
        speaker = self.speaker()
        return frozenset({speaker}) if speaker is not None else frozenset(range(self.num_players))

    def action_spec(self, player: int) -> ActionSpec:
        if self.phase == "talk":
            return talk_spec(self.max_chars)
        return self.act_spec(player)

    def check_action(self, player: int, action: Any) -> Any:
        self.require_mover(player)
        if self.phase == "talk":
            return check_message(action, self.max_chars)
        return self.check_act(player, action)

    def default_action(self, player: int) -> Action:
        # A seat that misses its talk turn stays silent.
        return "" if self.phase == "talk" else self.default_act(player)

    def _apply(self, actions: Mapping[int, Action]) -> None:
        if self.phase == "talk":
            ((seat, text),) = actions.items()
            self._add_message(seat, text)
        else:
            self._apply_act(actions)
        self._sync_phase()

    def act_spec(self, player: int) -> ActionSpec:
        raise NotImplementedError

    def check_act(self, player: int, action: Any) -> Any:
        raise NotImplementedError

    def default_act(self, player: int) -> Action:
        raise NotImplementedError

    def _add_message(self, seat: int, text: str) -> None:
        raise NotImplementedError

    def _apply_act(self, actions: Mapping[int, Action]) -> None:
        raise NotImplementedError


class CountTalkState(TalkState):
    """A talk game whose move is a whole number in a range (the coins to keep, a guess).

    The range is small, so it is listed for solvers as well as described for
    agents, and a text answer is read leniently by ``parse_int``.
    """

    #: What the number is, as the error message names it for the agent.
    count_what: ClassVar[str]

    def count_range(self) -> tuple[int, int]:
        """The smallest and largest legal number, both included."""
        raise NotImplementedError

    def legal_actions(self, player: int) -> Sequence[Action]:
        if player not in self.current_players() or player == CHANCE or self.phase == "talk":
            return []
        lo, hi = self.count_range()
        return list(range(lo, hi + 1))

    def act_spec(self, player: int) -> ActionSpec:
        lo, hi = self.count_range()
        return ActionSpec(schema={"type": "integer", "minimum": lo, "maximum": hi})

    def check_act(self, player: int, action: Action) -> Action:
        lo, hi = self.count_range()
        return parse_int(action, lo, hi, self.count_what)


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
        raise IllegalActionError(
            f"message of {len(text)} characters exceeds the limit of {max_chars}"
        )
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
            raise IllegalActionError(
                f"{what} must be a whole number in [{lo}, {hi}], got {action!r}"
            )
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
    number = float(value)
    if not math.isfinite(number):
        raise IllegalActionError(f"{what} must be finite, got {action!r}")
    if not lo <= number <= hi:
        raise IllegalActionError(f"{what} must be in [{lo}, {hi}], got {number}")
    return number


def split_allocation(quantity: float, mine: float, theirs: float) -> float:
    """The split rule of the negotiation game: q_a = q * p_a / max(q, p_a + p_b).

    Proposals that fit are granted; over-claims are scaled down proportionally,
    so both players always get a learning signal (no "no deal" outcome).
    """
    denom = max(quantity, mine + theirs)
    return quantity * mine / denom if denom > 0 else 0.0
