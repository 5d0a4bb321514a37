"""The access token of a replay served beyond loopback, and the cap on sockets that hold none.

``backroom replay`` shows every seat's private view (cards, prompts, private
channels). On a loopback address only people on this machine can reach it,
and ``gate.host_allowed`` keeps other sites' pages out; bound to any other
address, the ``Host`` header proves nothing (a script sends ``Host:
localhost``). So there the server prints a URL with a random token and
``AccessGate`` refuses every request, page, API and socket alike, that does
not carry it:

* ``?token=T`` on any page: checked, then answered with a redirect to the
  same URL without it and a cookie (``HttpOnly``, ``SameSite=Strict``), so the
  token leaves the address bar and history and the page's own requests and
  sockets carry the cookie;
* the cookie itself, or ``Authorization: Bearer T`` (scripts).

A request without it gets 401 (a wrong one 403), counted in
``backroom_web_refused_total{reason="token"}``. Sockets that carry no token
(every socket where no token is asked for, such as ``backroom web``'s
spectators and players before they sign in) are capped at ``max_anonymous``
at once: one more is refused before it is accepted and counted
(``reason="sockets"``), so a script cannot hold hundreds of them open.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from http.cookies import SimpleCookie
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode

from backroom import metrics

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("backroom.web")

#: Environment variable that fixes the replay's access token (default: a fresh random one).
TOKEN_ENV = "BACKROOM_REPLAY_TOKEN"
#: Sockets without the access token held open at once; one more is refused.
MAX_ANONYMOUS_SOCKETS = 64
_LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def cookie_name(port: int | None) -> str:
    """Per port, so two servers on one machine do not overwrite each other's cookie."""
    return f"backroom_access_{port or 0}"


class AccessGate:
    """ASGI middleware: the access token on every request (when one is set), the anonymous socket cap."""

    def __init__(
        self, app: ASGIApp, token: str | None, max_anonymous: int = MAX_ANONYMOUS_SOCKETS
    ) -> None:
        self.app = app
        self.token = token
        self.max_anonymous = max_anonymous
        self.anonymous = 0  # sockets open now that carry no token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        presented, from_query = self._presented(scope)
        if self.token is not None:
            if presented is None or not _same(presented, self.token):
                await self._refuse(scope, receive, send, wrong=presented is not None)
                return
            if from_query and scope["type"] == "http":
                await self._set_cookie(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http":
            await self.app(scope, receive, send)
            return
        if self.anonymous >= self.max_anonymous:
            metrics.WEB_REFUSED.labels(reason="sockets").inc()
            log.warning("refused a WebSocket: %d without a token are open", self.anonymous)
            await _deny(scope, receive, send, 503, "too many connections; try again later")
            return
        self.anonymous += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.anonymous -= 1

    @staticmethod
    def _presented(scope: Scope) -> tuple[str | None, bool]:
        """The token a request carries (query first, then header, then cookie), and whether in the query."""
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if "token" in query:
            return query["token"], True
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip(), False
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except Exception:  # a malformed cookie header is no token
            return None, False
        morsel = jar.get(cookie_name(_port(scope)))
        return (morsel.value if morsel is not None else None), False

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, wrong: bool) -> None:
        metrics.WEB_REFUSED.labels(reason="token").inc()
        log.warning("refused %s without the access token", scope["path"])
        detail = (
            "wrong access token"
            if wrong
            else "this server needs its access token: open the URL with ?token= it printed"
        )
        await _deny(scope, receive, send, 403 if wrong else 401, detail)

    async def _set_cookie(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.responses import RedirectResponse

        assert self.token is not None
        rest = [
            (k, v)
            for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"))
            if k != "token"
        ]
        target = scope["path"] + (f"?{urlencode(rest)}" if rest else "")
        response = RedirectResponse(target, status_code=303, headers={"Cache-Control": "no-store"})
        response.set_cookie(
            cookie_name(_port(scope)), self.token, httponly=True, samesite="strict", path="/"
        )
        await response(scope, receive, send)


def _same(presented: str, token: str) -> bool:
    """Constant-time comparison of bytes: ``compare_digest`` raises on a ``str`` that is not
    ASCII, and a request's token is whatever its sender typed (``?token=%C3%A9``: a 500)."""
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), token.encode())


def _port(scope: Scope) -> int | None:
    server = scope.get("server")
    return server[1] if server else None


async def _deny(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
    """An HTTP answer, or a socket refused before it is accepted (a denial response where supported)."""
    from starlette.responses import PlainTextResponse

    response = PlainTextResponse(detail, status_code=status)
    if scope["type"] == "http":
        await response(scope, receive, send)
        return
    from starlette.websockets import WebSocket

    ws = WebSocket(scope, receive, send)
    if "websocket.http.response" in scope.get("extensions", {}):
        await ws.send_denial_response(response)
    else:
        await ws.close(code=1008, reason=detail[:120])
