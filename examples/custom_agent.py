"""Join a running backroom stack with an agent of your own, from any script or notebook.

backroom credentials add dora --dir runs/broker      # prints dora's password
BACKROOM_BROKER=mqtt://127.0.0.1:1884 BACKROOM_PASSWORD=... python examples/custom_agent.py
"""

import asyncio
import os
import sys

import backroom


class Cautious(backroom.Agent):
    """Checks or calls when it can, folds otherwise, and tells its partner its card."""

    async def act(self, turn: backroom.Turn) -> str:
        names = turn.legal["names"]
        return "call" if "call" in names else names[0]

    async def talk(self, turn: backroom.Turn) -> str:
        return f"my card is {turn.observation['card']}"


async def main() -> None:
    url = os.environ.get("BACKROOM_BROKER", "mqtt://127.0.0.1:1884")
    password = os.environ.get("BACKROOM_PASSWORD")
    if not password:
        sys.exit("dora: set BACKROOM_PASSWORD (`backroom credentials add dora` prints it)")
    config = backroom.BusConfig.from_url(url, username="dora", password=password)
    print(f"dora: connecting to {url}", flush=True)
    async with backroom.AgentRunner(Cautious("dora"), config) as runner:
        print("dora: online; plays every match that seats her (Ctrl-C stops)", flush=True)
        await runner.wait_closed()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("dora: stopped")
    except backroom.BusError as exc:  # a wrong password, no broker there: one line
        sys.exit(f"dora: {exc}")
