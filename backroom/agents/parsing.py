"""Reading actions out of model replies, in the formats the papers' prompts ask for.

Pure functions, no I/O: the ``llm`` agent parses HTTP replies with them, the
``local`` agent uses them to render the text of each legal choice (what it
scores) and to parse free-text answers (prices, proposals), and both share the
documented fallback. Everything a game's prompt may ask for is accepted:

* a choice by name — ``"raise"``, ``"A"``, ``"call."``, or a name in tags
  (``"<A>"``, the IPD prompt of the social-strategies paper);
* ``<<proposal_start>> 7 <<proposal_end>>`` (Trust-and-Split);
* a number on the first line, a reason after it (Shall We Team Up, Prompts 9-11);
* a JSON object for dict-shaped proposals, or ``Proposal: x hats, y books, z balls``
  (Split No-Comm);
* a chat message, optionally in ``<<message_start>>...<<message_end>>``.

A reply that does not parse raises ``ParseError`` whose ``reason`` is written
to be sent back to the model in the repair round ("your reply was not valid
because ...").
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

JSON = Any

#: Integer schemas with at most this many values are treated as a finite choice
#: (scored exhaustively by the ``local`` agent).
MAX_ENUMERATED = 101

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_PROPOSAL = re.compile(r"<<proposal_start>>(.*?)(?:<<proposal_end>>|$)", re.S)
_MESSAGE = re.compile(r"<<message_start>>(.*?)(?:<<message_end>>|$)", re.S)
_TAG = re.compile(r"<\s*([A-Za-z0-9_]+)\s*>")
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
_ITEM_PAIR = re.compile(r"(\d+)\s*([A-Za-z]+)")


class ParseError(ValueError):
    """A reply with no valid action in it; ``reason`` is meant for the model's repair prompt."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- what the turn allows ------------------------------------------------------------


def legal_choices(legal: Mapping[str, JSON]) -> list[JSON]:
    """The finite legal answers of a turn, enumerating small integer ranges.

    Trust-and-Split and the beauty contest describe their answer as an integer
    schema; listing its values lets a model score every legal answer exactly.
    Empty when the answer is free text, a real number or a large/structured space.
    """
    listed = list(legal.get("choices", []))
    if listed:
        return listed
    schema = legal.get("schema") or {}
    if schema.get("type") == "integer" and "minimum" in schema and "maximum" in schema:
        lo, hi = int(schema["minimum"]), int(schema["maximum"])
        if 0 <= hi - lo < MAX_ENUMERATED:
            return list(range(lo, hi + 1))
    return []


def choice_names(legal: Mapping[str, JSON], choices: Sequence[JSON] | None = None) -> list[str]:
    """A display name per legal choice: the game's names, else the value's text."""
    values = list(choices) if choices is not None else legal_choices(legal)
    names = list(legal.get("names", []))
    if len(names) == len(values):
        return [str(n) for n in names]
    return [v if isinstance(v, str) else json.dumps(v) for v in values]


def answer_format(prompt: str) -> str:
    """Which answer format a game's prompt asks for.

    ``tag``: ``<A>`` (IPD); ``proposal``: ``<<proposal_start>>x<<proposal_end>>``;
    ``items``: ``Proposal: x hats, ...`` (Split No-Comm); ``plain``: anything else.
    """
    if "<<proposal_start>>" in prompt:
        return "proposal"
    if re.search(r'"<[A-Za-z0-9_]+>"', prompt):
        return "tag"
    if "Respond as Proposal:" in prompt or "Proposal: x" in prompt:
        return "items"
    return "plain"


def render_choice(name: str, fmt: str) -> str:
    """The reply text that plays a choice in the prompt's format (what the model should write)."""
    if fmt == "tag":
        return f"<{name}>"
    if fmt == "proposal":
        return f"<<proposal_start>>{name}<<proposal_end>>"
    return name


def format_hint(legal: Mapping[str, JSON], prompt: str = "") -> str:
    """A short instruction saying how to answer, used in the repair round."""
    fmt = answer_format(prompt)
    choices = legal_choices(legal)
    schema = legal.get("schema") or {}
    if choices and legal.get("choices"):
        names = choice_names(legal, choices)
        shown = ", ".join(render_choice(n, fmt) for n in names)
        return f"Reply with exactly one of: {shown}."
    if fmt == "proposal":
        return (
            f"Reply with <<proposal_start>> x <<proposal_end>> where x is an integer in "
            f"[{schema.get('minimum')}, {schema.get('maximum')}]."
        )
    kind = schema.get("type")
    if kind in ("integer", "number"):
        what = "an integer" if kind == "integer" else "a number"
        return (
            f"Reply with {what} between {schema.get('minimum')} and {schema.get('maximum')} "
            "on the first line, and nothing else on that line."
        )
    if kind == "object":
        props = schema.get("properties", {})
        example = {k: v.get("minimum", 0) for k, v in props.items()}
        return (
            f"Reply with a JSON object like {json.dumps(example)} (integers in the allowed ranges)."
        )
    return "Reply with your answer only."


