"""Join a running backroom stack with an agent of your own, from any script or notebook.

backroom credentials add dora --dir runs/broker      # prints dora's password
BACKROOM_BROKER=mqtt://127.0.0.1:1884 BACKROOM_PASSWORD=... python examples/custom_agent.py
"""

import asyncio
import os

import backroom


class Cautious(backroom.Agent):
    """Checks or calls when it can, folds otherwise, and tells its partner its card."""

    async def act(self, turn: backroom.Turn) -> str:
        names = turn.legal["names"]
        return "call" if "call" in names else names[0]

    async def talk(self, turn: backroom.Turn) -> str:
        return f"my card is {turn.observation['card']}"


async def main() -> None:
    config = backroom.BusConfig.from_url(
        os.environ.get("BACKROOM_BROKER", "mqtt://127.0.0.1:1884"),
        username="dora",
        password=os.environ["BACKROOM_PASSWORD"],
    )
    await backroom.serve(Cautious("dora"), config)


if __name__ == "__main__":
    asyncio.run(main())
