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
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.client import Bus, BusConfig, Will
from backroom.bus.connection import broker_reachable
from backroom.bus.errors import IdentityInUse
from backroom.bus.structs import Action, Chat, Event, Flag, Struct
from backroom.bus.wire import (
    ACCEPTED,
    BROKER_LOST,
    FORGOTTEN,
    IDENTITY_WINDOW_S,
    RUNNING,
    SHUTTING_DOWN,
    EpisodeRecord,
    ErrorReason,
    MatchRequest,
    MatchStart,
    Status,
    WireError,
    dump,
    dump_episode,
    parse_all,
)
from backroom.games.base import registered_games
from backroom.referee.budgets import (
    ERROR_BURST,
    ERROR_RATE_PER_S,
    INPUT_BURST_S,
    INPUT_SHARE,
    Budgets,
)
from backroom.referee.building import needs_vetting, vet
from backroom.referee.episodes import EpisodeLog
from backroom.referee.finished import Finished, asker, refusal_record
from backroom.referee.group import RefereeGroup
from backroom.referee.inputs import Judge
from backroom.referee.match import Match
from backroom.referee.outboxes import Outboxes
from backroom.referee.paraphrase import Paraphrasers
from backroom.referee.public import PublicPacer

#: Seconds after a reconnect during which seats of agents whose status says offline
#: still wait for them (instead of getting the default at once, past their grace): a
#: broker that went away sent everyone's will, and agents come back on their own
#: backoff, up to 3 s after the broker (``bus.connection``).
RECONNECT_GRACE_S = 5.0
T = TypeVar("T")


def _dropped(exc: WireError) -> None:
    """A payload on a status topic that was no status: counted by why."""
    metrics.STATUSES_DROPPED.labels(reason=exc.reason).inc()