# --- parsers ---------------------------------------------------------------------------


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().strip(".!\"'`*").strip().lower()


def _choice_keys(choices: Sequence[JSON], names: Sequence[str]) -> dict[str, JSON]:
    """Each choice by its normalised display name, and by its own text where that differs."""
    by_name = {_norm(n): c for n, c in zip(names, choices, strict=True)}
    for c in choices:
        by_name.setdefault(_norm(c if isinstance(c, str) else json.dumps(c)), c)
    return by_name


def _whole_reply_key(reply: str, by_name: Mapping[str, JSON]) -> str | None:
    """The name the whole reply, or its first line, is (bare or as a tag ``<name>``)."""
    lines = [line for line in reply.splitlines() if line.strip()]
    for candidate in (reply, lines[0] if lines else ""):
        key = (
            _norm(_TAG.sub(r"\1", candidate))
            if _TAG.fullmatch(candidate.strip())
            else _norm(candidate)
        )
        if key in by_name:
            return key
    return None


def _tagged_key(reply: str, by_name: Mapping[str, JSON]) -> str | None:
    """The one legal name the reply holds as a tag; two different ones are refused."""
    tags = {_norm(t) for t in _TAG.findall(reply)} & set(by_name)
    if len(tags) > 1:
        raise ParseError(f"it names several choices ({', '.join(sorted(tags))}); give exactly one")
    return tags.pop() if tags else None


def _word_key(reply: str, by_name: Mapping[str, JSON], names: Sequence[str]) -> str:
    """The one legal name the reply holds as a word; none, or two different ones, are refused."""
    lowered = reply.lower()
    found = {
        key
        for key in by_name
        if key and re.search(rf"(?<![A-Za-z0-9_]){re.escape(key)}(?![A-Za-z0-9_])", lowered)
    }
    # single letters ("a") would match any article: only as a whole reply or a tag
    found = {k for k in found if len(k) > 1}
    if len(found) == 1:
        return found.pop()
    legal = ", ".join(names)
    if len(found) > 1:
        raise ParseError(
            f"it names several choices ({', '.join(sorted(found))}); give exactly one of: {legal}"
        )
    raise ParseError(f"it does not name one of the legal choices: {legal}")


def parse_choice(text: str, choices: Sequence[JSON], names: Sequence[str] | None = None) -> JSON:
    """One legal choice named in ``text``.

    Tried in order: the whole reply (or its first line) is a name or a tag
    ``<name>``; the reply holds exactly one tag of a legal name; exactly one
    distinct legal name appears as a word. A reply naming two different
    choices is ambiguous and refused rather than guessed.
    """
    if not choices:
        raise ParseError("there is nothing to choose from")
    names = (
        list(names)
        if names is not None
        else [c if isinstance(c, str) else json.dumps(c) for c in choices]
    )
    by_name = _choice_keys(choices, names)
    stripped = text.strip()
    if not stripped:
        raise ParseError("the reply was empty")
    m = _PROPOSAL.search(stripped)
    if m:
        stripped = m.group(1).strip()
    key = _whole_reply_key(stripped, by_name)
    if key is None:
        key = _tagged_key(stripped, by_name)
    if key is None:
        key = _word_key(stripped, by_name, names)
    return by_name[key]


def parse_number(text: str, schema: Mapping[str, JSON]) -> int | float:
    """A number in the schema's range: inside proposal tags, else alone on the first line.

    Only the first non-empty line counts (the papers' prompts ask for the
    number there and a reason after it); it must hold exactly one number.
    """
    kind = schema.get("type", "number")
    lo = schema.get("minimum", -math.inf)
    hi = schema.get("maximum", math.inf)
    body = text.strip()
    m = _PROPOSAL.search(body)
    if m:
        body = m.group(1)
    lines = [line for line in body.splitlines() if line.strip()]
    if not lines:
        raise ParseError("the reply was empty; a number was expected")
    found = _NUMBER.findall(
        lines[0].replace(",", "") if re.fullmatch(r"[\d,.\s]+", lines[0]) else lines[0]
    )
    if len(found) != 1:
        what = "no number" if not found else f"{len(found)} numbers"
        raise ParseError(f"its first line holds {what}; it must hold exactly one number")
    value = float(found[0])
    if not math.isfinite(value):
        raise ParseError("the number is not finite")
    if kind == "integer":
        if value != int(value):
            raise ParseError(f"{found[0]} is not a whole number")
        value = int(value)
    if not lo <= value <= hi:
        raise ParseError(f"{found[0]} is outside the allowed range [{lo}, {hi}]")
    return value


