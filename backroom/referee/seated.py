"""What a referee believes of the agents it seats: offline or not, since when, their kind.

A job of its own because the matches ask it on every turn (is this seat's
agent offline? how long is it still waited for?), and the answers follow
rules of their own: an agent's offline grace counts once, from when its
status said offline, so one that went away a while ago costs later matches
nothing; after this referee's reconnect every offline agent is waited for a
while, since the broker that went away sent everyone's will; and what was
believed of an agent no longer read here is forgotten, because its retained
status comes again with the next subscription. The referee only reads the
statuses of the agents it seats (``referee.outboxes``); what it does with a
referee's status (its group, its own name) stays the referee's.
"""

from __future__ import annotations

import time

from backroom import metrics
from backroom.bus.wire import Status

#: Seconds after a reconnect during which seats of agents whose status says offline
#: still wait for them (instead of getting the default at once, past their grace): a
#: broker that went away sent everyone's will, and agents come back on their own
#: backoff, up to 3 s after the broker (``bus.connection``).
RECONNECT_GRACE_S = 5.0


class Seated:
    """The presence of the agents seated here: ``offline``, since when, kind, batching."""

    def __init__(self, grace_s: float) -> None:
        #: Seconds an agent whose status says offline is waited for before its seats default.
        self.grace_s = grace_s
        self.offline: set[str] = set()
        self.offline_since: dict[str, float] = {}  # agent -> monotonic time its status said offline
        self.kinds: dict[str, str] = {}
        self.batching: set[str] = set()  # agents whose status says they read batched inboxes
        #: Until when (monotonic) offline agents are waited for after a reconnect.
        self.settle_until = 0.0

    def follow(self, agent: str, status: Status) -> None:
        """Follow an explicit ``online`` or ``offline``; no heartbeat expiry here.

        A referee acts on an agent's ``offline`` (its grace, then defaults) and
        on its turn deadlines, which catch an agent that died without a will
        whatever its retained status says.
        """
        if status.kind:
            # A label value, so from a closed set: the kind is whatever the agent says.
            self.kinds[agent] = metrics.kind_label(status.kind)
        (self.batching.add if status.batches else self.batching.discard)(agent)
        if status.state == "offline":
            # Since when: kept while it was not read (``forget``), so an agent that went
            # away a while ago gets no new grace when it is seated here again.
            self.offline_since.setdefault(agent, time.monotonic())
            self.offline.add(agent)
        else:
            self.offline.discard(agent)
            self.offline_since.pop(agent, None)

    def forget(self, agent: str) -> None:
        """``agent`` is not read here any more: its last status may be stale by the time it is
        seated again, when its retained status comes with the subscription. An ``offline``
        believed meanwhile defaulted its first turn at once though it was back online."""
        self.offline.discard(agent)  # ``offline_since`` stays: see ``follow``
        self.batching.discard(agent)

    def reconnected(self) -> None:
        """The broker was away: offline agents are waited for ``RECONNECT_GRACE_S`` from now."""
        self.settle_until = time.monotonic() + RECONNECT_GRACE_S

    def offline_wait(self, agent: str) -> float:
        """Seconds of ``agent``'s offline grace left: its seats wait that long, then default.

        The grace counts from when its status said offline, once
        (``Match.seat_offline``): an agent that went away a while ago costs
        later matches nothing. Within ``RECONNECT_GRACE_S`` of this referee's
        reconnect, every offline agent is waited for until then.
        """
        now = time.monotonic()
        since = self.offline_since.get(agent, now)
        return max(since + self.grace_s, self.settle_until) - now

    def kind_of(self, agent: str) -> str:
        """The agent's kind as a metric label (``metrics.kind_label``)."""
        return self.kinds.get(agent, metrics.UNKNOWN_KIND)

    def batches(self, agent: str) -> bool:
        """Whether ``agent``'s status says it splits batched inbox messages."""
        return agent in self.batching
