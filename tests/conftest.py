"""Shared fixtures: a real Mosquitto broker with generated passwords and ACL, per test."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from backroom.agents import make_agent
from backroom.agents.base import Agent
from backroom.agents.runtime import AgentRunner
from backroom.bus.broker import Broker
from backroom.bus.client import BusConfig
from backroom.referee.service import Referee

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker")
    b.credentials.add("runner", role="runner")
    b.start()
    yield b
    b.stop()


def identity(broker: Broker, name: str, role: str = "agent") -> BusConfig:
    """Create (if needed) an identity on the running broker and return its connection settings."""
    cred = broker.credentials.add(name, role=role)  # type: ignore[arg-type]
    broker.reload()
    return BusConfig(host=broker.host, port=broker.port, username=name, password=cred.password)


@asynccontextmanager
async def stack(
    broker: Broker, runs_dir: Path, agents: list[Agent]
) -> AsyncIterator[tuple[Referee, list[AgentRunner]]]:
    """A referee and agents in this process (each with its own connection and identity)."""
    configs = [identity(broker, a.id) for a in agents]
    await asyncio.sleep(0.05)  # let the broker reread its password file after SIGHUP
    async with Referee(identity(broker, "referee", "referee"), runs_dir=runs_dir) as ref:
        runners = [AgentRunner(a, c) for a, c in zip(agents, configs, strict=True)]
        for r in runners:
            await r.__aenter__()
        try:
            yield ref, runners
        finally:
            for r in runners:
                await r.__aexit__(None, None, None)


def agents(*specs: tuple[str, str]) -> list[Agent]:
    return [make_agent(kind, agent_id) for agent_id, kind in specs]


class RawAgent:
    """An agent driven by hand over its own MQTT identity: sends anything, logs everything.

    It subscribes to ``backroom/v1/#``, so what it logs is exactly what the
    broker lets this identity read.
    """

    def __init__(self, config: BusConfig) -> None:
        from backroom.bus.client import Bus

        self.id = config.username or ""
        self.bus = Bus(config)
        self.seen: list[tuple[str, bytes]] = []
        self.inbox: list[object] = []
        self.new = asyncio.Event()

    async def __aenter__(self) -> RawAgent:
        from backroom.bus import topics
        from backroom.bus.wire import Status

        await self.bus.__aenter__()
        await self.bus.subscribe("backroom/v1/#", self._on)
        await self.bus.publish(
            topics.status(self.id), Status(state="online", kind="raw"), retain=True
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()

    def _on(self, topic: str, payload: bytes) -> None:
        from backroom.bus.wire import WireError, parse

        self.seen.append((topic, payload))
        if topic.endswith(f"/{self.id}/inbox"):
            try:
                self.inbox.append(parse(payload))
            except WireError:
                self.inbox.append(payload)
            self.new.set()

    async def send(self, payload: bytes | object) -> None:
        from backroom.bus import topics

        await self.bus.publish(topics.outbox(self.id), payload)  # type: ignore[arg-type]

    async def next_of(self, kind: type, timeout: float = 5.0, after: int = 0) -> object:
        """The first inbox message of ``kind`` at index >= ``after``."""

        async def wait() -> object:
            while True:
                for msg in self.inbox[after:]:
                    if isinstance(msg, kind):
                        return msg
                self.new.clear()
                await self.new.wait()

        return await asyncio.wait_for(wait(), timeout)

    def of(self, kind: type) -> list:
        return [m for m in self.inbox if isinstance(m, kind)]


def make_tiny_qwen(folder: Path) -> Path:
    """A randomly initialised 2-layer Qwen2 on SmolLM2's tokenizer (nothing downloaded): the Qwen code path, fast."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from backroom.agents.backend import shared_backend

    tok = shared_backend().tokenizer
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen") / "model")


async def eventually(condition: Callable[[], bool], timeout: float) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.05) + 1):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition still false after {timeout} s")