def _find_json_object(text: str) -> dict[str, JSON] | None:
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start = text.find("{")
    while start != -1:
        depth = 0
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    candidates.append(text[start : i + 1])
                    break
        start = text.find("{", start + 1)
    for c in candidates:
        try:
            value = json.loads(c)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _items_object(text: str, props: Mapping[str, Mapping[str, JSON]]) -> dict[str, JSON]:
    """``Proposal: 5 hats, 0 books, 5 balls`` as a dict; an item left out is at its minimum."""
    pairs = _ITEM_PAIR.findall(text)
    if not pairs:
        raise ParseError("it holds no JSON object and no 'x hats, y books, z balls' list")
    value: dict[str, JSON] = {}
    for num, word in pairs:
        w = word.lower()
        key = next((k for k in props if w in (k, k.rstrip("s"), k + "s")), None)
        if key is not None:
            value[key] = int(num)
    if not value:
        raise ParseError(f"it names none of the items {sorted(props)}")
    for k, p in props.items():
        value.setdefault(k, p.get("minimum", 0))
    return value


def _property_value(k: str, v: JSON, p: Mapping[str, JSON]) -> int | float:
    """One property's value as the number its schema asks for, in its range."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ParseError(f"{k} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParseError(f"{k} must be a number, got {v!r}")
    if p.get("type") == "integer":
        if v != int(v):
            raise ParseError(f"{k} must be a whole number, got {v}")
        v = int(v)
    lo, hi = p.get("minimum", -math.inf), p.get("maximum", math.inf)
    if not lo <= v <= hi:
        raise ParseError(f"{k} = {v} is outside [{lo}, {hi}]")
    return v


def parse_object(text: str, schema: Mapping[str, JSON]) -> dict[str, JSON]:
    """A dict proposal: a JSON object, or ``Proposal: 5 hats, 0 books, 5 balls``.

    Keys must be the schema's properties (an ``items`` reply may leave one out: it
    counts as 0, as in the paper's parser); values integers in range.
    """
    props: Mapping[str, Mapping[str, JSON]] = schema.get("properties", {})
    value = _find_json_object(text)
    if value is None:
        value = _items_object(text, props)
    extra = sorted(set(value) - set(props))
    missing = sorted(k for k in schema.get("required", props) if k not in value)
    if extra or missing:
        raise ParseError(
            f"the object must have exactly the keys {sorted(props)} (extra {extra}, missing {missing})"
        )
    return {k: _property_value(k, value[k], p) for k, p in props.items()}


def parse_message(text: str, max_chars: int | None = None) -> str:
    """A chat message: the part in ``<<message_start>>`` markers if any, trimmed and cut to length."""
    m = _MESSAGE.search(text)
    body = (m.group(1) if m else text).strip()
    if body.startswith(("'", '"')) and body.endswith(body[0]) and len(body) > 1:
        body = body[1:-1].strip()
    if max_chars is not None and len(body) > max_chars:
        body = body[:max_chars].rstrip()
    return body


def parse_action(text: str, legal: Mapping[str, JSON]) -> JSON:
    """The action in a reply to an act turn, whatever shape ``legal`` describes."""
    listed = list(legal.get("choices", []))
    if listed:
        return parse_choice(text, listed, choice_names(legal, listed))
    schema = legal.get("schema") or {}
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return parse_number(text, schema)
    if kind == "object":
        return parse_object(text, schema)
    if kind == "string":
        return parse_message(text, schema.get("maxLength"))
    raise ParseError("this turn describes no answer this agent can read")


def fallback_action(legal: Mapping[str, JSON], preferred: JSON = None) -> JSON:
    """The documented answer when no valid one could be had in time.

    ``preferred`` if it is legal (a choice, or its name), else: the first legal
    choice; a number schema's ``default``, else its minimum (0 coins in
    Trust-and-Split, as the game's own default); every key of an object at its
    minimum (Split No-Comm's "nothing"); silence for text.
    """
    listed = list(legal.get("choices", []))
    names = list(legal.get("names", []))
    if listed:
        if preferred in listed:
            return preferred
        if preferred in names:
            return listed[names.index(preferred)]
        return listed[0]
    schema = legal.get("schema") or {}
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return _fallback_number(schema, preferred)
    if kind == "object":
        return _fallback_object(schema, preferred)
    if kind == "string":
        return preferred if isinstance(preferred, str) else ""
    return preferred


def _fallback_number(schema: Mapping[str, Any], preferred: JSON) -> JSON:
    """``preferred`` if the schema takes it, else the schema's default, else its minimum."""
    if isinstance(preferred, (int, float)) and not isinstance(preferred, bool):
        try:
            return parse_number(str(preferred), schema)
        except ParseError:
            pass
    value = schema.get("default", schema.get("minimum", 0))
    return int(value) if schema.get("type") == "integer" else float(value)


def _fallback_object(schema: Mapping[str, Any], preferred: JSON) -> JSON:
    """``preferred`` if the schema takes it, else every key at its minimum."""
    if isinstance(preferred, Mapping):
        try:
            return parse_object(json.dumps(preferred), schema)
        except ParseError:
            pass
    return {k: p.get("minimum", 0) for k, p in schema.get("properties", {}).items()}
