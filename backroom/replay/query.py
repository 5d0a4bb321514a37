"""The replay list's query: its filters, sorts and pages, checked and turned into SQL.

Filters are parameters of the page's URL, so a bad one (``seat=x``) is refused
with the field named, never turned into an empty list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Rows per list page at most (the API's ``per_page`` is capped at this).
MAX_PAGE = 500
#: Integers a filter or page may name: within this, SQLite's 64-bit offsets never overflow.
MAX_INT = 10**9


#: The list's filters (query parameters) and what each selects.
FILTERS = ("agent", "seat", "outcome", "reason", "reward_min", "reward_max", "crn_group", "step")
OUTCOMES = ("win", "loss", "even")
REASONS = ("normal", "timeout", "forfeit", "error", "voided")
SORTS = ("position", "reward", "turns", "match", "ended")


class ReplayError(ValueError):
    """A request the index cannot answer: the message names the field and what to do."""


def outcome_of(reward: float) -> str:
    """A seat's outcome by the sign of its reward (its return after the run's transform)."""
    return "win" if reward > 0 else "loss" if reward < 0 else "even"


@dataclass(frozen=True)
class Query:
    """One page of the list: filters (``None``: any), a sort, a page."""

    agent: str | None = None
    seat: int | None = None
    outcome: str | None = None
    reason: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    crn_group: str | None = None
    step: int | None = None
    sort: str = "position"
    descending: bool = False
    page: int = 0
    per_page: int = 50

    @classmethod
    def from_params(cls, params: dict[str, str]) -> Query:
        """From a URL's query string; a bad value is refused with the field named."""

        def number(name: str, kind: type[int] | type[float]) -> Any:
            raw = params.get(name)
            if raw in (None, ""):
                return None
            try:
                value = kind(raw)
            except ValueError:
                raise ReplayError(f"{name}={raw!r} is not a number: give e.g. {name}=1") from None
            if not math.isfinite(value) or abs(value) > MAX_INT:
                raise ReplayError(f"{name}={raw!r} is out of range: at most {MAX_INT:,} either way")
            return value

        def choice(name: str, allowed: tuple[str, ...]) -> str | None:
            raw = params.get(name) or None
            if raw is not None and raw not in allowed:
                raise ReplayError(f"{name}={raw!r}: use one of {', '.join(allowed)}")
            return raw

        sort = choice("sort", SORTS) or "position"
        page, per_page = number("page", int) or 0, number("per_page", int) or 50
        if page < 0 or not 1 <= per_page <= MAX_PAGE:
            raise ReplayError(f"page must be >= 0 and per_page within 1..{MAX_PAGE}")
        return cls(
            agent=params.get("agent") or None,
            seat=number("seat", int),
            outcome=choice("outcome", OUTCOMES),
            reason=choice("reason", (*REASONS, "fallback")),
            reward_min=number("reward_min", float),
            reward_max=number("reward_max", float),
            crn_group=params.get("crn_group") or None,
            step=number("step", int),
            sort=sort,
            descending=params.get("order") == "desc",
            page=page,
            per_page=per_page,
        )


def seat_filters(q: Query) -> tuple[list[str], list[Any]]:
    """SQL conditions on a seat's row (``s``): its agent, seat, outcome and reward bounds."""
    conds: list[str] = []
    args: list[Any] = []
    for col, value in (("agent", q.agent), ("seat", q.seat), ("outcome", q.outcome)):
        if value is not None:
            conds.append(f"s.{col} = ?")
            args.append(value)
    for cond, bound in (("s.reward >= ?", q.reward_min), ("s.reward <= ?", q.reward_max)):
        if bound is not None:
            conds.append(cond)
            args.append(bound)
    return conds, args


def match_filters(q: Query) -> tuple[list[str], list[Any]]:
    """SQL conditions on a match's row (``m``): its end, CRN group and training step."""
    conds: list[str] = []
    args: list[Any] = []
    if q.reason == "fallback":
        conds.append("m.fallbacks > 0")
    elif q.reason is not None:
        conds.append("m.reason = ?")
        args.append(q.reason)
    for col, value in (("crn_group", q.crn_group), ("step", q.step)):
        if value is not None:
            conds.append(f"m.{col} = ?")
            args.append(value)
    return conds, args


def where_clause(q: Query) -> tuple[str, list[Any], str]:
    """SQL of the filters: with an agent or seat, one row per matching seat (joined)."""
    conds: list[str] = []
    args: list[Any] = []
    join = ""
    seat_conds, seat_args = seat_filters(q)
    if q.agent is not None or q.seat is not None or q.sort == "reward":
        if q.agent is None and q.seat is None:  # sorting by reward of no one: seat 0's
            seat_conds.append("s.seat = 0")
        join = "JOIN seats s ON s.id = m.id"
        conds += seat_conds
        args += seat_args
    elif seat_conds:  # an outcome or reward of any seat
        conds.append(
            "EXISTS (SELECT 1 FROM seats s WHERE s.id = m.id AND " + " AND ".join(seat_conds) + ")"
        )
        args += seat_args
    more, more_args = match_filters(q)
    conds += more
    args += more_args
    return ("WHERE " + " AND ".join(conds) if conds else ""), args, join
