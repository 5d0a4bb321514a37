"""The replay's observations, moves and results in words, for a person reading a match.

The referee's observations are made for programs: card numbers, history as a
list of dicts, empty fields, floats to 17 digits. The replay page shows each
seat's view as rows of (label, text) made here instead, the raw observation
kept one click away: cards by the game's own names (``state.card_name``, so
Loki Kuhn's ``4`` is ``Ace (card 4)``: the number stays, since programs at
the table say it), history as who did what, empty fields left out, numbers
rounded to three decimals (three significant digits below 1), and a talk
turn that said nothing as ``(silent)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backroom.games.kuhn import observed_card_name

#: Shown for a talk turn whose answer was no message.
SILENT = "(silent)"
#: Observation keys not shown as rows: the game's name, and who the seat is (the box says).
SKIP = ("game", "variant", "player")
#: Observation keys whose value is a seat: shown as its agent.
SEAT_KEYS = ("winner", "start")
#: Numbers of a long list shown before "… (N values)" (an OpenSpiel tensor, say).
MAX_LIST = 12


def number(x: float) -> str:
    """A number as a person reads it: whole ones bare, others to 3 decimals (3 digits below 1)."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) or float(x).is_integer():
        return str(int(x))
    if abs(x) >= 1:
        return f"{round(x, 3):g}" if abs(x) < 1e6 else f"{x:.4g}"
    return f"{x:.3g}"


def signed(x: float) -> str:
    """A return or reward with its sign: ``+1``, ``-0.059``, ``0``."""
    text = number(x)
    return text if text.startswith("-") or text == "0" else f"+{text}"


def empty(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, (list, dict)) and not value)


class Words:
    """Words for one match's values: its seats' names and, when rebuilt, its game state."""

    def __init__(self, seats: Sequence[str], state: Any = None) -> None:
        self.seats = list(seats)
        self.naming: Callable[[int], str] | None = getattr(state, "card_name", None)

    def seat(self, seat: Any) -> str:
        try:
            return self.seats[int(seat)]
        except (ValueError, TypeError, IndexError):
            return f"seat {seat}"

    def card(self, observation: Mapping[str, Any], card: Any) -> str:
        """A card by the game's own name, with its number when the two differ."""
        if isinstance(card, int) and self.naming is not None:
            try:
                name = str(self.naming(card))
            except (IndexError, KeyError, ValueError):
                return str(card)
            return name if name == str(card) else f"{name} (card {card})"
        return observed_card_name(observation, card)

    def value(self, value: Any) -> str:
        """Any observation value in words (the rows' fallback for keys without their own)."""
        if isinstance(value, (bool, int, float)):
            return number(value)
        if isinstance(value, str):
            return value
        if isinstance(value, Mapping):
            return ", ".join(
                f"{label(k)} {self.value(v)}" for k, v in value.items() if not empty(v)
            )
        if isinstance(value, (list, tuple)):
            if all(isinstance(v, (int, float)) for v in value):
                shown = ", ".join(number(v) for v in value[:MAX_LIST])
                return shown + (f" … ({len(value)} values)" if len(value) > MAX_LIST else "")
            return "; ".join(self.value(v) for v in value if not empty(v))
        return str(value)

    def history(self, observation: Mapping[str, Any], history: Sequence[Any]) -> str:
        """Who did what, in order: ``alice check → bob bet``; other games' entries in words."""
        items = []
        for h in history:
            if isinstance(h, Mapping) and "player" in h and "action" in h:
                items.append(f"{self.seat(h['player'])} {self.value(h['action'])}")
            elif isinstance(h, Mapping) and "seat" in h and "text" in h:
                items.append(f"{self.seat(h['seat'])}: {h['text']}")
            else:
                items.append(self.value(h))
        return " → ".join(items)

    def rows(self, observation: Mapping[str, Any] | None) -> list[list[str]]:
        """(label, text) of each field a person needs; empty fields left out."""
        if not observation:
            return []
        out: list[list[str]] = []
        for key, value in observation.items():
            if key in SKIP or empty(value):
                continue
            if key == "info_state" and observation.get("game") == "kuhn":
                continue  # the card and the history again, in the solver's shorthand
            text = self.field(observation, key, value)
            if text is not None:
                out.append([label(key), text])
        return out

    def field(self, observation: Mapping[str, Any], key: str, value: Any) -> str | None:
        """One field's text, by what the key holds; None for one that says nothing (no one folded)."""
        if key == "card":
            return self.card(observation, value)
        if isinstance(value, Mapping):
            if key == "shown":
                return ", ".join(
                    f"{self.seat(s)} {self.card(observation, c)}" for s, c in value.items()
                )
            return self.value(value)
        if isinstance(value, list):
            return self.list_field(observation, key, value)
        if key in SEAT_KEYS and isinstance(value, int):
            return self.seat(value)
        return self.value(value)

    def list_field(self, observation: Mapping[str, Any], key: str, value: list[Any]) -> str | None:
        """A list field's text: who folded, the history, the returns; any other list as values."""
        if key == "folded":
            return ", ".join(self.seat(s) for s, f in enumerate(value) if f is True) or None
        if key in ("history", "conversation", "messages"):
            return self.history(observation, value)
        if key == "returns":
            return " / ".join(f"{self.seat(s)} {signed(v)}" for s, v in enumerate(value))
        return self.value(value)

    def move(self, phase: str, action: Any, name: str | None) -> str:
        """One seat's answer: the move's name, the message, or ``(silent)``."""
        if phase == "talk":
            return SILENT if empty(action) else str(action)
        if name is not None:
            return name
        return "(no move)" if action is None else self.value(action)

    def result(self, record: Any) -> list[str]:
        """The end's lines: returns (and before the transform, where it changed them), the
        per-round rewards, timeouts and invalid inputs; each only where there is something."""
        lines = [
            "returns "
            + " / ".join(f"{self.seat(s)} {signed(r)}" for s, r in enumerate(record.returns))
        ]
        if [round(x, 9) for x in record.raw_returns] != [round(x, 9) for x in record.returns]:
            lines.append(
                "before the transform " + " / ".join(signed(r) for r in record.raw_returns)
            )
        if record.round_rewards:
            rounds = [" / ".join(signed(r) for r in rr) for rr in record.round_rewards]
            lines.append("round rewards: " + "; ".join(rounds))
        if record.timeouts:  # the seat of each timed-out turn
            per = Counter(record.timeouts)
            lines.append("timed out: " + ", ".join(f"{self.seat(s)} {n}x" for s, n in per.items()))
        if record.invalid_inputs:
            lines.append(f"invalid inputs: {record.invalid_inputs}")
        return lines


def label(key: Any) -> str:
    """A field's name as a label: ``to_call`` -> ``to call``."""
    return str(key).replace("_", " ")
