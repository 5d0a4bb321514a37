"""Bring your own game: a first-price sealed-bid auction, held to the contract by check_game.

python examples/custom_game.py      # runs backroom.games.testing.check_game on it
Register it for configs (`game: sealed_bid`) with an entry point in your package's pyproject:
[project.entry-points."backroom.games"]  sealed_bid = "my_package.custom_game:SealedBid"
"""

from backroom.games.base import CHANCE, Game, GameInfo, IllegalActionError, State, register


@register
class SealedBid(Game):
    """Chance deals each bidder a private value 1..max_value; all bid at once; the top bid
    wins and pays its bid (a tie splits the surplus)."""

    name = "sealed_bid"

    def __init__(self, players: int = 2, max_value: int = 10) -> None:
        self.num_players, self.max_value = players, max_value
        self.state_class = SealedBidState

    @property
    def info(self) -> GameInfo:  # a value-1 bidder paying max_value; a value-max bidder paying 0
        m = self.max_value
        return GameInfo(self.num_players, 1.0 - m, float(m), None, 1, self.num_players, m)

    def params(self) -> dict[str, int]:
        return {"players": self.num_players, "max_value": self.max_value}


class SealedBidState(State):
    game: SealedBid

    def __init__(self, game: Game, seed: int | None) -> None:
        super().__init__(game, seed)
        self.values: list[int] = []
        self.bids: list[int] | None = None

    def current_players(self) -> frozenset[int]:
        if self.bids is not None:
            return frozenset()
        if len(self.values) < self.num_players:
            return frozenset({CHANCE})
        return frozenset(range(self.num_players))

    def chance_outcomes(self) -> list[tuple[int, float]]:
        return [(v, 1 / self.game.max_value) for v in range(1, self.game.max_value + 1)]

    def _apply_chance(self, outcome: int) -> None:
        self.values.append(int(outcome))

    def legal_actions(self, player: int) -> list[int]:
        return list(range(self.game.max_value + 1))

    def check_action(self, player: int, action: object) -> int:
        self.require_mover(player)  # an LLM may answer "7": the canonical form is the int
        bid = int(text) if (text := str(action).strip()).isdigit() else -1
        if not 0 <= bid <= self.game.max_value:
            raise IllegalActionError(f"bid a whole number 0..{self.game.max_value}, not {action!r}")
        return bid

    def _apply(self, actions: dict[int, int]) -> None:  # type: ignore[override]
        self.bids = [actions[p] for p in range(self.num_players)]

    def is_terminal(self) -> bool:
        return self.bids is not None

    def returns(self) -> list[float]:
        if self.bids is None:
            return [0.0] * self.num_players
        top = max(self.bids)
        won = [p for p, b in enumerate(self.bids) if b == top]
        return [
            (self.values[p] - top) / len(won) if p in won else 0.0 for p in range(self.num_players)
        ]

    def observation(self, player: int) -> dict[str, object]:
        value = self.values[player] if player < len(self.values) else None
        out = {"game": "sealed_bid", "player": player, "value": value, "bids": self.bids}
        return out | ({"returns": self.returns()} if self.is_terminal() else {})

    def prompt(self, player: int) -> str:
        return (
            f"Sealed-bid auction, {self.num_players} bidders. The item is worth "
            f"{self.observation(player)['value']} to you. Bid a whole number from 0 to "
            f"{self.game.max_value}: the highest bid wins and pays its bid. Answer with the number."
        )


if __name__ == "__main__":
    from backroom.games.testing import check_game

    print(check_game(SealedBid, players=3))
