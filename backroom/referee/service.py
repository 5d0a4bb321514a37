"""The referee process: takes match requests, runs matches, routes what agents send.

Several referees split the work, in one group (``referee.group``). Each
referee names itself in every ``MatchStart`` it sends, and reads only the
outboxes addressed to it (``agents/{agent}/outbox/{itself}``) of the agents
seated in its matches (``referee.outboxes``): no referee parses another's moves.

Input handling is the security boundary after the broker's ACL. The sender of
an outbox message is the agent named in the topic (the ACL lets only that
identity write there); anything that fails validation gets an ``Error`` with a
reason in the sender's inbox and is counted in
``backroom_invalid_inputs_total``. What each identity may cost the referee, in
loop time and in errors sent back, is ``referee.budgets``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.claim import IdentityClaim
from backroom.bus.client import Bus, BusConfig, Will
from backroom.bus.errors import IdentityInUse
from backroom.bus.structs import Action, Chat, Flag, Struct
from backroom.bus.wire import (
    BROKER_LOST,
    SHUTTING_DOWN,
    EpisodeRecord,
    ErrorReason,
    MatchStart,
    Status,
    WireError,
    dump,
    dump_episode,
)
from backroom.games.base import registered_games
from backroom.referee.budgets import (
    ERROR_BURST,
    ERROR_RATE_PER_S,
    INPUT_BURST_S,
    INPUT_SHARE,
    Budgets,
)
from backroom.referee.episodes import EpisodeLog
from backroom.referee.finished import Finished
from backroom.referee.group import RefereeGroup
from backroom.referee.inputs import Judge
from backroom.referee.match import Match, Observer
from backroom.referee.meters import Meters
from backroom.referee.outboxes import Outboxes
from backroom.referee.paraphrase import Paraphrasers
from backroom.referee.public import PublicPacer
from backroom.referee.requests import Requests
from backroom.referee.running import Running
from backroom.referee.seated import Seated


def _dropped(exc: WireError) -> None:
    """A payload on a status topic that was no status: counted by why."""
    metrics.STATUSES_DROPPED.labels(reason=exc.reason).inc()


class Referee:
    """The process: its connection, and the jobs it wires together on it.

    Each job is an object it holds: taking match requests (``requests``,
    ``referee.requests``), running the matches they start (``running``,
    ``referee.running``), the presence of the agents it seats (``seated``,
    ``referee.seated``), whose outboxes and statuses it reads (``outboxes``),
    judging what they send (``judge``, ``budgets``), its peers' group
    (``peers``), what it finished (``past``) and wrote (``episodes``), the
    pace of public events (``public``) and its message metrics (``meters``).
    What stays here is the connection's life (open, reconnect, disconnect,
    goodbye) and what a ``Match`` asks of its referee (``MatchReferee``).
    """

    def __init__(
        self,
        config: BusConfig,
        runs_dir: str | Path = "runs",
        referee_id: str | None = None,
        offline_grace_s: float = 1.0,
        public_interval_s: float = 0.25,
        error_burst: int = ERROR_BURST,
        error_rate_per_s: float = ERROR_RATE_PER_S,
        input_burst_s: float = INPUT_BURST_S,
        input_share: float = INPUT_SHARE,
        contested: bool = False,
        paraphrasers: Paraphrasers | None = None,
    ) -> None:
        """``contested``: other processes may try this name at the same moment (a name
        pool, ``claim_pooled``), so stay ready to be thrown off at start even under a
        name never used before. ``paraphrasers``: the models a channel's ``paraphrase``
        may name (its operator's, never a request's); closed with the referee."""
        self.config = config
        self.paraphrasers = paraphrasers
        self.id = referee_id or f"{self.name}@{socket.gethostname()}:{os.getpid()}"
        self.log = logging.getLogger("backroom.referee")
        self.episodes = EpisodeLog(runs_dir)
        self.public = PublicPacer(public_interval_s)
        self.public_due = self.public.due  # matches whose public events wait (``Match``)
        self.past = Finished()
        self.finished_ids = self.past.ids  # match ids finished here, oldest first
        self.seated = Seated(offline_grace_s)
        self.offline = self.seated.offline  # agents whose status says offline (``Match``)
        self.meters = Meters(self.seated.kind_of)
        self.budgets = Budgets(error_burst, error_rate_per_s, input_burst_s, input_share)
        self.outboxes = Outboxes(
            self._on_outbox, self._on_status, forget=self.seated.forget, referee=self.name
        )
        self.judge = Judge(self.budgets, self.send_to, self.outboxes.mute)
        self.bus: Bus | None = None
        self.running = Running(self.outboxes, self.past, self.log, self._closing)
        self.matches = self.running.matches  # the matches in flight here, by id
        self.tasks = self.running.tasks  # what it started and has not seen end
        self.idle = self.running.idle  # set while no match runs here
        self.requests = Requests(self, self.running, self.past, self.episodes, self.meters)
        self.peers = RefereeGroup(self.name, self.requests.on_payload, self._announce, self.log)
        # While starting: the claim of this identity (``bus.claim``), which learns from
        # a retained status of it that someone used it before (``_follow_status``).
        self._starting = False
        self.identity = IdentityClaim(config, "referee", used_before=contested)
        #: Referees whose statuses are read from the first connection on, with this one's
        #: own: a name pool's (``referee.pool``), so that a try that finds its name taken
        #: has read which of the others are online.
        self.watch: list[str] = []

    @property
    def name(self) -> str:
        """The identity this referee logs in under (its status, roster and group records)."""
        return self.config.username or "referee"

    @property
    def group(self) -> str | None:
        """The shared-subscription group this referee reads requests in (None until joined)."""
        return self.peers.current

    @property
    def offline_grace_s(self) -> float:
        """Seconds an offline agent's seats wait for it before defaulting (``Seated``)."""
        return self.seated.grace_s

    @offline_grace_s.setter
    def offline_grace_s(self, seconds: float) -> None:
        self.seated.grace_s = seconds

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Referee:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> Referee:
        """Connect, join the referees' group, announce ``online``; ``IdentityInUse`` if taken.

        The session expires with the connection (expiry 0): the broker then
        forgets this referee's place in the shared-subscription group the
        moment it is gone. With an expiry, a referee killed outright kept being
        handed its share of the match requests for that long, queued for a
        session nobody would resume. A referee that reconnects subscribes
        again, and voids what it was running anyway (``_on_disconnect``).

        No process can look whether its identity is online without logging in
        under it, which throws off whoever is (the client id is the username).
        So a referee starting under a name used before (a status of it is
        retained) stays ready for ``IDENTITY_WINDOW_S`` from its first
        connection to be thrown off in turn (``bus.claim``).
        """
        claim = self.identity
        self.bus = Bus(
            replace(self.config, session_expiry_s=0),
            will=Will(topics.status(self.name), dump(Status(state="offline", kind="referee"))),
            on_connect=[self._announce, self._reconnected],
            on_disconnect=[claim.thrown_off, self._on_disconnect],
            role="referee",
        )
        # "online" is announced only once requests and outboxes are being read. Statuses
        # read: this referee's own (was the name used before?) and ``watch``'s, its peers'
        # (``peers``), and those of the agents seated here (``referee.outboxes``), never
        # ``agents/+/status``.
        watched = dict.fromkeys([self.name, *self.watch])
        await self.bus.subscribe_many([topics.status(n) for n in watched], self._on_status)
        self.outboxes.bus = self.bus
        await self.peers.subscribe(self.bus, self._on_status)
        self._starting = True
        try:
            await self.bus.open()
            async with claim.on(self.bus):
                group = await claim.unless_taken(self.peers.join())
                await claim.hold(since=claim.started)
                await self.peers.read_in(group)
        except IdentityInUse:
            await self.bus.close()
            raise
        finally:
            self._starting = False
        await self._announce()
        self.peers.converge()  # a rival's proposal may have come in since the choice
        return self

    async def close(self) -> None:
        """Void the matches in flight (the runner asks for them again), say goodbye, disconnect."""
        self.running.void(SHUTTING_DOWN)
        await self.running.drain(limit_s=5)
        self.peers.stop()
        self.outboxes.close()
        if self.bus is not None:
            if self.group is not None:
                await self._goodbye()
            await self.bus.close()
        if self.paraphrasers is not None:
            await self.paraphrasers.aclose()

    async def _goodbye(self) -> None:
        """Say ``offline``, and take this referee's group record away.

        A normal disconnect sends no will: without this, a referee that stopped
        left ``online`` retained for good, and runners would count on it. The
        group record goes too (an empty retained message deletes it), so the
        records of referees that runs started and stopped do not pile up on a
        shared broker, nor lead a later referee into a group nobody reads in;
        the referees still running keep theirs.
        """
        assert self.bus is not None
        name = self.name
        offline = Status(state="offline", kind="referee")
        with contextlib.suppress(Exception):  # the broker gone: the will says offline
            await asyncio.wait_for(
                asyncio.gather(
                    self.bus.publish(topics.status(name), offline, retain=True),
                    self.bus.publish(topics.referee_group(name), b"", retain=True),
                    self.bus.publish(topics.referee_roster(name), b"", retain=True),
                ),
                2,
            )

    async def serve_forever(self) -> None:
        async with self:
            await asyncio.Event().wait()

    async def _reconnected(self) -> None:
        if self.group is not None:  # not the first connect: the broker was away
            self.seated.reconnected()

    async def _announce(self) -> None:
        if self.group is None:
            return  # connected, but not reading requests yet: ``__aenter__`` announces
        assert self.bus is not None
        name = self.name
        # Again on every connect: a broker that lost its retained messages learns
        # the group back from the referees that read in it.
        await self.bus.publish(topics.referee_group(name), self.group.encode(), retain=True)
        # Before the status: a runner counts a status saying "referee" only from a name
        # on the roster, which only the referee role can write (``topics.REFEREE_ROSTERS``).
        await self.bus.publish(topics.referee_roster(name), b"referee", retain=True)
        await self.bus.publish(
            topics.status(name), Status(state="online", kind="referee"), retain=True
        )

    async def _on_disconnect(self) -> None:
        if self._starting:
            return  # a takeover is the claim's (``identity``); else the bus tries again
        # Messages sent while the broker was away may be lost both ways, so a
        # match in flight can no longer be refereed fairly: void it, and say so.
        self.running.void(BROKER_LOST)

    def _closing(self) -> bool:
        """Whether this referee's connection is being closed: a task it cuts short is no failure."""
        return self.bus is not None and self.bus.closing

    # --- inbound -------------------------------------------------------------------

    def _on_outbox(self, topic: str, payload: bytes) -> None:
        """Judge every message of one payload (``referee.inputs``): one ``Error`` at most."""
        agent = topics.agent_of(topic)
        if agent is not None:
            self.judge.outbox(agent, payload, self._from_agent)

    def _from_agent(self, agent: str, msg: Any) -> None:
        if isinstance(msg, WireError):
            return self.reject(agent, msg.reason, msg.detail)
        # Addressed to this referee (its outbox, ``agents/{agent}/outbox/{me}``): a move
        # for a match not run here is no other referee's, and is answered.
        self.meters.message("in", msg.type).inc()
        if not isinstance(msg, Action | Chat | Flag):
            return self.reject(
                agent, "unexpected_type", f"agents send action, chat or flag, not {msg.type!r}"
            )
        match = self.matches.get(msg.match or "")
        if match is None:
            if msg.match in self.finished_ids:
                return self.reject(
                    agent, "late", f"match {msg.match} has finished", msg.match, msg.seq
                )
            return self.reject(
                agent,
                "unknown_match",
                f"no match {msg.match!r} is running here",
                msg.match,
                msg.seq,
            )
        start, refused = time.monotonic(), self.judge.refused
        match.on_message(agent, msg)
        self.judge.moved(start, refused)

    def _on_status(self, topic: str, payload: bytes) -> None:
        """Follow an identity's status, out of the same budget as its outbox (``Judge.status``)."""
        agent = topics.agent_of(topic)
        if agent is not None:
            self.judge.status(agent, len(payload), lambda: self._follow_status(topic, payload))

    def _follow_status(self, topic: str, payload: bytes) -> None:
        """A status read: an agent's is ``seated``'s; a referee's, the group's or this one's.

        A referee acts on an agent's explicit ``offline`` (its grace, then
        defaults, ``referee.seated``) and on its turn deadlines, which catch an
        agent that died without a will whatever its retained status says.
        """
        seen = presence.read(topic, payload, _dropped)
        if seen is None:
            return
        agent, msg = seen.name, seen.status
        if self._starting and agent == self.name:
            self.identity.used_before = True
        if msg.kind == "referee":
            self.peers.follow(agent, msg.state == "online")
        self.seated.follow(agent, msg)
        if msg.state == "offline":
            self.running.seat_offline(agent)

    def offline_wait(self, agent: str) -> float:
        """Seconds of ``agent``'s offline grace left (``Seated.offline_wait``)."""
        return self.seated.offline_wait(agent)

    def kind_of(self, agent: str) -> str:
        """The agent's kind as its status says, a metric label (``Seated.kind_of``)."""
        return self.seated.kind_of(agent)

    # --- outbound ------------------------------------------------------------------

    def send(self, topic: str, msg: BaseModel | Struct, batch: bool = False) -> None:
        """Publish without waiting for the PUBACK: the move path must not wait on the broker twice.

        With ``batch``, messages to the same topic in one loop iteration share
        an MQTT message (only for readers that said they split batches).
        """
        self.meters.message("out", getattr(msg, "type", "?")).inc()
        assert self.bus is not None
        self.bus.publish(topic, msg, batch=batch)

    def public_pending(self, match: Match) -> None:
        """``match`` queued public events: they leave at the pace of ``referee.public``."""
        self.public.pending(match)

    def send_to(self, agent: str, msg: BaseModel | Struct) -> None:
        if type(msg) is MatchStart:
            msg.referee = self.name  # the outbox the seat's moves go to: this referee's
        self.send(topics.inbox(agent), msg, batch=self.seated.batches(agent))

    def latency(self, agent: str, phase: str) -> Observer:
        """The histogram ``agent``'s answers in ``phase`` go to (``Meters.latency``)."""
        return self.meters.latency(agent, phase)

    def reject(
        self,
        agent: str,
        reason: ErrorReason,
        detail: str,
        match: str | None = None,
        ref_seq: int | None = None,
    ) -> None:
        """Count a refused message and answer it (``Judge.reject``)."""
        self.judge.reject(agent, reason, detail, match, ref_seq)

    async def finished(
        self, match: Match | None, record: EpisodeRecord, write: bool = True
    ) -> None:
        """Write ``record`` to its run's file (unless not ``write``), count it, publish it.

        Played and refused matches alike (``Requests.refuse``): every request
        gets its episode, so the runner never waits forever.
        """
        record_json = record.model_dump_json().encode()  # the longest message: serialised once
        if write:
            written = await self.episodes.commit(record, record_json, self.log)
            if written is not record:
                record, record_json = written, written.model_dump_json().encode()
        # A refused request (no match) may name any game: the label takes registered ones only.
        known = match is not None or record.game in registered_games()
        game = record.game if known else metrics.OTHER
        metrics.MATCHES_FINISHED.labels(game=game, outcome=record.reason).inc()
        for action in record.actions:
            if action.fallback is not None:  # a closed set of reasons, a closed set of kinds
                metrics.FALLBACKS.labels(
                    kind=self.seated.kind_of(action.agent), reason=action.fallback
                ).inc()
        self.past.keep(record.match, record.game, record_json)
        self.publish_episode(record.game, record.match, record_json)

    def publish_episode(self, game: str, match: str, record_json: bytes) -> None:
        """Publish a finished match's episode (a first time, or again for its asker)."""
        assert self.bus is not None
        self.meters.message("out", "episode").inc()
        self.bus.publish(topics.episodes(game), dump_episode(match, record_json), batch=True)
