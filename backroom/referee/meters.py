"""The referee's per-message metrics, their label children cached.

A job of its own because it sits on the move path: every message in and out
is counted, and every answered turn observed, and a prometheus label lookup
costs microseconds each. The children are looked up once per label set and
kept; the label sets are closed (message types, agent kinds as
``metrics.kind_label`` gives them, turn phases), so the caches stay small.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backroom import metrics


class Meters:
    """``backroom_messages_total`` and the turn latency, by cached label children."""

    def __init__(self, kind_of: Callable[[str], str]) -> None:
        """``kind_of``: an agent's kind as a metric label (``Seated.kind_of``)."""
        self.kind_of = kind_of
        self._messages: dict[tuple[str, str], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}

    def message(self, direction: str, kind: str) -> Any:
        """The counter of messages of type ``kind`` going ``direction`` (``in`` or ``out``)."""
        child = self._messages.get((direction, kind))
        if child is None:
            child = self._messages[(direction, kind)] = metrics.MESSAGES.labels(
                direction=direction, type=kind
            )
        return child

    def latency(self, agent: str, phase: str) -> Any:
        """The histogram of ``agent``'s answers in ``phase``, labelled by its kind."""
        key = (self.kind_of(agent), phase)
        child = self._latency.get(key)
        if child is None:
            child = self._latency[key] = metrics.TURN_LATENCY.labels(kind=key[0], phase=phase)
        return child
