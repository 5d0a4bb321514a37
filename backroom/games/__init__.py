"""Pure rules engines. Importing this package registers every engine by name."""

from backroom.games import kuhn as kuhn
from backroom.games.base import (
    CHANCE,
    Action,
    ActionSpec,
    Game,
    IllegalActionError,
    State,
    make_game,
    registered_games,
)

__all__ = [
    "CHANCE",
    "Action",
    "ActionSpec",
    "Game",
    "IllegalActionError",
    "State",
    "make_game",
    "registered_games",
]
