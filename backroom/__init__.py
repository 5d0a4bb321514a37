"""backroom: games with talk between AI agents of any kind, over an MQTT bus.

The public API for your own agents::

    import backroom

    class Mine(backroom.Agent):
        async def act(self, turn: backroom.Turn):
            return turn.legal["choices"][0]

    await backroom.serve(Mine("dora"), backroom.BusConfig.from_url(url, "dora", password))
"""

from backroom.agents.base import Agent, register_agent
from backroom.agents.runtime import AgentRunner, serve, serve_many
from backroom.bus.client import BusConfig
from backroom.bus.wire import Delivery, MatchEnd, MatchStart, Turn

__all__ = [
    "Agent",
    "AgentRunner",
    "BusConfig",
    "Delivery",
    "MatchEnd",
    "MatchStart",
    "Turn",
    "register_agent",
    "serve",
    "serve_many",
]
__version__ = "0.1.0"
