"""What each identity may cost a referee: loop time for what it sends, errors for what it gets.

Nothing an agent sends can stop a match or the referee, nor make it send more
than it received: one payload (a batch of any length) gets at most one
``Error`` back, and each identity's errors come out of a token bucket
(``ERROR_BURST``, refilled at ``ERROR_RATE_PER_S``); errors past it are
dropped and counted in ``backroom_errors_dropped_total``. What each identity
sends is budgeted too, in seconds of the referee's loop its outbox and status
payloads cost (``WorkBudget``): past it, payloads are dropped unread, and the
referee stops reading that identity until the budget has refilled
(``referee.outboxes``): a payload dropped unread still cost the socket and
paho its receipt.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

#: Error replies an identity may get at once, and how fast its budget refills
#: (per second). A well-behaved agent gets a handful of errors per match; a
#: flood from one identity must not become a flood back.
ERROR_BURST = 100
ERROR_RATE_PER_S = 20.0
#: What one identity's outbox and status payloads may cost the referee's loop, in
#: seconds: a burst, then this share of every second (``WorkBudget``). What is
#: charged is the work of judging them (parsing, refusals, statuses), not the
#: matches' own work on the moves they carry, and nothing for a payload its
#: matches took whole (play the rules bound: ``Ticket.free``), so an honest agent
#: pays only for what is refused and 8,000 demo hands muted nobody. Past the
#: budget a payload is dropped before it is parsed
#: (``backroom_inputs_dropped_total``) and the identity is not read at all until
#: the budget is full again (``Outboxes.mute``): its moves are lost, so its seats
#: time out to their defaults, while every other agent's matches go on. The burst
#: is small because what the broker holds for the referee while it reads a flood
#: (up to ``max_inflight_messages``) still arrives after the UNSUBSCRIBE, a stall
#: for every match: a 0.25 s burst cost a seated flood's victims a third of their
#: rate (docs/operations.md, *Limits*).
INPUT_BURST_S = 0.05
INPUT_SHARE = 0.03
#: What a payload costs before its handler runs (the socket, paho, the dispatch),
#: which the handler cannot time: charged on top, so that a flood of tiny
#: payloads is priced too. Measured as the referee process's CPU seconds per
#: payload under a flat-out flood of small ones from a seated agent (103 µs;
#: 140 µs at 1 KB, 149 µs at 60 KB: ``PAYLOAD_BYTE_S``), on one of this
#: project's 2-core machines (docs/operations.md, *Limits*). 30 µs, the guess
#: before, priced a flood at a third of what it cost.
PAYLOAD_OVERHEAD_S = 100e-6
PAYLOAD_BYTE_S = 0.8e-9
#: Budgets of each kind kept at once (identities are bounded by the broker's password
#: file, but the referee does not trust that to bound its memory).
ERROR_BUDGETS = 10_000

V = TypeVar("V")


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; ``take`` spends one when there is one."""

    __slots__ = ("at", "capacity", "rate", "tokens")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.tokens = capacity
        self.at = now

    def take(self, now: float, n: float = 1) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


class WorkBudget:
    """Seconds of the loop one identity may use: ``burst`` at once, then ``share`` of each second.

    A payload is charged after it was handled, with the seconds it held the
    loop: a payload cheap in bytes and dear to judge pays what it cost. The
    balance may go below zero; nothing more is read from that identity until
    the clock has paid the debt back. The clock refills only the time between
    one payload's end and the next one's start: the seconds a payload held the
    loop earn it nothing (docs/operations.md, *Incidents*: why not bytes).
    """

    __slots__ = ("at", "burst", "share", "tokens")

    def __init__(self, burst: float, share: float, now: float) -> None:
        self.burst = burst
        self.share = share
        self.tokens = burst
        self.at = now

    def open(self, now: float) -> bool:
        """Whether a payload arriving ``now`` may be handled (the balance is above zero)."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.share)
        self.at = now
        return self.tokens > 0

    def charge(self, seconds: float, now: float) -> None:
        """The payload opened last cost ``seconds`` and ended ``now``."""
        self.tokens -= seconds
        self.at = max(self.at, now)

    def refill_s(self) -> float:
        """Seconds from the last payload's end until the balance is back at the full burst."""
        return max(0.0, self.burst - self.tokens) / self.share


class Ticket:
    """One payload's admission: ``open`` when it may be handled; ``uncharged`` are seconds of
    its handling that were not the sender's doing (the matches' own work on its moves).
    Leaving the ``with`` block charges the budget (a class, not a generator: every payload
    takes this path)."""

    __slots__ = ("budget", "free", "open", "overhead", "start", "uncharged")

    def __init__(self, budget: WorkBudget, start: float, size: int) -> None:
        self.budget = budget
        self.start = start
        self.open = budget.open(start)
        self.overhead = PAYLOAD_OVERHEAD_S + size * PAYLOAD_BYTE_S
        self.uncharged = 0.0
        self.free = False  # every message in it was play its match took: nothing charged

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.monotonic()
        if self.free:
            self.budget.charge(0.0, end)
            return
        spent = end - self.start - self.uncharged if self.open else 0.0
        self.budget.charge(spent + self.overhead, end)


class _Lru(Generic[V]):
    """At most ``size`` values by identity, the least recently used dropped first."""

    def __init__(self, size: int, make: Callable[[float], V]) -> None:
        self.size = size
        self.make = make
        self.values: OrderedDict[str, V] = OrderedDict()

    def get(self, agent: str, now: float) -> V:
        value = self.values.get(agent)
        if value is None:
            value = self.values[agent] = self.make(now)
            while len(self.values) > self.size:
                self.values.popitem(last=False)
        else:
            self.values.move_to_end(agent)
        return value


class Budgets:
    """Each identity's input budget (``WorkBudget``, over its outbox and its status alike)
    and error budget (``TokenBucket``), at most ``ERROR_BUDGETS`` of each kept."""

    def __init__(
        self,
        error_burst: int = ERROR_BURST,
        error_rate_per_s: float = ERROR_RATE_PER_S,
        input_burst_s: float = INPUT_BURST_S,
        input_share: float = INPUT_SHARE,
        keep: int = ERROR_BUDGETS,
    ) -> None:
        self.error_burst = error_burst
        self.error_rate_per_s = error_rate_per_s
        self.input_burst_s = input_burst_s
        self.input_share = input_share
        self._errors = _Lru(keep, lambda now: TokenBucket(error_burst, error_rate_per_s, now))
        self._inputs = _Lru(keep, lambda now: WorkBudget(input_burst_s, input_share, now))

    def input(self, agent: str) -> WorkBudget:
        """``agent``'s one budget over its outbox and its status."""
        return self._inputs.get(agent, time.monotonic())

    def may_error(self, agent: str) -> bool:
        """Whether ``agent`` may be sent one more error (a token taken if so)."""
        now = time.monotonic()
        return self._errors.get(agent, now).take(now)

    def admit(self, agent: str, size: int) -> Ticket:
        """Admit one payload of ``agent``'s, ``size`` bytes long (``with budgets.admit(agent,
        len(payload)) as ticket``), and charge it the loop time it took when the block ends.

        A payload past the budget is not to be handled (``ticket.open`` is
        false) and costs only the overhead (``PAYLOAD_OVERHEAD_S`` and
        ``PAYLOAD_BYTE_S`` a byte); one handled costs the seconds it held the
        loop, less ``ticket.uncharged``, plus the overhead.
        """
        start = time.monotonic()
        return Ticket(self._inputs.get(agent, start), start, size)
