"""Trainable play through an OpenAI-compatible server (``backroom serve-model``, vLLM's protocol).

The trainer has the server load its adapter (``/v1/load_lora_adapter``, name
``{policy}@{version}``); an ``llm`` agent with ``trainable: true`` plays the
version its match names by that model name, and its trace carries the exact
prompt and completion token ids and log-probs, which the learner recomputes
to the same values (TIS weights 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from backroom.agents.llm import LLMAgent
from backroom.bus.wire import AdapterRef, MatchStart, Trace, Turn
from backroom.model.adapters import adapter_digest
from backroom.model.backend import Backend
from backroom.model.serve import running_server, serve_model_app
from backroom.model.spec import ModelSpec
from backroom.trainer.learner import Learner, LoraSettings, sample_of
from backroom.trainer.serving import announce_to_servers


async def test_trainable_llm_agent_traces_what_the_server_said(
    tiny_qwen_model: Path, tmp_path: Path
) -> None:
    learner = Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"),
        lora=LoraSettings(rank=4, alpha=8),
        seed=2,
    )
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    folder = learner.save(tmp_path / "adapters" / "v1")
    sha, size = adapter_digest(folder)
    ref = AdapterRef(policy="pol", version="v1", uri=str(folder), sha256=sha, size=size)
    backend = Backend(
        ModelSpec(path=str(tiny_qwen_model), device="cpu")
    ).load()  # the server's own copy
    app = serve_model_app(backend, "tiny", adapter_dir=tmp_path / "adapters")
    async with running_server(app) as url:
        assert await announce_to_servers([url], ref) == {url: "ok"}
        assert "pol@v1" in backend.adapters
        assert (await announce_to_servers([url], ref))[url].startswith(
            "HTTP 400"
        )  # a name is loaded once
        agent = LLMAgent(
            "a",
            base_url=f"{url}/v1",
            model="tiny",
            api_key_env="",
            trainable=True,
            talk={"max_tokens": 8, "temperature": 1.0},
        )
        traces: list[Trace] = []

        async def sink(t: Trace) -> None:
            traces.append(t)

        agent._trace_sink = sink
        await agent.setup()
        try:
            for match, adapter in (("m1", ref), ("m2", None)):
                await agent.on_match_start(
                    MatchStart(
                        match=match,
                        seat=1,
                        seats=["b", "a"],
                        game="trust_and_split",
                        turn_timeout_s=30,
                        adapter=adapter,
                    )
                )
                await agent.talk(
                    Turn(
                        match=match,
                        turn=3,
                        seat=1,
                        phase="talk",
                        observation={},
                        prompt="Tell the other player your hand.",
                        deadline_s=30,
                    )
                )
        finally:
            await agent.close()
    tuned, base = traces
    assert tuned.request[0]["model"] == "pol@v1" and base.request[0]["model"] == "tiny"
    assert (tuned.adapter_version, base.adapter_version) == ("v1", None)
    assert (tuned.adapter_policy, base.adapter_policy) == ("pol", None)
    for t in traces:
        assert t.seat == 1 and t.prompt_ids and t.completion_ids
        assert len(t.logprobs) == len(t.completion_ids)
    # the learner, on the same adapter, recomputes the server's log-probs
    sample = sample_of(tuned, 1.0)
    assert sample is not None
    same = Learner(ModelSpec(path=str(tiny_qwen_model), device="cpu"), adapter=folder)
    with torch.no_grad():
        (lp,), _ = same.action_logprobs([sample])
    torch.testing.assert_close(lp, torch.tensor(tuned.logprobs), atol=1e-5, rtol=0)
