"""Connects an ``Agent`` to the bus: status, inbox, answers, reconnects.

Each agent has its own MQTT identity (username = agent id), reads only its own
inbox and writes only its own outbox and status — the broker enforces that.
Its moves for a match go to the outbox of the referee that runs it, as that
match's ``MatchStart`` names it (``bus.addressing``).
Its status topic is retained, with a last will of ``offline``, so the referee
learns at once when an agent process dies and stops waiting on it. The
``online`` status is renewed every ``status_refresh_s`` (and says so), so one
left behind by a process that died without its will expires
(``backroom.bus.presence``).

Usage from any script or notebook, against a running stack::

    async with AgentRunner(MyAgent("alice"), BusConfig.from_url(url, "alice", pw)) as runner:
        await runner.wait_closed()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import replace
from typing import Any

from backroom import metrics
from backroom.agents.base import Agent
from backroom.agents.eager import start_eagerly
from backroom.bus import presence, topics
from backroom.bus.addressing import Referees
from backroom.bus.claim import IdentityClaim
from backroom.bus.client import Bus, BusConfig, Will
from backroom.bus.structs import Action
from backroom.bus.wire import (
    IDENTITY_WINDOW_S,
    Chat,
    Checkpoint,
    Delivery,
    Error,
    Flag,
    MatchEnd,
    MatchStart,
    Status,
    Trace,
    Turn,
    WireError,
    dump,
    parse,
    parse_all,
)

log = logging.getLogger("backroom.agent")


class AgentRunner:
    def __init__(
        self,
        agent: Agent,
        config: BusConfig,
        *,
        status_refresh_s: float = presence.STATUS_REFRESH_S,
    ) -> None:
        if status_refresh_s <= 0:
            raise ValueError("status_refresh_s must be positive")
        if config.username and config.username != agent.id:
            raise ValueError(
                f"agent id {agent.id!r} must equal its MQTT username {config.username!r}"
            )
        self.agent = agent
        self.config = replace(config, username=agent.id)
        self.bus: Bus | None = None
        self.errors: deque[Error] = deque(maxlen=1000)
        self.answered: deque[tuple[str | None, int, int]] = deque(maxlen=10_000)
        self._answered_set: set[tuple[str | None, int, int]] = set()
        self.seq = 0
        self.referees = Referees()  # match -> the referee whose outbox its moves go to
        self.tasks: set[asyncio.Task[Any]] = set()
        self.lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self.status_refresh_s = float(status_refresh_s)
        self._renewing: asyncio.Task[None] | None = None
        # The identity check at start (``open``, ``bus.claim``).
        self._starting = False
        self.identity: IdentityClaim | None = None  # made with the bus, in ``open``
        self._mine = b""  # the first "online", read back to tell what came before it
        self._echo = asyncio.Event()
        self._decisions = {
            phase: metrics.AGENT_DECISIONS.labels(kind=agent.kind, phase=phase)
            for phase in ("talk", "act", "review")
        }

    async def __aenter__(self) -> AgentRunner:
        return await self.open()

    async def open(self) -> AgentRunner:
        """Connect and announce ``online``; ``IdentityInUse`` if another process holds the id.

        No process can look whether its identity is online without logging in
        under it, which throws off whoever is (the client id is the username).
        So the first ``online`` is announced and read back: a status of this
        identity that arrives before it is an earlier process's (retained),
        and then this agent stays ready for ``IDENTITY_WINDOW_S`` to be thrown
        off in turn (``bus.claim``). A name never used on this broker costs no
        wait.
        """
        await self.agent.setup()
        offline = Status(state="offline", kind=self.agent.kind)
        # The window read now, not at import: tests lengthen it.
        claim = self.identity = IdentityClaim(self.config, "agent", window_s=IDENTITY_WINDOW_S)
        self.bus = Bus(
            self.config,
            will=Will(topics.status(self.agent.id), dump(offline)),
            on_connect=[self._announce],
            on_disconnect=[claim.thrown_off],
            role="agent",
        )
        # Subscribe before connecting: the bus subscribes first and announces
        # "online" after, so no turn can arrive before the inbox is read.
        await self.bus.subscribe(topics.inbox(self.agent.id), self._on_inbox)
        await self.bus.subscribe(topics.status(self.agent.id), self._on_own_status)
        if self.agent.policy:
            await self.bus.subscribe(topics.checkpoint(self.agent.policy), self._on_checkpoint)
        if self.agent.follows_announcements:
            await self.bus.subscribe(topics.ALL_MODEL_VERSIONS, self._on_version)
        self.agent._trace_sink = self._publish_trace
        self.agent._chat_sink = self._send
        self._starting = True
        try:
            await self.bus.open()
            async with claim.on(self.bus):
                await self._read_back(claim)
        except BaseException:
            if self._mine and not claim.taken.is_set():
                # Stopped while claiming (a name used before waits IDENTITY_WINDOW_S, online
                # and playing): say offline, or the clean disconnect below drops the will and
                # the retained "online" outlives the process (the next run refused the name).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._say_offline(), 2)
            await self.bus.close()
            await self.agent.close()
            raise
        finally:
            self._starting = False
        self._renewing = asyncio.get_running_loop().create_task(
            presence.keep_announcing(self._announce, self.status_refresh_s)
        )
        return self

    @property
    def _claiming(self) -> bool:
        """Connected, and claiming its identity (reading its first status back, or holding)."""
        return self.identity is not None and self.identity.claiming

    async def _read_back(self, claim: IdentityClaim) -> None:
        """Announce the first ``online`` and read it back; a status before it holds the window."""
        assert self.bus is not None
        self._mine = dump(self._online())
        self.bus.publish(topics.status(self.agent.id), self._mine, retain=True)
        with contextlib.suppress(TimeoutError):
            await claim.unless_taken(asyncio.wait_for(self._echo.wait(), 10))
        await claim.hold()
        if self.bus.reconnects:  # the broker went away meanwhile: announce again
            self.bus.publish(topics.status(self.agent.id), self._online(), retain=True)

    def _on_own_status(self, _topic: str, payload: bytes) -> None:
        if not self._starting or self._echo.is_set():
            return
        if payload == self._mine:
            self._echo.set()
        elif self.identity is not None:
            self.identity.used_before = True  # retained: a process before this one used it

    async def _send(self, msg: Action | Chat | Flag) -> None:
        # Not awaited, batched: answers decided in one loop iteration (to many
        # matches) share one MQTT message. Delivery is at least once (resent
        # after a reconnect); the referee drops duplicates.
        self.seq += 1
        msg.seq = self.seq
        assert self.bus is not None
        self.bus.publish(self.referees.outbox(self.agent.id, msg.match), msg, batch=True)

    async def _publish_trace(self, trace: Trace) -> None:
        assert self.bus is not None
        await self.bus.publish(topics.traces(self.agent.id), trace)

    def _on_checkpoint(self, _topic: str, payload: bytes) -> None:
        try:
            msg = parse(payload)
        except WireError as exc:
            log.warning("%s: unreadable checkpoint message: %s", self.agent.id, exc)
            return
        if isinstance(msg, Checkpoint):
            self.agent.on_announced(msg)  # the topic is the trainer's alone (broker ACL)
            self._spawn(self.agent.on_checkpoint(msg))

    def _on_version(self, topic: str, payload: bytes) -> None:
        if not payload:  # a retained announcement cleared
            return
        try:
            msg = parse(payload)
        except WireError as exc:
            log.warning("%s: unreadable version announcement on %s: %s", self.agent.id, topic, exc)
            return
        if isinstance(msg, Checkpoint) and topics.model_version_of(topic) == (
            msg.policy,
            msg.version,
        ):
            self.agent.on_announced(msg)
        else:
            log.warning(
                "%s: %s does not announce the version its topic names", self.agent.id, topic
            )

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Say ``offline`` and disconnect."""
        await presence.stop(self._renewing)  # no renewal may follow the offline below
        self._renewing = None
        if self.bus is not None:
            # If the broker is gone the will says offline for us.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._say_offline(), 2)
            await self.bus.close()
        for t in list(self.tasks):
            t.cancel()
        await self.agent.close()
        self._closed.set()

    async def _say_offline(self) -> None:
        assert self.bus is not None
        offline = Status(state="offline", kind=self.agent.kind)
        await self.bus.publish(topics.status(self.agent.id), offline, retain=True)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def _online(self) -> Status:
        return Status(
            state="online",
            kind=self.agent.kind,
            batches=True,
            heartbeat_s=self.status_refresh_s,
            traces=self.agent.traces_decisions,
        )

    async def _announce(self) -> None:
        if self._starting:
            return  # the first connect: ``_claim`` announces
        assert self.bus is not None
        await self.bus.publish(topics.status(self.agent.id), self._online(), retain=True)

    # --- inbox -----------------------------------------------------------------------

    def _on_inbox(self, _topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, WireError):
            log.warning("%s: unreadable inbox message: %s", self.agent.id, msg)
            return
        if isinstance(msg, Turn):
            key = (msg.match, msg.turn, msg.seat)
            if key in self._answered_set:
                return  # a QoS 1 redelivery of a turn already answered
            self._remember(key)
            self._spawn(self._decide(msg))
        elif isinstance(msg, Delivery):
            self._spawn(self.agent.on_message(msg))
        elif isinstance(msg, MatchStart):
            self.referees.note(msg)  # before any answer to this match can be sent
            self._spawn(self.agent.on_match_start(msg))
        elif isinstance(msg, MatchEnd):
            self._spawn(self.agent.on_match_end(msg))
        elif isinstance(msg, Error):
            self.errors.append(msg)
            metrics.AGENT_ERRORS.labels(kind=self.agent.kind, reason=msg.reason).inc()
            log.info("%s: referee says %s: %s", self.agent.id, msg.reason, msg.detail)
            self._spawn(self.agent.on_error(msg))

    def _remember(self, key: tuple[str | None, int, int]) -> None:
        if len(self.answered) == self.answered.maxlen:
            self._answered_set.discard(self.answered[0])
        self.answered.append(key)
        self._answered_set.add(key)

    async def _decide(self, turn: Turn) -> None:
        if self.agent.concurrent:
            reply = await self._reply(turn)
        else:
            async with self.lock:
                reply = await self._reply(turn)
        if reply is not None:
            await self._send(reply)

    async def _reply(self, turn: Turn) -> Action | Chat | None:
        self._decisions[turn.phase].inc()
        try:
            if turn.phase == "review":
                # An observer's flags leave before this answer, on the same outbox: the
                # referee has them all when the review turn ends.
                await self.agent.review(turn)
                return Action(match=turn.match, turn=turn.turn, seat=turn.seat, action=None)
            if turn.phase == "talk":
                text = await self.agent.talk(turn)
                return Chat(
                    match=turn.match,
                    turn=turn.turn,
                    seat=turn.seat,
                    channel=turn.channel or "",
                    text=text or "",
                    fallback=self.agent.take_fallback(turn),
                )
            action = await self.agent.act(turn)
            return Action(
                match=turn.match,
                turn=turn.turn,
                seat=turn.seat,
                action=action,
                fallback=self.agent.take_fallback(turn),
            )
        except Exception:
            # A bug in the agent's policy leaves the seat to the referee's timeout default.
            log.exception(
                "%s: decision failed for %s turn %s", self.agent.id, turn.match, turn.turn
            )
            self.agent.take_fallback(turn)
            return None

    def _spawn(self, coro: Any) -> None:
        if not self.agent.inline:
            task: asyncio.Task[Any] | None = asyncio.get_running_loop().create_task(coro)
        else:
            # A scripted policy answers in this very callback: no task, no extra loop iteration.
            try:
                task = start_eagerly(coro)
            except Exception:
                log.exception("%s: handler failed", self.agent.id)
                return
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


async def serve(agent: Agent, config: BusConfig) -> None:
    """Run one agent until cancelled."""
    async with AgentRunner(agent, config) as runner:
        await runner.wait_closed()


async def serve_many(agents: list[Agent], configs: list[BusConfig]) -> None:
    """Host several agents in one process, each with its own identity and connection."""
    await asyncio.gather(*(serve(a, c) for a, c in zip(agents, configs, strict=True)))
