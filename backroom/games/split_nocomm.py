"""Split No-Comm from "Learning Robust Social Strategies with LLMs" (section 4).

Each round there are 10 hats, 10 books and 10 balls. Every category is worth
1 or 10 to each player; at least one category is valued differently by the two
players (the conflict that makes it a dilemma); and both players' totals are
equal. The values are public. Both players simultaneously propose how many of
each category to keep, and the split rule allocates

    q_ka = q_k * p_ka / max(q_k, p_ka + p_kb),

so proposals that fit are granted and over-claims are scaled down. Proposals
and payoffs are revealed after each round.

Value generation follows the paper's public code (``NoPressSimulation`` with
``game_type="10-1-ties"``, ``atleast_one_conflict=True``, equal round totals):
independent 1/10 draws per player and category, redrawn until both
conditions hold. That is the uniform distribution over the 12 value pairs that
satisfy them, which is exactly the explicit chance node here.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from backroom.games._common import (
    fill,
    merge_prompts,
    name_fields,
    observation_head,
    require_count,
    seat_names,
    split_allocation,
    totals_fields,
)
from backroom.games.base import (
    CHANCE,
    JSON,
    Action,
    ActionSpec,
    Game,
    GameInfo,
    IllegalActionError,
    State,
    register,
)

ITEMS = ("hats", "books", "balls")
Values = tuple[tuple[int, ...], tuple[int, ...]]

#: The paper's prompts (section 13, Figure 13; text as in its public code,
#: ``NoPressAgent``). "between 1 and 20" is kept verbatim from both, although
#: values are only ever 1 or 10 (see docs/games.md).
PROMPTS: dict[str, str] = {
    "intro": (
        "Welcome to an iterated game. You are {agent}. The other agent is {other_agent}.\n"
        "Setup:\n"
        "1. The game consists of multiple independent rounds.\n"
        "2. In each round, there are multiple items to split between the two agents.\n"
        "3. Both agents are assigned a per-item value between 1 and 20 (inclusive) in each round.\n"
        "4. You can observe per-item values of both agents.\n"
        "5. Because assignments are random, both agents are equally likely to have same expected per-item value.\n"
        "\n"
        "Protocol:\n"
        "1. Both agents simultaneously propose the amount of each item they will keep.\n"
        "2. If the total sum of proposals is less than or equal to the item quantity, both agents receive their proposed amounts.\n"
        "3. If the total sum of proposals exceeds the item quantity, they are allocated proportionally.\n"
        "4. Your points for the round = (amount you receive per item) x (your per-item value for that round), added across all items.\n"
        "5. Points are accumulated across rounds.\n"
        "Your goal: Maximize your total points over the whole game."
    ),
    "round_summary": (
        "{title}:\n"
        "   - Items to split: {quantities}\n"
        "   - Your per-item values: {my_values}\n"
        "   - {other_agent}'s per-item values: {other_values}\n"
        "   - You proposed: {my_proposal}\n"
        "   - You earned: {my_points} points\n"
        "   - {other_agent} proposed: {other_proposal}\n"
        "   - {other_agent} earned: {other_points} points\n"
        "   - Round Complete."
    ),
    "new_round": (
        "A New Round Begins\n"
        "The items to split are {quantities}.\n"
        "Your per-item values are {my_values} and {other_agent}'s per-item values are {other_values}."
    ),
    "ask": (
        "Submit Your Proposal\n"
        "Respond as Proposal: x hats, y books, z balls where x: 0-{q} (integer), "
        "y: 0-{q} (integer), z: 0-{q} (integer)."
    ),
    "game_over": "The game is over. You earned {my_total} points and {other_agent} {other_total}.",
}

_PAIR = re.compile(r"(\d+)\s*(hat|book|ball)s?", re.I)


def value_outcomes(low: int, high: int, n_items: int = len(ITEMS)) -> list[Values]:
    """All value pairs the paper's sampler can produce, in a fixed order.

    Per category each player's value is ``low`` or ``high``; the totals must be
    equal and at least one category must differ.
    """
    singles = list(itertools.product((low, high), repeat=n_items))
    return [(a, b) for a in singles for b in singles if sum(a) == sum(b) and a != b]


@register
class SplitNoComm(Game):
    name = "split_nocomm"
    num_players = 2

    def __init__(
        self,
        rounds: int = 10,
        quantity: int = 10,
        low: int = 1,
        high: int = 10,
        names: list[str] | None = None,
        prompts: dict[str, str] | None = None,
    ) -> None:
        require_count(self.name, "rounds", rounds)
        require_count(self.name, "quantity", quantity)
        if not 0 <= low < high:
            raise ValueError("split_nocomm: need 0 <= low < high")
        self.rounds, self.quantity, self.low, self.high = rounds, quantity, int(low), int(high)
        self.names = seat_names(self.name, names, ["Alice", "Bob"])
        self.prompt_overrides = dict(prompts or {})
        self.prompts = merge_prompts(PROMPTS, prompts, self.name)
        self.outcomes = value_outcomes(self.low, self.high)

    @property
    def info(self) -> GameInfo:
        """Per round a seat gets between nothing (it claims nothing) and every item at its
        values (it claims all, the other nothing), in a round whose values have the
        largest total; both ends are attained. General-sum: over-claims lose value.
        """
        best = max(sum(mine) for mine, _ in self.outcomes)
        return GameInfo(
            num_players=2,
            min_utility=0.0,
            max_utility=float(self.rounds * self.quantity * best),
            utility_sum=None,
            max_game_length=self.rounds,
            max_chance_nodes=self.rounds,
            max_chance_outcomes=len(self.outcomes),
        )

    def params(self) -> dict[str, JSON]:
        return {
            "rounds": self.rounds,
            "quantity": self.quantity,
            "low": self.low,
            "high": self.high,
            "names": self.names,
            "prompts": self.prompt_overrides,
        }


def _items(d: Mapping[str, Any] | Sequence[Any]) -> str:
    if isinstance(d, Mapping):
        return ", ".join(f"{d[k]} {k}" for k in ITEMS)
    return ", ".join(f"{v} {k}" for k, v in zip(ITEMS, d, strict=True))


def _values(v: Sequence[int]) -> str:
    return ", ".join(f"{k}={x}" for k, x in zip(ITEMS, v, strict=True))


def _points(x: float) -> float:
    # The paper's code prints points rounded to one decimal, "50.0" included.
    return round(x, 1)


class SplitState(State):
    game: SplitNoComm

    def __init__(self, game: SplitNoComm, seed: int | None) -> None:
        super().__init__(game, seed)
        self.values: Values | None = None
        #: One entry per finished round: values, proposals and allocations by seat.
        self.history: list[dict[str, Any]] = []

    def current_players(self) -> frozenset[int]:
        if self.is_terminal():
            return frozenset()
        if self.values is None:
            return frozenset({CHANCE})
        return frozenset({0, 1})

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if self.values is not None or self.is_terminal():
            raise NotImplementedError("not a chance node")
        n = len(self.game.outcomes)
        return [(o, 1.0 / n) for o in self.game.outcomes]

    def _apply_chance(self, outcome: Action) -> None:
        # Accept lists too (an outcome that went through JSON).
        try:
            values = (tuple(int(x) for x in outcome[0]), tuple(int(x) for x in outcome[1]))
        except (TypeError, ValueError, IndexError):
            raise IllegalActionError(f"{outcome!r} is not a value assignment") from None
        if values not in self.game.outcomes:
            raise IllegalActionError(f"{outcome!r} is not a possible value assignment")
        self.values = values

    def legal_actions(self, player: int) -> Sequence[Action]:
        # 11**3 proposals: described by the schema instead of listed.
        return []

    def action_spec(self, player: int) -> ActionSpec:
        q = self.game.quantity
        return ActionSpec(
            schema={
                "type": "object",
                "properties": {k: {"type": "integer", "minimum": 0, "maximum": q} for k in ITEMS},
                "required": list(ITEMS),
                "additionalProperties": False,
            }
        )

    def check_action(self, player: int, action: Action) -> Action:
        self.require_mover(player)
        q = self.game.quantity
        if isinstance(action, str):
            # "Proposal: 5 hats, 0 books, 5 balls"; a category left out is 0,
            # as in the paper's parser.
            found = {k: 0 for k in ITEMS}
            pairs = _PAIR.findall(action)
            if not pairs:
                raise IllegalActionError(
                    f"answer as 'Proposal: x hats, y books, z balls' or a mapping, not {action!r}"
                )
            for num, item in pairs:
                found[item.lower() + "s"] = int(num)
            action = found
        if not isinstance(action, Mapping):
            raise IllegalActionError(
                f"a proposal maps {list(ITEMS)} to integers 0..{q}, not {action!r}"
            )
        extra = sorted(set(action) - set(ITEMS))
        missing = [k for k in ITEMS if k not in action]
        if extra or missing:
            raise IllegalActionError(
                f"a proposal needs exactly {list(ITEMS)}; extra {extra}, missing {missing}"
            )
        out: dict[str, int] = {}
        for k in ITEMS:
            v = action[k]
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or v != int(v)
                or not 0 <= v <= q
            ):
                raise IllegalActionError(f"{k} must be an integer in [0, {q}], got {v!r}")
            out[k] = int(v)
        return out

    def default_action(self, player: int) -> Action:
        # The paper's parser turns an unreadable answer into a proposal of
        # nothing; a silent seat gets the same.
        return {k: 0 for k in ITEMS}

    def _apply(self, actions: Mapping[int, Action]) -> None:
        assert self.values is not None
        q = self.game.quantity
        props = [[int(actions[p][k]) for k in ITEMS] for p in (0, 1)]
        alloc = [
            [split_allocation(q, props[p][i], props[1 - p][i]) for i in range(len(ITEMS))]
            for p in (0, 1)
        ]
        rewards = [
            sum(a * v for a, v in zip(alloc[p], self.values[p], strict=True)) for p in (0, 1)
        ]
        self.round_rewards.append(rewards)
        self.history.append(
            {
                "round": len(self.history) + 1,
                "values": [list(self.values[0]), list(self.values[1])],
                "proposals": props,
                "allocations": alloc,
                "rewards": rewards,
            }
        )
        self.values = None

    def is_terminal(self) -> bool:
        return len(self.history) >= self.game.rounds

    # --- what players see ------------------------------------------------------

    def observation(self, player: int) -> dict[str, JSON]:
        other = 1 - player
        totals = self.returns()
        obs: dict[str, Any] = {
            **observation_head(self, player, self.game.rounds),
            "names": self.game.names,
            "items": list(ITEMS),
            "quantities": {k: self.game.quantity for k in ITEMS},
            "my_values": dict(zip(ITEMS, self.values[player], strict=True))
            if self.values
            else None,
            "other_values": dict(zip(ITEMS, self.values[other], strict=True))
            if self.values
            else None,
            # Everything here is public, so the history is kept by seat.
            "history": copy.deepcopy(self.history),
            **totals_fields(totals, player),
        }
        if self.is_terminal():
            obs["returns"] = totals
        return obs

    def rules(self, player: int) -> str:
        return fill(self.game.prompts["intro"], **name_fields(self.game.names, player))

    def prompt(self, player: int) -> str:
        g, t = self.game, self.game.prompts
        other = 1 - player
        names = name_fields(g.names, player)
        quantities = _items({k: g.quantity for k in ITEMS})
        parts = [self.rules(player)]
        for i, h in enumerate(self.history):
            last = i == len(self.history) - 1
            parts.append(
                fill(
                    t["round_summary"],
                    title="Last Round Summary" if last else f"Round {h['round']} Summary",
                    quantities=quantities,
                    my_values=_values(h["values"][player]),
                    other_values=_values(h["values"][other]),
                    my_proposal=_items(h["proposals"][player]),
                    other_proposal=_items(h["proposals"][other]),
                    my_points=_points(h["rewards"][player]),
                    other_points=_points(h["rewards"][other]),
                    **names,
                )
            )
        if self.is_terminal():
            totals = totals_fields(self.returns(), player, _points)
            parts.append(fill(t["game_over"], **totals, **names))
        elif self.values is not None:
            parts.append(
                fill(
                    t["new_round"],
                    quantities=quantities,
                    my_values=_values(self.values[player]),
                    other_values=_values(self.values[other]),
                    **names,
                )
            )
            parts.append(fill(t["ask"], q=g.quantity))
        return "\n".join(parts)


SplitNoComm.state_class = SplitState
