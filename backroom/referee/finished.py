"""What a referee remembers of the matches it finished: their ids, askers and episodes.

A runner that lost its session while an episode went out (a broker killed)
asks for the match again; a message for a finished match is answered
``late``, not ``unknown_match``. Both need the referee to remember, within
bounds: ``FINISHED_MEMORY`` ids, ``REPUBLISH_MEMORY_BYTES`` of episodes.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from backroom.bus.wire import EpisodeRecord, MatchRequest

#: How many finished match ids a referee remembers, to answer late messages and drop duplicate requests.
FINISHED_MEMORY = 10_000
#: Bytes of finished matches' episodes a referee keeps, newest first, to publish again
#: when a runner asks again (its session was lost while they went out).
REPUBLISH_MEMORY_BYTES = 64 << 20
#: Seconds between two publications of one match's episode again, however often it is asked.
REPUBLISH_EVERY_S = 5.0

#: Who asked for a match: its ``reply_to`` and ``run_key``; only they may have it again.
Asker = tuple[str | None, str | None]


def asker(msg: MatchRequest) -> Asker:
    return (msg.reply_to, msg.run_key)


class Finished:
    """Match ids finished here (``ids``), who asked for each, and the episodes as published."""

    def __init__(self) -> None:
        self.ids: OrderedDict[str, None] = OrderedDict()
        #: Finished match -> (game, record JSON) as published, within ``REPUBLISH_MEMORY_BYTES``.
        self.published: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._published_bytes = 0
        self._askers: dict[str, Asker] = {}  # matches running or finished here
        self._republished_at: dict[str, float] = {}  # match -> monotonic time of its last

    def __contains__(self, match: object) -> bool:
        return match in self.ids

    def asked(self, match: str, by: Asker) -> None:
        """``by`` asked for ``match``, which runs (or was refused) here."""
        self._askers[match] = by

    def asked_by(self, match: str, by: Asker) -> bool:
        return self._askers.get(match) == by

    def add(self, match: str) -> None:
        """``match`` is over; the oldest ids (and their askers) past ``FINISHED_MEMORY`` go."""
        self.ids[match] = None
        while len(self.ids) > FINISHED_MEMORY:
            forgotten, _ = self.ids.popitem(last=False)
            self._askers.pop(forgotten, None)

    def keep(self, match: str, game: str, record_json: bytes) -> None:
        """Keep a published episode; the oldest go past ``REPUBLISH_MEMORY_BYTES``."""
        self.published[match] = (game, record_json)
        self._published_bytes += len(record_json)
        while self._published_bytes > REPUBLISH_MEMORY_BYTES and self.published:
            gone, (_, old) = self.published.popitem(last=False)
            self._published_bytes -= len(old)
            self._republished_at.pop(gone, None)

    def republish_due(self, match: str) -> bool:
        """Whether ``match``'s episode may go out again now (at most every ``REPUBLISH_EVERY_S``);
        if so, it counts as gone out."""
        now = time.monotonic()
        if now - self._republished_at.get(match, -REPUBLISH_EVERY_S) < REPUBLISH_EVERY_S:
            return False
        self._republished_at[match] = now
        return True


def refusal_record(msg: MatchRequest, referee: str, why: str) -> EpisodeRecord:
    """The ``error`` episode of a request the referee cannot run: no play, its reason."""
    now = time.time()
    seats = list(msg.spec.seats)
    return EpisodeRecord(
        match=msg.match,
        run=msg.spec.run,
        referee=referee,
        spec=msg.spec,
        game=msg.spec.game,
        params=msg.spec.params,
        seed=msg.spec.seed,
        crn_group=msg.spec.crn_group,
        seats=seats,
        actions=[],
        deliveries=[],
        round_rewards=[],
        raw_returns=[0.0] * len(seats),
        returns=[0.0] * len(seats),
        reason="error",
        detail=f"refused: {why}",
        started_at=now,
        ended_at=now,
    )
