"""Iterated Prisoner's Dilemma as in "Learning Robust Social Strategies with LLMs".

The paper hides the game's identity from the model: the actions are ``A``
(cooperate) and ``B`` (defect) and no prompt says "prisoner", "cooperate" or
"defect". Payoffs per round (section 12): (A,A) 3/3, (A,B) 0/5, (B,A) 5/0,
(B,B) 1/1; 10 rounds (section 11). Both players move simultaneously and see the
other's previous move after each round.

``continuation`` adds the textbook stochastic ending: after every round but the
last a chance node continues with that probability, so ``rounds`` is then a
cap. The paper trains with fixed-length games ("no empirical difference"), so
it is off by default. Everything else is in docs/games.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from backroom.games._common import (
    fill,
    merge_prompts,
    number_text,
    observation_head,
    require_count,
    totals_fields,
)
from backroom.games.base import (
    CHANCE,
    JSON,
    Action,
    Game,
    GameInfo,
    IllegalActionError,
    State,
    register,
)

COOPERATE, DEFECT = "A", "B"
MOVES = (COOPERATE, DEFECT)

#: The paper's prompts (section 13, Figures 10 and 12; text as in its public
#: code, configs/ipd_*.yaml). ``own_move`` is ours: a flat prompt needs to say
#: which past move was the reader's, where the paper's chat had it as the
#: model's own turn.
PROMPTS: dict[str, str] = {
    "intro": (
        "Welcome to an iterated game. You are playing against another agent.\n"
        "\n"
        "Game Rules:\n"
        "1. In each round, both agents simultaneously choose to either play A or B.\n"
        "2. The payoffs for each round are as follows:\n"
        "   - If both agents play A, both receive {reward} points.\n"
        "   - If both agents play B, both receive {punishment} points.\n"
        "   - If one agent plays A and the other plays B, the player who plays A receives "
        "{sucker} points and the player who plays B receives {temptation} points.\n"
        "3. The goal is to maximize your total points over all rounds.\n"
        "4. You will see the previous play of the other player after the completion of a round.\n"
        "\n"
        'In order to play A, you must write "<A>" and nothing else.\n'
        'In order to play B, you must write "<B>" and nothing else.\n'
        "\n"
        'During the entire game, you must only write "<A>" or "<B>". If you write anything '
        "else, your response will be considered as an error.\n"
        "\n"
        "The game starts now:"
    ),
    "own_move": "You played <{move}>.",
    "last_round": "Last round, the other agent played <{move}>.",
    "game_over": "The game is over. You scored {my_total} points and the other agent {other_total}.",
}


@register
class IteratedPrisonersDilemma(Game):
    name = "ipd"
    num_players = 2

    def __init__(
        self,
        rounds: int = 10,
        continuation: float | None = None,
        reward: float = 3,
        temptation: float = 5,
        sucker: float = 0,
        punishment: float = 1,
        prompts: dict[str, str] | None = None,
    ) -> None:
        require_count(self.name, "rounds", rounds)
        if continuation is not None and not 0.0 <= continuation <= 1.0:
            raise ValueError("ipd: continuation must be a probability in [0, 1]")
        self.rounds = rounds
        self.continuation = continuation
        self.reward, self.temptation = float(reward), float(temptation)
        self.sucker, self.punishment = float(sucker), float(punishment)
        self.prompt_overrides = dict(prompts or {})
        self.prompts = merge_prompts(PROMPTS, prompts, self.name)

    @property
    def info(self) -> GameInfo:
        """Bounds from the payoff matrix: any cell can be a seat's payoff in any round.

        With ``continuation`` the play may stop after any round, so one round's
        payoff bounds it too. The returns have a constant sum only if every cell
        of the matrix has the same sum, and with a random length only if that sum is 0.
        """
        cells = (self.reward, self.temptation, self.sucker, self.punishment)
        lengths = (self.rounds,) if self.continuation is None else (1, self.rounds)
        lo, hi = min(cells), max(cells)
        sums = {2 * self.reward, self.temptation + self.sucker, 2 * self.punishment}
        utility_sum: float | None = None
        if len(sums) == 1:
            (per_round,) = sums
            if self.continuation is None:
                utility_sum = per_round * self.rounds
            elif per_round == 0.0:
                utility_sum = 0.0
        chance = self.rounds - 1 if self.continuation is not None else 0
        return GameInfo(
            num_players=2,
            min_utility=min(k * lo for k in lengths),
            max_utility=max(k * hi for k in lengths),
            utility_sum=utility_sum,
            max_game_length=self.rounds,
            max_chance_nodes=chance,
            max_chance_outcomes=2 if chance else 0,
        )

    def payoff(self, mine: str, theirs: str) -> float:
        if mine == COOPERATE:
            return self.reward if theirs == COOPERATE else self.sucker
        return self.temptation if theirs == COOPERATE else self.punishment

    def params(self) -> dict[str, JSON]:
        return {
            "rounds": self.rounds,
            "continuation": self.continuation,
            "reward": self.reward,
            "temptation": self.temptation,
            "sucker": self.sucker,
            "punishment": self.punishment,
            "prompts": self.prompt_overrides,
        }


class IPDState(State):
    game: IteratedPrisonersDilemma

    def __init__(self, game: IteratedPrisonersDilemma, seed: int | None) -> None:
        super().__init__(game, seed)
        #: (move of seat 0, move of seat 1) per finished round.
        self.moves: list[tuple[str, str]] = []
        self.awaiting_continuation = False
        self.stopped = False

    # --- flow ------------------------------------------------------------------

    def current_players(self) -> frozenset[int]:
        if self.is_terminal():
            return frozenset()
        if self.awaiting_continuation:
            return frozenset({CHANCE})
        return frozenset({0, 1})

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if not self.awaiting_continuation:
            raise NotImplementedError("not a chance node")
        c = self.game.continuation
        assert c is not None
        return [(True, c), (False, 1.0 - c)]

    def _apply_chance(self, outcome: Action) -> None:
        if not self.awaiting_continuation or outcome not in (True, False):
            raise IllegalActionError(f"{outcome!r} is not a continuation outcome")
        self.awaiting_continuation = False
        self.stopped = not outcome

    def legal_actions(self, player: int) -> Sequence[Action]:
        return list(MOVES) if player in self.current_players() else []

    def check_action(self, player: int, action: Action) -> Action:
        self.require_mover(player)
        # "<A>", "a" and " A " all mean A: the paper's agents answer in tags.
        if isinstance(action, str):
            move = action.strip().strip("<>").strip().upper()
            if move in MOVES:
                return move
        raise IllegalActionError(f"answer A or B (or <A> / <B>), not {action!r}")

    def default_action(self, player: int) -> Action:
        # The paper's code scores any answer that is not "<A>" as B; a seat
        # that says nothing in time is treated the same way.
        return DEFECT

    def _apply(self, actions: Mapping[int, Action]) -> None:
        a, b = actions[0], actions[1]
        self.moves.append((a, b))
        self.round_rewards.append([self.game.payoff(a, b), self.game.payoff(b, a)])
        if len(self.moves) < self.game.rounds and self.game.continuation is not None:
            self.awaiting_continuation = True

    def is_terminal(self) -> bool:
        return self.stopped or len(self.moves) >= self.game.rounds

    # --- what players see ------------------------------------------------------

    def information_state(self, player: int) -> str:
        """Own move then the other's, per round: ``"AB,BB"``."""
        return ",".join(m[player] + m[1 - player] for m in self.moves)

    def observation(self, player: int) -> dict[str, JSON]:
        other = 1 - player
        history = [
            {
                "round": i + 1,
                "mine": m[player],
                "theirs": m[other],
                "reward": self.round_rewards[i][player],
                "other_reward": self.round_rewards[i][other],
            }
            for i, m in enumerate(self.moves)
        ]
        totals = self.returns()
        obs: dict[str, Any] = {
            **observation_head(self, player, self.game.rounds),
            "last_opponent_move": self.moves[-1][other] if self.moves else None,
            "history": history,
            **totals_fields(totals, player),
            "info_state": self.information_state(player),
        }
        if self.is_terminal():
            obs["returns"] = totals
        return obs

    def rules(self, player: int) -> str:
        g, t = self.game, self.game.prompts
        return fill(
            t["intro"],
            reward=number_text(g.reward),
            temptation=number_text(g.temptation),
            sucker=number_text(g.sucker),
            punishment=number_text(g.punishment),
        )

    def prompt(self, player: int) -> str:
        t = self.game.prompts
        lines = [self.rules(player)]
        for m in self.moves:
            lines.append(fill(t["own_move"], move=m[player]))
            lines.append(fill(t["last_round"], move=m[1 - player]))
        if self.is_terminal():
            lines.append(fill(t["game_over"], **totals_fields(self.returns(), player, number_text)))
        return "\n".join(lines)


IteratedPrisonersDilemma.state_class = IPDState
