"""The referee process: takes match requests, runs matches, routes what agents send.

Several referees split the work: match requests arrive through a shared
subscription ``$share/<group>/.../control/matches``, so the broker hands each
request to one of them. The group's name is a secret among referees (see
``Referee._join_group``): Mosquitto lets anyone subscribe to anything, and a
stranger in the group would be handed requests it cannot read. Each referee
reads every outbox and acts only on messages for its own matches.

Input handling is the security boundary after the broker's ACL. The sender of
an outbox message is the agent named in the topic (the ACL lets only that
identity write there); anything that fails validation gets an ``Error`` with a
reason in the sender's inbox and is counted in
``backroom_invalid_inputs_total``. Nothing an agent sends can stop a match or
the referee, nor make it send more than it received: one payload (a batch of
any length) gets at most one ``Error`` back, and each identity's errors come
out of a token bucket (``ERROR_BURST``, refilled at ``ERROR_RATE_PER_S``);
errors past it are dropped and counted in ``backroom_errors_dropped_total``.
What each identity sends is budgeted too, in seconds of the referee's loop
its outbox and status payloads cost (``WorkBudget``): past it, payloads are
dropped unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.client import Bus, BusConfig, Will
from backroom.bus.connection import broker_reachable
from backroom.bus.errors import ConnectTimeout, IdentityInUse
from backroom.bus.wire import (
    MAX_PAYLOAD_BYTES,
    Action,
    Chat,
    Episode,
    EpisodeRecord,
    Error,
    Event,
    MatchRequest,
    Status,
    WireError,
    dump,
    dump_episode,
    parse_all,
)
from backroom.games.base import registered_games
from backroom.referee.episodes import EpisodeLog
from backroom.referee.match import Match

#: How many finished match ids a referee remembers, to answer late messages and drop duplicate requests.
FINISHED_MEMORY = 10_000
#: Bytes of finished matches' episodes a referee keeps, newest first, to publish again
#: when a runner asks again (its session was lost while they went out: ``_request``).
REPUBLISH_MEMORY_BYTES = 64 << 20
#: Seconds between two publications of one match's episode again, however often it is asked.
REPUBLISH_EVERY_S = 5.0
#: Error replies an identity may get at once, and how fast its budget refills
#: (per second). A well-behaved agent gets a handful of errors per match; a
#: flood from one identity must not become a flood back.
ERROR_BURST = 100
ERROR_RATE_PER_S = 20.0
#: What one identity's outbox and status payloads may cost the referee's loop, in
#: seconds: a burst, then this share of every second (``WorkBudget``). What is
#: charged is the work of judging them (parsing, refusals, statuses), not the
#: matches' own work on the moves they carry: a busy agent in hundreds of
#: matches spends some 1% of the loop on it. Past the budget a payload is
#: dropped before it is parsed (``backroom_inputs_dropped_total``) and its moves
#: are lost, so that agent's seats time out to their defaults, while every other
#: agent's matches go on at full speed.
INPUT_BURST_S = 0.25
INPUT_SHARE = 0.1
#: What a payload costs before its handler runs (the socket, paho, the dispatch),
#: which the handler cannot time: charged on top, so that a flood of tiny
#: payloads is priced too. Some 30 µs on a 2020s core.
PAYLOAD_OVERHEAD_S = 30e-6
#: Error budgets kept at once (identities are bounded by the broker's password
#: file, but the referee does not trust that to bound its memory).
ERROR_BUDGETS = 10_000
#: Seconds a referee that proposed a group name waits for rival proposals from
#: referees started at the same moment on a fresh broker.
GROUP_SETTLE_S = 0.3
#: Seconds to wait for the probe that says every retained group name has arrived.
GROUP_PROBE_TIMEOUT_S = 5.0
#: What a group name looks like: 128 random bits, so it cannot be guessed.
GROUP_NAME = re.compile(r"^referees-[0-9a-f]{32}$")
#: Seconds a referee starting under an identity that was used before stays ready to
#: be thrown off by a process still logged in under it (``IdentityInUse``). That
#: process reconnects within about 0.1 s of losing its connection (the bus's first
#: backoff), so a second leaves room for a busy one.
IDENTITY_WINDOW_S = 1.0
#: Passes over a referee name pool before ``claim_pooled`` gives up.
CLAIM_PASSES = 3
#: Seconds after a reconnect during which seats of agents whose status says offline
#: still wait for them (instead of getting the default at once, past their grace): a
#: broker that went away sent everyone's will, and agents come back on their own
#: backoff, up to 3 s after the broker (``bus.connection``).
RECONNECT_GRACE_S = 5.0
#: Why a stopping referee voids the matches it runs: not the match's doing, so the
#: runner asks for them again (``backroom.runner.local``).
SHUTTING_DOWN = "referee shutting down"
#: How the detail of an ``error`` episode whose record the referee could not write
#: begins (a full disk, a read-only or broken run directory): the runner fails the
#: run with it (``backroom.runner.local``), rather than wait for a record on disk.
NOT_WRITTEN = "episode not written"

T = TypeVar("T")


def _dropped(exc: WireError) -> None:
    """A payload on a status topic that was no status: counted by why."""
    metrics.STATUSES_DROPPED.labels(reason=exc.reason).inc()


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; ``take`` spends one when there is one."""

    __slots__ = ("at", "capacity", "rate", "tokens")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.tokens = capacity
        self.at = now

    def take(self, now: float, n: float = 1) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


