"""The state every browser of ``backroom web`` shares: seats played from a browser, public events.

A seat (``SeatSession``) is one agent identity played from a browser, with its
own MQTT connection *as that identity*, shared by the browser's tabs; the
``WebHub`` holds the seats, their holds and lingering (``web.py``'s docstring:
one browser per seat) and the observer's view of public events, and answers
each browser's requests (``WebHub.handle``). The routes and guards around it
are ``web.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.addressing import Referees
from backroom.bus.auth import ID_PATTERN, CredentialStore
from backroom.bus.client import Bus, BusConfig, BusError, Will
from backroom.bus.errors import LoginRefused
from backroom.bus.wire import (
    MATCH_ID,
    Action,
    Chat,
    Envelope,
    Event,
    MatchStart,
    Status,
    Turn,
    WireError,
    dump,
    parse,
    parse_all,
)
from backroom.human.gate import LockedOut, LoginGuard
from backroom.human.parse import offered
from backroom.human.render import rules_for

if TYPE_CHECKING:
    from starlette.websockets import WebSocket

log = logging.getLogger("backroom.web")

#: Kind in the status messages of identities played from a browser.
KIND = "human-web"
MAX_MATCHES = 200  # public match summaries kept for the lobby
MAX_EVENTS = 500  # public events kept per match, for spectators who arrive late
MAX_SEAT_MATCHES = 5  # matches whose inbox messages a seat keeps for a reload
_MATCH_RE = re.compile(MATCH_ID)


class JoinError(Exception):
    """A browser may not join as that identity; the text is shown to the person."""


class WrongSecret(JoinError):
    """A wrong password or token: counted against the client's address (``LoginGuard``)."""


