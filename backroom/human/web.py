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

One browser per seat (``web_hub.py``: the seats and public events every
browser shares): the first to join an identity holds it, and gets a seat
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
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from backroom import metrics
from backroom.bus.auth import CredentialStore
from backroom.bus.broker import reload_broker
from backroom.bus.client import BusConfig, BusError
from backroom.human.access import MAX_ANONYMOUS_SOCKETS, AccessGate
from backroom.human.gate import (
    HOSTS_ENV,
    LOOPBACK_HOSTS,
    ORIGINS_ENV,
    LoginGuard,
    host_allowed,
    origin_allowed,
    parse_hosts,
    parse_origins,
)
from backroom.human.league_page import league_routes
from backroom.human.web_hub import Client, JoinError, WebHub
from backroom.replay.routes import replay_routes

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send
    from starlette.websockets import WebSocket

    from backroom.replay.index import ReplayIndex

log = logging.getLogger("backroom.web")

STATIC = Path(__file__).with_name("web_static")
#: The identity (role observer) ``backroom web --credentials DIR`` creates to watch public events.
OBSERVER_ID = "web-observer"
MAX_WS_BYTES = 256 * 1024
#: What the page is served with: never cached, its scripts and sockets its own only.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self' ws: wss:; img-src 'self' data:"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class Site:
    """The routes of one app, as methods over what they answer from: the hub, the page, the origins.

    One object, so each route is a short method a reader finds by its name
    (``web_app`` lists them) rather than a closure inside the app's factory.
    """

    def __init__(self, hub: WebHub, page: str, origins: list[str]) -> None:
        self.hub = hub
        self.page = page
        self.origins = origins

    async def index(self, _request: Request) -> Response:
        from starlette.responses import HTMLResponse

        return HTMLResponse(self.page, headers=PAGE_HEADERS)

    async def matches(self, _request: Request) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse(list(reversed(self.hub.matches.values())))

    async def health(self, _request: Request) -> Response:
        from starlette.responses import JSONResponse

        hub = self.hub
        return JSONResponse(
            {"ok": True, "seats": sorted(hub.seats), "spectate": hub.observer_bus is not None}
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        await self.hub.start()
        try:
            yield
        finally:
            await self.hub.stop()

    async def socket(self, ws: WebSocket) -> None:
        """``/ws``: one browser's requests in, what its seat and spectating send out."""
        from starlette.websockets import WebSocketDisconnect

        origin = ws.headers.get("origin")
        if not origin_allowed(origin, ws.headers.get("host"), self.origins):
            await self._refuse(ws, origin)
            return
        await ws.accept()
        client = Client(ws)
        self.hub.clients.add(client)
        writer = asyncio.create_task(client.writer())
        client.push(self.hub.hello())
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self._request(client, message.get("text"))
        except WebSocketDisconnect:  # a disconnect while sending
            pass
        finally:
            self.hub.clients.discard(client)
            self.hub.leave(client, release=False)  # a dropped socket: the holder may come back
            writer.cancel()

    async def _refuse(self, ws: WebSocket, origin: str | None) -> None:
        """Another site's page, in a person's browser: it could play, spectate and guess
        passwords with that browser's network position. Refused unaccepted."""
        from starlette.responses import PlainTextResponse

        metrics.WEB_REFUSED.labels(reason="origin").inc()
        log.warning("refused a WebSocket from origin %r (host %r)", origin, ws.headers.get("host"))
        detail = (
            f"origin {origin} may not connect to this server; "
            f"list it in {ORIGINS_ENV} if it is a proxy in front of it"
        )
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(PlainTextResponse(detail, status_code=403))
        else:
            await ws.close(code=1008, reason=detail[:120])

    async def _request(self, client: Client, raw: str | None) -> None:
        """One text frame: a request handled, or its error sent back to the browser."""
        req: Any = None
        if raw is None:
            client.push({"op": "error", "detail": "send JSON in text frames"})
            return
        try:
            req = json.loads(raw)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
            await self.hub.handle(client, req)
        except (JoinError, ValueError, ValidationError) as exc:
            detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            client.push(
                {
                    "op": "error",
                    "detail": detail,
                    "ref": req.get("op") if isinstance(req, dict) else None,
                }
            )
        except BusError as exc:
            client.push({"op": "error", "detail": f"bus: {exc}"})


class OnlyServedHosts:
    """Refuse (400) any request, socket or page, whose ``Host`` this server does not serve."""

    def __init__(self, app: ASGIApp, served: list[str]) -> None:
        self.app = app
        self.served = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            from starlette.datastructures import Headers
            from starlette.responses import PlainTextResponse

            host = Headers(scope=scope).get("host")
            if not host_allowed(host, self.served):
                metrics.WEB_REFUSED.labels(reason="host").inc()
                log.warning("refused a request for host %r (%s)", host, scope["path"])
                detail = f"this server does not serve host {host!r}; list it in {HOSTS_ENV}"
                await PlainTextResponse(detail, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _observer_in(store: CredentialStore, broker_url: str) -> BusConfig | None:
    """The store's ``web-observer``, else any identity of role observer in it; None: none."""
    creds = store.load()
    pick = creds.get(OBSERVER_ID) or next((c for c in creds.values() if c.role == "observer"), None)
    if pick is None or pick.role != "observer":
        return None
    return BusConfig.from_url(broker_url, username=pick.username, password=pick.password)


def web_app(
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
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route, WebSocketRoute

    store = CredentialStore(credentials_dir) if credentials_dir is not None else None
    if observer is None and store is not None:
        observer = _observer_in(store, broker_url)
    origins = parse_origins(",".join(allowed_origins))
    served = [
        *parse_hosts(",".join(LOOPBACK_HOSTS if served_hosts is None else served_hosts)),
        *(urlsplit(o).hostname or "" for o in origins),  # a listed proxy's name, on any port
    ]
    guard = LoginGuard(limit=login_limit, base_s=login_backoff_s)
    hub = WebHub(
        broker_url, store=store, token=token, observer=observer, linger_s=linger_s, guard=guard
    )
    site = Site(hub, (STATIC / "index.html").read_text(), origins)
    app = Starlette(
        routes=[
            Route("/", site.index),
            Route("/api/matches", site.matches),
            Route("/healthz", site.health),
            WebSocketRoute("/ws", site.socket),
            *(replay_routes(replay, hub) if replay is not None else []),
            *league_routes(list(leagues), PAGE_HEADERS),  # /league: human/league_page.py
        ],
        middleware=[
            Middleware(OnlyServedHosts, served=served),
            Middleware(AccessGate, token=access_token, max_anonymous=max_anonymous_sockets),
        ],
        lifespan=site.lifespan,
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
