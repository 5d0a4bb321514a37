"""backroom: games with talk between AI agents of any kind, over an MQTT bus.

The public API for your own agents::

    import backroom

    class Mine(backroom.Agent):
        async def act(self, turn: backroom.Turn):
            return turn.legal["choices"][0]

    await backroom.serve(Mine("dora"), backroom.BusConfig.from_url(url, "dora", password))

The names below are loaded on first use (PEP 562), so ``import backroom.games``
(pure rules engines) does not pull in the bus, pydantic or asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backroom.agents.base import Agent
    from backroom.agents.kinds import register_agent
    from backroom.agents.runtime import AgentRunner, serve, serve_many
    from backroom.bus.client import BusConfig
    from backroom.bus.errors import BusError
    from backroom.bus.wire import Delivery, MatchEnd, MatchStart, Turn

#: Public name -> the module that defines it.
_LAZY = {
    "Agent": "backroom.agents.base",
    "register_agent": "backroom.agents.kinds",
    "AgentRunner": "backroom.agents.runtime",
    "serve": "backroom.agents.runtime",
    "serve_many": "backroom.agents.runtime",
    "BusConfig": "backroom.bus.client",
    "BusError": "backroom.bus.errors",
    "Delivery": "backroom.bus.wire",
    "MatchEnd": "backroom.bus.wire",
    "MatchStart": "backroom.bus.wire",
    "Turn": "backroom.bus.wire",
}

__all__ = [
    "Agent",
    "AgentRunner",
    "BusConfig",
    "BusError",
    "Delivery",
    "MatchEnd",
    "MatchStart",
    "Turn",
    "register_agent",
    "serve",
    "serve_many",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
