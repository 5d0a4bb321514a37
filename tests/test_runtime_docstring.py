"""The usage example in ``backroom.agents.runtime``'s docstring runs as written."""

from __future__ import annotations

import asyncio
import re
import textwrap

import backroom.agents.runtime as runtime
from backroom.agents.scripted.basic import RandomAgent
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, BusConfig
from backroom.bus.wire import Status, parse

from .conftest import identity


async def test_agent_runner_docstring_example_connects_and_goes_online(broker: Broker) -> None:
    doc = runtime.__doc__ or ""
    (block,) = re.findall(r"::\n\n((?:    .*\n)+)", doc)
    code = textwrap.dedent(block)
    alice = identity(broker, "alice")
    names = {
        "AgentRunner": runtime.AgentRunner,
        "BusConfig": BusConfig,
        "MyAgent": RandomAgent,
        "url": broker.url,
        "pw": alice.password,
    }
    exec(f"async def example():\n{textwrap.indent(code, '    ')}", names)
    online = asyncio.Event()

    def seen(_topic: str, payload: bytes) -> None:
        msg = parse(payload)
        if isinstance(msg, Status) and msg.state == "online":
            online.set()

    async with Bus(identity(broker, "watcher", "observer")) as watcher:
        await watcher.subscribe(topics.status("alice"), seen)
        task = asyncio.create_task(names["example"]())
        await asyncio.wait_for(online.wait(), 20)  # the example connected and announced itself
        assert not task.done()  # and waits, as the docstring says, until the runner closes
        task.cancel()