class Client:
    """One browser WebSocket. Bus callbacks must not await, so they push into a queue a writer drains."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        #: Where the socket comes from, for counting failed sign-ins (behind a proxy on
        #: this machine, uvicorn's proxy headers make it the browser's address).
        self.address = ws.client.host if ws.client is not None else "unknown"
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=2000)
        self.seat: SeatSession | None = None
        self.watching: str | None = None

    def push(self, msg: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:  # a stuck browser: drop the oldest, never block the bus
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
            self.queue.put_nowait(msg)

    async def writer(self) -> None:
        try:
            while True:
                msg = await self.queue.get()
                await self.ws.send_text(json.dumps(msg))
        except Exception:  # the browser went away; the reader side cleans up
            return


class SeatSession:
    """One agent identity played from the browser: its own MQTT connection, shared by its tabs."""

    def __init__(self, hub: WebHub, config: BusConfig) -> None:
        assert config.username is not None
        self.hub = hub
        self.agent: str = config.username
        self.config = config
        self.bus: Bus | None = None
        self.clients: set[Client] = set()
        #: match -> (arrival time, the inbox message, what the server adds for the page)
        self.log: OrderedDict[str, list[tuple[float, dict[str, Any], dict[str, Any]]]] = (
            OrderedDict()
        )
        self.answered: set[tuple[str | None, int | None]] = set()
        self.referees = Referees()  # match -> the referee whose outbox its moves go to
        self.seq = 0
        self.linger: asyncio.TimerHandle | None = None
        #: The holding browser's seat key while any of its tabs is attached; None: free.
        self.key: str | None = None

    async def open(self) -> None:
        offline = Status(state="offline", kind=KIND)
        self.bus = Bus(
            self.config,
            will=Will(topics.status(self.agent), dump(offline)),
            on_connect=[self._announce],
            role="web",
        )
        # Subscribed before connecting, so the inbox subscription exists before the
        # on-connect hook announces "online" (a referee may send the moment it sees that).
        await self.bus.subscribe(topics.inbox(self.agent), self._on_inbox)
        await self.bus.open()

    async def _announce(self) -> None:
        assert self.bus is not None
        await self.bus.publish(
            topics.status(self.agent), Status(state="online", kind=KIND), retain=True
        )

    async def close(self) -> None:
        if self.bus is None:
            return
        if self.bus.connected.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.bus.publish(
                        topics.status(self.agent), Status(state="offline", kind=KIND), retain=True
                    ),
                    2,
                )
        await self.bus.close()
        self.bus = None

    def _on_inbox(self, _topic: str, payload: bytes) -> None:
        try:
            msg = parse(payload)
        except WireError as exc:
            log.warning("%s: unreadable inbox message: %s", self.agent, exc)
            return
        self.referees.note(msg)
        data = msg.model_dump(mode="json")
        extra = for_person(msg)
        key = msg.match or ""
        entries = self.log.setdefault(key, [])
        self.log.move_to_end(key)
        entries.append((time.time(), data, extra))
        del entries[:-1000]
        while len(self.log) > MAX_SEAT_MATCHES:
            self.log.popitem(last=False)
        for client in self.clients:
            client.push({"op": "inbox", "msg": data, "age": 0.0, **extra})

    def replay(self, client: Client) -> None:
        """What a newly attached tab needs to draw the current match; stale turns left out."""
        now = time.time()
        for match, entries in self.log.items():
            for t, data, extra in entries:
                if data.get("type") == "turn" and (
                    (match, data.get("turn")) in self.answered
                    or now - t >= float(data.get("deadline_s", 0))
                ):
                    continue
                client.push({"op": "inbox", "msg": data, "age": now - t, **extra})

    async def send(self, msg: Action | Chat) -> None:
        if self.bus is None:
            raise JoinError("this seat is not connected")
        self.seq += 1
        msg.seq = self.seq
        await self.bus.publish(self.referees.outbox(self.agent, msg.match), msg)
        if msg.turn is not None:
            self.answered.add((msg.match, msg.turn))


def for_person(msg: Envelope) -> dict[str, Any]:
    """What the page needs besides the wire message, made here so both front ends agree.

    ``rules`` with a match's start (``render.rules_for``, the terminal's text),
    ``legal`` with a turn (``parse.offered``: the moves as a person is offered
    them, which the page's buttons and number keys use). The message itself
    is relayed unchanged.
    """
    if isinstance(msg, MatchStart):
        return {"rules": rules_for(msg)}
    if isinstance(msg, Turn) and msg.phase == "act":
        return {"legal": offered(msg.legal, msg.observation)}
    return {}


class WebHub:
    """State shared by every browser: seat sessions, the observer's view of public events."""

    def __init__(
        self,
        broker_url: str,
        store: CredentialStore | None = None,
        token: str | None = None,
        observer: BusConfig | None = None,
        linger_s: float = 15.0,
        guard: LoginGuard | None = None,
        default_heartbeat_s: float = presence.STATUS_REFRESH_S,
    ) -> None:
        self.broker = BusConfig.from_url(broker_url)
        #: Who is online, an ``online`` good while renewed; statuses that declare no renewal
        #: period are held to ``default_heartbeat_s`` (``presence.Roster``).
        self.presence = presence.Roster(default_heartbeat_s)
        self.store = store
        self.token = token if store is not None else None
        self.observer = observer
        self.linger_s = linger_s
        self.guard = guard or LoginGuard()
        self.observer_bus: Bus | None = None
        self.seats: dict[str, SeatSession] = {}
        self.clients: set[Client] = set()
        self.matches: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.events: dict[str, deque[tuple[float, dict[str, Any]]]] = {}
        self._join_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.observer is None:
            return
        # A broker rereads its password file some moments after the SIGHUP that
        # ``web_command`` sent for a new observer identity: a refused first login
        # is retried for a few seconds before it counts.
        for attempt in range(20):
            bus = Bus(self.observer, role="web")
            await bus.subscribe(topics.ALL_PUBLIC, self._on_public)
            await bus.subscribe(topics.ALL_STATUS, self._on_status)
            try:
                await bus.open()
            except LoginRefused:
                if attempt == 19:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            self.observer_bus = bus
            return

    async def stop(self) -> None:
        for session in list(self.seats.values()):
            await session.close()
        self.seats.clear()
        if self.observer_bus is not None:
            await self.observer_bus.close()

    def hello(self) -> dict[str, Any]:
        return {
            "op": "hello",
            "spectate": self.observer_bus is not None,
            "token_login": self.token is not None,
            "matches": list(reversed(self.matches.values())),
        }

    # --- public events (spectators) ------------------------------------------------------------------

    def _on_public(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if len(parts) != 5:
            return
        for msg in parse_all(payload):  # the referee batches a match's public events
            if isinstance(msg, Event):
                self._public_event(parts[3], msg)

    def _public_event(self, match: str, msg: Event) -> None:
        data = msg.model_dump(mode="json")
        now = time.time()
        self.events.setdefault(match, deque(maxlen=MAX_EVENTS)).append((now, data))
        summary = self.matches.setdefault(match, {"match": match, "state": "running", "moves": 0})
        self.matches.move_to_end(match)
        if msg.kind == "started":
            summary.update(
                game=msg.data.get("game"), seats=msg.data.get("seats", []), started=msg.ts
            )
        elif msg.kind == "moved":
            summary["moves"] = summary.get("moves", 0) + 1
        elif msg.kind == "ended":
            summary.update(
                state="ended", reason=msg.data.get("reason"), returns=msg.data.get("returns")
            )
        while len(self.matches) > MAX_MATCHES:
            old, _ = self.matches.popitem(last=False)
            self.events.pop(old, None)
        for client in self.clients:
            if client.watching == match:
                client.push({"op": "public", "match": match, "event": data, "age": 0.0})
            if msg.kind in ("started", "ended"):
                client.push({"op": "match", "match": summary})

    def _on_status(self, topic: str, payload: bytes) -> None:
        self.presence.see(topic, payload)

    def spectate(self, client: Client, match: str) -> None:
        if self.observer_bus is None:
            raise JoinError(
                "this server has no observer identity, so it cannot show public events; "
                "start it with --credentials DIR, or BACKROOM_USERNAME/BACKROOM_PASSWORD of an observer"
            )
        if not _MATCH_RE.match(match):
            raise JoinError(f"{match!r} is not a match id")
        client.watching = match
        client.push({"op": "spectating", "match": match, "summary": self.matches.get(match)})
        now = time.time()
        for t, data in self.events.get(match, ()):
            client.push({"op": "public", "match": match, "event": data, "age": now - t})

    # --- seats (players) -----------------------------------------------------------------------------

    def credentials_for(self, agent: str, password: str | None, token: str | None) -> BusConfig:
        """Which login to use for ``agent``: the typed password, or the store's when the token is right."""
        if not ID_PATTERN.match(agent or ""):
            raise JoinError("an agent id is 1-64 letters, digits, '_', '.' or '-'")
        if token:
            if (
                self.token is None
                or self.store is None
                or not hmac.compare_digest(token.encode(), self.token.encode())
            ):
                raise WrongSecret(
                    "this link's token is not valid here; type the agent's password instead"
                )
            cred = self.store.load().get(agent)
            if cred is None or cred.role != "agent":
                raise JoinError(f"{agent!r} is not an agent identity on this broker")
            password = cred.password
        if not password:
            raise JoinError("type the agent's password (from `backroom credentials add`)")
        return BusConfig(
            host=self.broker.host, port=self.broker.port, username=agent, password=password
        )

    async def join(
        self,
        client: Client,
        agent: str,
        password: str | None,
        token: str | None,
        key: str | None = None,
    ) -> SeatSession:
        """Attach ``client`` to ``agent``'s seat, opening its connection if need be.

        In order: the address's lockout (before any secret is looked at), the
        token or password (a wrong one counts against the address), then the
        hold: a seat attached to another browser is refused unless ``key`` is
        that browser's seat key.
        """
        try:
            self.guard.check(client.address)
        except LockedOut as exc:
            metrics.WEB_REFUSED.labels(reason="locked_out").inc()
            raise JoinError(str(exc)) from None
        try:
            return await self._join(client, agent, password, token, key)
        except WrongSecret:
            self.guard.failed(client.address)
            raise

    async def _join(
        self, client: Client, agent: str, password: str | None, token: str | None, key: str | None
    ) -> SeatSession:
        config = self.credentials_for(agent, password, token)
        async with self._join_lock:
            self.leave(client)
            session = self.seats.get(agent)
            if session is not None:
                if not hmac.compare_digest(
                    (session.config.password or "").encode(), (config.password or "").encode()
                ):
                    raise WrongSecret(f"wrong password for {agent!r}")
                if session.key is not None and not (
                    key and hmac.compare_digest(key.encode(), session.key.encode())
                ):
                    metrics.WEB_REFUSED.labels(reason="seat_held").inc()
                    raise JoinError(
                        f"{agent!r} is being played from another browser; the seat is free "
                        f"again once that browser leaves it, or {self.linger_s:g} s after it "
                        "closes its page"
                    )
            else:
                kind = self.presence.kind(agent)
                if self.presence.is_online(agent) and kind != KIND:
                    raise JoinError(
                        f"{agent!r} is already online (kind {kind or 'unknown'}); stop that process first: "
                        "one identity can hold only one connection"
                    )
                session = SeatSession(self, config)
                try:
                    await session.open()
                except LoginRefused:
                    await session.close()
                    raise WrongSecret(f"the broker refused {agent!r} with that password") from None
                except BusError as exc:
                    await session.close()
                    raise JoinError(f"could not connect as {agent!r}: {exc}") from None
                self.seats[agent] = session
            if session.linger is not None:
                session.linger.cancel()
                session.linger = None
            if session.key is None:  # a new hold: this browser's key, for its other tabs
                session.key = secrets.token_urlsafe(18)
            session.clients.add(client)
            client.seat = session
            return session

    def leave(self, client: Client, release: bool = True) -> None:
        """Detach ``client`` from its seat; ``release=False`` (its socket dropped) keeps the hold.

        A seat whose last tab is gone lingers ``linger_s``: released, anyone may
        take it meanwhile; held, only the holder's seat key may (a reload).
        """
        session, client.seat = client.seat, None
        if session is None:
            return
        session.clients.discard(client)
        if not session.clients and release:
            session.key = None  # the holder let go: the seat is free
        if not session.clients and session.linger is None:
            # Keep the seat a little: a page reload should not drop the person out of a match.
            loop = asyncio.get_running_loop()
            session.linger = loop.call_later(self.linger_s, self._spawn_expire, session)

    def _spawn_expire(self, session: SeatSession) -> None:
        task = asyncio.get_running_loop().create_task(self._expire(session))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire(self, session: SeatSession) -> None:
        async with self._join_lock:
            if session.clients or self.seats.get(session.agent) is not session:
                return
            del self.seats[session.agent]
        await session.close()

    # --- one browser ------------------------------------------------------------------------------------

    async def handle(self, client: Client, req: dict[str, Any]) -> None:
        """One request from a browser; errors go back to it as ``{"op": "error"}``."""
        op = req.get("op")
        if op == "join":
            password, token, key = req.get("password"), req.get("token"), req.get("key")
            session = await self.join(
                client,
                str(req.get("agent", "")),
                None if password is None else str(password),
                None if token is None else str(token),
                None if key is None else str(key),
            )
            client.push({"op": "joined", "agent": session.agent, "key": session.key})
            session.replay(client)
        elif op == "leave":
            self.leave(client)
            client.push({"op": "left"})
        elif op == "spectate":
            self.spectate(client, str(req.get("match", "")))
        elif op == "unspectate":
            client.watching = None
        elif op == "matches":
            client.push({"op": "matches", "matches": list(reversed(self.matches.values()))})
        elif op in ("action", "chat"):
            seat = client.seat
            if seat is None:
                raise JoinError("join a seat first")
            fields = {k: req.get(k) for k in ("match", "turn", "seat")}
            msg: Action | Chat
            if op == "action":
                msg = Action.model_validate({**fields, "action": req.get("action")})
            else:
                msg = Chat.model_validate(
                    {
                        **fields,
                        "channel": str(req.get("channel", "")),
                        "text": str(req.get("text", "")),
                    }
                )
            await seat.send(msg)
            client.push({"op": "sent", "what": op, "match": msg.match, "turn": msg.turn})
        else:
            raise JoinError(f"unknown request {op!r}")
