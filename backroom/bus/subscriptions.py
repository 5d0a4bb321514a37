"""Subscriptions: which handler gets which message, kept across reconnects.

A handler is ``handler(topic, payload)``, called on the event loop's thread
straight from the socket read (``bus.paho_fixes``): it must not block, so
anything slow goes to a task. Filters are remembered and subscribed again on
every new connection (``bus.connection``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import aiomqtt

from backroom.bus.errors import NotAuthorizedError

log = logging.getLogger("backroom.bus")

Handler = Callable[[str, bytes], None]

#: Topics whose matching handlers are remembered; past this the cache starts over
#: (topics are per match, so their number grows with every match).
ROUTE_CACHE = 10_000


def _exact(topic_filter: str) -> bool:
    """A filter that matches one topic only (no wildcard, no shared subscription)."""
    return not (set(topic_filter) & {"+", "#"} or topic_filter.startswith("$"))


class Subscriptions:
    """Wildcard filters are matched against each new topic (the answer cached); exact ones
    are looked up by topic, so that a referee's one filter per seated agent's outbox
    (``referee.outboxes``) is added and removed without starting the cache over."""

    def __init__(self, count_in: Any) -> None:
        self.handlers: list[tuple[str, Handler]] = []  # wildcard filters
        self.exact: dict[str, list[Handler]] = {}
        self._routes: dict[str, list[tuple[str, Handler]]] = {}  # topic -> matching handlers
        self._count_in = count_in

    def add(self, topic_filter: str, handler: Handler) -> None:
        """Route ``topic_filter`` to ``handler`` too; adding the same pair again changes nothing
        (a filter subscribed again after a refusal must not be handled twice)."""
        if _exact(topic_filter):
            handlers = self.exact.setdefault(topic_filter, [])
            if handler not in handlers:
                handlers.append(handler)
            return
        if (topic_filter, handler) not in self.handlers:
            self.handlers.append((topic_filter, handler))
            self._routes.clear()

    def remove(self, topic_filter: str) -> None:
        if self.exact.pop(topic_filter, None) is not None:
            return
        self.handlers = [(f, h) for f, h in self.handlers if f != topic_filter]
        self._routes.clear()

    async def subscribe(self, client: aiomqtt.Client, topic_filter: str, qos: int = 1) -> None:
        """SUBSCRIBE on ``client``; the broker's refusal raises ``NotAuthorizedError``."""
        await self.subscribe_many(client, [topic_filter], qos)

    async def subscribe_many(
        self, client: aiomqtt.Client, filters: list[str], qos: int = 1
    ) -> None:
        """One SUBSCRIBE for all of ``filters``; a refusal of any raises ``NotAuthorizedError``."""
        codes = await client.subscribe([(f, qos) for f in filters])
        for topic_filter, code in zip(filters, codes, strict=False):
            if getattr(code, "is_failure", False):
                raise NotAuthorizedError(f"broker refused subscription to {topic_filter!r}: {code}")

    async def subscribe_all(self, client: aiomqtt.Client) -> None:
        """Every filter again, on a new connection (the exact ones in one SUBSCRIBE)."""
        for topic_filter in dict.fromkeys(f for f, _ in self.handlers):
            await self.subscribe(client, topic_filter)
        if self.exact:
            await self.subscribe_many(client, list(self.exact))

    def deliver(self, topic: str, payload: bytes) -> None:
        """Hand one message to every handler whose filter matches; a failing handler is logged."""
        self._count_in.inc()
        routes = self._routes.get(topic)
        if routes is None:
            if len(self._routes) > ROUTE_CACHE:
                self._routes.clear()
            routes = self._routes[topic] = [
                (f, h) for f, h in self.handlers if aiomqtt.Topic(topic).matches(f)
            ]
        for topic_filter, handler in routes:
            try:
                handler(topic, payload)
            except Exception:
                log.exception("handler for %s failed on %s", topic_filter, topic)
        for handler in self.exact.get(topic, ()):
            try:
                handler(topic, payload)
            except Exception:
                log.exception("handler for %s failed", topic)
