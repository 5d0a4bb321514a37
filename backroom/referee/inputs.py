"""Judging what an identity sends: at most one ``Error`` per payload, within its budgets.

A 64 KB batch holds some 21,000 ``{}``: answering each would turn one message
from an agent into thousands from the referee. Every refusal is still counted
(``backroom_invalid_inputs_total``, the match's ``invalid_inputs``); the reply
names the first and how many more. Which match a message is for is the
referee's business (``Referee._from_agent``); this is the part that charges
and answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from backroom import metrics
from backroom.bus.structs import Struct, parse_all
from backroom.bus.wire import MAX_PAYLOAD_BYTES, Error, ErrorReason, Message, WireError
from backroom.referee.budgets import Budgets, Ticket

Route = Callable[[str, Struct | Message | WireError], None]


class Judge:
    """Refusals held while a payload is judged, sent once; each identity's budgets kept."""

    def __init__(
        self,
        budgets: Budgets,
        send: Callable[[str, Error], None],
        over_budget: Callable[[str, float], None] | None = None,
    ) -> None:
        self.budgets = budgets
        self.send = send
        #: Told ``(agent, seconds)`` when a payload of ``agent``'s is dropped over budget:
        #: the seconds until its budget is full again (``Outboxes.mute`` stops reading it).
        self.over_budget = over_budget
        self.refused = 0  # refusals so far: a refused move is charged to its sender
        #: Seconds the payload being judged spent in its matches' own work (not charged),
        #: and how many of its messages a match took.
        self._match_s = 0.0
        self._taken = 0
        # While an outbox payload is judged: its sender, its first refusal, how many more.
        self._judging: str | None = None
        self._held: Error | None = None
        self._held_more = 0

    def outbox(self, agent: str, payload: bytes, route: Route) -> None:
        """Judge every message of ``agent``'s payload (``route`` each); answer once at most."""
        with self.budgets.admit(agent, len(payload)) as ticket:
            if not ticket.open:
                metrics.INPUTS_DROPPED.inc()
                share = self.budgets.input_share
                detail = (
                    f"over {share:.0%} of the referee's time: payload dropped unread, and "
                    "nothing more read from you until your budget has refilled"
                )
                self.send_error(agent, Error(reason="rate_limited", detail=detail))
                self._over(agent, ticket)
                return
            self._judging, self._match_s, self._taken = agent, 0.0, 0
            messages = 0
            try:
                for msg in parse_all(payload, MAX_PAYLOAD_BYTES):
                    messages += 1
                    route(agent, msg)
                held, more = self._held, self._held_more
                if held is not None:
                    if more:
                        held.detail = f"{held.detail} (and {more} more refused in the same payload)"
                    self.send_error(agent, held)
            finally:
                ticket.uncharged = self._match_s
                # Every message a move or chat its match took: play, bounded by the game's
                # rules (one move a turn, the free-chat allowance), not the sender's cost.
                ticket.free = 0 < messages == self._taken
                self._judging, self._held, self._held_more = None, None, 0

    def _over(self, agent: str, ticket: Ticket) -> None:
        if self.over_budget is not None:
            self.over_budget(agent, ticket.budget.refill_s())

    def status(self, agent: str, size: int, follow: Callable[[], None]) -> None:
        """Follow a status (``follow``), out of the same budget as the sender's outbox.

        A status costs the loop too (an ``offline`` visits every match), so a
        flood of online/offline flips or of big statuses is dropped past the
        budget and counted (``backroom_statuses_dropped_total``); what is lost
        is the sender's own presence, renewed by its next status.
        """
        with self.budgets.admit(agent, size) as ticket:
            if not ticket.open:
                metrics.STATUSES_DROPPED.labels(reason="over_budget").inc()
                self._over(agent, ticket)
                return
            follow()

    def moved(self, start: float, refused: int) -> None:
        """A move handed to its match at ``start`` (``refused`` refusals before) is done: its
        time is the match's work, not the sender's, unless the match refused it (not your
        turn, an illegal action). Not a context manager: this is every move's path."""
        if self.refused == refused:
            self._match_s += time.monotonic() - start
            self._taken += 1

    def reject(
        self,
        agent: str,
        reason: ErrorReason,
        detail: str,
        match: str | None = None,
        ref_seq: int | None = None,
    ) -> None:
        """Count a refused message and answer it (once per payload, within the agent's budget)."""
        self.refused += 1
        metrics.INVALID_INPUTS.labels(reason=reason).inc()
        if self._judging == agent and self._held is not None:
            self._held_more += 1  # one Error per payload: the rest are counted, never built
            return
        error = Error(match=match, reason=reason, detail=detail, ref_seq=ref_seq)
        if self._judging == agent:
            self._held = error
            return
        self.send_error(agent, error)

    def send_error(self, agent: str, error: Error) -> None:
        """Send ``error`` if ``agent``'s token bucket has a token; else drop it and count it."""
        if self.budgets.may_error(agent):
            self.send(agent, error)
        else:
            metrics.ERRORS_DROPPED.inc()
