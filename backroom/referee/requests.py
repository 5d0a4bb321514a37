"""Taking match requests: a referee's share of ``control/matches``, answered once each.

A job of its own because a request is a promise to the runner that asked:
every request gets an answer, a played match's episode or a refusal's
(``refusal_record``), so no runner waits forever; a match runs once however
often it is asked for (QoS 1 redelivers, a runner that lost its session asks
``again``), and only its asker gets its episode published again; a request
naming a run directory of another run's key is refused unwritten; and a
game that may take long to build is vetted in a child process
(``referee.building``) before it is built, off the loop the matches in
flight share. What it asks of the referee is ``RequestsReferee``.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from backroom import metrics
from backroom.bus import topics
from backroom.bus.structs import Event
from backroom.bus.wire import (
    ACCEPTED,
    FORGOTTEN,
    RUNNING,
    EpisodeRecord,
    MatchRequest,
    WireError,
    parse_all,
)
from backroom.referee.building import needs_vetting, vet
from backroom.referee.episodes import EpisodeLog
from backroom.referee.finished import Finished, asker, refusal_record
from backroom.referee.match import Match, MatchReferee
from backroom.referee.meters import Meters
from backroom.referee.running import Running


class RequestsReferee(MatchReferee, Protocol):
    """What taking requests needs from the referee: a ``Match``'s needs, its name, episodes out."""

    @property
    def name(self) -> str: ...  # its identity: whose status says when it is gone
    async def finished(
        self, match: Match | None, record: EpisodeRecord, write: bool = True
    ) -> None: ...
    def publish_episode(self, game: str, match: str, record_json: bytes) -> None: ...


class Requests:
    """The match requests a referee reads: vetted, accepted and started, refused, or answered again."""

    def __init__(
        self,
        referee: RequestsReferee,
        running: Running,
        past: Finished,
        episodes: EpisodeLog,
        meters: Meters,
    ) -> None:
        self.referee = referee
        self.running = running
        self.past = past
        self.episodes = episodes
        self.meters = meters
        self.vetting: set[str] = set()  # match ids whose game is being vetted (``_vetted``)

    @property
    def log(self) -> logging.Logger:
        return self.referee.log

    def on_payload(self, _topic: str, payload: bytes) -> None:
        """Take each request of one payload (a batch is an array)."""
        for msg in parse_all(payload):
            self.take(msg)

    def take(self, msg: Any) -> None:
        """Answer one request: run it once, answer it again, or refuse it with an episode."""
        if isinstance(msg, WireError):
            metrics.INVALID_INPUTS.labels(reason=f"request_{msg.reason}").inc()
            self.log.warning("bad match request: %s", msg)
            return
        if not isinstance(msg, MatchRequest):
            metrics.INVALID_INPUTS.labels(reason="request_unknown_type").inc()
            return
        self.meters.message("in", msg.type).inc()
        if msg.match in self.running or msg.match in self.past.ids:
            # Asked again (QoS 1 redelivers, a runner that lost its session asks
            # again): the match runs once, and what it has to say goes out again.
            self._answer_again(msg)
            return
        if msg.again:
            return  # another referee's match (or one long forgotten): never played here
        stamp = msg.spec.run_stamp
        if stamp and not self.episodes.may_write(msg.spec.run, stamp, msg.run_key):
            metrics.RUN_DIRS_REFUSED.inc()
            why = f"run directory {msg.spec.run}/{stamp} belongs to another run (not its key)"
            self.log.warning("refused match %s: %s", msg.match, why)
            self.refuse(msg, why, write=False)
            return
        if needs_vetting(msg.spec):  # a game that may take long to build: off the loop
            if msg.match not in self.vetting:
                self.vetting.add(msg.match)
                self.running.spawn(self._vetted(msg))
            return
        self._accept(msg)

    async def _vetted(self, msg: MatchRequest) -> None:
        """Vet the requested game in a child process (``referee.building``), then accept."""
        try:
            await vet(msg.spec)
        except ValueError as exc:
            self.log.warning("refused match %s: %s", msg.match, exc)
            self.refuse(msg, str(exc))
            return
        finally:
            self.vetting.discard(msg.match)
        self._accept(msg)

    def _accept(self, msg: MatchRequest) -> None:
        """Build the match (its game vetted, where it needs it) and start it, or refuse it."""
        referee = self.referee
        try:
            match = Match(referee, msg.match, msg.spec)
        except ValueError as exc:
            self.log.warning("refused match %s: %s", msg.match, exc)
            self.refuse(msg, str(exc))
            return
        self.past.asked(match.id, asker(msg))
        if msg.reply_to:
            # "identity": whose status tells the runner when this referee is gone
            # (its will), and with it the matches it accepted.
            data = {"referee": referee.id, "identity": referee.name}
            ack = Event(match=match.id, kind=ACCEPTED, data=data)
            referee.send(topics.inbox(msg.reply_to), ack, batch=msg.reply_batches)
        self.running.start(match)

    def _answer_again(self, msg: MatchRequest) -> None:
        """A request for a match this referee runs or ran: say ``running``, or publish again.

        Episodes published while the runner's session was lost (a broker
        killed) reach nobody, so the runner asks again: its episode goes out
        again (counted in ``backroom_episodes_republished_total``); one past
        ``REPUBLISH_MEMORY_BYTES`` is not kept, and the runner then asks for the
        match under a new id.
        """
        if not msg.again or not self.past.asked_by(msg.match, asker(msg)):
            # A redelivery, or someone else naming the match: an episode (up to 16 MB) goes
            # to every reader, so only the asker's own `again` gets it.
            return
        if msg.match in self.running:
            self._reply(msg, RUNNING)
            return
        kept = self.past.published.get(msg.match)
        if kept is None:
            self._reply(msg, FORGOTTEN)  # no longer kept: the runner asks under a new id
            return
        if not self.past.republish_due(msg.match):
            return
        game, record_json = kept
        metrics.EPISODES_REPUBLISHED.inc()
        self.referee.publish_episode(game, msg.match, record_json)

    def _reply(self, msg: MatchRequest, kind: str) -> None:
        """Tell the asker (if it gave an inbox) what became of its match here."""
        if msg.reply_to:
            event = Event(match=msg.match, kind=kind, data={"referee": self.referee.id})
            self.referee.send(topics.inbox(msg.reply_to), event, batch=msg.reply_batches)

    def refuse(self, msg: MatchRequest, why: str, write: bool = True) -> None:
        """A request the referee cannot run still gets an episode, an ``error`` without play.

        ``write=False``: published only (the run directory it names is not the requester's)."""
        record = refusal_record(msg, self.referee.id, why)
        self.past.add(msg.match)
        self.past.asked(msg.match, asker(msg))
        self.running.spawn(self.referee.finished(None, record, write=write))
