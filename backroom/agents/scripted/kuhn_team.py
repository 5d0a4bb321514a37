"""The ``kuhn-team`` kind: a Kuhn colluder playing its seat's part of the team solve.

The team solve (``backroom.solvers.team``) plays the colluders as one player
who, at every colluder's turn, knows every colluder's card. This agent makes
that true at the table through the referee, never around it: in its talk turn
on the team's channel (a ``start`` channel: every member talks after the deal,
before the first move) it tells its partners its card, "my card is 3"; at each
act turn it rebuilds the team's key from its own information state and the
cards its partners told it, and samples that row of the joint strategy from
its per-match generator, so a rerun replays every move.

A colluder that acts without a partner's card (the partner timed out, or does
not tell) cannot play the joint strategy. It averages the rows over the cards
the partner may hold, counts the decision in ``uninformed`` and logs it; the
episode record shows the missing message. A key the policy lacks (seats the
solve did not team up) plays uniformly and counts in ``misses``, as the
``table`` agent does.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from backroom.agents.base import JSON, choices
from backroom.agents.kinds import register_agent
from backroom.agents.scripted.basic import TableAgent
from backroom.bus.wire import MatchStart, Turn
from backroom.games.base import make_game
from backroom.solvers.policy_file import read_policy
from backroom.solvers.team import joint_key

#: The shipped joint strategy of the Loki team solve (``backroom solve team``).
DEFAULT_POLICY = "kuhn_loki_team"
_CARD = re.compile(r"my card is (\d+)")
log = logging.getLogger(__name__)


def partner_state(own_state: str, own_card: int, partner_card: int) -> str:
    """A partner's Kuhn information state: its card, then the public part of ours.

    Kuhn's information states are the holder's card followed by what every
    seat sees (Loki: the first player and the moves; classic: the moves), so
    the partner's differs from ours in the card alone.
    """
    prefix = str(own_card)
    if not own_state.startswith(prefix):
        raise ValueError(f"information state {own_state!r} does not open with the card {prefix}")
    return f"{partner_card}{own_state[len(prefix) :]}"


@register_agent("kuhn-team")
class KuhnTeamAgent(TableAgent):
    """Options: ``policy`` (a team policy file or shipped name; default ``kuhn_loki_team``)."""

    def __init__(
        self, agent_id: str, policy: str | dict[str, Any] = DEFAULT_POLICY, **options: Any
    ) -> None:
        data = policy if isinstance(policy, dict) else read_policy(policy)
        meta = data.get("meta") or {}
        if meta.get("kind") != "team" or len(meta.get("team") or []) < 2:
            raise TypeError(f"policy {policy!r} is not a team policy (`backroom solve team`)")
        super().__init__(agent_id, policy=data, **options)
        #: The colluding seats, in the order the solve's keys name them.
        self.team: tuple[int, ...] = tuple(int(s) for s in meta["team"])
        self.uninformed = 0

    async def on_match_start(self, start: MatchStart) -> None:
        await super().on_match_start(start)
        try:
            game = make_game(start.game, **start.params)
        except ValueError as exc:  # a game no registry here builds: said in one line
            log.warning("%s: match %s names a game it cannot build: %s", self.id, start.match, exc)
            return
        self.memory(start.match)["cards"] = int(getattr(game, "num_cards", 0))

    async def talk(self, turn: Turn) -> str | None:
        """Tell the partners my card, on a channel that reaches them."""
        start: MatchStart | None = self.memory(turn.match).get("start")
        channel = (
            next((c for c in start.channels if c.name == turn.channel), None) if start else None
        )
        if channel is None or not set(self.team) <= set(channel.members):
            return None
        return f"my card is {turn.observation['card']}"

    def told_cards(self, match: str | None, seat: int) -> dict[int, int]:
        """Each partner's card as it said it on a channel (not overheard), the latest word."""
        told: dict[int, int] = {}
        for d in self.memory(match)["heard"]:
            if d.overheard or d.sender_seat == seat or d.sender_seat not in self.team:
                continue
            if m := _CARD.search(d.text):
                told[d.sender_seat] = int(m.group(1))
        return told

    def rows(self, turn: Turn) -> tuple[list[dict[str, float]], list[int]]:
        """The joint strategy's rows this act turn may be at, and the partners not heard from.

        One row once every partner's card is known; else one per card a
        silent partner may hold, weighed alike.
        """
        seat, card = turn.seat, int(turn.observation["card"])
        own = str(turn.observation.get("info_state"))
        told = self.told_cards(turn.match, seat)
        unknown = [s for s in self.team if s != seat and s not in told]
        rows = []
        for cards in self._guesses(turn.match, card, told, unknown):
            try:
                states = {s: partner_state(own, card, cards.get(s, card)) for s in self.team}
            except ValueError:
                break
            if (row := self.table.get(joint_key(seat, states))) is not None:
                rows.append(row)
        return rows, unknown

    async def act(self, turn: Turn) -> JSON:
        legal = choices(turn)
        rng = self.rng_for(turn.match, turn.seat)
        rows, unknown = self.rows(turn)
        if unknown and turn.seat in self.team:
            self.uninformed += 1
            log.warning(
                "%s (seat %s) acts in match %s without the card of seat(s) %s: "
                "averaging the team rows over the cards they may hold",
                self.id,
                turn.seat,
                turn.match,
                unknown,
            )
        weights = [sum(max(0.0, float(r.get(json.dumps(a), 0.0))) for r in rows) for a in legal]
        if sum(weights) <= 0:  # a seat or a state the solve does not know
            self.misses += 1
            return rng.choice(legal)
        return rng.choices(legal, weights)[0]

    def _guesses(
        self, match: str | None, card: int, told: dict[int, int], unknown: list[int]
    ) -> list[dict[int, int]]:
        """The partners' cards: as told, and for a silent partner every card it may hold."""
        if not unknown:
            return [told]
        out = [dict(told)]
        for s in unknown:
            cards = range(int(self.memory(match).get("cards") or 0))
            out = [{**g, s: c} for g in out for c in cards if c != card and c not in g.values()]
        return out
