"""Keynesian beauty contest from "Shall We Team Up" (ICML 2024, section 3).

N players (24 in the paper) each choose an integer in [0, 100]; the winners are
all players whose choice is closest to 2/3 of the mean choice. Reward rules,
with M the number of winners: ``exclusive`` (a lone winner gets 1, several
winners get nothing), ``independent`` (each winner gets 1), ``amplified`` (each
winner gets M).

With ``discussion`` on, a talk phase precedes the choice: players speak in a
random order, two turns each, one at a time, every message public (later
speakers read earlier ones). The order is drawn by explicit chance nodes, one
speaker at a time, so a state without a seed can still be played (and a
solver can enumerate it). Personas (``personas``) go into the prompts as in the
paper's persona ablation.

The paper plays one round (its config: ``"max. round": 1``); ``rounds`` > 1
follows the code's multi-round mode, where each player is reminded of its own
earlier guesses. Every decision is in docs/games.md.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from backroom.games._common import (
    CountTalkState,
    fill,
    merge_prompts,
    persona_texts,
    require_count,
)
from backroom.games.base import JSON, Action, Game, GameInfo, IllegalActionError, register

Rule = Literal["exclusive", "independent", "amplified"]
RULES: tuple[str, ...] = ("exclusive", "independent", "amplified")
LOW, HIGH = 0, 100
TURNS = 2

#: Persona shorthands of the paper's ablation (code: ``persona_details``).
PERSONAS = {
    "none": "a player participating the number-choosing game",
    "agreeable": "an agreeable player participating the number-choosing game",
    "disagreeable": "a disagreeable player participating the number-choosing game",
}

#: The paper's prompts (appendix A.1, Prompts 2-9), worded as in its public
#: code (``Keynesian/prompt.py``). ``multi_round`` is ours, for ``rounds`` > 1.
PROMPTS: dict[str, str] = {
    "rules": (
        "Welcome to the game. You players will be asked to choose a number between 0 and 100.\n"
        "The player(s) who select a number closest to 2/3 of the average of all selected numbers "
        "(compared with the choices of other players) will win the game.\n"
    ),
    "multi_round": "We will play {rounds} rounds of this game; each round is won and rewarded on its own.\n",
    "base_reward": (
        "You players are college students. You will earn 1 mark(s) for the Game Theory course "
        "as a reward if you win the game alone.\n"
    ),
    "exclusive": (
        "If multiple players win the game together, no one will obtain a reward.\n"
        "That is, only by winning alone can one earn 1 mark(s) for the Game Theory course.\n"
    ),
    "independent": (
        "If multiple players win the game together, each winner will obtain an independent reward.\n"
        "That is, each winner will earn 1 mark(s) for the Game Theory course.\n"
    ),
    "amplified": (
        "If multiple players win the game together, each winner will obtain an amplified reward "
        "that is scaled based on the number of winners.\n"
        "That is, if M players win the game, each winner will earn M*1 mark(s) for the Game Theory course.\n"
    ),
    "communication_rule": (
        "Before selecting a number, all players are allowed to discuss the game together, "
        "taking two turns to speak. In each turn, the players can present their ideas one by one.\n"
    ),
    "round_beginning": "We are now going to play Round {round_number}.\n",
    "choice_history": "Your previous guesses were: {previous_guesses}\n",
    "communication_request": (
        "Let's start discussion:\n{previous_talks}"
        "Player {player_id}, you are {persona}. Please speak.\n"
        "(Please present your ideas as concisely as possible. You may state your strategy "
        "explicitly, e.g., 'I will select X.' You don't need to indicate your identity in the response.)"
    ),
    "communication_history": "This is a record of your previous discussions:\n<<{communication_history}>>\n",
    "choice_request": (
        "Player {player_id}, you are {persona}.\n"
        "Please enter your choice of number between 0 and 100 on the first line "
        "(reply with a number only, without any text, e.g., '100'), "
        "and provide a brief explanation of your choice on the second line.\n"
    ),
    "talk_line": "Player {player_id}: {text}\n",
    "game_over": "The game is over. You earned {my_total} mark(s).\n",
}


def winners_of(choices: Sequence[int]) -> list[int]:
    """Seats closest to 2/3 of the mean, compared exactly in integers.

    |x - 2/3 * S/N| is ordered like |3N x - 2S|, so ties are exact and two
    choices equally far on either side of the target both win.
    """
    n, s = len(choices), sum(choices)
    dist = [abs(3 * n * x - 2 * s) for x in choices]
    best = min(dist)
    return [i for i, d in enumerate(dist) if d == best]


def rewards_for(n: int, winners: Sequence[int], rule: str) -> list[float]:
    m = len(winners)
    if rule == "exclusive":
        per = 1.0 if m == 1 else 0.0
    elif rule == "independent":
        per = 1.0
    elif rule == "amplified":
        per = float(m)
    else:
        raise ValueError(f"unknown reward rule {rule!r}")
    return [per if i in winners else 0.0 for i in range(n)]


@register
class BeautyContest(Game):
    name = "beauty_contest"

    def __init__(
        self,
        players: int = 24,
        rule: Rule = "amplified",
        discussion: bool = True,
        personas: list[str] | None = None,
        rounds: int = 1,
        max_chars: int = 500,
        prompts: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(players, int) or players < 2:
            raise ValueError("beauty_contest: players must be an integer >= 2")
        if rule not in RULES:
            raise ValueError(f"beauty_contest: rule must be one of {list(RULES)}, not {rule!r}")
        require_count(self.name, "rounds", rounds)
        if personas is not None and len(personas) != players:
            raise ValueError(f"beauty_contest: personas needs one entry per player ({players})")
        self.num_players = players
        self.rule: str = rule
        self.discussion = bool(discussion)
        self.persona_params = list(personas) if personas is not None else None
        self.personas = persona_texts(personas, PERSONAS, players)
        self.rounds, self.max_chars = rounds, int(max_chars)
        self.prompt_overrides = dict(prompts or {})
        self.prompts = merge_prompts(PROMPTS, prompts, self.name)

    @property
    def info(self) -> GameInfo:
        """Per round a seat wins nothing, or 1 (``amplified``: M, the number of winners,
        N when all choose alike); both ends are attained. General-sum: how much is
        paid out depends on the ties.

        With discussion a round is 2N messages and one simultaneous choice, and
        chance draws the speaking order one speaker at a time (N nodes, at most
        N outcomes each).
        """
        n = self.num_players
        best = float(n) if self.rule == "amplified" else 1.0
        talk = self.discussion
        return GameInfo(
            num_players=n,
            min_utility=0.0,
            max_utility=self.rounds * best,
            utility_sum=None,
            max_game_length=self.rounds * (TURNS * n + 1 if talk else 1),
            max_chance_nodes=self.rounds * n if talk else 0,
            max_chance_outcomes=n if talk else 0,
        )

    def params(self) -> dict[str, JSON]:
        return {
            "players": self.num_players,
            "rule": self.rule,
            "discussion": self.discussion,
            "personas": self.persona_params,
            "rounds": self.rounds,
            "max_chars": self.max_chars,
            "prompts": self.prompt_overrides,
        }


class BeautyContestState(CountTalkState):
    game: BeautyContest
    count_what = "your number"

    def __init__(self, game: BeautyContest, seed: int | None) -> None:
        super().__init__(game, seed)
        #: Speaking order of the current round, drawn one speaker at a time.
        self.order: list[int] = []
        #: This round's discussion: {"player", "turn", "text"}.
        self.messages: list[dict[str, Any]] = []
        #: Finished rounds: choices of everyone, target, winners, rewards.
        self.results: list[dict[str, Any]] = []
        self.phase = "act"
        self._sync_phase()

    # --- flow ------------------------------------------------------------------

    def _at_chance(self) -> bool:
        # The speaking order is drawn one speaker at a time before the discussion.
        return self.game.discussion and len(self.order) < self.num_players

    def _talking(self) -> bool:
        return self.game.discussion and len(self.messages) < TURNS * self.num_players

    def speaker(self) -> int | None:
        if self.is_terminal() or self._at_chance() or not self._talking():
            return None
        return self.order[len(self.messages) % self.num_players]

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if self.is_terminal() or not self._at_chance():
            raise NotImplementedError("not a chance node")
        left = [p for p in range(self.num_players) if p not in self.order]
        return [(p, 1.0 / len(left)) for p in left]

    def _apply_chance(self, outcome: Action) -> None:
        if not self._at_chance():
            raise IllegalActionError("not a chance node")
        if (
            isinstance(outcome, bool)
            or outcome not in range(self.num_players)
            or outcome in self.order
        ):
            raise IllegalActionError(f"{outcome!r} cannot speak next")
        self.order.append(int(outcome))
        self._sync_phase()

    def count_range(self) -> tuple[int, int]:
        return LOW, HIGH

    def default_act(self, player: int) -> Action:
        # 50, the level-0 guess (the middle of the range), for a choice that
        # did not come in time.
        return 50

    def _add_message(self, seat: int, text: str) -> None:
        turn = len(self.messages) // self.num_players + 1
        self.messages.append({"player": seat, "turn": turn, "text": text})

    def _apply_act(self, actions: Mapping[int, Action]) -> None:
        n = self.num_players
        choices = [int(actions[p]) for p in range(n)]
        winners = winners_of(choices)
        rewards = rewards_for(n, winners, self.game.rule)
        mean = sum(choices) / n
        self.round_rewards.append(rewards)
        self.results.append(
            {
                "round": len(self.results) + 1,
                "order": list(self.order),
                "choices": choices,
                "mean": mean,
                "target": 2.0 * mean / 3.0,
                "winners": winners,
                "closest": choices[winners[0]],
                "rewards": rewards,
            }
        )
        self.order, self.messages = [], []

    def is_terminal(self) -> bool:
        return len(self.results) >= self.game.rounds

    # --- what players see ------------------------------------------------------

    def observation(self, player: int) -> dict[str, JSON]:
        g = self.game
        history = [
            {
                "round": r["round"],
                "my_choice": r["choices"][player],
                "won": player in r["winners"],
                "closest": r["closest"],
                "target": r["target"],
                "winners": len(r["winners"]),
                "reward": r["rewards"][player],
            }
            for r in self.results
        ]
        speaker = self.speaker()
        obs: dict[str, Any] = {
            "game": "beauty_contest",
            "round": self.current_round(),
            "rounds": g.rounds,
            "player": player,
            "players": self.num_players,
            "phase": self.phase,
            "rule": g.rule,
            "range": [LOW, HIGH],
            "persona": g.personas[player],
            "discussion": g.discussion,
            "order": list(self.order),
            "speaker": speaker,
            "speaking_turn": len(self.messages) // self.num_players + 1
            if speaker is not None
            else None,
            "messages": [dict(m) for m in self.messages],
            "history": history,
            "my_total": self.returns()[player],
        }
        if self.is_terminal():
            # The game is over: everyone's choices may be shown (the analysis reads them here).
            obs["results"] = copy.deepcopy(self.results)
            obs["returns"] = self.returns()
        return obs

    def _background(self, with_communication: bool) -> str:
        g, t = self.game, self.game.prompts
        text = t["rules"]
        if g.rounds > 1:
            text += fill(t["multi_round"], rounds=g.rounds)
        text += t["base_reward"] + t[g.rule]
        if with_communication:
            text += t["communication_rule"]
        return text + "\n"

    def rules(self, player: int) -> str:
        return self._background(self.game.discussion)

    def _previous_guesses(self, player: int) -> str:
        parts = []
        for r in self.results:
            mine = r["choices"][player]
            if player in r["winners"]:
                parts.append(f"{mine} (Win), ")
            else:
                parts.append(f"{mine} (Lose, the closest number was {r['closest']}), ")
        wins = sum(player in r["winners"] for r in self.results)
        return "".join(parts) + f"where you won {wins} time(s)."

    def _talks(self) -> str:
        t = self.game.prompts
        return "".join(
            fill(t["talk_line"], player_id=m["player"] + 1, text=m["text"])
            for m in self.messages
            if m["text"]
        )

    def prompt(self, player: int) -> str:
        g, t = self.game, self.game.prompts
        persona = g.personas[player]
        if self.is_terminal():
            return self._background(False) + fill(t["game_over"], my_total=self.returns()[player])
        talking = self.phase == "talk"
        text = self._background(talking)
        if g.rounds > 1:
            text += fill(t["round_beginning"], round_number=len(self.results) + 1)
            if self.results:
                text += fill(t["choice_history"], previous_guesses=self._previous_guesses(player))
        if talking and self.speaker() != player:
            # Someone else has the floor: show the discussion, ask for nothing.
            return text + fill(t["communication_history"], communication_history=self._talks())
        if talking:
            return text + fill(
                t["communication_request"],
                previous_talks=self._talks(),
                player_id=player + 1,
                persona=persona,
            )
        if g.discussion:
            text += fill(t["communication_history"], communication_history=self._talks())
        return text + fill(t["choice_request"], player_id=player + 1, persona=persona)


BeautyContest.state_class = BeautyContestState
