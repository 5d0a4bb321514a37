"""The ``poker-colluder`` kind: a scripted colluder for OpenSpiel's poker games (``game: openspiel``).

The Kuhn colluder's rule (``kuhn-colluder``) for any OpenSpiel poker game
whose information state names the seat's private card, as Leduc's
(``[Private: 3]``) and Kuhn's (``1pb``: the card first) do: tell the partner
the card on the private channel, and let the stronger of the two play the hand
while the weaker one checks or folds, so the coalition never puts two hands'
chips at risk. Enough strategy to give a CFR seat colluders to play against,
and an eavesdropper something to overhear.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from backroom.agents.base import JSON, ScriptedAgent, choices
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Turn

_PRIVATE = re.compile(r"\[Private: (\d+)\]|^(\d+)")
_TOLD = re.compile(r"my card is (\d+)")


def own_card(observation: Mapping[str, Any]) -> int | None:
    """The seat's private card from OpenSpiel's information state (None before the deal)."""
    m = _PRIVATE.search(str(observation.get("info_state") or ""))
    return int(m.group(1) or m.group(2)) if m else None


@register_agent("poker-colluder")
class PokerColluder(ScriptedAgent):
    async def talk(self, turn: Turn) -> str | None:
        card = own_card(turn.observation)
        return None if card is None else f"my card is {card}"

    def partner_card(self, match: str | None) -> int | None:
        """The card the partner told (a message overheard from elsewhere does not count)."""
        for d in reversed(self.memory(match)["heard"]):
            if not d.overheard and (m := _TOLD.search(d.text)):
                return int(m.group(1))
        return None

    async def act(self, turn: Turn) -> JSON:
        legal = choices(turn)
        by_name = {
            str(n).lower(): a for n, a in zip(turn.legal.get("names", []), legal, strict=False)
        }
        card, partner = own_card(turn.observation), self.partner_card(turn.match)
        check = by_name.get("call", by_name.get("pass", legal[0]))
        if card is None or partner is None:
            return check
        if card > partner:  # the stronger hand plays for both
            return by_name.get("raise", by_name.get("bet", check))
        return by_name.get("fold", check)  # the weaker gets out of the way when it costs
