"""Who hears what: a match's chat routing, its interventions and its record of every copy.

A chat message goes to the referee; ``Router.deliver`` hands a copy to each member
and each eavesdropper and records it. On a channel with interventions
(``referee.interventions``) each reader list gets its own copy, numbered, possibly
held back (``delay``) or waiting on a paraphrasing model; ``settle`` and ``release``
hand those out at the start of each turn, and all that is left when the match ends.

Apart from ``Match`` so that the match's turn loop reads without the routing, and
the routing without the turns; the match gives it the table (who sits where), its
way out (``send``, ``public``) and its clock (the turn number).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from backroom import seeds
from backroom.bus.structs import Delivery
from backroom.bus.wire import (
    ChannelSpec,
    DeliveryRecord,
    Intervention,
    MatchSpec,
    Paraphrase,
)
from backroom.referee import interventions
from backroom.referee.paraphrase import Paraphrasers

#: The implicit all-seats channel for a game's own talk phases, echoed on the public topic.
TABLE = "table"


@dataclass
class Held:
    """One reader list's copy of message ``number``, held until turn ``due`` (``end``: the
    match's end; None: handed out at once)."""

    number: int
    seat: int
    channel: ChannelSpec
    sent: str
    copy: interventions.Copy
    readers: list[int]
    due: int | Literal["end"] | None


