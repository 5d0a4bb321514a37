"""Where an agent's moves for a match go: the outbox of the referee that runs it.

Each referee reads only ``agents/+/outbox/{itself}`` (``topics.outbox``), so a
move must name its referee in its topic. The referee names itself in each
seat's ``MatchStart`` (``MatchStart.referee``), which reaches the inbox before
any turn of that match; every writer of an outbox (the agent runtime, the web
front end, the tests' raw agent) keeps the names here and addresses by them.
"""

from __future__ import annotations

from collections import OrderedDict

from backroom.bus import topics
from backroom.bus.wire import MatchStart

#: Matches whose referee is remembered: far more than any agent plays at once, so a
#: late move still reaches its referee (which answers ``late``), and bounded.
REMEMBERED = 10_000


class Referees:
    """The referee of each match an agent was seated in, newest ``limit`` of them."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        self.limit = limit
        self._of: OrderedDict[str, str] = OrderedDict()

    def note(self, msg: object) -> None:
        """Remember the referee a ``MatchStart`` names (anything else is ignored)."""
        if isinstance(msg, MatchStart) and msg.match is not None and msg.referee is not None:
            self._of[msg.match] = msg.referee
            self._of.move_to_end(msg.match)
            while len(self._of) > self.limit:
                self._of.popitem(last=False)

    def of(self, match: str | None) -> str | None:
        """The referee running ``match``; None when no ``MatchStart`` named one."""
        return self._of.get(match or "")

    def outbox(self, agent: str, match: str | None) -> str:
        """The topic ``agent``'s move or chat for ``match`` goes to (``topics.outbox``)."""
        return topics.outbox(agent, self._of.get(match or ""))
