"""What a person typed, read as an answer to a turn: the one ``parse_action`` for people.

A person answers with a number from a menu, a name or the start of one, a
value in a range, or a proposal; a model answers with prose that has to be
searched (``backroom.agents.parsing``). The two are different jobs with
different errors: a model gets a reason to repair its reply with, a person a
line saying what would be accepted, at once, before anything is sent. What the
two share (the name shown for each legal choice, reading a dict proposal) is
taken from ``agents.parsing`` so that a choice is named the same way for
both.

Pure functions, no I/O: the terminal front end calls them for every typed
line; the menu text (``describe_legal``) is what both its prompt and its
refusals show. ``offered`` turns the game's legal answers into the menu a
person gets, in the terminal and in the browser alike (the web server sends
it along with each turn).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backroom.agents.parsing import ParseError, choice_names, parse_object

JSON = Any


#: Kuhn's actions as a person is offered them: (the game's name, facing a bet) -> the
#: label, or None for a move not offered. Classic Kuhn's pass is a check or a fold and
#: its bet a bet or a call (OpenSpiel's names); Loki's call is a check when nothing is
#: owed, and its fold, legal then but dominated (the paper's fixed action space), is
#: left out, as at a real table.
KUHN_LABELS: dict[tuple[str, bool], str | None] = {
    ("pass", False): "check",
    ("pass", True): "fold",
    ("bet", False): "bet",
    ("bet", True): "call",
    ("fold", False): None,
    ("fold", True): "fold",
    ("call", False): "check",
    ("call", True): "call",
}


def offered(legal: Mapping[str, Any], observation: Mapping[str, Any]) -> dict[str, Any]:
    """The legal answers as a person is offered them: poker words that fit the table.

    A game's action names are fixed (models, solvers and the record use them),
    but at a Kuhn table what a move means depends on whether a bet is
    outstanding: ``names`` become the labels of the moves offered, and
    ``game_names`` keeps the game's own names, which are still accepted when
    typed. Other games' answers are offered as the game lists them.
    """
    choices = list(legal.get("choices", []))
    if observation.get("game") != "kuhn" or not choices:
        return dict(legal)
    facing = float(observation.get("to_call") or 0) > 0
    kept, labels, names = [], [], []
    for choice, name in zip(choices, choice_names(legal, choices), strict=True):
        label = KUHN_LABELS.get((name, facing), name)
        if label is None:
            continue
        kept.append(choice)
        labels.append(label)
        names.append(name)
    return {**legal, "choices": kept, "names": labels, "game_names": names}


def action_labels(legal: Mapping[str, Any]) -> list[str]:
    """One label per listed choice: its name when the game names them, else the value itself."""
    return choice_names(legal, list(legal.get("choices", [])))


def numbered(legal: Mapping[str, Any]) -> bool:
    """Whether choices get position numbers; not when a label is itself a number (no ambiguity)."""
    return not any(
        label.lstrip("-").replace(".", "", 1).isdigit() for label in action_labels(legal)
    )


def describe_legal(legal: Mapping[str, Any]) -> str:
    """The menu of an act turn: ``1 fold · 2 call · 3 raise``, or a range, or the shape asked for."""
    labels = action_labels(legal)
    if labels:
        if numbered(legal):
            return " · ".join(f"{i} {label}" for i, label in enumerate(labels, 1))
        return " · ".join(labels)
    schema = legal.get("schema", {})
    kind = schema.get("type", "value")
    if kind == "object":
        props = schema.get("properties", {})
        example = ", ".join(f"{p.get('minimum', 0)} {k}" for k, p in props.items())
        return f"a proposal such as '{example}' (or a JSON object)"
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None and hi is not None:
        return f"{kind} from {lo} to {hi}"
    return str(kind)


def parse_action(text: str, legal: Mapping[str, Any]) -> JSON:
    """Map what the person typed to a legal answer; ``ValueError`` says what would be accepted.

    Listed choices: the exact label (any case), or the game's own name of an
    offered move (``offered``: ``call`` for Kuhn's check), else the position number when
    labels are not numbers themselves, else a unique prefix of a label (``r``
    for ``raise``). Numbers: the type and range of the schema. Objects (a
    proposal): a JSON object or ``5 hats, 0 books, 5 balls``. Text: as typed.
    Refused input never reaches the referee, so a typo costs nothing but the
    line.
    """
    text = text.strip()
    choices = list(legal.get("choices", []))
    if choices:
        return _parse_choice(text, choices, legal)
    schema = legal.get("schema", {})
    kind = schema.get("type")
    if kind in ("integer", "number"):
        try:
            value: Any = int(text) if kind == "integer" else float(text)
        except ValueError:
            raise ValueError(f"type a{'n integer' if kind == 'integer' else ' number'}") from None
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"must be between {lo} and {hi}")
        return value
    if kind == "object":
        try:
            return parse_object(text, schema)
        except ParseError as exc:
            raise ValueError(f"{exc.reason}; type {describe_legal(legal)}") from None
    if kind == "string" or not text:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_choice(text: str, choices: list[JSON], legal: Mapping[str, Any]) -> JSON:
    """One of the listed ``choices``, by ``parse_action``'s order of readings (label first)."""
    labels = action_labels(legal)
    low = text.lower()
    for choice, label in zip(choices, labels, strict=True):
        if label.lower() == low:
            return choice
    for choice, name in zip(choices, legal.get("game_names", []), strict=False):
        if str(name).lower() == low:  # the game's own name for an offered move
            return choice
    if numbered(legal) and text.isdigit():
        i = int(text)
        if 1 <= i <= len(choices):
            return choices[i - 1]
        raise ValueError(f"pick a number from 1 to {len(choices)}")
    prefixed = [
        c for c, label in zip(choices, labels, strict=True) if low and label.lower().startswith(low)
    ]
    if len(prefixed) == 1:
        return prefixed[0]
    raise ValueError(f"not one of: {describe_legal(legal)}")
