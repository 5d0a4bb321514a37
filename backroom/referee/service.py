"""The referee process: takes match requests, runs matches, routes what agents send.

Several referees split the work: match requests arrive through the shared
subscription ``$share/referees/.../control/matches``, so the broker hands each
request to one of them. Each referee reads every outbox and acts only on
messages for its own matches.

Input handling is the security boundary after the broker's ACL. The sender of
an outbox message is the agent named in the topic (the ACL lets only that
identity write there); anything that fails validation gets an ``Error`` with a
reason in the sender's inbox and is counted in
``backroom_invalid_inputs_total``. Nothing an agent sends can stop a match or
the referee.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from backroom import metrics
from backroom.bus import topics
from backroom.bus.client import BUSY_MATCHES, Bus, BusConfig, Will
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
    parse,
    parse_all,
)
from backroom.referee.episodes import EpisodeLog
from backroom.referee.match import Match

#: How many finished match ids a referee remembers, to answer late messages and drop duplicate requests.
FINISHED_MEMORY = 10_000


class Referee:
    def __init__(
        self,
        config: BusConfig,
        runs_dir: str | Path = "runs",
        referee_id: str | None = None,
        max_matches: int = 10_000,
        offline_grace_s: float = 1.0,
        public_interval_s: float = 0.25,
    ) -> None:
        self.config = config
        self.id = (
            referee_id or f"{config.username or 'referee'}@{socket.gethostname()}:{os.getpid()}"
        )
        self.log = logging.getLogger("backroom.referee")
        self.episodes = EpisodeLog(runs_dir)
        self.max_matches = max_matches
        self.offline_grace_s = offline_grace_s
        self.public_interval_s = public_interval_s
        self.public_due: dict[str, Match] = {}
        self._public_timer: asyncio.TimerHandle | None = None
        self.matches: dict[str, Match] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.finished_ids: OrderedDict[str, None] = OrderedDict()
        self.offline: set[str] = set()
        self.kinds: dict[str, str] = {}
        self.batching: set[str] = set()  # agents whose status says they read batched inboxes
        self._counters: dict[tuple[str, str], Any] = {}
        self._latency: dict[tuple[str, str], Any] = {}
        self.bus: Bus | None = None
        self.idle = asyncio.Event()
        self.idle.set()

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Referee:
        name = self.config.username or "referee"
        self.bus = Bus(
            self.config,
            will=Will(topics.status(name), dump(Status(state="offline", kind="referee"))),
            on_connect=[self._announce],
            on_disconnect=[self._on_disconnect],
            role="referee",
        )
        # Subscribed before connecting, so "online" is announced only once
        # requests and outboxes are being read.
        await self.bus.subscribe(topics.ALL_STATUS, self._on_status)
        await self.bus.subscribe(topics.ALL_OUTBOXES, self._on_outbox)
        await self.bus.subscribe(topics.CONTROL_MATCHES_SHARED, self._on_request)
        await self.bus.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for match in list(self.matches.values()):
            match.void("referee shutting down")
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        if self.bus is not None:
            await self.bus.close()

    async def serve_forever(self) -> None:
        async with self:
            await asyncio.Event().wait()

    async def _announce(self) -> None:
        assert self.bus is not None
        name = self.config.username or "referee"
        await self.bus.publish(
            topics.status(name), Status(state="online", kind="referee"), retain=True
        )

    async def _on_disconnect(self) -> None:
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
            return  # a redelivered request (QoS 1 is at least once): the match runs once
        try:
            match = Match(self, msg.match, msg.spec)
        except ValueError as exc:
            self.log.warning("refused match %s: %s", msg.match, exc)
            self._publish_refusal(msg, str(exc))
            return
        self.matches[match.id] = match
        self._busy_or_not()
        if msg.reply_to:
            ack = Event(match=match.id, kind="accepted", data={"referee": self.id})
            self.send(topics.inbox(msg.reply_to), ack, batch=msg.reply_batches)
        self.idle.clear()
        self._spawn(self._run_match(match))

    async def _run_match(self, match: Match) -> None:
        try:
            await match.run()
        finally:
            self.matches.pop(match.id, None)
            self._busy_or_not()
            self.finished_ids[match.id] = None
            while len(self.finished_ids) > FINISHED_MEMORY:
                self.finished_ids.popitem(last=False)
            if not self.matches:
                self.idle.set()

    def _on_outbox(self, topic: str, payload: bytes) -> None:
        agent = topics.agent_of(topic)
        if agent is None:
            return
        for msg in parse_all(payload, MAX_PAYLOAD_BYTES):
            self._from_agent(agent, msg)

    def _from_agent(self, agent: str, msg: Any) -> None:
        if isinstance(msg, WireError):
            return self.reject(agent, msg.reason, msg.detail)
        self._counter("in", msg.type).inc()
        if not isinstance(msg, Action | Chat):
            return self.reject(
                agent, "unexpected_type", f"agents send action or chat, not {msg.type!r}"
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
        match.on_message(agent, msg)

    def _on_status(self, topic: str, payload: bytes) -> None:
        agent = topics.agent_of(topic)
        try:
            msg = parse(payload)
        except WireError:
            return
        if agent is None or not isinstance(msg, Status):
            return
        if msg.kind:
            self.kinds[agent] = msg.kind
        (self.batching.add if msg.batches else self.batching.discard)(agent)
        if msg.state == "offline":
            self.offline.add(agent)
            for match in self.matches.values():
                match.seat_offline(agent)
        else:
            self.offline.discard(agent)

    def _busy_or_not(self) -> None:
        """Many matches in flight: let outgoing batches linger to fill (``Bus.set_busy``)."""
        if self.bus is not None:
            self.bus.set_busy(len(self.matches) >= BUSY_MATCHES)

    def kind_of(self, agent: str) -> str:
        return self.kinds.get(agent, "unknown")

    # --- outbound ------------------------------------------------------------------

    def send(self, topic: str, msg: BaseModel, batch: bool = False) -> None:
        """Publish without waiting for the PUBACK: the move path must not wait on the broker twice.

        With ``batch``, messages to the same topic in one loop iteration share
        an MQTT message (only for readers that said they split batches).
        """
        self._counter("out", getattr(msg, "type", "?")).inc()
        assert self.bus is not None
        if batch:
            self.bus.publish_batched(topic, msg)
        else:
            self.bus.publish_nowait(topic, msg)

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
        metrics.INVALID_INPUTS.labels(reason=reason).inc()
        self.send_to(agent, Error(match=match, reason=reason, detail=detail, ref_seq=ref_seq))

    async def finished(self, match: Match, record: EpisodeRecord) -> None:
        record_json = record.model_dump_json().encode()  # the longest message: serialised once
        await self.episodes.append(record.run, record_json)
        metrics.MATCHES_FINISHED.labels(game=record.game, outcome=record.reason).inc()
        assert self.bus is not None
        self._counter("out", "episode").inc()
        self.bus.publish_batched(
            topics.episodes(record.game), dump_episode(record.match, record_json)
        )

    def _publish_refusal(self, msg: MatchRequest, why: str) -> None:
        """A request the referee cannot run still gets an episode, so the runner never waits forever."""
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

        async def publish() -> None:
            await self.episodes.append(record.run, record.model_dump_json().encode())
            metrics.MATCHES_FINISHED.labels(game=record.game, outcome="error").inc()
            assert self.bus is not None
            self._counter("out", "episode").inc()
            await self.bus.publish(
                topics.episodes(record.game), Episode(match=record.match, record=record)
            )

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
