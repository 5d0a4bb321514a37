"""Readers' helpers over episode records: the one count of moves not an agent's own.

Beside ``runs.py`` (which finds and reads the records) and below every reader
of them — the runner, the league, the trainer, ``backroom analyze``, the
replay — and not in ``referee/``, which writes the records and needs none of
this: a reader that imports it need not import the referee.

Counting the recorded moves that were not an agent's own choice
(``ActionRecord.fallback``): one count for every reader — the table a run ends with
(``backroom.runner.results.summarize``), ``backroom analyze`` and its
``analysis.json`` — so they cannot disagree about what a fallback is: a move
whose record carries a reason (``backroom.bus.wire.Fallback``), or, in a record
written before the field existed, one the referee marked ``timed_out`` (its
timeout default, then the only fallback recorded). Every reason counts alike,
``repaired`` included (docs/agents.md, *Fallbacks*).

Pure functions over plain values and record dicts: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

#: Above this share of an agent's moves, the run's table and ``backroom analyze`` warn.
WARN_SHARE = 0.05

#: One agent's count: ``moves`` (act and talk turns recorded), ``fallbacks``, ``share``
#: (fallbacks / moves) and ``by_reason`` (reason -> count, largest first).
Count = dict[str, Any]


def fallback_of(fallback: str | None, timed_out: bool = False) -> str | None:
    """A move's reason; ``timeout`` for a record from before the field that says ``timed_out``."""
    if fallback is not None:
        return fallback
    return "timeout" if timed_out else None


def record_moves(record: Mapping[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(agent, fallback reason or None) of every move in an episode record dict."""
    for a in record.get("actions") or []:
        yield str(a["agent"]), fallback_of(a.get("fallback"), bool(a.get("timed_out")))


def has_fallback(record: Mapping[str, Any]) -> bool:
    """Whether any move of the match was not its agent's own choice."""
    return any(reason is not None for _, reason in record_moves(record))


def count_fallbacks(moves: Iterable[tuple[str, str | None]]) -> dict[str, Count]:
    """Per agent, in the order agents first appear: moves, fallbacks, share, by reason."""
    counts: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for agent, reason in moves:
        reasons = counts.setdefault(agent, {})
        totals[agent] = totals.get(agent, 0) + 1
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + 1
    out: dict[str, Count] = {}
    for agent, reasons in counts.items():
        n = sum(reasons.values())
        out[agent] = {
            "moves": totals[agent],
            "fallbacks": n,
            "share": n / totals[agent],
            "by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        }
    return out


def reasons(count: Count) -> str:
    """``deadline 8, unparseable 2``."""
    return ", ".join(f"{r} {n}" for r, n in count["by_reason"].items())


def describe(count: Count) -> str:
    """``0``, or ``10 of 32 (31.2%): deadline 8, unparseable 2``."""
    if not count["fallbacks"]:
        return "0"
    return f"{count['fallbacks']} of {count['moves']} ({count['share']:.1%}): {reasons(count)}"


def warning_lines(counts: Mapping[str, Count], share: float = WARN_SHARE) -> list[str]:
    """A line per agent whose fallbacks exceed ``share`` of its moves."""
    return [
        f"warning: {agent}: {c['fallbacks']} of its {c['moves']} moves ({c['share']:.1%}) "
        f"were not its own choice ({reasons(c)}), over {share:.0%}: "
        "its numbers are not its own play alone"
        for agent, c in counts.items()
        if c["share"] > share
    ]