class WorkBudget:
    """Seconds of the loop one identity may use: ``burst`` at once, then ``share`` of each second.

    A payload is charged after it was handled, with the seconds it held the
    loop: a payload cheap in bytes and dear to judge pays what it cost (a byte
    budget let 64 KB that took 2.6 s through as 64 KB). The balance may go
    below zero; nothing more is read from that identity until the clock has
    paid the debt back. The clock refills only the time between one
    payload's end and the next one's start: the seconds a payload held the
    loop earn it nothing (a byte budget refilled by the wall clock paid a
    stalled referee's sender for the stall).
    """

    __slots__ = ("at", "burst", "share", "tokens")

    def __init__(self, burst: float, share: float, now: float) -> None:
        self.burst = burst
        self.share = share
        self.tokens = burst
        self.at = now

    def open(self, now: float) -> bool:
        """Whether a payload arriving ``now`` may be handled (the balance is above zero)."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.share)
        self.at = now
        return self.tokens > 0

    def charge(self, seconds: float, now: float) -> None:
        """The payload opened last cost ``seconds`` and ended ``now``."""
        self.tokens -= seconds
        self.at = max(self.at, now)


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
    ) -> None:
        """``contested``: other processes may try this name at the same moment (a name
        pool, ``claim_pooled``), so stay ready to be thrown off at start even under a
        name never used before."""
        self.config = config
        self.id = (
            referee_id or f"{config.username or 'referee'}@{socket.gethostname()}:{os.getpid()}"
        )
        self.log = logging.getLogger("backroom.referee")
        self.episodes = EpisodeLog(runs_dir)
        self.offline_grace_s = offline_grace_s
        self.public_interval_s = public_interval_s
        self.public_due: dict[str, Match] = {}
        self._public_timer: asyncio.TimerHandle | None = None
        self.matches: dict[str, Match] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.finished_ids: OrderedDict[str, None] = OrderedDict()
        #: Finished match -> (game, record JSON) as published, within ``REPUBLISH_MEMORY_BYTES``.
        self.published: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._published_bytes = 0
        #: Match -> who asked for it (``reply_to``, ``run_key``): only they may have it again.
        self._askers: dict[str, tuple[str | None, str | None]] = {}
        self._republished_at: dict[str, float] = {}  # match -> monotonic time of its last
        self.offline: set[str] = set()
        self.offline_since: dict[str, float] = {}  # agent -> monotonic time its status said offline
        self.kinds: dict[str, str] = {}
        self.batching: set[str] = set()  # agents whose status says they read batched inboxes
        self._counters: dict[tuple[str, str], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}
        self.error_burst = error_burst
        self.error_rate_per_s = error_rate_per_s
        self._budgets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.input_burst_s = input_burst_s
        self.input_share = input_share
        self._inputs: OrderedDict[str, WorkBudget] = OrderedDict()
        #: Seconds the payload being judged spent in its matches' own work (not charged).
        self._match_s = 0.0
        self._refused = 0  # refusals so far (``reject``): a refused move is charged to its sender
        # While an outbox payload is judged: its sender, its first refusal, how many more.
        self._judging: str | None = None
        self._held: Error | None = None
        self._held_more = 0
        #: The shared-subscription group this referee reads requests in (None until joined).
        self.group: str | None = None
        self.groups: dict[str, str] = {}  # referee -> the group it says it reads in
        #: Referees whose status says online (``claim_pooled`` skips their names).
        self.referees_online: set[str] = set()
        self._probed = asyncio.Event()
        self._proposed: str | None = None  # the group this referee proposed, if it did
        self._moving: asyncio.Task[None] | None = None  # to a smaller group (``_converge``)
        self.bus: Bus | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        # While starting: whether a status of this identity was retained (someone used
        # it before), and whether the connection was taken away (someone still does).
        self._starting = False
        self._claiming = False  # connected, not yet started
        self._used_before = contested
        self._taken = asyncio.Event()
        #: Until when (monotonic) offline agents are waited for after a reconnect.
        self._settle_until = 0.0

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Referee:
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
        name = self.config.username or "referee"
        self.bus = Bus(
            replace(self.config, session_expiry_s=0),
            will=Will(topics.status(name), dump(Status(state="offline", kind="referee"))),
            on_connect=[self._announce, self._reconnected],
            on_disconnect=[self._on_disconnect],
            role="referee",
        )
        # "online" is announced only once requests and outboxes are being read.
        await self.bus.subscribe(topics.ALL_STATUS, self._on_status)
        await self.bus.subscribe(topics.ALL_OUTBOXES, self._on_outbox)
        await self.bus.subscribe(topics.REFEREE_GROUPS, self._on_group)
        await self.bus.subscribe(topics.referee_probe(name), self._on_probe)
        self._starting = True
        try:
            await self.bus.__aenter__()
            self._claiming = True
            connected = time.monotonic()
            group = await self._unless_taken(self._join_group(name))
            if self._used_before:
                left = connected + IDENTITY_WINDOW_S - time.monotonic()
                await self._unless_taken(asyncio.sleep(max(0.0, left)))
            await self.bus.subscribe(topics.control_matches_shared(group), self._on_request)
        except IdentityInUse:
            await self.bus.close()
            raise
        finally:
            self._starting = self._claiming = False
        self.group = group
        await self._announce()
        self._converge()  # a rival's proposal may have come in since the choice
        return self

    async def _unless_taken(self, step: Awaitable[T]) -> T:
        """``step``'s result, unless the connection is taken away first: then ``IdentityInUse``."""
        name = self.config.username or "referee"
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

    async def __aexit__(self, *exc: object) -> None:
        for match in list(self.matches.values()):
            match.void(SHUTTING_DOWN)
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        if self._moving is not None:
            self._moving.cancel()
        if self.bus is not None:
            if self.group is not None:
                await self._goodbye()
            await self.bus.close()

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
        name = self.config.username or "referee"
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
        name = self.config.username or "referee"
        # Again on every connect: a broker that lost its retained messages learns
        # the group back from the referees that read in it.
        await self.bus.publish(topics.referee_group(name), self.group.encode(), retain=True)
        # Before the status: a runner counts a status saying "referee" only from a name
        # on the roster, which only the referee role can write (``topics.REFEREE_ROSTERS``).
        await self.bus.publish(topics.referee_roster(name), b"referee", retain=True)
        await self.bus.publish(
            topics.status(name), Status(state="online", kind="referee"), retain=True
        )

    async def _join_group(self, name: str) -> str:
        """The shared-subscription group this referee reads match requests in.

        The broker's ACL cannot keep anyone out of a group (Mosquitto does not
        check subscriptions, see ``backroom.bus.auth``), so the group's name is
        the lock: 128 random bits, kept retained under ``control/referees/``,
        which only referees may read. A referee adopts the name the referees
        before it use; the first one on a broker makes one up. Referees started
        at the same moment on a fresh broker may each propose one: each waits
        ``GROUP_SETTLE_S`` for the others' and takes the smallest. On a busy
        machine a rival's proposal can come later than that; ``_converge``
        then moves this referee over, so all end in the smallest.
        """
        assert self.bus is not None
        await self._probe(name)
        if not self.groups:
            mine = self._proposed = f"referees-{secrets.token_hex(16)}"
            await self.bus.publish(topics.referee_group(name), mine.encode(), retain=True)
            await asyncio.sleep(GROUP_SETTLE_S)
            await self._probe(name)  # every proposal the broker had by now has arrived
            self.groups.setdefault(name, mine)
        return min(self.groups.values())

    def name_announced(self) -> bool:
        """Whether a referee started under this one's name announced its group.

        A referee says which group it reads in only once started, so a record
        under the name that is not this one's own proposal (``_join_group``)
        means the name had a holder, not only a rival still starting. Its
        status cannot tell: the holder's will says offline each time this
        referee's login throws it off.
        """
        record = self.groups.get(self.config.username or "referee")
        return record is not None and record != self._proposed

    def _converge(self) -> None:
        """Move to the smallest group any referee reads in, if it is not this one's.

        Every referee keeps its record retained and reads the others', so all
        of them see every name and all end in the smallest. While two groups
        are read in, a request goes to one referee of each and runs twice
        (the runner keeps the first episode), hence the move as soon as a
        smaller name is seen, not a warning to restart.
        """
        if self.group is None or self._moving is not None or not self.groups:
            return
        if min(self.groups.values()) < self.group:
            self._moving = asyncio.ensure_future(self._move())

    async def _move(self) -> None:
        assert self.bus is not None
        try:
            while self.group is not None and (target := min(self.groups.values())) < self.group:
                old, self.group = self.group, target
                self.log.info("moving to the referees' smaller group, proposed at the same time")
                await self.bus.unsubscribe(topics.control_matches_shared(old))
                await self.bus.subscribe(topics.control_matches_shared(target), self._on_request)
                await self._announce()
        finally:
            self._moving = None

    async def _probe(self, name: str) -> None:
        """Return once every retained group name has arrived.

        The broker sends a subscription's retained messages before it handles
        the client's next packet, so the referee's own message on its probe
        topic comes back after all of them.
        """
        assert self.bus is not None
        self._probed.clear()
        await self.bus.publish(topics.referee_probe(name), b"probe")
        try:
            await asyncio.wait_for(self._probed.wait(), GROUP_PROBE_TIMEOUT_S)
        except TimeoutError:
            self.log.warning(
                "no echo from the broker in %ss; choosing a group anyway", GROUP_PROBE_TIMEOUT_S
            )

    def _on_probe(self, _topic: str, _payload: bytes) -> None:
        self._probed.set()

    def _on_group(self, topic: str, payload: bytes) -> None:
        referee = topic.split("/")[-2]
        name = payload.decode(errors="replace")
        if not GROUP_NAME.match(name):
            self.groups.pop(referee, None)  # an emptied (or foreign) record
            return
        self.groups[referee] = name
        self._converge()

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
            match.void("broker connection lost mid-match")

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
        try:
            match = Match(self, msg.match, msg.spec)
        except ValueError as exc:
            self.log.warning("refused match %s: %s", msg.match, exc)
            self._publish_refusal(msg, str(exc))
            return
        self.matches[match.id] = match
        self._askers[match.id] = (msg.reply_to, msg.run_key)
        if msg.reply_to:
            # "identity": whose status tells the runner when this referee is gone
            # (its will), and with it the matches it accepted.
            data = {"referee": self.id, "identity": self.config.username or "referee"}
            ack = Event(match=match.id, kind="accepted", data=data)
            self.send(topics.inbox(msg.reply_to), ack, batch=msg.reply_batches)
        self.idle.clear()
        self._spawn(self._run_match(match))

    def _answer_again(self, msg: MatchRequest) -> None:
        """A request for a match this referee runs or ran: say ``running``, or publish again.

        Episodes published while the runner's session was lost (a broker
        killed) reach nobody, and a request asked again used to be dropped in
        silence: the runner waited for ever. Its episode goes out again now
        (counted in ``backroom_episodes_republished_total``); one past
        ``REPUBLISH_MEMORY_BYTES`` is not kept, and the runner then asks for the
        match under a new id.
        """
        assert self.bus is not None
        if not msg.again or (msg.reply_to, msg.run_key) != self._askers.get(msg.match):
            # A redelivery, or someone else naming the match: an episode (up to 16 MB) goes
            # to every reader, so only the asker's own `again` gets it.
            return
        if msg.match in self.matches:
            if msg.reply_to:
                running = Event(match=msg.match, kind="running", data={"referee": self.id})
                self.send(topics.inbox(msg.reply_to), running, batch=msg.reply_batches)
            return
        kept = self.published.get(msg.match)
        if kept is None:
            if msg.reply_to:  # finished here, no longer kept: the runner asks under a new id
                gone = Event(match=msg.match, kind="forgotten", data={"referee": self.id})
                self.send(topics.inbox(msg.reply_to), gone, batch=msg.reply_batches)
            return
        now = time.monotonic()
        if now - self._republished_at.get(msg.match, -REPUBLISH_EVERY_S) < REPUBLISH_EVERY_S:
            return
        self._republished_at[msg.match] = now
        game, record_json = kept
        metrics.EPISODES_REPUBLISHED.inc()
        self._counter("out", "episode").inc()
        self.bus.publish(topics.episodes(game), dump_episode(msg.match, record_json), batch=True)

    def _keep_published(self, match: str, game: str, record_json: bytes) -> None:
        self.published[match] = (game, record_json)
        self._published_bytes += len(record_json)
        while self._published_bytes > REPUBLISH_MEMORY_BYTES and self.published:
            gone, (_, old) = self.published.popitem(last=False)
            self._published_bytes -= len(old)
            self._republished_at.pop(gone, None)

    async def _run_match(self, match: Match) -> None:
        try:
            await match.run()
        finally:
            self.matches.pop(match.id, None)
            self.finished_ids[match.id] = None
            while len(self.finished_ids) > FINISHED_MEMORY:
                forgotten, _ = self.finished_ids.popitem(last=False)
                self._askers.pop(forgotten, None)
            if not self.matches:
                self.idle.set()

    def _on_outbox(self, topic: str, payload: bytes) -> None:
        """Judge every message of one payload; answer its refusals with one ``Error`` at most.

        A 64 KB batch holds some 21,000 ``{}``: answering each would turn one
        message from an agent into thousands from the referee. Every refusal
        is still counted (``backroom_invalid_inputs_total``, the match's
        ``invalid_inputs``); the reply names the first and how many more.
        """
        agent = topics.agent_of(topic)
        if agent is None:
            return
        budget = self._input_budget(agent)
        start = time.monotonic()
        if not budget.open(start):
            metrics.INPUTS_DROPPED.inc()
            self._send_error(
                agent,
                Error(
                    reason="rate_limited",
                    detail=f"over {self.input_share:.0%} of the referee's time: "
                    "payload dropped unread",
                ),
            )
            budget.charge(PAYLOAD_OVERHEAD_S, time.monotonic())
            return
        self._judging, self._match_s = agent, 0.0
        try:
            for msg in parse_all(payload, MAX_PAYLOAD_BYTES):
                self._from_agent(agent, msg)
            held, more = self._held, self._held_more
            if held is not None:
                if more:
                    held.detail = f"{held.detail} (and {more} more refused in the same payload)"
                self._send_error(agent, held)
        finally:
            self._judging, self._held, self._held_more = None, None, 0
            end = time.monotonic()
            budget.charge(end - start - self._match_s + PAYLOAD_OVERHEAD_S, end)

    def _from_agent(self, agent: str, msg: Any) -> None:
        if isinstance(msg, WireError):
            return self.reject(agent, msg.reason, msg.detail)
        move = isinstance(msg, Action | Chat)
        match = self.matches.get(msg.match or "") if move else None
        if move and match is None and msg.match not in self.finished_ids and self.has_peers():
            # Every referee reads every agent's outbox (DESIGN.md's topics), so with other
            # referees online a move for a match not run here is, as a rule, another
            # referee's: answering it would send the agent K-1 errors for each of its
            # moves and count them as invalid inputs. Not answered; counted apart.
            metrics.FOREIGN_INPUTS.inc()
            return
        self._counter("in", msg.type).inc()
        if not isinstance(msg, Action | Chat):
            return self.reject(
                agent, "unexpected_type", f"agents send action or chat, not {msg.type!r}"
            )
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
        start, refused = time.monotonic(), self._refused
        match.on_message(agent, msg)
        if self._refused == refused:  # an accepted move: the match's work, not the sender's
            self._match_s += time.monotonic() - start

    def has_peers(self) -> bool:
        """Whether another referee is online (then it may run a match unknown here).

        A peer is a name with a group record, which only the referee role may
        write (an agent can say ``kind: referee`` in its own status, not this),
        whose status says online (its will clears that when it dies; the
        retained group record outlives it).
        """
        me = self.config.username or "referee"
        return any(r != me and r in self.groups for r in self.referees_online)

    def _on_status(self, topic: str, payload: bytes) -> None:
        """Follow an identity's status, out of the same budget as its outbox.

        A status costs the loop too (an ``offline`` visits every match), so a
        flood of online/offline flips or of big statuses is dropped past the
        budget and counted (``backroom_statuses_dropped_total``); what is lost
        is the sender's own presence, renewed by its next status.
        """
        agent = topics.agent_of(topic)
        if agent is None:
            return
        budget = self._input_budget(agent)
        start = time.monotonic()
        if not budget.open(start):
            metrics.STATUSES_DROPPED.labels(reason="over_budget").inc()
            budget.charge(PAYLOAD_OVERHEAD_S, time.monotonic())
            return
        try:
            self._follow_status(topic, payload)
        finally:
            end = time.monotonic()
            budget.charge(end - start + PAYLOAD_OVERHEAD_S, end)

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
        if self._starting and agent == (self.config.username or "referee"):
            self._used_before = True
        if msg.kind:
            # A label value, so from a closed set: the kind is whatever the agent says.
            self.kinds[agent] = metrics.kind_label(msg.kind)
        if msg.kind == "referee":
            (self.referees_online.add if msg.state == "online" else self.referees_online.discard)(
                agent
            )
        (self.batching.add if msg.batches else self.batching.discard)(agent)
        if msg.state == "offline":
            if agent not in self.offline:
                self.offline_since[agent] = time.monotonic()
            self.offline.add(agent)
            for match in self.matches.values():
                match.seat_offline(agent)
        else:
            self.offline.discard(agent)
            self.offline_since.pop(agent, None)

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

    def send(self, topic: str, msg: BaseModel, batch: bool = False) -> None:
        """Publish without waiting for the PUBACK: the move path must not wait on the broker twice.

        With ``batch``, messages to the same topic in one loop iteration share
        an MQTT message (only for readers that said they split batches).
        """
        self._counter("out", getattr(msg, "type", "?")).inc()
        assert self.bus is not None
        self.bus.publish(topic, msg, batch=batch)

    def public_pending(self, match: Match) -> None:
        """``match`` queued public events: send them at most every ``public_interval_s``.

        Each match's public topic is its own MQTT message, so sending after
        every turn would cost a packet per move and match. Instead a match's
        events leave together ``public_interval_s`` after its previous public
        message (the first: after it started), and at its end; a match played
        within the interval costs one message. Spectators see events at most
        that late. With an interval of 0 every turn flushes at once.
        """
        if self.public_interval_s <= 0:
            match.flush_public()
            return
        self.public_due[match.id] = match
        if self._public_timer is None:
            loop = asyncio.get_running_loop()
            self._public_timer = loop.call_later(self.public_interval_s / 4, self._flush_public)

    def _flush_public(self) -> None:
        self._public_timer = None
        now = time.monotonic()
        for match in list(self.public_due.values()):
            if now - match.public_sent_at >= self.public_interval_s:
                match.flush_public()
        if self.public_due:
            self._public_timer = asyncio.get_running_loop().call_later(
                self.public_interval_s / 4, self._flush_public
            )

    def send_to(self, agent: str, msg: BaseModel) -> None:
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
        reason: str,
        detail: str,
        match: str | None = None,
        ref_seq: int | None = None,
    ) -> None:
        """Count a refused message and answer it (once per payload, within the agent's budget).

        A refusal inside a match (not your turn, an illegal action) is the sender's cost:
        ``_refused`` tells ``_from_agent`` not to take its time off the sender's charge.
        """
        self._refused += 1
        metrics.INVALID_INPUTS.labels(reason=reason).inc()
        error = Error(match=match, reason=reason, detail=detail, ref_seq=ref_seq)
        if self._judging == agent:
            if self._held is None:
                self._held = error
            else:
                self._held_more += 1
            return
        self._send_error(agent, error)

    def _input_budget(self, agent: str) -> WorkBudget:
        """``agent``'s one budget over its outbox and its status (``WorkBudget``)."""
        budget = self._inputs.get(agent)
        if budget is None:
            budget = self._inputs[agent] = WorkBudget(
                self.input_burst_s, self.input_share, time.monotonic()
            )
            while len(self._inputs) > ERROR_BUDGETS:
                self._inputs.popitem(last=False)
        else:
            self._inputs.move_to_end(agent)
        return budget

    def _send_error(self, agent: str, error: Error) -> None:
        """Send ``error`` if ``agent``'s token bucket has a token; else drop it and count it."""
        now = time.monotonic()
        bucket = self._budgets.get(agent)
        if bucket is None:
            bucket = self._budgets[agent] = TokenBucket(
                self.error_burst, self.error_rate_per_s, now
            )
            while len(self._budgets) > ERROR_BUDGETS:
                self._budgets.popitem(last=False)
        else:
            self._budgets.move_to_end(agent)
        if bucket.take(now):
            self.send_to(agent, error)
        else:
            metrics.ERRORS_DROPPED.inc()

    async def finished(self, match: Match, record: EpisodeRecord) -> None:
        record_json = record.model_dump_json().encode()  # the longest message: serialised once
        written = await self._write(record, record_json)
        if written is not record:
            record, record_json = written, written.model_dump_json().encode()
        metrics.MATCHES_FINISHED.labels(game=record.game, outcome=record.reason).inc()
        for action in record.actions:
            if action.fallback is not None:  # a closed set of reasons, a closed set of kinds
                metrics.FALLBACKS.labels(
                    kind=self.kind_of(action.agent), reason=action.fallback
                ).inc()
        assert self.bus is not None
        self._counter("out", "episode").inc()
        self._keep_published(record.match, record.game, record_json)
        self.bus.publish(
            topics.episodes(record.game), dump_episode(record.match, record_json), batch=True
        )

    async def _write(self, record: EpisodeRecord, record_json: bytes) -> EpisodeRecord:
        """Append ``record`` to its run's file; the ``error`` record to publish when that fails.

        A full disk or a broken run directory used to be logged per match and
        the episode never published, so the runner waited for ever. The episode
        still goes out, as an ``error`` naming the ``OSError`` (its play kept,
        for the record), and the runner fails the run with that reason.
        """
        try:
            await self.episodes.append(record.run, record_json, record.spec.run_stamp)
        except OSError as exc:
            metrics.EPISODES_NOT_WRITTEN.inc()
            where = self.episodes.path(record.run, record.spec.run_stamp)
            self.log.error("match %s: episode not written to %s: %r", record.match, where, exc)
            was = f"{record.reason}: {record.detail}" if record.detail else record.reason
            detail = f"{NOT_WRITTEN} to {where}: {exc!r} (the match ended {was})"
            return record.model_copy(update={"reason": "error", "detail": detail})
        return record

    def _publish_refusal(self, msg: MatchRequest, why: str, write: bool = True) -> None:
        """A request the referee cannot run still gets an episode, so the runner never waits forever.

        ``write=False``: published only (the run directory it names is not the requester's)."""
        record = EpisodeRecord(
            match=msg.match,
            run=msg.spec.run,
            referee=self.id,
            spec=msg.spec,
            game=msg.spec.game,
            params=msg.spec.params,
            seed=msg.spec.seed,
            crn_group=msg.spec.crn_group,
            seats=list(msg.spec.seats),
            actions=[],
            deliveries=[],
            round_rewards=[],
            raw_returns=[0.0] * len(msg.spec.seats),
            returns=[0.0] * len(msg.spec.seats),
            reason="error",
            detail=f"refused: {why}",
            started_at=time.time(),
            ended_at=time.time(),
        )
        self.finished_ids[msg.match] = None
        self._askers[msg.match] = (msg.reply_to, msg.run_key)

        async def publish() -> None:
            written = (
                await self._write(record, record.model_dump_json().encode()) if write else record
            )
            # A refused request may name any game: the label takes registered ones only.
            game = record.game if record.game in registered_games() else metrics.OTHER
            metrics.MATCHES_FINISHED.labels(game=game, outcome="error").inc()
            assert self.bus is not None
            self._counter("out", "episode").inc()
            episode = Episode(match=record.match, record=written)
            self._keep_published(record.match, record.game, written.model_dump_json().encode())
            await self.bus.publish(topics.episodes(record.game), episode)

        self._spawn(publish())

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