class Router:
    """One match's chat routing; ``deliveries`` is what its episode record keeps."""

    def __init__(
        self,
        spec: MatchSpec,
        agents: list[str],
        send: Callable[[str, Any], None],
        public: Callable[[str, dict[str, Any]], None],
        log: logging.Logger,
        paraphrasers: Paraphrasers | None,
    ) -> None:
        self.spec, self.agents, self.send, self.public, self.log = spec, agents, send, public, log
        self.paraphrasers = paraphrasers
        for c in spec.channels:
            for step in [*c.interventions, *(c.eavesdropper_interventions or [])]:
                if isinstance(step, Paraphrase) and step.model not in (paraphrasers or ()):
                    raise ValueError(
                        f"channel {c.name!r}: paraphrase model {step.model!r} is not one this "
                        "referee was given (backroom referee --paraphraser NAME=BASE_URL)"
                    )
        self.deliveries: list[DeliveryRecord] = []
        self.turn_no = 0  # the match's, as of the last ``release``
        self.messages = 0  # messages of channels with interventions, numbered
        self.budgets = interventions.BudgetLedger()
        self.held: list[Held] = []
        self.rewrites: list[asyncio.Task[None]] = []  # copies waiting on a paraphrasing model

    # --- in ------------------------------------------------------------------------

    def deliver(self, seat: int, channel: ChannelSpec, text: str) -> None:
        """Route one chat message: members hear it, eavesdroppers overhear it, all of it recorded."""
        if channel.intervened():
            self.intervene(seat, channel, text)
            return
        now = time.time()
        sender = self.spec.seats[seat]
        readers = [(s, False) for s in channel.members if s != seat]
        readers += [(s, True) for s in channel.eavesdroppers if s not in channel.members]
        for to_seat, overheard in readers:
            self.send(
                self.agents[to_seat],
                Delivery(
                    channel=channel.name,
                    sender=sender,
                    sender_seat=seat,
                    text=text,
                    overheard=overheard,
                ),
            )
            self.deliveries.append(
                DeliveryRecord(
                    t=now,
                    channel=channel.name,
                    from_seat=seat,
                    to_seat=to_seat,
                    text=text,
                    overheard=overheard,
                )
            )
        if channel.name == TABLE:
            self.public("talk", {"seat": seat, "text": text})

    def intervene(self, seat: int, channel: ChannelSpec, text: str) -> None:
        """A message of a channel with interventions: each reader list gets its own copy."""
        number, self.messages = self.messages, self.messages + 1
        members = [s for s in channel.members if s != seat]
        eavesdroppers = [s for s in channel.eavesdroppers if s not in channel.members]
        lists: list[tuple[interventions.Audience, list[int], list[Intervention]]] = [
            ("members", members, channel.interventions)
        ]
        if channel.eavesdropper_interventions is None:
            lists[0] = ("members", members + eavesdroppers, channel.interventions)
        else:
            lists.append(("eavesdroppers", eavesdroppers, channel.eavesdropper_interventions))
        for audience, readers, steps in lists:
            if not readers:
                continue
            copy = interventions.apply(
                steps,
                text,
                match_seed=self.spec.seed,
                channel=channel.name,
                message=number,
                seat=seat,
                audience=audience,
                ledger=self.budgets,
            )
            held = Held(number, seat, channel, text, copy, readers, None)
            if copy.rewrite_at is not None:
                self.rewrites.append(asyncio.create_task(self.rewrite(held, steps, audience)))
            else:
                self.route(held)

    def route(self, held: Held) -> None:
        """Hand a finished copy out now, or hold it for the turn its delay names."""
        delay = held.copy.delay
        held.due = self.turn_no + delay if isinstance(delay, int) else delay
        if held.copy.delivered and held.due is not None:
            self.held.append(held)
        else:
            self.hand_out(held)

    async def rewrite(
        self, held: Held, steps: list[Intervention], audience: interventions.Audience
    ) -> None:
        """Ask the paraphrasing model, then go on with the list after it; a model that fails
        loses the copy (recorded as not delivered, the error in the referee's log)."""
        copy = held.copy
        assert copy.rewrite_at is not None and self.paraphrasers is not None
        step = steps[copy.rewrite_at]
        assert isinstance(step, Paraphrase)
        seed = seeds.derive_seed(self.spec.seed, "paraphrase", held.number, audience)
        try:
            rewritten = await self.paraphrasers.rewrite(step, copy.text, seed % 2**31)
        except Exception as exc:  # any failure of a model is a lost copy, never a lost match
            self.log.warning(
                "paraphrase failed (%s, message %d): %r", held.channel.name, held.number, exc
            )
            copy.delivered, copy.rewrite_at = False, None
            copy.changed_by.append("paraphrase")
            self.route(held)
            return
        if rewritten != copy.text:
            copy.changed_by.append("paraphrase")
        copy.text = rewritten
        interventions.apply(
            steps,
            rewritten,
            match_seed=self.spec.seed,
            channel=held.channel.name,
            message=held.number,
            seat=held.seat,
            audience=audience,
            ledger=self.budgets,
            copy=copy,
            start=copy.rewrite_at + 1,
        )
        if copy.rewrite_at is not None:  # a second paraphrase further down the list
            await self.rewrite(held, steps, audience)
        else:
            self.route(held)

    # --- out -----------------------------------------------------------------------

    async def settle(self) -> None:
        """Wait for the copies still with a model: what was said reaches its readers before
        the next turn (or the match's end)."""
        while self.rewrites:
            pending, self.rewrites = self.rewrites, []
            await asyncio.gather(*pending)

    def release(self, turn_no: int, at_end: bool = False) -> None:
        """A new turn ``turn_no``: hand out the copies due by it (all of them at the end)."""
        self.turn_no = turn_no
        if not self.held:
            return
        due = [d for d in self.held if at_end or (isinstance(d.due, int) and d.due <= turn_no)]
        self.held = [d for d in self.held if d not in due]
        for held in due:
            self.hand_out(held)

    def hand_out(self, held: Held) -> None:
        """Send one list's copy to its readers and record, for each, what was sent and got."""
        now, copy = time.time(), held.copy
        sender = "" if copy.anonymous else self.spec.seats[held.seat]
        for to_seat in held.readers:
            overheard = to_seat not in held.channel.members
            if copy.delivered:
                self.send(
                    self.agents[to_seat],
                    Delivery(
                        channel=held.channel.name,
                        sender=sender,
                        sender_seat=-1 if copy.anonymous else held.seat,
                        text=copy.text,
                        overheard=overheard,
                    ),
                )
            self.deliveries.append(
                DeliveryRecord(
                    t=now,
                    channel=held.channel.name,
                    from_seat=held.seat,
                    to_seat=to_seat,
                    text=copy.text if copy.delivered else "",
                    overheard=overheard,
                    message=held.number,
                    sent=held.sent if copy.changed_by else None,
                    changed_by=list(copy.changed_by),
                    delivered=copy.delivered,
                )
            )
        if held.channel.name == TABLE and copy.delivered:
            self.public("talk", {"seat": held.seat, "text": copy.text})
