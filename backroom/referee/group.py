"""The referees' group: the shared subscription match requests are split in, and its members.

Several referees split the work: match requests arrive through a shared
subscription ``$share/<group>/.../control/matches``, so the broker hands each
request to one of them. The group's name is a secret among referees:
Mosquitto lets anyone subscribe to anything, and a stranger in the group would
be handed requests it cannot read (``backroom.bus.auth``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Awaitable, Callable

from backroom.bus import topics
from backroom.bus.client import Bus, Handler

#: Seconds a referee that proposed a group name waits for rival proposals from
#: referees started at the same moment on a fresh broker.
GROUP_SETTLE_S = 0.3
#: Seconds to wait for the probe that says every retained group name has arrived.
GROUP_PROBE_TIMEOUT_S = 5.0
#: What a group name looks like: 128 random bits, so it cannot be guessed.
GROUP_NAME = re.compile(r"^referees-[0-9a-f]{32}$")


class RefereeGroup:
    """One referee's view of the group: which it reads in (``current``), which the others
    say they read in (``records``), and which referees are online (``online``)."""

    def __init__(
        self,
        name: str,
        on_request: Handler,
        announce: Callable[[], Awaitable[None]],
        log: logging.Logger,
    ) -> None:
        self.name = name
        self.on_request = on_request
        self.announce = announce
        self.log = log
        self.bus: Bus | None = None
        #: The group this referee reads requests in (None until it does).
        self.current: str | None = None
        self.records: dict[str, str] = {}  # referee -> the group it says it reads in
        #: Referees whose status says online (``claim_pooled`` skips their names).
        self.online: set[str] = set()
        self._probed = asyncio.Event()
        self._proposed: str | None = None  # the group this referee proposed, if it did
        self._moving: asyncio.Task[None] | None = None  # to a smaller group (``converge``)
        self.on_status: Handler = lambda _topic, _payload: None

    async def subscribe(self, bus: Bus, on_status: Handler) -> None:
        """Follow the group records and this referee's probe (before connecting), and the
        status of each referee a record names (``on_status``, which calls ``follow``)."""
        self.bus = bus
        self.on_status = on_status
        await bus.subscribe(topics.REFEREE_GROUPS, self._on_record)
        await bus.subscribe(topics.referee_probe(self.name), self._on_probe)

    async def join(self) -> str:
        """The shared-subscription group this referee is to read match requests in.

        The broker's ACL cannot keep anyone out of a group (Mosquitto does not
        check subscriptions, see ``backroom.bus.auth``), so the group's name is
        the lock: 128 random bits, kept retained under ``control/referees/``,
        which only referees may read. A referee adopts the name the referees
        before it use; the first one on a broker makes one up. Referees started
        at the same moment on a fresh broker may each propose one: each waits
        ``GROUP_SETTLE_S`` for the others' and takes the smallest. On a busy
        machine a rival's proposal can come later than that; ``converge``
        then moves this referee over, so all end in the smallest.
        """
        assert self.bus is not None
        await self._probe()
        if not self.records:
            mine = self._proposed = f"referees-{secrets.token_hex(16)}"
            await self.bus.publish(topics.referee_group(self.name), mine.encode(), retain=True)
            await asyncio.sleep(GROUP_SETTLE_S)
            await self._probe()  # every proposal the broker had by now has arrived
            self.records.setdefault(self.name, mine)
        return min(self.records.values())

    async def read_in(self, group: str) -> None:
        """Take match requests from ``group`` from now on."""
        assert self.bus is not None
        await self.bus.subscribe(topics.control_matches_shared(group), self.on_request)
        self.current = group

    def name_announced(self) -> bool:
        """Whether a referee started under this one's name announced its group.

        A referee says which group it reads in only once started, so a record
        under the name that is not this one's own proposal (``join``) means
        the name had a holder, not only a rival still starting. Its status
        cannot tell: the holder's will says offline each time this referee's
        login throws it off.
        """
        record = self.records.get(self.name)
        return record is not None and record != self._proposed

    def has_peers(self) -> bool:
        """Whether another referee is online (then it may run a match unknown here).

        A peer is a name with a group record, which only the referee role may
        write (an agent can say ``kind: referee`` in its own status, not this),
        whose status says online (its will clears that when it dies; the
        retained group record outlives it).
        """
        return any(r != self.name and r in self.records for r in self.online)

    def follow(self, referee: str, online: bool) -> None:
        """A status of kind ``referee`` said ``referee`` is online, or not."""
        (self.online.add if online else self.online.discard)(referee)

    def converge(self) -> None:
        """Move to the smallest group any referee reads in, if it is not this one's.

        Every referee keeps its record retained and reads the others', so all
        of them see every name and all end in the smallest. While two groups
        are read in, a request goes to one referee of each and runs twice
        (the runner keeps the first episode), hence the move as soon as a
        smaller name is seen, not a warning to restart.
        """
        if self.current is None or self._moving is not None or not self.records:
            return
        if min(self.records.values()) < self.current:
            self._moving = asyncio.ensure_future(self._move())

    def stop(self) -> None:
        if self._moving is not None:
            self._moving.cancel()

    async def _move(self) -> None:
        assert self.bus is not None
        try:
            while (
                self.current is not None and (target := min(self.records.values())) < self.current
            ):
                old = self.current
                self.log.info("moving to the referees' smaller group, proposed at the same time")
                await self.bus.unsubscribe(topics.control_matches_shared(old))
                await self.read_in(target)
                await self.announce()
        finally:
            self._moving = None

    async def _probe(self) -> None:
        """Return once every retained group name has arrived.

        The broker sends a subscription's retained messages before it handles
        the client's next packet, so the referee's own message on its probe
        topic comes back after all of them.
        """
        assert self.bus is not None
        self._probed.clear()
        await self.bus.publish(topics.referee_probe(self.name), b"probe")
        try:
            await asyncio.wait_for(self._probed.wait(), GROUP_PROBE_TIMEOUT_S)
        except TimeoutError:
            self.log.warning(
                "no echo from the broker in %ss; choosing a group anyway", GROUP_PROBE_TIMEOUT_S
            )

    def _on_probe(self, _topic: str, _payload: bytes) -> None:
        self._probed.set()

    def _on_record(self, topic: str, payload: bytes) -> None:
        referee = topic.split("/")[-2]
        name = payload.decode(errors="replace")
        if not GROUP_NAME.match(name):
            self.records.pop(referee, None)  # an emptied (or foreign) record
            return
        if referee not in self.records and referee != self.name and self.bus is not None:
            self.bus.follow([topics.status(referee)], self.on_status)  # whether it is online
        self.records[referee] = name
        self.converge()
