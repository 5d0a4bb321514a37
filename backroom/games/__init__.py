"""Pure rules engines. Importing this package registers every engine by name."""

from backroom.games import beauty_contest as beauty_contest
from backroom.games import bertrand as bertrand
from backroom.games import ipd as ipd
from backroom.games import kuhn as kuhn
from backroom.games import openspiel as openspiel
from backroom.games import split_nocomm as split_nocomm
from backroom.games import trust_and_split as trust_and_split
from backroom.games.base import (
    CHANCE,
    Action,
    ActionSpec,
    Game,
    GameInfo,
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
    "GameInfo",
    "IllegalActionError",
    "State",
    "make_game",
    "registered_games",
]
