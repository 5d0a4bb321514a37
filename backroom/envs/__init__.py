"""PettingZoo views of backroom's games: ``pettingzoo_env(game, **params)``.

Needs the ``envs`` extra (``pip install 'backroom[envs]'``: PettingZoo and
Gymnasium). The other direction, a PettingZoo environment seated at the
referee, is the engine ``game: pettingzoo`` (``backroom/games/pettingzoo_aec.py``),
which imports neither.
"""

from importlib.util import find_spec

if missing := [m for m in ("pettingzoo", "gymnasium") if find_spec(m) is None]:
    raise ImportError(
        f'backroom.envs needs the "envs" extra ({", ".join(missing)} not installed): '
        "pip install 'backroom[envs]'"
    )

from backroom.envs.aec import BackroomAEC, pettingzoo_env

__all__ = ["BackroomAEC", "pettingzoo_env"]
