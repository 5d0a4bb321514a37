"""The pace of a referee's public events: per match, at most every ``interval`` seconds.

Each match's public topic is its own MQTT message, so sending after every
turn would cost a packet per move and match. Instead a match's events leave
together ``interval`` after its previous public message (the first: after it
started), and at its end; a match played within the interval costs one
message. Spectators see events at most that late. With an interval of 0 every
turn flushes at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backroom.referee.match import Match


class PublicPacer:
    """The matches whose public events wait (``due``), and the one timer that flushes them."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.due: dict[str, Match] = {}
        self._timer: asyncio.TimerHandle | None = None

    def pending(self, match: Match) -> None:
        """``match`` queued public events: flush them now (interval 0) or when they are due."""
        if self.interval_s <= 0:
            match.flush_public()
            return
        self.due[match.id] = match
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.interval_s / 4, self._flush)

    def _flush(self) -> None:
        self._timer = None
        now = time.monotonic()
        for match in list(self.due.values()):
            if now - match.public_sent_at >= self.interval_s:
                match.flush_public()  # takes the match off ``due``
        if self.due:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s / 4, self._flush)