async def claim_pooled(
    names: list[str],
    make: Callable[[str], Referee],
    say: Callable[[str], None],
    passes: int = CLAIM_PASSES,
) -> Referee:
    """The first referee of ``names`` whose identity no other process holds, started.

    For replicas of one service (``docker compose up --scale referee=4``): they
    share one env file, so one name pattern and one password, and each takes
    a name of the pool that is free. Trying a name a running referee holds
    throws that one off (once or twice: the bus's clean-start pre-login and its
    login; it reconnects at once and keeps its name, voiding the matches it had
    in flight); that try also reads every referee's status, so later tries skip
    the names online and a pass throws off at most one referee.

    Replicas racing for one name settle it within the identity window, since
    every try waits it (``contested``): the later login keeps the name. A
    replica that lost every name of a pass waits until the rivals that were
    still starting have settled, and tries again the names it saw no started
    referee under (``Referee.name_announced``), up to ``passes`` times: three
    replicas started at once on a pool of three could leave one without a
    name. Raises ``IdentityInUse`` when every name is taken.
    """
    pool = list(names)
    held: set[str] = set()  # names seen online or announced by a started referee
    for n in range(passes):
        if n:
            say(f"no name of the pool was free; trying {', '.join(names)} again")
            # Rivals in their identity window are online after it: wait it out, with
            # jitter so that two replicas that lost the same name do not meet again.
            await asyncio.sleep(IDENTITY_WINDOW_S * (1.0 + random.random()))
        usable: list[str] = []
        for name in names:
            if name in held:
                continue
            try:
                ref = make(name)
            except KeyError as exc:  # no credentials for this name of the pool
                say(f"skipping {name!r}: {exc.args[0]}")
                continue
            usable.append(name)
            try:
                return await ref.__aenter__()
            except IdentityInUse:
                # It read every referee's retained status meanwhile: skip the names
                # online, so the rest of the pass throws nobody else off.
                held |= ref.referees_online
                if ref.name_announced():
                    held.add(name)
                say(f"referee identity {name!r} is in use; trying a free name of the pool")
            except ConnectTimeout:
                # Two replicas logging in under one name at once can throw each other off
                # until the first connection's deadline (seen on a loaded 2-core machine):
                # contested, not a broker that is away. The name stays for the next pass.
                if not await broker_reachable(ref.config):
                    raise
                say(f"referee identity {name!r} is contested; trying a free name of the pool")
        names = [name for name in usable if name not in held]
        if not names:
            break
    raise IdentityInUse(
        f"every referee identity of the pool ({pool[0]} to {pool[-1]}) is in use: stop a "
        "referee, or make the pool larger (`--pool N`, and identities for the new names)"
    )
