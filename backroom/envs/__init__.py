"""PettingZoo both ways: ``pettingzoo_env(game, **params)``, and PettingZoo games seated.

``pettingzoo_env`` (aec.py) needs the ``envs`` extra (``pip install
'backroom[envs]'``: PettingZoo and Gymnasium); asking for it without them says
so. The other direction, a PettingZoo environment seated at the referee, is the
engine ``game: pettingzoo`` (seated.py). The game registry, below this package,
finds it through backroom's own ``backroom.games`` entry point, as it finds a
third party's engine; its module imports PettingZoo only when a config builds
an environment, so importing this package needs neither library.
"""

from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backroom.envs.aec import BackroomAEC, pettingzoo_env

__all__ = ["BackroomAEC", "pettingzoo_env"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'backroom.envs' has no attribute {name!r}")
    if missing := [m for m in ("pettingzoo", "gymnasium") if find_spec(m) is None]:
        raise ImportError(
            f'backroom.envs needs the "envs" extra ({", ".join(missing)} not installed): '
            "pip install 'backroom[envs]'"
        )
    from backroom.envs import aec

    return getattr(aec, name)
