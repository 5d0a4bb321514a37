"""What the referee does to a chat message between its sender and its readers.

A channel's ``interventions`` (``bus.wire.Intervention``: redact, budget, delay,
drop, shuffle_roles, paraphrase) run in order over each message, once for its members and,
where the channel gives them a list of their own, once for its eavesdroppers: every
reader of one list gets the same copy, so "the overseer sees the raw text, the
partner sees the redacted one" is two lists, and a per-match budget is spent once
per message, not once per reader.

Why these choices:

* Pure and deterministic but for ``paraphrase``, which this module only marks (the
  referee asks the model and resumes the list after it). The only chance (``drop``) is drawn from a generator
  seeded by the match seed, the channel, the message's number and the list, so
  the same config and seed lose the same messages whatever else happens.
* A list stops at the first ``drop`` that fires (nothing is left to change);
  ``delay`` only says when to deliver, so the interventions after it still apply.
* A channel without interventions never comes here: its play and its records
  are what they were before interventions existed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Literal

from backroom import seeds
from backroom.bus.wire import Budget, Delay, Drop, Intervention, Paraphrase, Redact, ShuffleRoles

#: Which reader list a copy was made for (members, or eavesdroppers with a list of their own).
Audience = Literal["members", "eavesdroppers"]


@dataclass
class Copy:
    """What one list of readers gets of one message."""

    text: str
    delivered: bool = True
    delay: int | Literal["end"] | None = None
    anonymous: bool = False
    changed_by: list[str] = field(default_factory=list)
    #: The position of a ``paraphrase`` the copy waits on (the model is asked, then the
    #: list goes on after it: ``apply(..., copy=copy, start=rewrite_at + 1)``).
    rewrite_at: int | None = None


@dataclass
class BudgetLedger:
    """Units each sender has spent of each per-match budget, by (channel, seat, list, position)."""

    spent: dict[tuple[str, int, Audience, int], int] = field(default_factory=dict)


def units(budget: Budget, text: str) -> int:
    if budget.chars is not None:
        return len(text)
    if budget.tokens is not None:
        return len(text.split())
    return 8 * len(text.encode())


def cut(budget: Budget, text: str, allowed: int) -> str:
    """``text`` cut to at most ``allowed`` units of the budget's kind."""
    if budget.chars is not None:
        return text[:allowed]
    if budget.tokens is not None:
        # Keep the text as written up to the end of its allowed-th word.
        words = list(re.finditer(r"\S+", text))
        if allowed >= len(words):
            return text
        return text[: words[allowed - 1].end()] if allowed > 0 else ""
    return text.encode()[: allowed // 8].decode(errors="ignore")


def limit(budget: Budget) -> int:
    value = budget.chars if budget.chars is not None else budget.tokens
    value = value if value is not None else budget.bits
    assert value is not None  # the model requires exactly one
    return value


def apply(
    interventions: list[Intervention],
    text: str,
    *,
    match_seed: int,
    channel: str,
    message: int,
    seat: int,
    audience: Audience,
    ledger: BudgetLedger,
    copy: Copy | None = None,
    start: int = 0,
) -> Copy:
    """The copy one list of readers gets of message number ``message`` that ``seat`` sent.

    Stops at a ``paraphrase`` (``Copy.rewrite_at``): a model's answer is not pure, so the
    referee asks it and calls again with the rewritten ``copy`` from the step after.
    """
    copy = copy if copy is not None else Copy(text=text)
    copy.rewrite_at = None
    for position, step in enumerate(interventions[start:], start):
        before = copy.text
        if isinstance(step, Paraphrase):
            copy.rewrite_at = position
            return copy
        if isinstance(step, Redact):
            for pattern in step.patterns:
                copy.text = re.sub(pattern, step.mark, copy.text)
        elif isinstance(step, Budget):
            allowed = limit(step)
            if step.per == "match":
                key = (channel, seat, audience, position)
                allowed = max(0, allowed - ledger.spent.get(key, 0))
            copy.text = cut(step, copy.text, allowed)
            if step.per == "match":
                ledger.spent[key] = ledger.spent.get(key, 0) + units(step, copy.text)
        elif isinstance(step, Delay):
            copy.delay = step.turns
            copy.changed_by.append(step.kind)
            continue
        elif isinstance(step, Drop):
            rng = random.Random(
                seeds.derive_seed(match_seed, "drop", channel, message, audience, position)
            )
            if rng.random() < step.p:
                copy.delivered = False
                copy.changed_by.append(step.kind)
                return copy
            continue
        elif isinstance(step, ShuffleRoles):
            copy.anonymous = True
            copy.changed_by.append(step.kind)
            continue
        if copy.text != before:
            copy.changed_by.append(step.kind)
    return copy
