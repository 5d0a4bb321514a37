"""Bertrand duopoly with differentiated goods, from "Shall We Team Up" (section 4).

Two firms set prices simultaneously every round (up to 800 rounds in the
paper); each then learns its own demand and profit and the rival's price. The
demand systems (``linear``, the paper's; ``logit``, Calvano et al. 2020), the
profits and the benchmark prices are in ``bertrand_market``: the scripted
firms and the analysis use the same formulas.

With ``talk_rounds`` = k > 0 every round opens with a talk phase of k
exchanges on the firms' private channel, the speaking order drawn at random
each round (a chance node), one speaker at a time — the paper's "three
exchanges of dialogue". Choices where the paper is silent are in docs/games.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from backroom.games._common import (
    TalkState,
    fill,
    merge_prompts,
    observation_head,
    parse_float,
    persona_texts,
    require_count,
    seat_names,
)
from backroom.games.base import (
    JSON,
    Action,
    ActionSpec,
    Game,
    GameInfo,
    IllegalActionError,
    register,
)
from backroom.games.bertrand_market import Demand, equilibrium_prices, make_market

#: Persona shorthands (the paper's code, ``SABM_Economics_Data.persona``).
PERSONAS = {
    "none": "",
    "explore": "You are encouraged to actively explore your price to get more profit.",
    "aggressive": "You are encouraged to adjust your price aggressively to get more profit.",
    "uncooperative": (
        "You are selfish and dishonest to other players. You are encouraged to actively reduce "
        "your price to seek more demand in the market and beat your opponent."
    ),
}


#: The paper's prompts (appendix A.2, Prompts 10 and 11) as its public code
#: words them (``SABM_Economics_Data.prompts``). The planning prompt (13) and
#: its strategy memory belong to an LLM agent, not the engine; ``planning`` is
#: here so such agents find the paper's text in one place.
PROMPTS: dict[str, str] = {
    "game_description": (
        "This is a game between two players that spans multiple rounds. Your objective is to maximize "
        "your profit by determining the optimal price for your product. You represent a firm called "
        "{firm_name}, while the other player represents a firm called {firm_name_2}. Do not create or "
        'mention any additional firm names, e.g., do not say anything related to "AI" or "AI assistant/model".\n'
        "\n"
        "In each round, you will be informed of your prices, demands, profits, and the other player's "
        "prices in previous rounds. Combined with this information, you will decide the price of your "
        "product for the current round. Make sure your objective is maximizing your own profit.\n"
        "\n"
        "Your profit is (p - c) * q, where p is the price of your product in this round, c (= {firm_cost}) "
        "is the cost of your product, and q is the demand of your product, which is affected by both "
        "players' prices in this round.{persona} \n"
    ),
    "game_description_conversation": (
        "This is a game between two players that spans multiple rounds. Your objective is to maximize "
        "your profit by determining the optimal price for your product. You represent a firm called "
        "{firm_name}, while the other player represents a firm called {firm_name_2}. Do not create or "
        'mention any additional firm names, e.g., do not say anything related to "AI" or "AI assistant/model". '
        "I am responsible for facilitating communication between two players.\n"
        "\n"
        "Each round is composed of three phases:\n"
        "In Phase 1, two players are permitted to engage in open-ended discussions on any topic, up to "
        "{talk_rounds_words}.\n"
        "In Phase 2, you determine the price of your product for the current round, taking into "
        "consideration prices, demands, and profits from previous rounds, as well as the information you "
        "garnered during Phase 1.\n"
        "In Phase 3, you will be informed of the other player's pricing and your profit for this round. "
        "Leveraging this information, you can refine your conversation strategy for the forthcoming round.\n"
        "Make sure your objective is maximizing your own profit.\n"
        "\n"
        "Your profit is (p - c) * q, where p is the price of your product in this round, c (= {firm_cost}) "
        "is the cost of your product, and q is the demand of your product, which is affected by both "
        "players' prices in this round.{persona} \n"
    ),
    "prev_decisions": (
        "Your and the other player's past {prev_round_number} rounds' decisions and profits "
        "(Round #a: [your price, your demand, your profit, the other player's price]) are as follows:\n"
        "{prev_decisions}\n"
    ),
    "decision_line": "Round #{round}: [{price}, {demand}, {profit}, {rival_price}]\n",
    "round_header": "\nYou are Firm {firm_name}. This is Round #{round_id}.\n",
    "phase_1": (
        "We are currently in Phase 1. Feel free to converse openly with the other player. You may select "
        "any topic that could potentially maximize your profit. Additionally, you are encouraged to ask "
        "questions to the other player.\n"
    ),
    "conversation_so_far": "\nConversation so far:\n{conversations}\n",
    "conversation_phase_1": "\nConversation in Phase 1:\n{conversations}\n",
    "conversation_line": "Firm {firm_name}: {text}\n",
    "phase_2": "We are currently in Phase 2. ",
    "price_request": (
        "Based on the information you have, please determine the price of your product to maximize your "
        'profit. Only reply with a number in the range between 0 and {firm_a}, e.g., "10". Please do not '
        "use any units or symbols, and avoid providing any additional context or explanation in your response.\n"
    ),
    "planning": (
        "Statistics of historical data (Rounds #a - #b: [your average price, your average demand, your "
        "average profit, the other player's average price]) are given below.\n{statistics}\n"
        "Your strategy in previous rounds:\n{strategies}\n"
        "Based on the above statistics and your previous strategies, what is your strategy for this round?\n"
    ),
    "game_over": "The game is over after {rounds} rounds. Your total profit is {my_total}.\n",
}

_TIMES = {1: "once", 2: "twice", 3: "three times"}


@register
class Bertrand(Game):
    name = "bertrand"
    num_players = 2

    def __init__(
        self,
        demand: Demand = "linear",
        rounds: int = 800,
        talk_rounds: int = 0,
        demand_params: dict[str, float] | None = None,
        max_price: float | None = None,
        history_window: int | None = None,
        prompt_window: int = 20,
        max_chars: int = 500,
        firm_names: list[str] | None = None,
        personas: list[str] | None = None,
        prompts: dict[str, str] | None = None,
    ) -> None:
        self.market = make_market(demand, demand_params)
        self.demand: str = demand
        self.demand_params = dict(demand_params or {})
        require_count(self.name, "rounds", rounds)
        if not isinstance(talk_rounds, int) or talk_rounds < 0:
            raise ValueError("bertrand: talk_rounds must be an integer >= 0")
        if history_window is not None and history_window < 0:
            raise ValueError("bertrand: history_window must be >= 0 or null (full history)")
        if prompt_window < 0:
            raise ValueError("bertrand: prompt_window must be >= 0")
        self.rounds, self.talk_rounds = rounds, talk_rounds
        self.max_price_param = max_price
        self.max_price = float(max_price) if max_price is not None else self._default_max_price()
        if not self.max_price > 0:
            raise ValueError("bertrand: max_price must be positive")
        self.history_window, self.prompt_window = history_window, prompt_window
        self.max_chars = int(max_chars)
        self.firm_names = seat_names(self.name, firm_names, ["Ed", "Gill"], "firm_names", "firms")
        if personas is not None and len(personas) != 2:
            raise ValueError("bertrand: personas needs one entry per firm")
        self.persona_params = list(personas) if personas is not None else None
        self.personas = persona_texts(personas, PERSONAS, 2)
        self.prompt_overrides = dict(prompts or {})
        self.prompts = merge_prompts(PROMPTS, prompts, self.name)
        self.equilibrium = equilibrium_prices(demand, self.demand_params)

    @property
    def info(self) -> GameInfo:
        """Per-round profit bounds over every pair of prices in [0, max_price], attained.

        ``Market.profit_bounds`` says where each is attained. General-sum.
        """
        worst, best = self.market.profit_bounds(self.max_price)
        talk = self.talk_rounds > 0
        return GameInfo(
            num_players=2,
            min_utility=self.rounds * worst,
            max_utility=self.rounds * best,
            utility_sum=None,
            max_game_length=self.rounds * (2 * self.talk_rounds + 1),
            max_chance_nodes=self.rounds if talk else 0,
            max_chance_outcomes=2 if talk else 0,
        )

    def _default_max_price(self) -> float:
        p = self.market.params
        if self.demand == "linear":
            # The code's ``firm_a``: the common price at which demand vanishes (14).
            return p["intercept"] / (p["own_slope"] - p["cross_slope"])
        # No counterpart in the paper; twice the product quality a (4.0) keeps
        # the monopoly price (1.925) well inside the range.
        return 2.0 * p["a"]

    def params(self) -> dict[str, JSON]:
        return {
            "demand": self.demand,
            "rounds": self.rounds,
            "talk_rounds": self.talk_rounds,
            "demand_params": self.demand_params,
            "max_price": self.max_price_param,
            "history_window": self.history_window,
            "prompt_window": self.prompt_window,
            "max_chars": self.max_chars,
            "firm_names": self.firm_names,
            "personas": self.persona_params,
            "prompts": self.prompt_overrides,
        }


def _r(x: float, digits: int) -> float:
    return round(float(x), digits)


class BertrandState(TalkState):
    game: Bertrand

    def __init__(self, game: Bertrand, seed: int | None) -> None:
        super().__init__(game, seed)
        # The history lists are the only per-round memory (plus round_rewards).
        self.prices: list[list[float]] = [[], []]
        self.demands: list[list[float]] = [[], []]
        self.profits: list[list[float]] = [[], []]
        #: Who speaks first this round (drawn by chance when there is talk).
        self.first: int | None = None
        #: This round's conversation only: {"seat", "text"}.
        self.conversation: list[dict[str, Any]] = []
        self.phase = "act"
        self._sync_phase()

    # --- flow ------------------------------------------------------------------

    @property
    def rounds_played(self) -> int:
        return len(self.prices[0])

    def _at_chance(self) -> bool:
        # With talk, each round's first speaker is drawn by chance.
        return self.game.talk_rounds > 0 and self.first is None

    def speaker(self) -> int | None:
        if self.is_terminal() or self._at_chance() or self.game.talk_rounds == 0:
            return None
        if len(self.conversation) >= 2 * self.game.talk_rounds:
            return None
        assert self.first is not None
        return (self.first + len(self.conversation)) % 2

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if self.is_terminal() or not self._at_chance():
            raise NotImplementedError("not a chance node")
        return [(0, 0.5), (1, 0.5)]

    def _apply_chance(self, outcome: Action) -> None:
        if not self._at_chance() or isinstance(outcome, bool) or outcome not in (0, 1):
            raise IllegalActionError(f"{outcome!r} is not a first speaker here")
        self.first = int(outcome)
        self._sync_phase()

    def legal_actions(self, player: int) -> Sequence[Action]:
        # Prices are continuous: ``action_spec`` describes them.
        return []

    def act_spec(self, player: int) -> ActionSpec:
        return ActionSpec(schema={"type": "number", "minimum": 0.0, "maximum": self.game.max_price})

    def check_act(self, player: int, action: Action) -> Action:
        return parse_float(action, 0.0, self.game.max_price, "the price")

    def default_act(self, player: int) -> Action:
        # A firm that does not answer keeps its posted price; before it has
        # one, the paper's code falls back to the cost.
        return self.prices[player][-1] if self.prices[player] else self.game.market.cost

    def _add_message(self, seat: int, text: str) -> None:
        self.conversation.append({"seat": seat, "text": text})

    def _apply_act(self, actions: Mapping[int, Action]) -> None:
        m = self.game.market
        p = [float(actions[0]), float(actions[1])]
        rewards = []
        for i in (0, 1):
            q = m.quantity(p[i], p[1 - i])
            self.prices[i].append(p[i])
            self.demands[i].append(q)
            self.profits[i].append(m.profit(p[i], p[1 - i]))
            rewards.append(self.profits[i][-1])
        self.round_rewards.append(rewards)
        self.first, self.conversation = None, []

    def is_terminal(self) -> bool:
        return self.rounds_played >= self.game.rounds

    def returns(self) -> list[float]:
        return [sum(self.profits[0]), sum(self.profits[1])]

    # --- what players see ------------------------------------------------------

    def _window(self, player: int, size: int | None) -> dict[str, Any]:
        n = self.rounds_played
        start = 0 if size is None else max(0, n - size)
        rival = 1 - player
        # Rounded so an 800-round observation stays a few tens of kilobytes.
        return {
            "start": start + 1,
            "prices": [_r(x, 6) for x in self.prices[player][start:]],
            "demands": [_r(x, 4) for x in self.demands[player][start:]],
            "profits": [_r(x, 4) for x in self.profits[player][start:]],
            "rival_prices": [_r(x, 6) for x in self.prices[rival][start:]],
        }

    def observation(self, player: int) -> dict[str, JSON]:
        g = self.game
        terminal = self.is_terminal()
        speaker = self.speaker()
        obs: dict[str, Any] = {
            **observation_head(self, player, g.rounds),
            "firm": g.firm_names[player],
            "rival": g.firm_names[1 - player],
            "market": {
                "demand": g.demand,
                "params": dict(g.market.params),
                "cost": g.market.cost,
                "max_price": g.max_price,
            },
            # The terminal observation always holds the whole game, for the analysis.
            "history": self._window(player, None if terminal else g.history_window),
            "talk_rounds": g.talk_rounds,
            "speaker": speaker,
            "conversation": [
                {"seat": c["seat"], "firm": g.firm_names[c["seat"]], "text": c["text"]}
                for c in self.conversation
            ],
            "my_total": self.returns()[player],
        }
        if terminal:
            obs["returns"] = self.returns()
        return obs

    def rules(self, player: int) -> str:
        g, t = self.game, self.game.prompts
        persona = g.personas[player]
        return fill(
            t["game_description_conversation" if g.talk_rounds > 0 else "game_description"],
            firm_name=g.firm_names[player],
            firm_name_2=g.firm_names[1 - player],
            firm_cost=f"{g.market.cost:g}",
            persona=(" " + persona) if persona else "",
            talk_rounds_words=_TIMES.get(g.talk_rounds, f"{g.talk_rounds} times"),
        )

    def prompt(self, player: int) -> str:
        g, t = self.game, self.game.prompts
        talk = g.talk_rounds > 0
        text = self.rules(player)
        n = self.rounds_played
        if n:
            start = max(0, n - g.prompt_window)
            lines = "".join(
                fill(
                    t["decision_line"],
                    round=i + 1,
                    price=f"{self.prices[player][i]:g}",
                    demand=_r(self.demands[player][i], 2),
                    profit=_r(self.profits[player][i], 2),
                    rival_price=f"{self.prices[1 - player][i]:g}",
                )
                for i in range(start, n)
            )
            text += fill(t["prev_decisions"], prev_round_number=n - start, prev_decisions=lines)
        if self.is_terminal():
            return text + fill(t["game_over"], rounds=n, my_total=_r(self.returns()[player], 2))
        text += fill(t["round_header"], firm_name=g.firm_names[player], round_id=n + 1)
        conv = "".join(
            fill(t["conversation_line"], firm_name=g.firm_names[c["seat"]], text=c["text"])
            for c in self.conversation
            if c["text"]
        )
        if self.phase == "talk":
            text += t["phase_1"]
            if conv:
                text += fill(t["conversation_so_far"], conversations=conv)
            return text
        if talk:
            text += fill(t["conversation_phase_1"], conversations=conv) + t["phase_2"]
        return text + fill(t["price_request"], firm_a=f"{g.max_price:g}")


Bertrand.state_class = BertrandState
