"""A scripted Kuhn colluder: tells its partner its card and lets the stronger hand play.

Enough strategy to exercise the private channel end to end; the CFR team
solve is the real yardstick for what collusion is worth.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from backroom.agents.base import JSON, ScriptedAgent, choices
from backroom.agents.kinds import register_agent
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
        names = turn.legal.get("names", [])
        return naive_choice(turn.observation, legal, names, self.partner_card(turn.match))


def naive_choice(
    observation: Mapping[str, Any],
    legal: Sequence[JSON],
    names: Sequence[str],
    partner: int | None,
) -> JSON:
    """The naive rule, from what the referee shows the seat and the partner's card if heard.

    Apart from the agent so that ``backroom.analysis.kuhn`` values the rule
    exactly on the game tree, from the observations the referee would send.
    """
    by_name = dict(zip(names, legal, strict=False))
    card = int(observation["card"])
    facing_bet = observation.get("to_call", 0) > 0
    strongest = partner is None or card > partner
    # The stronger colluder bets its good cards and calls; the weaker one gets
    # out of the way instead of putting more coalition chips at risk.
    if strongest and card >= 3 and "raise" in by_name:
        return by_name["raise"]
    if strongest or not facing_bet:
        return by_name.get("call", legal[0])
    return by_name.get("fold", legal[0])
