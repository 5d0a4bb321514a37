"""Issue 22, item 4: a referee names an adapter no trainer chose, replayed against a real broker.

``name_unannounced_adapter`` logs in as a ``referee`` identity and writes a
``MatchStart`` straight into a ``local`` agent's inbox (the referee role may
write every inbox), naming a folder with its true digest that no trainer
announced, then a ``Turn``; it reads the agent's answer on its outbox (which
referees read). Then a ``trainer`` identity announces the same reference on
``models/{policy}/versions/{version}`` and the referee names it again. Held when
the first seat refuses the adapter (its answer a fallback marked
``adapter_refused``, ``backroom_adapter_rejected_total{reason="unannounced"}``
up by one, the version never loaded) and the second plays it. Before issue 22
the agent loaded whatever a match named.

The agent runs in this process (a tiny random Qwen2 on SmolLM2's tokenizer, a
random LoRA for it: nothing downloaded) under the ``agent`` identity, which the
caller creates with ``referee`` and ``trainer`` (not the names a running stack
uses: a second login would throw it off).

Run alone, from ``bench/``: ``python -m abuse_parts.provenance`` (starts its own broker).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from abuse_parts import login
from backroom.bus import topics
from backroom.bus.client import Bus
from backroom.bus.wire import Action, Checkpoint, MatchStart, Turn, parse_all


def _model_and_adapter(root: Path) -> tuple[Path, Path]:
    """A 2-layer random Qwen2 and a random LoRA for it (as tests/conftest.py's ``tiny_qwen``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    from backroom.model.backend import shared_backend
    from backroom.model.loading import save_random_qwen

    model_dir = save_random_qwen(root / "model", shared_backend().tokenizer, "tiny")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(Qwen2ForCausalLM.from_pretrained(model_dir), lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(root / "adapter"))
    return model_dir, root / "adapter"


async def name_unannounced_adapter(
    url: str,
    creds_dir: str | Path,
    seconds: float,
    agent: str = "agent",
    referee: str = "referee",
    trainer: str = "trainer",
) -> dict[str, Any]:
    """Name an unannounced adapter in a MatchStart, then the same once a trainer announced it.

    ``seconds`` bounds each answer's wait (the agent waits up to 2 s for an
    announcement that may trail a match's start before refusing).
    """
    from prometheus_client import REGISTRY

    from backroom.agents.adapter_seats import adapter_name
    from backroom.agents.local_model import LocalAgent
    from backroom.agents.runtime import AgentRunner
    from backroom.bus.wire import AdapterRef
    from backroom.model.adapters import adapter_digest

    def rejected() -> float:
        labels = {"reason": "unannounced"}
        return REGISTRY.get_sample_value("backroom_adapter_rejected_total", labels) or 0.0

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapter_dir = await asyncio.to_thread(_model_and_adapter, Path(tmp))
        sha, size = adapter_digest(adapter_dir)
        ref = AdapterRef(policy="pol", version="v9", uri=str(adapter_dir), sha256=sha, size=size)
        local = LocalAgent(
            agent,
            model=str(model_dir),
            device="cpu",
            policy="pol",
            adapter_cache=str(Path(tmp) / "cache"),
            announce_wait_s=2.0,
        )
        answers: asyncio.Queue[Action] = asyncio.Queue()

        def on_outbox(_topic: str, payload: bytes) -> None:
            for msg in parse_all(payload):
                if isinstance(msg, Action):
                    answers.put_nowait(msg)

        async def play(match: str) -> Action:
            start = MatchStart(
                match=match,
                seat=0,
                seats=[agent, "nobody"],
                game="ipd",
                params={"rounds": 1},
                turn_timeout_s=20,
                adapter=ref,
                referee=referee,
            )
            turn = Turn(
                match=match,
                turn=0,
                seat=0,
                phase="act",
                observation={},
                prompt="Choose <A> or <B>.",
                legal={"choices": ["A", "B"]},
                deadline_s=20,
            )
            await ref_bus.publish(topics.inbox(agent), start)
            await ref_bus.publish(topics.inbox(agent), turn)
            return await asyncio.wait_for(answers.get(), seconds)

        before = rejected()
        t0 = time.monotonic()
        async with (
            AgentRunner(local, login(url, creds_dir, agent)),
            Bus(login(url, creds_dir, referee)) as ref_bus,
            Bus(login(url, creds_dir, trainer)) as tr_bus,
        ):
            await ref_bus.subscribe(topics.outbox(agent, referee), on_outbox)
            forged = await play("forged")
            cp = Checkpoint(**ref.model_dump())
            await tr_bus.publish(topics.model_version("pol", "v9"), cp, retain=True)
            announced = await play("announced")
            await tr_bus.publish(topics.model_version("pol", "v9"), b"", retain=True)
            assert local.cache is not None
            loaded = adapter_name("pol", "v9", sha) in local.cache.loaded
        return {
            "forged_fallback": forged.fallback,
            "unannounced_rejected": rejected() - before,
            "announced_fallback": announced.fallback,
            "announced_loaded": loaded,
            "took_s": round(time.monotonic() - t0, 2),
            "ok": forged.fallback == "adapter_refused"
            and rejected() - before == 1
            and announced.fallback is None
            and loaded,
        }


async def _main() -> None:
    from backroom.bus.broker import Broker

    with tempfile.TemporaryDirectory() as tmp:
        broker = Broker(Path(tmp) / "broker")
        broker.credentials.add("agent", role="agent")
        broker.credentials.add("referee", role="referee")
        broker.credentials.add("trainer", role="trainer")
        broker.start()
        try:
            print(
                "name_unannounced_adapter",
                await name_unannounced_adapter(broker.url, broker.dir, 60),
            )
        finally:
            broker.stop()


if __name__ == "__main__":
    asyncio.run(_main())
