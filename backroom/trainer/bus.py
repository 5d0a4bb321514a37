"""The trainer's one door to MQTT: a persistent session that feeds the store, requests, checkpoints.

The session survives the process (clean start 0, a long session expiry, the
old session never discarded), and its subscriptions are made before the
connection, so what referees and agents published while the trainer was down
(episodes, traces; QoS 1) is delivered when it comes back and lands in the
store. Each message is committed to the store inside the receive callback,
before paho acknowledges it: a crash loses nothing, and a redelivery is
deduplicated by the store's keys.

A trace counts only for the agent its topic names (``traces/{agent}``; the
broker's ACL lets only that agent write there), whatever its payload claims.

Any agent may publish anything on its own traces topic, so what one message
costs here is bounded: at most ``MAX_TRACE_BYTES``, one trace or an array of
at most ``MAX_TRACES_PER_MESSAGE``, refused whole on its first bad element
(never validated element by element), refusals counted in memory and the
stored traces written in one transaction: one fsync per message at most, so a
flood cannot hold the loop (and the keepalive) for more than a message's parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.client import Bus, BusConfig
from backroom.bus.wire import (
    MAX_TRACE_BYTES,
    AdapterRef,
    Checkpoint,
    Episode,
    EpisodeRecord,
    MatchRequest,
    Trace,
    WireError,
    parse,
    parse_all,
)
from backroom.play.ledger import MatchLedger
from backroom.play.loop import Batch
from backroom.trainer.store import STORED, Request, Store

log = logging.getLogger("backroom.trainer")

#: Long enough to outlive a trainer restart (or a step on a slow machine).
SESSION_EXPIRY_S = 24 * 3600

#: Traces in one message at most. Agents send one trace per message; an array is
#: only what ``Bus.publish(batch=True)`` joins (at most ``BATCH_MAX_BYTES``).
MAX_TRACES_PER_MESSAGE = 64

_TRACES: TypeAdapter[Trace | list[Trace]] = TypeAdapter(
    Trace | Annotated[list[Trace], Field(max_length=MAX_TRACES_PER_MESSAGE, fail_fast=True)]
)


def parse_traces(payload: bytes) -> list[Trace] | str:
    """The traces of one message, or why it is refused whole (``trace_oversized``, ``trace_malformed``).

    The length of an array is checked before any element is validated, and
    one bad element refuses the message: its cost is one bounded parse.
    """
    if len(payload) > MAX_TRACE_BYTES:
        return "trace_oversized"
    try:
        parsed = _TRACES.validate_json(payload)
    except ValidationError:
        return "trace_malformed"
    return parsed if isinstance(parsed, list) else [parsed]


class TrainerBus:
    """``async with TrainerBus(config, store, game) as bus``: stores what arrives, sends what is asked."""

    def __init__(
        self,
        config: BusConfig,
        store: Store,
        game: str,
        follow: Sequence[str] = (),
        watch: Sequence[str] | None = None,
    ) -> None:
        """``follow``: policies other trainers train on this bus (co-training), whose current
        checkpoints this one reads (``current_of``). ``watch``: the agents whose statuses are
        read (the run's players, baselines and pool; ``wait_online`` waits for no other);
        None reads every agent's. Why not always all: any identity can publish statuses, and
        a flood of them costs the trainer a parse each."""
        config = replace(config, session_expiry_s=max(config.session_expiry_s, SESSION_EXPIRY_S))
        self.store = store
        self.game = game
        self.me = config.username or "trainer"
        self.bus = Bus(config, role="trainer", persistent=True)
        #: The agents' statuses; an ``online`` counts while renewed (its heartbeat).
        self.presence = presence.Roster()
        self.follow = list(follow)
        self.watch = None if watch is None else list(watch)
        self.checkpoints: dict[str, AdapterRef] = {}
        self._arrived = asyncio.Event()
        #: The batch being played on this session (``trainer.batch``): told what referees
        #: answer and finish; its sink commits the episodes it keeps (``keep``).
        self.batch: Batch | None = None
        #: Referees a roster record names, and whether their status says online now.
        self.referees: dict[str, bool] = {}

    async def __aenter__(self) -> TrainerBus:
        # the rosters are retained: a referee's record is here before its status
        await self.bus.subscribe(topics.REFEREE_ROSTERS, self._on_roster)
        await self.bus.subscribe(topics.inbox(self.me), self._on_ack)
        await self.bus.subscribe(topics.episodes(self.game), self._on_episode)
        await self.bus.subscribe(topics.ALL_TRACES, self._on_trace)
        if self.watch is None:
            await self.bus.subscribe(topics.ALL_STATUS, self._on_status)
        else:
            await self.bus.subscribe_many([topics.status(a) for a in self.watch], self._on_status)
        for policy in self.follow:
            await self.bus.subscribe(topics.checkpoint(policy), self._on_checkpoint)
        await self.bus.open()
        if self.watch is not None:
            # its session persists: an earlier run's subscription to every status may remain
            await self.bus.unsubscribe(topics.ALL_STATUS)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.bus.close()

    @property
    def ledger(self) -> MatchLedger | None:
        """The ledger of the batch being played, if any."""
        return None if self.batch is None else self.batch.ledger

    # --- what arrives ------------------------------------------------------------

    def _on_episode(self, _topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            if not isinstance(msg, Episode):
                continue
            if self.batch is not None and self.batch.episode(msg.record):
                continue  # kept: the batch's sink committed it (``keep``), before the PUBACK
            self.keep(msg.record)  # any other: a voided one is what ``--resume`` reads back

    def keep(self, record: EpisodeRecord) -> bool:
        """Commit an episode to the store; True if stored (a repeat or an unrequested one is not).

        Called in the receive callback, so it is committed before paho
        acknowledges the message: a crash loses nothing.
        """
        if not self.store.add_episode(record):
            return False
        self._arrived.set()
        return True

    def _on_trace(self, topic: str, payload: bytes) -> None:
        agent = topic.rsplit("/", 1)[-1]
        traces = parse_traces(payload)
        if isinstance(traces, str):
            self.store.count(traces)
            metrics.TRAIN_DROPPED.labels(reason=traces).inc()
            return
        counts = self.store.add_traces(agent, traces)
        if counts.pop(STORED, 0):
            self._arrived.set()
        for reason, n in counts.items():
            metrics.TRAIN_DROPPED.labels(reason=reason).inc(n)

    def _on_status(self, topic: str, payload: bytes) -> None:
        seen = self.presence.see(topic, payload)  # capped: wire.MAX_STATUS_BYTES
        if seen is None:
            return
        self._arrived.set()
        if seen.name in self.referees and seen.status.kind == "referee":
            self.referees[seen.name] = seen.online
            if self.batch is not None:
                self.batch.referee(seen.name, seen.online)

    def _on_roster(self, topic: str, payload: bytes) -> None:
        """A referee-only record names a referee: its status is read from now on (only its
        own: any identity may say ``kind: referee`` of itself)."""
        name = topics.referee_of(topic)
        if name is not None and payload and name not in self.referees:
            self.referees[name] = False
            self.bus.follow([topics.status(name)], self._on_status)

    def _on_ack(self, _topic: str, payload: bytes) -> None:
        """Referees answer each request they take, and each ask ``again``, in our inbox."""
        if self.batch is not None:
            self.batch.acks(payload)
            self._arrived.set()

    def _on_checkpoint(self, topic: str, payload: bytes) -> None:
        """Another trainer's current adapter (the topic is the trainer role's alone: broker ACL)."""
        try:
            msg = parse(payload) if payload else None
        except WireError:
            return
        if isinstance(msg, Checkpoint) and topics.checkpoint(msg.policy) == topic:
            self.checkpoints[msg.policy] = msg.ref()
            self._arrived.set()

    # --- what the trainer sends ----------------------------------------------------

    def send(self, request: MatchRequest) -> None:
        """One match request out (the ledger's ``publish``: asks, resends, asks ``again``)."""
        self.bus.publish(topics.CONTROL_MATCHES, request)

    def connected(self) -> bool:
        return self.bus.connected.is_set()

    async def request(
        self, requests: Sequence[Request], window: int | None = None, timeout_s: float = 600.0
    ) -> None:
        """Ask the referees (shared subscription) to play these matches; acks come to our inbox.

        With ``window``, at most that many of them are in flight (sent, no
        episode yet): a step of 128 matches does not queue 128 decisions on an
        agent that batches 32 well, and a stalled stack stops being fed.
        """
        sent: list[str] = []
        for r in requests:
            if window is not None:
                await self._until(
                    lambda: len(self.store.missing_episodes(sent)) < window, timeout_s
                )
            await self.bus.publish(
                topics.CONTROL_MATCHES, MatchRequest(match=r.match, spec=r.spec, reply_to=self.me)
            )
            sent.append(r.match)

    async def announce(self, ref: AdapterRef, *, current: bool = True) -> None:
        """Announce a version (retained on its own topic), and with ``current`` make it the
        retained checkpoint of its policy.

        ``local`` agents load the adapter a match names only if it was announced
        (``backroom.agents.local_model``): the checkpoint topic keeps the latest version
        alone, and the agent buffer's opponents are older ones. The version goes
        first, so an agent never holds a checkpoint it has not seen announced.
        """
        msg = Checkpoint(
            policy=ref.policy, version=ref.version, uri=ref.uri, sha256=ref.sha256, size=ref.size
        )
        await self.bus.publish(topics.model_version(ref.policy, ref.version), msg, retain=True)
        if current:
            await self.bus.publish(topics.checkpoint(ref.policy), msg, retain=True)

    async def retract(self, ref: AdapterRef) -> None:
        """Delete a version's retained announcement once the agent buffer has let it go.

        Every ``local`` agent reads all of them when it starts: kept for ever, a run of N
        steps left N+1. An agent that read it keeps it (it was the trainer's); no match
        the trainer asks for names it again.
        """
        await self.bus.publish(topics.model_version(ref.policy, ref.version), b"", retain=True)

    # --- waiting ---------------------------------------------------------------------

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(left, 1.0))
        return True

    async def current_of(self, policies: Sequence[str], timeout_s: float) -> dict[str, AdapterRef]:
        """The followed policies' current checkpoints, waiting for the first of each;
        ``TimeoutError`` naming those no trainer announced in time."""
        await self._until(lambda: all(p in self.checkpoints for p in policies), timeout_s)
        if missing := sorted(set(policies) - set(self.checkpoints)):
            raise TimeoutError(f"no checkpoint of policies {missing} within {timeout_s:.0f} s")
        return {p: self.checkpoints[p] for p in policies}

    async def wait_online(self, agents: Sequence[str], timeout_s: float) -> list[str]:
        """Wait until every agent's status says online, renewed in time; return those still missing."""
        await self._until(lambda: not self.presence.missing(agents), timeout_s)
        return self.presence.missing(agents)

    async def wait_episodes(self, matches: Sequence[str], timeout_s: float) -> list[str]:
        """Wait until the store holds an episode for every match; return the missing ones."""
        wanted = list(matches)
        await self._until(lambda: not self.store.missing_episodes(wanted), timeout_s)
        return self.store.missing_episodes(wanted)

    async def wait_traces(self, matches: Sequence[str], timeout_s: float) -> int:
        """Traces travel on the agents' connections and may trail their episode: wait a little
        for the trained seats' traces; return how many are still missing (``join`` drops them)."""
        wanted = list(matches)
        await self._until(lambda: not self.store.missing_traces(wanted), timeout_s)
        return len(self.store.missing_traces(wanted))
