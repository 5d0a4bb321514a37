"""``backroom web``: people play and watch matches from a browser.

One page (``web_static/index.html``, plain HTML and JavaScript, no build step)
talks JSON over a WebSocket to this server, which bridges it to the bus:

* **Play.** A person joins as an agent identity. The server opens one MQTT
  connection *as that identity* (its username and password) for the seat,
  relays what arrives in that inbox to the browser, and publishes the
  browser's actions and chat to that outbox. So the broker's ACL holds for
  people exactly as for programs: a person sees what the referee sends that
  seat and nothing more, and can act only in that seat's name. The server
  adds no knowledge of its own: it never reads another inbox.
* **Watch.** An ``observer`` identity of the server subscribes to
  ``matches/+/public``; a spectator sees those public events only (who sat
  where, the moves, table talk, the final returns) — no cards, no private
  channels.

Authentication (what identity a browser may use) has two forms:

1. **Password**: the person types the agent id and its password (printed by
   ``backroom credentials add ID``). The server keeps no list: the broker
   accepts or refuses the login.
2. **Token** (only when started with the broker's credentials directory): the
   server prints a link with a random token; whoever holds it may join as any
   identity of role ``agent`` in that directory (never a referee, runner,
   trainer or observer) without typing its password. Meant for a room of
   trusted people around one organiser. The token travels in the URL
   fragment, which browsers do not send in requests or log.

One browser per seat: the first to join an identity holds it, and gets a seat
key (the page keeps it in ``localStorage``). Another browser is refused, even
with the token or the password, so a link passed around a room cannot take a
seat someone is playing (and see its card); tabs of the holding browser
present the key and share the one connection. The hold ends at once when the
holder leaves; when its last socket drops (a reload, a network blip) the seat
and its connection stay held for ``linger_s``, so that only the holder's key
gets it back, with the current match replayed (the link alone would replay
that seat's private cards to whoever used it first); after that the seat is free. An identity
already online from another process (a scripted agent, say) is refused, since
two connections with one identity would throw each other off the broker. An
``online`` status counts only while renewed (``backroom.bus.presence``): one
left retained by a process that died without its will stops blocking the seat
after a few missed renewals.

Exposure (``gate.py``): a socket whose ``Origin`` is not this server's own
host, nor one listed (``allowed_origins``, ``BACKROOM_WEB_ORIGINS``), is
refused before it is accepted; failed passwords and tokens are counted per
client address, and after ``login_limit`` of them that address waits longer
after each further one. ``access.py``: with an access token (the replay
beyond loopback) every request must carry it; sockets without one are capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from backroom import metrics
from backroom.bus import presence, topics
from backroom.bus.addressing import Referees
from backroom.bus.auth import ID_PATTERN, CredentialStore
from backroom.bus.broker import reload_broker
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
from backroom.human.access import MAX_ANONYMOUS_SOCKETS, AccessGate
from backroom.human.gate import (
    HOSTS_ENV,
    LOOPBACK_HOSTS,
    ORIGINS_ENV,
    LockedOut,
    LoginGuard,
    host_allowed,
    origin_allowed,
    parse_hosts,
    parse_origins,
)
from backroom.human.league_page import league_routes
from backroom.human.parse import offered
from backroom.human.render import rules_for
from backroom.replay.routes import replay_routes

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.websockets import WebSocket

    from backroom.replay.index import ReplayIndex

log = logging.getLogger("backroom.web")

STATIC = Path(__file__).with_name("web_static")
#: The identity (role observer) ``backroom web --credentials DIR`` creates to watch public events.
OBSERVER_ID = "web-observer"
#: Kind in the status messages of identities played from a browser.
KIND = "human-web"
MAX_MATCHES = 200  # public match summaries kept for the lobby
MAX_EVENTS = 500  # public events kept per match, for spectators who arrive late
MAX_SEAT_MATCHES = 5  # matches whose inbox messages a seat keeps for a reload
MAX_WS_BYTES = 256 * 1024
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


def web_app(  # noqa: C901, PLR0915 (the routes are closures over one app's state; each route is short)
    broker_url: str,
    credentials_dir: str | Path | None = None,
    *,
    token: str | None = None,
    observer: BusConfig | None = None,
    linger_s: float = 15.0,
    allowed_origins: Iterable[str] = (),
    login_limit: int = 5,
    login_backoff_s: float = 2.0,
    served_hosts: Iterable[str] | None = None,
    replay: ReplayIndex | None = None,
    leagues: Iterable[Path] = (),
    access_token: str | None = None,
    max_anonymous_sockets: int = MAX_ANONYMOUS_SOCKETS,
) -> Starlette:
    """The Starlette app: ``/`` the page, ``/ws`` the bridge, ``/api/matches`` the lobby as JSON.

    ``credentials_dir`` enables token logins (with ``token``) and supplies an
    observer identity when ``observer`` is not given (``web-observer``, or any
    identity of role observer in the directory). Without an observer identity
    the page can play but not spectate.

    ``allowed_origins`` (``https://play.example.org``): pages besides this
    server's own that may open the WebSocket, such as the public address of a
    reverse proxy that rewrites ``Host``. ``login_limit`` failed sign-ins from
    one address are free; each one after locks the address out for
    ``login_backoff_s``, doubling (``gate.LoginGuard``). The address is the
    socket's peer as the ASGI server reports it: ``web_command`` lets uvicorn
    read ``X-Forwarded-For`` only from the proxies it is told to trust.

    ``served_hosts`` (``gate.parse_hosts`` entries; default: the loopback
    names) and the hosts of ``allowed_origins``: the ``Host`` every request
    must name, else it gets 400 (a rebound DNS name, ``gate.host_allowed``).

    ``replay``: a run's index, served at ``/replay`` (``backroom replay``).

    ``access_token``: every request and socket must carry it (``access.AccessGate``:
    what ``backroom replay`` beyond loopback asks); sockets without it are
    capped at ``max_anonymous_sockets`` at once.
    """
    from pydantic import ValidationError
    from starlette.applications import Starlette
    from starlette.datastructures import Headers
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route, WebSocketRoute
    from starlette.types import ASGIApp, Receive, Scope, Send
    from starlette.websockets import WebSocketDisconnect

    store = CredentialStore(credentials_dir) if credentials_dir is not None else None
    if observer is None and store is not None:
        creds = store.load()
        pick = creds.get(OBSERVER_ID) or next(
            (c for c in creds.values() if c.role == "observer"), None
        )
        if pick is not None and pick.role == "observer":
            observer = BusConfig.from_url(
                broker_url, username=pick.username, password=pick.password
            )
    origins = parse_origins(",".join(allowed_origins))
    served = [
        *parse_hosts(",".join(LOOPBACK_HOSTS if served_hosts is None else served_hosts)),
        *(urlsplit(o).hostname or "" for o in origins),  # a listed proxy's name, on any port
    ]
    guard = LoginGuard(limit=login_limit, base_s=login_backoff_s)
    hub = WebHub(
        broker_url, store=store, token=token, observer=observer, linger_s=linger_s, guard=guard
    )
    page = (STATIC / "index.html").read_text()
    headers = {
        "Cache-Control": "no-store",
        "Content-Security-Policy": (
            "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self' ws: wss:; img-src 'self' data:"
        ),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    async def index(_request: Request) -> Response:
        return HTMLResponse(page, headers=headers)

    async def matches(_request: Request) -> Response:
        return JSONResponse(list(reversed(hub.matches.values())))

    async def health(_request: Request) -> Response:
        return JSONResponse(
            {"ok": True, "seats": sorted(hub.seats), "spectate": hub.observer_bus is not None}
        )

    async def ws_endpoint(ws: WebSocket) -> None:
        origin = ws.headers.get("origin")
        if not origin_allowed(origin, ws.headers.get("host"), origins):
            # Another site's page, in a person's browser: it could play, spectate and
            # guess passwords with that browser's network position. Refused unaccepted.
            metrics.WEB_REFUSED.labels(reason="origin").inc()
            log.warning(
                "refused a WebSocket from origin %r (host %r)", origin, ws.headers.get("host")
            )
            detail = (
                f"origin {origin} may not connect to this server; "
                f"list it in {ORIGINS_ENV} if it is a proxy in front of it"
            )
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(PlainTextResponse(detail, status_code=403))
            else:
                await ws.close(code=1008, reason=detail[:120])
            return
        await ws.accept()
        client = Client(ws)
        hub.clients.add(client)
        writer = asyncio.create_task(client.writer())
        client.push(hub.hello())
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                raw = message.get("text")
                req: Any = None
                if raw is None:
                    client.push({"op": "error", "detail": "send JSON in text frames"})
                    continue
                try:
                    req = json.loads(raw)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                    await hub.handle(client, req)
                except (JoinError, ValueError, ValidationError) as exc:
                    detail = (
                        exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                    )
                    client.push(
                        {
                            "op": "error",
                            "detail": detail,
                            "ref": req.get("op") if isinstance(req, dict) else None,
                        }
                    )
                except BusError as exc:
                    client.push({"op": "error", "detail": f"bus: {exc}"})
        except WebSocketDisconnect:  # a disconnect while sending
            pass
        finally:
            hub.clients.discard(client)
            hub.leave(client, release=False)  # a dropped socket: the holder may come back
            writer.cancel()

    class OnlyServedHosts:
        """Refuse (400) any request, socket or page, whose ``Host`` this server does not serve."""

        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] in ("http", "websocket"):
                host = Headers(scope=scope).get("host")
                if not host_allowed(host, served):
                    metrics.WEB_REFUSED.labels(reason="host").inc()
                    log.warning("refused a request for host %r (%s)", host, scope["path"])
                    detail = f"this server does not serve host {host!r}; list it in {HOSTS_ENV}"
                    await PlainTextResponse(detail, status_code=400)(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> Any:
        await hub.start()
        try:
            yield
        finally:
            await hub.stop()

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/matches", matches),
            Route("/healthz", health),
            WebSocketRoute("/ws", ws_endpoint),
            *(replay_routes(replay, hub) if replay is not None else []),
            *league_routes(list(leagues), headers),  # /league: human/league_page.py
        ],
        middleware=[
            Middleware(OnlyServedHosts),
            Middleware(AccessGate, token=access_token, max_anonymous=max_anonymous_sockets),
        ],
        lifespan=lifespan,
    )
    app.state.hub = hub
    return app


#: Environment variable: addresses of reverse proxies whose ``X-Forwarded-For`` is believed
#: (comma separated, as uvicorn's ``forwarded_allow_ips``); unset, no forwarded header is.
TRUSTED_PROXIES_ENV = "BACKROOM_WEB_TRUSTED_PROXIES"
_ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


def served_names(host: str, hosts: str | None) -> list[str]:
    """What ``backroom web`` answers to: the loopback names, the bind host and ``hosts``.

    Names match on any port: a published port may differ from the bound one
    (compose maps it), and the DNS-rebinding attack is told apart by its name.
    """
    bind = [] if host in _ANY_ADDRESS else [host]
    return parse_hosts(",".join([*LOOPBACK_HOSTS, *bind, hosts or ""]))


def server_config(app: Starlette, host: str, port: int, trusted_proxies: str | None = None) -> Any:
    """uvicorn's settings for ``app``: proxy headers believed only from ``trusted_proxies``.

    uvicorn's default trusts ``X-Forwarded-For`` from 127.0.0.1, so any local
    process (or a proxy that passes the header through) could name a new
    client address per guess and never be locked out (``gate.LoginGuard``).
    """
    import uvicorn

    trusted = [a.strip() for a in (trusted_proxies or "").split(",") if a.strip()]
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        ws_max_size=MAX_WS_BYTES,
        lifespan="on",
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
    )


def web_command(
    broker: str,
    host: str,
    port: int,
    credentials: Path | None,
    origins: str | None = None,
    hosts: str | None = None,
    trusted_proxies: str | None = None,
    replay: ReplayIndex | None = None,
    leagues: Iterable[Path] = (),
    access_token: str | None = None,
) -> None:
    """Serve the page until Ctrl-C (what ``backroom web`` runs; ``backroom replay`` with ``replay``).

    With ``credentials`` (the broker's credentials directory) the server adds
    the ``web-observer`` identity for spectating and prints a token link for
    players (``BACKROOM_WEB_TOKEN`` fixes the token). Without it, spectating
    uses ``BACKROOM_USERNAME``/``BACKROOM_PASSWORD`` when set (an identity of
    role observer), and players type their agent's password. ``origins``
    (default ``BACKROOM_WEB_ORIGINS``): comma-separated origins, besides the
    server's own, whose pages may connect (a reverse proxy's public address).
    ``hosts`` (default ``BACKROOM_WEB_HOSTS``): names besides the loopback ones
    and ``host`` that requests may be addressed to (``served_names``).
    ``trusted_proxies`` (default ``BACKROOM_WEB_TRUSTED_PROXIES``): proxy
    addresses whose ``X-Forwarded-For`` names the client; none by default.
    ``access_token``: asked of every request (``access.AccessGate``).
    """
    import uvicorn

    from backroom.bus.client import run

    observer: BusConfig | None = None
    token: str | None = None
    if credentials is not None:
        cred = CredentialStore(credentials).add(OBSERVER_ID, role="observer")
        # the observer connects later, once the page is served; the bus retries until
        # the broker has reread its files
        reload_broker(credentials)
        observer = BusConfig.from_url(broker, username=cred.username, password=cred.password)
        token = os.environ.get("BACKROOM_WEB_TOKEN") or secrets.token_urlsafe(18)
    elif os.environ.get("BACKROOM_USERNAME") and os.environ.get("BACKROOM_PASSWORD"):
        observer = BusConfig.from_url(
            broker,
            username=os.environ["BACKROOM_USERNAME"],
            password=os.environ["BACKROOM_PASSWORD"],
        )
    allowed = parse_origins(origins if origins is not None else os.environ.get(ORIGINS_ENV))
    served = served_names(host, hosts if hosts is not None else os.environ.get(HOSTS_ENV))
    proxies = (
        trusted_proxies if trusted_proxies is not None else os.environ.get(TRUSTED_PROXIES_ENV)
    )
    app = web_app(
        broker,
        credentials,
        token=token,
        observer=observer,
        allowed_origins=allowed,
        served_hosts=served,
        replay=replay,
        leagues=leagues,
        access_token=access_token,
    )
    url = f"http://{host}:{port}/"
    print(f"backroom web: {url}  (broker {broker})")
    if access_token:  # beyond loopback with a replay: every request carries it (then a cookie)
        print(f"  access token asked of every request: open {url}?token={access_token}")
    if token:
        print(f"  players: open {url}#token={token} and enter an agent id of {credentials}")
    print("  or enter an agent id and its password (`backroom credentials add ID` prints it)")
    if leagues:
        print(f"  league standings: {url}league")
    if allowed:
        print(f"  pages of {', '.join(allowed)} may connect too ({ORIGINS_ENV})")
    if observer is None:
        print(
            "  spectating is off: no observer identity (pass --credentials, or BACKROOM_USERNAME/PASSWORD)"
        )
    if host in _ANY_ADDRESS:
        print(f"  answers to {', '.join(served)} only: other names go in {HOSTS_ENV}")
    if proxies:
        print(f"  X-Forwarded-For believed from {proxies} ({TRUSTED_PROXIES_ENV})")
    run(uvicorn.Server(server_config(app, host, port, proxies)).serve())
