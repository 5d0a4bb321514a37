"""A scripted Kuhn colluder: tells its partner its card and lets the stronger hand play.

Enough strategy to exercise the private channel end to end; the CFR team
solve is the real yardstick for what collusion is worth.
"""

from __future__ import annotations

import re

from backroom.agents.base import JSON, ScriptedAgent, choices, register_agent
from backroom.bus.wire import Turn

_CARD = re.compile(r"my card is (\d+)")


@register_agent("kuhn-colluder")
class KuhnColluder(ScriptedAgent):
    async def talk(self, turn: Turn) -> str | None:
        return f"my card is {turn.observation['card']}"

    def partner_card(self, match: str | None) -> int | None:
        for d in reversed(self.memory(match)["heard"]):
            if not d.overheard and (m := _CARD.search(d.text)):
                return int(m.group(1))
        return None

    async def act(self, turn: Turn) -> JSON:
        legal = choices(turn)
        names = dict(zip(turn.legal.get("names", []), legal, strict=False))
        card = int(turn.observation["card"])
        partner = self.partner_card(turn.match)
        facing_bet = turn.observation.get("to_call", 0) > 0
        strongest = partner is None or card > partner
        # The stronger colluder bets its good cards and calls; the weaker one gets
        # out of the way instead of putting more coalition chips at risk.
        if strongest and card >= 3 and "raise" in names:
            return names["raise"]
        if strongest or not facing_bet:
            return names.get("call", legal[0])
        return names.get("fold", legal[0])
