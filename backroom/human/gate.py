"""Who may open a socket to ``backroom web``, and how often an address may guess a secret.

Two guards of the browser front end, kept apart from its bus bridge so each
can be read (and tested) on its own:

* ``origin_allowed``: a browser sends ``Origin`` with every WebSocket
  handshake, and any page the person visits can open a socket to a server
  on their machine or network. Only the page this server serves (same host
  and port) or an origin the operator listed may connect, so another site
  cannot play, spectate or guess passwords through the person's browser.
  A client that sends no ``Origin`` is not a browser, hence not a vehicle for
  that attack; it is let through (scripts, the tests).
* ``host_allowed``: a page of another site can make the person's browser
  resolve its own name to this machine (DNS rebinding); it then sends that
  name as ``Host`` and its own origin, a pair the ``Origin`` check alone
  would take for this server's page. Every request (pages, ``/api``,
  ``/healthz``, the socket) must name a host this server serves
  (``served_hosts``: by default the loopback names; more with
  ``BACKROOM_WEB_HOSTS``).
* ``LoginGuard``: the join form takes a password or the room's token. After
  ``limit`` failed attempts from one client address, each further failure
  locks that address out for twice as long as the one before (``base_s``,
  then 2x, 4x ... up to ``max_s``), so guessing is slow however many sockets
  the guesser opens; failures are forgotten after ``forget_s`` quiet seconds.
  A success does not clear the count: a guesser holding one identity of its
  own must not reset its budget by signing in as that one in between.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Environment variable with extra allowed origins, comma separated (a reverse proxy's
#: public address, e.g. ``https://play.example.org``).
ORIGINS_ENV = "BACKROOM_WEB_ORIGINS"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
#: Environment variable with more host names the server answers to, comma separated
#: (``play.example.org``, ``192.168.1.5:8765``; a name without a port takes any port).
HOSTS_ENV = "BACKROOM_WEB_HOSTS"
#: Names every server answers to: this machine's loopback (a proxy or tunnel on it too).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _split_host(text: str) -> tuple[str, int | None] | None:
    """(lower-case name, port or None) of ``name``, ``name:port`` or ``[v6]:port``; None if malformed."""
    text = text.strip()
    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address
        text = f"[{text}]"
    try:
        parts = urlsplit(f"//{text}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.username is not None or parts.path or parts.query:
        return None
    return parts.hostname.lower().rstrip("."), port


def parse_hosts(text: str | None) -> list[str]:
    """Served names of a comma-separated list (``name`` or ``name:port``); a bad entry is an error."""
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        split = _split_host(item)
        if split is None:
            raise ValueError(f"{item.strip()!r} is not a host name such as play.example.org:443")
        name, port = split
        spelled = f"[{name}]" if ":" in name else name
        out.append(name if port is None else f"{spelled}:{port}")
    return out


def host_allowed(host: str | None, served: Iterable[str]) -> bool:
    """Whether a request whose ``Host`` header is ``host`` is for this server.

    ``served`` holds names from ``parse_hosts``: a bare name matches it on any
    port, ``name:port`` on that port only (a ``Host`` without a port is port 80).
    A request without ``Host``, or with a malformed one, is refused.
    """
    split = _split_host(host) if host else None
    if split is None:
        return False
    name, port = split
    for entry in served:
        want = _split_host(entry)
        if want is not None and want[0] == name and want[1] in (None, port or 80):
            return True
    return False


def normalize_origin(origin: str) -> str | None:
    """``scheme://host:port`` in lower case with the port spelled out; ``None`` if not http(s)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return f"{scheme}://{parts.hostname.lower()}:{port or _DEFAULT_PORTS[scheme]}"


def parse_origins(text: str | None) -> list[str]:
    """The allowed origins of a comma-separated list; an entry that is not an origin is an error."""
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        norm = normalize_origin(item)
        if norm is None:
            raise ValueError(f"{item.strip()!r} is not an origin such as https://play.example.org")
        out.append(norm)
    return out


def origin_allowed(origin: str | None, host: str | None, allowed: Iterable[str] = ()) -> bool:
    """Whether a WebSocket handshake with this ``Origin`` may go on.

    Allowed: no ``Origin`` at all (not a browser); an origin whose host and
    port are the ``Host`` the request was sent to (the page this server
    served); an origin in ``allowed`` (normalized, see ``parse_origins``).
    Refused: anything else, ``null`` (sandboxed frames, files) included.
    """
    if origin is None:
        return True
    norm = normalize_origin(origin)
    if norm is None:
        return False
    if norm in allowed:
        return True
    if not host:
        return False
    scheme = norm.split("://", 1)[0]
    return normalize_origin(f"{scheme}://{host}") == norm


@dataclass
class _Record:
    failures: int = 0
    last: float = 0.0  # time.monotonic() of the last failure
    until: float = 0.0  # locked out until then


class LoginGuard:
    """Failed sign-ins per client address, and the lockouts they earn (see the module)."""

    def __init__(
        self,
        limit: int = 5,
        base_s: float = 2.0,
        max_s: float = 300.0,
        forget_s: float = 900.0,
        max_addresses: int = 10_000,
    ) -> None:
        self.limit = limit
        self.base_s = base_s
        self.max_s = max_s
        self.forget_s = forget_s
        self.max_addresses = max_addresses
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def _record(self, address: str, now: float) -> _Record | None:
        rec = self._records.get(address)
        if rec is not None and now - rec.last > self.forget_s and now >= rec.until:
            del self._records[address]
            return None
        return rec

    def wait_s(self, address: str) -> float:
        """Seconds ``address`` must still wait before its next attempt counts (0: go ahead)."""
        now = time.monotonic()
        rec = self._record(address, now)
        return max(0.0, rec.until - now) if rec is not None else 0.0

    def check(self, address: str) -> None:
        """Refuse an attempt from a locked-out address before any secret is looked at."""
        wait = self.wait_s(address)
        if wait > 0:
            raise LockedOut(
                f"too many failed sign-ins from your address: try again in {math.ceil(wait)} s"
            )

    def failed(self, address: str) -> None:
        """Count a wrong password or token; from the ``limit``-th on, lock the address out."""
        now = time.monotonic()
        rec = self._record(address, now) or _Record()
        rec.failures += 1
        rec.last = now
        if rec.failures >= self.limit:
            doublings = min(rec.failures - self.limit, 30)  # past the cap anyway; no huge powers
            rec.until = now + min(self.max_s, self.base_s * 2**doublings)
        self._records[address] = rec
        self._records.move_to_end(address)
        while len(self._records) > self.max_addresses:
            self._records.popitem(last=False)


class LockedOut(Exception):
    """An address that failed too often tried again too soon; the text is shown to the person."""
