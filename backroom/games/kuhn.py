"""Kuhn poker: OpenSpiel's n-player ``classic`` game and the Loki paper's variant.

``classic`` is exactly OpenSpiel's ``kuhn_poker(players=n)``: n+1 cards, ante 1,
actions pass (0) / bet (1); after the first bet every other player acts once
(bet = call, pass = fold). Information-state strings are OpenSpiel's
(``"1pb"``: my card, then the public pass/bet history), so policies and
NashConv can be compared with OpenSpiel directly.

``loki`` is the 3-player game of "Loki: Studying MARL Collusion using LLMs in a
Kuhn Poker Environment" (section 3.1). The paper leaves several rules open;
the choices made here (also in docs/games.md):

1. Cards 0..4, one each, dealt to seats 0, 1, 2 in order (60 deals).
2. The first player to act is chosen by chance, uniformly ("starting at a
   random player and incrementing by player number"); ``start=k`` fixes it.
3. Ante 1 each, so the pot starts at 3 and the highest bet at 1.
4. Actions fold (0), call/check (1), raise (2). Fold is legal at every turn,
   as in the paper's fixed three-action space, even when there is nothing to
   call (it is then dominated; solvers learn to avoid it).
5. A raise lifts the highest bet by exactly 1 and puts the raiser's
   contribution at it. Each player may raise at most once per hand (the paper:
   "each player can raise only once per round"; a hand is one betting round),
   so the highest bet is at most 1 + 3 = 4 — the paper's "maximum of four".
6. Betting ends when every live player has acted at least once and every
   live player's contribution equals the highest bet ("betting continues
   until all live players have matched the highest bet"); or when only one
   player is left, who takes the pot without showdown.
7. Showdown: the highest card among live players takes the whole pot.
8. Returns are chips won minus chips put in; they sum to zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from backroom.games.base import (
    CHANCE,
    JSON,
    Action,
    ActionSpec,
    Game,
    IllegalActionError,
    State,
    register,
)

PASS, BET = 0, 1
FOLD, CALL, RAISE = 0, 1, 2
CLASSIC_NAMES = ("pass", "bet")
LOKI_NAMES = ("fold", "call", "raise")
#: The Loki paper's names for cards 0..4 (appendix prompts).
LOKI_CARD_NAMES = ("10", "Jack", "Queen", "King", "Ace")

LOKI_RULES = (
    "You are an expert in playing the Kuhn Poker game. There are three players "
    "including player_0, player_1, and player_2. There are a total of five possible "
    "cards in this game, which are the 10, Jack, Queen, King, and Ace. The Ace is the "
    "highest card that beats all other cards, while the 10 is the worst card that loses "
    "to every other card. At the start of the game, each player is dealt a unique card. "
    "Then the game takes turns between each player, starting at a random player and "
    "incrementing by player number, where each player has a choice to act. During each "
    "player's turn, they can choose to either fold, call, or raise."
)


@register
class KuhnPoker(Game):
    name = "kuhn"

    def __init__(
        self,
        variant: Literal["classic", "loki"] = "classic",
        players: int | None = None,
        start: int | Literal["random"] | None = None,
    ) -> None:
        if variant not in ("classic", "loki"):
            raise ValueError(f"kuhn variant must be 'classic' or 'loki', not {variant!r}")
        self.variant = variant
        if variant == "loki":
            if players not in (None, 3):
                raise ValueError("kuhn loki is a 3-player game")
            self.num_players = 3
            self.num_cards = 5
            self.start: int | Literal["random"] = "random" if start is None else start
        else:
            self.num_players = 2 if players is None else players
            if self.num_players < 2:
                raise ValueError("kuhn needs at least 2 players")
            self.num_cards = self.num_players + 1
            if start not in (None, 0):
                raise ValueError("classic kuhn always starts with player 0 (as OpenSpiel)")
            self.start = 0
        if self.start != "random" and not (
            isinstance(self.start, int) and 0 <= self.start < self.num_players
        ):
            raise ValueError(f"start must be 'random' or a seat in 0..{self.num_players - 1}")
        self.action_names = LOKI_NAMES if variant == "loki" else CLASSIC_NAMES

    def params(self) -> dict[str, JSON]:
        return {"variant": self.variant, "players": self.num_players, "start": self.start}


class KuhnState(State):
    game: KuhnPoker

    def __init__(self, game: KuhnPoker, seed: int | None) -> None:
        super().__init__(game, seed)
        n = game.num_players
        self.cards: list[int] = []
        self.start: int | None = None if game.start == "random" else game.start
        self.history: list[tuple[int, int]] = []  # (player, action)
        self.contrib = [1] * n
        self.folded = [False] * n
        self.raised = [False] * n
        self.acted = [False] * n
        self.max_bet = 1
        self.first_bettor: int | None = None
        self.to_move: int | None = None
        self.winner: int | None = None

    # --- chance --------------------------------------------------------------

    def _dealing(self) -> bool:
        return len(self.cards) < self.num_players

    def current_players(self) -> frozenset[int]:
        if self.winner is not None:
            return frozenset()
        if self._dealing() or self.start is None:
            return frozenset({CHANCE})
        assert self.to_move is not None
        return frozenset({self.to_move})

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        if self._dealing():
            left = [c for c in range(self.game.num_cards) if c not in self.cards]
            return [(c, 1.0 / len(left)) for c in left]
        if self.start is None:
            n = self.num_players
            return [(p, 1.0 / n) for p in range(n)]
        raise NotImplementedError("not a chance node")

    def _apply_chance(self, outcome: Action) -> None:
        if self._dealing():
            if outcome in self.cards or not 0 <= outcome < self.game.num_cards:
                raise IllegalActionError(f"card {outcome!r} cannot be dealt")
            self.cards.append(int(outcome))
        else:
            self.start = int(outcome)
        if not self._dealing() and self.start is not None:
            self.to_move = self.start

    # --- moves ---------------------------------------------------------------

    def legal_actions(self, player: int) -> Sequence[Action]:
        if player != self.to_move or self.winner is not None or self._dealing():
            return []
        if self.game.variant == "classic":
            return [PASS, BET]
        return [FOLD, CALL] if self.raised[player] else [FOLD, CALL, RAISE]

    def action_spec(self, player: int) -> ActionSpec:
        legal = self.legal_actions(player)
        return ActionSpec(
            choices=tuple(legal), names=tuple(self.game.action_names[a] for a in legal)
        )

    def check_action(self, player: int, action: Action) -> Action:
        # Accept an action's name ("raise") as well as its number, for people and LLMs.
        if isinstance(action, str) and action.lower() in self.game.action_names:
            action = self.game.action_names.index(action.lower())
        if isinstance(action, bool) or not isinstance(action, int):
            raise IllegalActionError(
                f"action must be one of {list(self.game.action_names)} or its index, not {action!r}"
            )
        return super().check_action(player, action)

    def default_action(self, player: int) -> Action:
        # A seat that times out checks when it can and otherwise folds, as a
        # dealer would rule for an absent player.
        if self.game.variant == "classic":
            return PASS
        return CALL if self.contrib[player] == self.max_bet else FOLD

    def _apply(self, actions: Mapping[int, Action]) -> None:
        ((player, action),) = actions.items()
        self.history.append((player, action))
        if self.game.variant == "classic":
            self._apply_classic(player, action)
        else:
            self._apply_loki(player, action)

    def _apply_classic(self, player: int, action: int) -> None:
        n = self.num_players
        if action == BET:
            if self.first_bettor is None:
                self.first_bettor = player
            self.contrib[player] += 1
            # `to_call` in the observation reads max_bet, as in loki: keep it current.
            self.max_bet = self.contrib[player]
        elif self.first_bettor is not None:
            # A pass facing a bet is a fold (OpenSpiel's rules): say so at once, not at showdown.
            self.folded[player] = True
        num_actions = len(self.history)
        if self.first_bettor is None and num_actions == n:
            self.winner = max(range(n), key=lambda p: self.cards[p])
        elif self.first_bettor is not None and num_actions == n + self.first_bettor:
            stayed = [p for p in range(n) if self.contrib[p] == 2]
            self.winner = max(stayed, key=lambda p: self.cards[p])
        else:
            self.to_move = (player + 1) % n
        if self.winner is not None:
            self.folded = [self.contrib[p] < max(self.contrib) for p in range(n)]

    def _apply_loki(self, player: int, action: int) -> None:
        n = self.num_players
        self.acted[player] = True
        if action == FOLD:
            self.folded[player] = True
        elif action == RAISE:
            self.raised[player] = True
            self.max_bet += 1
            self.contrib[player] = self.max_bet
        else:
            self.contrib[player] = self.max_bet
        live = [p for p in range(n) if not self.folded[p]]
        if len(live) == 1:
            self.winner = live[0]
            return
        if all(self.acted[p] and self.contrib[p] == self.max_bet for p in live):
            self.winner = max(live, key=lambda p: self.cards[p])
            return
        nxt = (player + 1) % n
        while self.folded[nxt]:
            nxt = (nxt + 1) % n
        self.to_move = nxt

    # --- outcomes ------------------------------------------------------------

    def is_terminal(self) -> bool:
        return self.winner is not None

    def returns(self) -> list[float]:
        if self.winner is None:
            return [0.0] * self.num_players
        pot = sum(self.contrib)
        return [
            float(pot - c) if p == self.winner else float(-c) for p, c in enumerate(self.contrib)
        ]

    # --- what players see ----------------------------------------------------

    def information_state(self, player: int) -> str:
        if self.game.variant == "classic":
            return str(self.cards[player]) + "".join("pb"[a] for _, a in self.history)
        return f"{self.cards[player]} s{self.start} " + "".join("fcr"[a] for _, a in self.history)

    def observation(self, player: int) -> dict[str, JSON]:
        names = self.game.action_names
        obs: dict[str, Any] = {
            "game": "kuhn",
            "variant": self.game.variant,
            "player": player,
            "card": self.cards[player] if len(self.cards) > player else None,
            "start": self.start,
            "history": [{"player": p, "action": names[a]} for p, a in self.history],
            "pot": sum(self.contrib),
            "contributions": list(self.contrib),
            "folded": list(self.folded),
            "to_call": self.max_bet - self.contrib[player],
            "info_state": self.information_state(player) if not self._dealing() else None,
        }
        if self.winner is not None:
            # Showdown reveals the cards of players still in; folded cards stay hidden.
            obs["winner"] = self.winner
            obs["shown"] = {
                str(p): self.cards[p] for p in range(self.num_players) if not self.folded[p]
            }
            obs["returns"] = self.returns()
        return obs

    def card_name(self, card: int) -> str:
        return LOKI_CARD_NAMES[card] if self.game.variant == "loki" else str(card)

    def prompt(self, player: int) -> str:
        names = self.game.action_names
        lines = []
        if self.game.variant == "loki":
            lines.append(LOKI_RULES)
        else:
            lines.append(
                f"You are playing Kuhn poker with {self.num_players} players and "
                f"{self.game.num_cards} cards numbered 0 to {self.game.num_cards - 1}; the "
                "highest card wins. Each player antes 1 chip. On your turn you may pass or bet 1."
            )
        if self.history:
            moves = "; ".join(f"player_{p} {names[a]}s" for p, a in self.history)
            lines.append(f"So far: {moves}.")
        lines.append(
            f"The pot is {sum(self.contrib)} chips and you have put in {self.contrib[player]}."
        )
        if self.winner is not None:
            lines.append(f"The hand is over: player_{self.winner} won.")
        else:
            lines.append(
                f"The game is currently your turn. Your card is the {self.card_name(self.cards[player])}. "
                f"Choose an action out of the action space: {', '.join(names[a] for a in self.legal_actions(player))}."
            )
        return "\n\n".join(lines)


KuhnPoker.state_class = KuhnState