class Referee:
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
        self.offline_grace_s = offline_grace_s
        self.public = PublicPacer(public_interval_s)
        self.public_due = self.public.due  # matches whose public events wait (``Match``)
        self.matches: dict[str, Match] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.vetting: set[str] = set()  # match ids whose game is being vetted (``_vetted``)
        self.past = Finished()
        self.finished_ids = self.past.ids  # match ids finished here, oldest first
        self.offline: set[str] = set()
        self.offline_since: dict[str, float] = {}  # agent -> monotonic time its status said offline
        self.kinds: dict[str, str] = {}
        self.batching: set[str] = set()  # agents whose status says they read batched inboxes
        self._counters: dict[tuple[str, str], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}
        self.budgets = Budgets(error_burst, error_rate_per_s, input_burst_s, input_share)
        self.outboxes = Outboxes(
            self._on_outbox, self._on_status, forget=self._forget, referee=self.name
        )
        self.judge = Judge(self.budgets, self.send_to, self.outboxes.mute)
        self.peers = RefereeGroup(self.name, self._on_request, self._announce, self.log)
        self.bus: Bus | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        # While starting: whether a status of this identity was retained (someone used
        # it before), and whether the connection was taken away (someone still does).
        self._starting = False
        self._claiming = False  # connected, not yet started
        self._used_before = contested
        #: Referees whose statuses are read from the first connection on, with this one's
        #: own: a name pool's (``referee.pool``), so that a try that finds its name taken
        #: has read which of the others are online.
        self.watch: list[str] = []
        self._taken = asyncio.Event()
        #: Until when (monotonic) offline agents are waited for after a reconnect.
        self._settle_until = 0.0

    @property
    def name(self) -> str:
        """The identity this referee logs in under (its status, roster and group records)."""
        return self.config.username or "referee"

    @property
    def group(self) -> str | None:
        """The shared-subscription group this referee reads requests in (None until joined)."""
        return self.peers.current

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
        retained) stays ready for ``IDENTITY_WINDOW_S`` to be thrown off in
        turn: a process still logged in under the name reconnects at once, and
        this one then stops, without reconnecting, instead of taking the name
        back again and again. The other process loses its connection once.
        """
        self.bus = Bus(
            replace(self.config, session_expiry_s=0),
            will=Will(topics.status(self.name), dump(Status(state="offline", kind="referee"))),
            on_connect=[self._announce, self._reconnected],
            on_disconnect=[self._on_disconnect],
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
            self._claiming = True
            connected = time.monotonic()
            group = await self._unless_taken(self.peers.join())
            if self._used_before:
                left = connected + IDENTITY_WINDOW_S - time.monotonic()
                await self._unless_taken(asyncio.sleep(max(0.0, left)))
            await self.peers.read_in(group)
        except IdentityInUse:
            await self.bus.close()
            raise
        finally:
            self._starting = self._claiming = False
        await self._announce()
        self.peers.converge()  # a rival's proposal may have come in since the choice
        return self

    async def _unless_taken(self, step: Awaitable[T]) -> T:
        """``step``'s result, unless the connection is taken away first: then ``IdentityInUse``."""
        name = self.name
        work = asyncio.ensure_future(step)
        taken = asyncio.ensure_future(self._taken.wait())
        try:
            await asyncio.wait({work, taken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, taken):
                if not task.done():
                    task.cancel()
        if self._taken.is_set():
            raise IdentityInUse(
                f"referee identity {name!r} is in use: another process logged in as {name!r} "
                "took the connection back while this referee was starting. Stop that process, "
                "or start this referee under an identity of its own "
                "(`backroom credentials add NAME --role referee`)."
            )
        return work.result()

    async def close(self) -> None:
        """Void the matches in flight (the runner asks for them again), say goodbye, disconnect."""
        for match in list(self.matches.values()):
            match.void(SHUTTING_DOWN)
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
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
            self._settle_until = time.monotonic() + RECONNECT_GRACE_S

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
            if not (self._claiming and await broker_reachable(self.config)):
                return  # not connected yet, or the broker went away: the bus tries again
            # Thrown off while starting, the broker up: a process still logged in
            # under this identity took the connection back (``__aenter__``). Stay
            # off rather than throw it off again.
            self._taken.set()
            if self.bus is not None:
                await self.bus.close()
            return
        # Messages sent while the broker was away may be lost both ways, so a
        # match in flight can no longer be refereed fairly: void it, and say so.
        for match in list(self.matches.values()):
            match.void(BROKER_LOST)

    # --- inbound -------------------------------------------------------------------

    def _on_request(self, _topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            self._request(msg)

    def _request(self, msg: Any) -> None:
        if isinstance(msg, WireError):
            metrics.INVALID_INPUTS.labels(reason=f"request_{msg.reason}").inc()
            self.log.warning("bad match request: %s", msg)
            return
        if not isinstance(msg, MatchRequest):
            metrics.INVALID_INPUTS.labels(reason="request_unknown_type").inc()
            return
        self._counter("in", msg.type).inc()
        if msg.match in self.matches or msg.match in self.finished_ids:
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
            self._publish_refusal(msg, why, write=False)
            return
        if needs_vetting(msg.spec):  # a game that may take long to build: off the loop
            if msg.match not in self.vetting:
                self.vetting.add(msg.match)
                self._spawn(self._vetted(msg))
            return
        self._accept(msg)

    async def _vetted(self, msg: MatchRequest) -> None:
        """Vet the requested game in a child process (``referee.building``), then accept."""
        try:
            await vet(msg.spec)
        except ValueError as exc:
            self.log.warning("refused match %s: %s", msg.match, exc)
            self._publish_refusal(msg, str(exc))
            return
        finally:
            self.vetting.discard(msg.match)
        self._accept(msg)

    def _accept(self, msg: MatchRequest) -> None:
        """Build the match (its game vetted, where it needs it) and start it, or refuse it."""
        try:
            match = Match(self, msg.match, msg.spec)
        except ValueError as exc:
            self.log.warning("refused match %s: %s", msg.match, exc)
            self._publish_refusal(msg, str(exc))
            return
        self.matches[match.id] = match
        self.past.asked(match.id, asker(msg))
        if msg.reply_to:
            # "identity": whose status tells the runner when this referee is gone
            # (its will), and with it the matches it accepted.
            data = {"referee": self.id, "identity": self.name}
            ack = Event(match=match.id, kind=ACCEPTED, data=data)
            self.send(topics.inbox(msg.reply_to), ack, batch=msg.reply_batches)
        self.idle.clear()
        self._spawn(self._run_match(match))

    def _answer_again(self, msg: MatchRequest) -> None:
        """A request for a match this referee runs or ran: say ``running``, or publish again.

        Episodes published while the runner's session was lost (a broker
        killed) reach nobody, so the runner asks again: its episode goes out
        again (counted in ``backroom_episodes_republished_total``); one past
        ``REPUBLISH_MEMORY_BYTES`` is not kept, and the runner then asks for the
        match under a new id.
        """
        assert self.bus is not None
        if not msg.again or not self.past.asked_by(msg.match, asker(msg)):
            # A redelivery, or someone else naming the match: an episode (up to 16 MB) goes
            # to every reader, so only the asker's own `again` gets it.
            return
        if msg.match in self.matches:
            if msg.reply_to:
                running = Event(match=msg.match, kind=RUNNING, data={"referee": self.id})
                self.send(topics.inbox(msg.reply_to), running, batch=msg.reply_batches)
            return
        kept = self.past.published.get(msg.match)
        if kept is None:
            if msg.reply_to:  # finished here, no longer kept: the runner asks under a new id
                gone = Event(match=msg.match, kind=FORGOTTEN, data={"referee": self.id})
                self.send(topics.inbox(msg.reply_to), gone, batch=msg.reply_batches)
            return
        if not self.past.republish_due(msg.match):
            return
        game, record_json = kept
        metrics.EPISODES_REPUBLISHED.inc()
        self._counter("out", "episode").inc()
        self.bus.publish(topics.episodes(game), dump_episode(msg.match, record_json), batch=True)

    async def _run_match(self, match: Match) -> None:
        seats = match.agents  # the players and the observers: both may write
        try:
            try:
                await self.outboxes.seat(seats)
            except Exception as exc:  # the connection lost: subscribed again on the next one
                self.log.warning("match %s: reading its seats' outboxes: %r", match.id, exc)
            await match.run()
        finally:
            self.outboxes.unseat(seats)
            self.matches.pop(match.id, None)
            self.past.add(match.id)
            if not self.matches:
                self.idle.set()

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
        self._counter("in", msg.type).inc()
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
        """Follow an explicit ``online`` or ``offline``; no heartbeat expiry here.

        A referee acts on an agent's ``offline`` (its grace, then defaults) and
        on its turn deadlines, which catch an agent that died without a will
        whatever its retained status says.
        """
        seen = presence.read(topic, payload, _dropped)
        if seen is None:
            return
        agent, msg = seen.name, seen.status
        if self._starting and agent == self.name:
            self._used_before = True
        if msg.kind:
            # A label value, so from a closed set: the kind is whatever the agent says.
            self.kinds[agent] = metrics.kind_label(msg.kind)
        if msg.kind == "referee":
            self.peers.follow(agent, msg.state == "online")
        (self.batching.add if msg.batches else self.batching.discard)(agent)
        if msg.state == "offline":
            # Since when: kept while it was not read (``_forget``), so an agent that went
            # away a while ago gets no new grace when it is seated here again.
            self.offline_since.setdefault(agent, time.monotonic())
            self.offline.add(agent)
            for match in self.matches.values():
                match.seat_offline(agent)
        else:
            self.offline.discard(agent)
            self.offline_since.pop(agent, None)

    def _forget(self, agent: str) -> None:
        """``agent`` is not read here any more: its last status may be stale by the time it is
        seated again, when its retained status comes with the subscription. An ``offline``
        believed meanwhile defaulted its first turn at once though it was back online."""
        self.offline.discard(agent)  # ``offline_since`` stays: see ``_follow_status``
        self.batching.discard(agent)

    def offline_wait(self, agent: str) -> float:
        """Seconds of ``agent``'s offline grace left: its seats wait that long, then default.

        The grace counts from when its status said offline, once
        (``Match.seat_offline``): an agent that went away a while ago costs
        later matches nothing. Within ``RECONNECT_GRACE_S`` of this referee's
        reconnect, every offline agent is waited for until then.
        """
        now = time.monotonic()
        since = self.offline_since.get(agent, now)
        return max(since + self.offline_grace_s, self._settle_until) - now

    def kind_of(self, agent: str) -> str:
        """The agent's kind as a metric label (``metrics.kind_label``)."""
        return self.kinds.get(agent, metrics.UNKNOWN_KIND)

    # --- outbound ------------------------------------------------------------------

    def send(self, topic: str, msg: BaseModel | Struct, batch: bool = False) -> None:
        """Publish without waiting for the PUBACK: the move path must not wait on the broker twice.

        With ``batch``, messages to the same topic in one loop iteration share
        an MQTT message (only for readers that said they split batches).
        """
        self._counter("out", getattr(msg, "type", "?")).inc()
        assert self.bus is not None
        self.bus.publish(topic, msg, batch=batch)

    def public_pending(self, match: Match) -> None:
        """``match`` queued public events: they leave at the pace of ``referee.public``."""
        self.public.pending(match)

    def send_to(self, agent: str, msg: BaseModel | Struct) -> None:
        if type(msg) is MatchStart:
            msg.referee = self.name  # the outbox the seat's moves go to: this referee's
        self.send(topics.inbox(agent), msg, batch=agent in self.batching)

    def _counter(self, direction: str, kind: str) -> Any:
        # Label lookups cost microseconds each; the hot path caches the children.
        child = self._counters.get((direction, kind))
        if child is None:
            child = self._counters[(direction, kind)] = metrics.MESSAGES.labels(
                direction=direction, type=kind
            )
        return child

    def latency(self, agent: str, phase: str) -> Any:
        key = (self.kind_of(agent), phase)
        child = self._latency.get(key)
        if child is None:
            child = self._latency[key] = metrics.TURN_LATENCY.labels(kind=key[0], phase=phase)
        return child

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

        Played and refused matches alike (``_publish_refusal``): every request
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
                    kind=self.kind_of(action.agent), reason=action.fallback
                ).inc()
        assert self.bus is not None
        self._counter("out", "episode").inc()
        self.past.keep(record.match, record.game, record_json)
        self.bus.publish(
            topics.episodes(record.game), dump_episode(record.match, record_json), batch=True
        )

    def _publish_refusal(self, msg: MatchRequest, why: str, write: bool = True) -> None:
        """A request the referee cannot run still gets an episode, an ``error`` without play.

        ``write=False``: published only (the run directory it names is not the requester's)."""
        record = refusal_record(msg, self.id, why)
        self.past.add(msg.match)
        self.past.asked(msg.match, asker(msg))
        self._spawn(self.finished(None, record, write=write))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.bus is not None and self.bus.closing:
            return  # a publish cut short by our own shutdown
        self.log.error("referee task failed: %r", task.exception())
