"""Trust-and-Split from "Learning Robust Social Strategies with LLMs" (section 4, Figure 1).

Each round both players get a private rock/paper/scissors hand, never the
same one. The upper hand values a coin at 10, the lower at 1. The players then
exchange one message each (talk phase, the starting speaker alternating every
round) and propose simultaneously how many of the 10 coins to keep (act
phase); the split rule allocates the coins. Both hands and both proposals are
revealed before the next round, which is what makes reciprocity possible.

Hands are dealt uniformly over the six ordered pairs of distinct hands, as the
paper's code does (``rng.choice(hands, size=2, replace=False)``), so each
player holds the upper hand with probability 1/2 every round. The first
round's starting speaker is a chance node (the code draws it at random), unless
``first_speaker`` fixes it. Other choices are in docs/games.md.

Privacy: a player's observation and prompt name only its own current hand;
the other hand appears only in the history of finished rounds.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from backroom.games._common import (
    CountTalkState,
    fill,
    merge_prompts,
    name_fields,
    number_text,
    observation_head,
    require_count,
    seat_names,
    split_allocation,
    totals_fields,
)
from backroom.games.base import JSON, Action, Game, GameInfo, IllegalActionError, register

HANDS = ("rock", "paper", "scissors")
#: hand -> the hand it has the upper hand over.
BEATS = {"rock": "scissors", "scissors": "paper", "paper": "rock"}
DEALS = tuple((a, b) for a in HANDS for b in HANDS if a != b)


def is_upper(hand: str, other: str) -> bool:
    return BEATS[hand] == other


#: The paper's prompts (section 13, Figure 14; text as in its public code,
#: ``TrustAndSplitRPSAgent`` with the ``<<message_start>>`` / ``<<proposal_start>>``
#: formats its configs use). ``you_said``, ``you_proposed``, ``silence`` and
#: ``game_over`` are ours: a flat prompt has to restate the reader's own turns.
PROMPTS: dict[str, str] = {
    "intro": (
        "Welcome to an iterated game. You are {agent}. The other agent is {other_agent}.\n"
        "\n"
        "Setup:\n"
        "1. The game has multiple independent rounds.\n"
        "2. In each round, there are {coins} coins to split between the two agents.\n"
        "3. Each agent's per-coin value for that round is determined as follows:\n"
        "   - Both agents are randomly assigned a rock, paper or scissors hands\n"
        "   - Rock has the upper hand over scissors, scissors has the upper hand over paper and paper has the upper hand over rock.\n"
        "   - The agent with the upper hand has a per-coin value of {upper_value}.\n"
        "   - The agent with the lower hand has a per-coin value of {lower_value}.\n"
        "4. You only see your own hand, but you may communicate it in messages and infer your value based on the other agent's hand.\n"
        "5. Over many rounds both agents are equally likely to have the upper and lower hand.\n"
        "\n"
        "Protocol:\n"
        "1. At the start of the round, one agent begins the conversation. The starting role alternates each round.\n"
        "2. Agents exchange a short chat ({quota} messages per round per agent) to negotiate how to split the {coins} coins.\n"
        "   - Use this chat to communicate your hand so that both agents can determine their per-coin values.\n"
        "3. After the chat, both agents simultaneously propose how many coins they keep.\n"
        "4. If the total sum of proposals is less than or equal to {coins}, both agents receive their proposals.\n"
        "5. If the total sum of proposals exceeds {coins}, the coins are allocated proportionally.\n"
        "6. Your points for the round = (coins you receive) x (your per-coin value for that round). \n"
        "7. The points are accumulated across rounds.\n"
        "Your goal: Maximize your total points over the whole game."
    ),
    "previous_round": "In the previous round, {other_agent} had a {relation} hand and proposed {other_proposal} coins.",
    "new_round": "A New Round Begins\nYour hand is {hand}. You don't know {other_agent}'s hand yet.",
    "wait": "Wait for {other_agent} to send a message...",
    "other_said": "{other_agent} said: <<message_start>>{text}<<message_end>>",
    "you_said": "You said: <<message_start>>{text}<<message_end>>",
    "silence": "{speaker} said nothing.",
    "send_message": "Send your message now in <<message_start>>...<<message_end>> (<={max_chars} chars).",
    "ask": (
        "Submit your proposal\n"
        "Respond with <<proposal_start>> x <<proposal_end>> where x is an integer in [0, {coins}]."
    ),
    "you_proposed": "You proposed {my_proposal} coins.",
    "game_over": "The game is over. You earned {my_total} points and {other_agent} {other_total}.",
}


@register
class TrustAndSplit(Game):
    name = "trust_and_split"
    num_players = 2

    def __init__(
        self,
        rounds: int = 10,
        coins: int = 10,
        upper_value: float = 10,
        lower_value: float = 1,
        messages_per_round: int = 1,
        max_chars: int = 500,
        first_speaker: int | None = None,
        names: list[str] | None = None,
        prompts: dict[str, str] | None = None,
    ) -> None:
        require_count(self.name, "rounds", rounds)
        require_count(self.name, "coins", coins)
        if not isinstance(messages_per_round, int) or messages_per_round < 0:
            raise ValueError("trust_and_split: messages_per_round must be >= 0")
        if first_speaker not in (None, 0, 1):
            raise ValueError("trust_and_split: first_speaker must be 0, 1 or null (chance)")
        if max_chars < 1:
            raise ValueError("trust_and_split: max_chars must be positive")
        self.rounds, self.coins = rounds, coins
        self.upper_value, self.lower_value = float(upper_value), float(lower_value)
        self.messages_per_round, self.max_chars = messages_per_round, int(max_chars)
        self.first_speaker = first_speaker
        self.names = seat_names(self.name, names, ["Alice", "Bob"])
        self.prompt_overrides = dict(prompts or {})
        self.prompts = merge_prompts(PROMPTS, prompts, self.name)

    @property
    def info(self) -> GameInfo:
        """Per round a seat keeps 0 to ``coins`` coins worth the upper or the lower value
        each, and can hold either hand in any round, so the bounds are attained.

        A round is ``2 · messages_per_round`` messages and one simultaneous
        proposal; chance draws the first speaker (unless fixed) and every round's hands.
        """
        values = (self.upper_value, self.lower_value)
        per_round = [self.coins * v for v in values] + [0.0]
        first = self.first_speaker is None
        return GameInfo(
            num_players=2,
            min_utility=self.rounds * min(per_round),
            max_utility=self.rounds * max(per_round),
            utility_sum=None,
            max_game_length=self.rounds * (2 * self.messages_per_round + 1),
            max_chance_nodes=self.rounds + first,
            max_chance_outcomes=len(DEALS),
        )

    def value(self, hand: str, other: str) -> float:
        return self.upper_value if is_upper(hand, other) else self.lower_value

    def params(self) -> dict[str, JSON]:
        return {
            "rounds": self.rounds,
            "coins": self.coins,
            "upper_value": self.upper_value,
            "lower_value": self.lower_value,
            "messages_per_round": self.messages_per_round,
            "max_chars": self.max_chars,
            "first_speaker": self.first_speaker,
            "names": self.names,
            "prompts": self.prompt_overrides,
        }


def _num(x: float) -> str:
    # The paper's code prints per-coin values and totals with one decimal.
    return number_text(x, ".1f")


class TrustAndSplitState(CountTalkState):
    game: TrustAndSplit
    count_what = "the number of coins to keep"

    def __init__(self, game: TrustAndSplit, seed: int | None) -> None:
        super().__init__(game, seed)
        self.first_speaker: int | None = game.first_speaker
        self.hands: tuple[str, str] | None = None
        #: This round's messages, in order: {"seat", "text"}.
        self.messages: list[dict[str, Any]] = []
        #: Finished rounds, fully revealed.
        self.history: list[dict[str, Any]] = []
        self.phase = "act"

    # --- flow ------------------------------------------------------------------

    @property
    def round_index(self) -> int:
        return len(self.history)

    def starter(self) -> int | None:
        """Who opens the current round's chat: alternates from the first speaker."""
        if self.first_speaker is None:
            return None
        return (self.first_speaker + self.round_index) % 2

    def _talking(self) -> bool:
        return len(self.messages) < 2 * self.game.messages_per_round

    def speaker(self) -> int | None:
        s = self.starter()
        if s is None or self.hands is None or not self._talking() or self.is_terminal():
            return None
        return (s + len(self.messages)) % 2

    def _at_chance(self) -> bool:
        # The first speaker (once) and each round's hands are drawn by chance.
        return self.first_speaker is None or self.hands is None

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if self.is_terminal():
            raise NotImplementedError("not a chance node")
        if self.first_speaker is None:
            return [(0, 0.5), (1, 0.5)]
        if self.hands is None:
            return [(d, 1.0 / len(DEALS)) for d in DEALS]
        raise NotImplementedError("not a chance node")

    def _apply_chance(self, outcome: Action) -> None:
        if self.first_speaker is None:
            if outcome not in (0, 1) or isinstance(outcome, bool):
                raise IllegalActionError(f"{outcome!r} is not a first speaker")
            self.first_speaker = int(outcome)
        elif self.hands is None:
            try:
                deal = (str(outcome[0]), str(outcome[1]))
            except (TypeError, IndexError):
                raise IllegalActionError(f"{outcome!r} is not a deal of two hands") from None
            if deal not in DEALS:
                raise IllegalActionError(f"{outcome!r} is not a deal of two different hands")
            self.hands = deal
        else:
            raise IllegalActionError("not a chance node")
        self._sync_phase()

    def count_range(self) -> tuple[int, int]:
        return 0, self.game.coins

    def default_act(self, player: int) -> Action:
        # A proposal of nothing, as Split No-Comm's parser gives an unreadable proposal.
        return 0

    def _add_message(self, seat: int, text: str) -> None:
        self.messages.append({"seat": seat, "text": text})

    def _apply_act(self, actions: Mapping[int, Action]) -> None:
        assert self.hands is not None
        g = self.game
        props = [int(actions[0]), int(actions[1])]
        coins = [split_allocation(g.coins, props[p], props[1 - p]) for p in (0, 1)]
        values = [g.value(self.hands[p], self.hands[1 - p]) for p in (0, 1)]
        rewards = [coins[p] * values[p] for p in (0, 1)]
        self.round_rewards.append(rewards)
        self.history.append(
            {
                "round": self.round_index + 1,
                "starter": self.starter(),
                "hands": list(self.hands),
                "values": values,
                "messages": self.messages,
                "proposals": props,
                "coins": coins,
                "rewards": rewards,
            }
        )
        self.hands = None
        self.messages = []

    def is_terminal(self) -> bool:
        return len(self.history) >= self.game.rounds

    # --- what players see ------------------------------------------------------

    def observation(self, player: int) -> dict[str, JSON]:
        g = self.game
        totals = self.returns()
        obs: dict[str, Any] = {
            **observation_head(self, player, g.rounds),
            "names": g.names,
            "coins": g.coins,
            "values": {"upper": g.upper_value, "lower": g.lower_value},
            # Only this player's own hand: the other's is revealed in history
            # once the round is over.
            "hand": self.hands[player] if self.hands is not None else None,
            "starter": self.starter(),
            "speaker": self.speaker(),
            "messages": [dict(m) for m in self.messages],
            "history": copy.deepcopy(self.history),
            **totals_fields(totals, player),
        }
        if self.is_terminal():
            obs["returns"] = totals
        return obs

    def _transcript(self, player: int, messages: list[dict[str, Any]]) -> list[str]:
        t, names = self.game.prompts, self.game.names
        other_name = names[1 - player]
        lines = []
        for m in messages:
            if not m["text"]:
                lines.append(
                    fill(t["silence"], speaker="You" if m["seat"] == player else other_name)
                )
            elif m["seat"] == player:
                lines.append(fill(t["you_said"], text=m["text"]))
            else:
                lines.append(fill(t["other_said"], other_agent=other_name, text=m["text"]))
        return lines

    def rules(self, player: int) -> str:
        g = self.game
        return fill(
            g.prompts["intro"],
            coins=g.coins,
            upper_value=_num(g.upper_value),
            lower_value=_num(g.lower_value),
            quota=g.messages_per_round,
            **name_fields(g.names, player),
        )

    def prompt(self, player: int) -> str:
        g, t = self.game, self.game.prompts
        other = 1 - player
        names = name_fields(g.names, player)
        parts = [self.rules(player)]
        for h in self.history:
            parts.append(fill(t["new_round"], hand=h["hands"][player], **names))
            parts.extend(self._transcript(player, h["messages"]))
            parts.append(fill(t["you_proposed"], my_proposal=h["proposals"][player]))
            relation = "upper" if is_upper(h["hands"][other], h["hands"][player]) else "lower"
            parts.append(
                fill(
                    t["previous_round"],
                    relation=relation,
                    other_proposal=h["proposals"][other],
                    **names,
                )
            )
        if self.is_terminal():
            totals = totals_fields(self.returns(), player, _num)
            parts.append(fill(t["game_over"], **totals, **names))
            return "\n".join(parts)
        if self.hands is None:
            return "\n".join(parts)
        parts.append(fill(t["new_round"], hand=self.hands[player], **names))
        parts.extend(self._transcript(player, self.messages))
        speaker = self.speaker()
        if speaker == player:
            parts.append(fill(t["send_message"], max_chars=g.max_chars))
        elif speaker is not None:
            parts.append(fill(t["wait"], **names))
        else:
            parts.append(fill(t["ask"], coins=g.coins))
        return "\n".join(parts)


TrustAndSplit.state_class = TrustAndSplitState
