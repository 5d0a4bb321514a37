"""The prompt head a batch shares, encoded once, and the last few heads kept for the next batch.

Prompts of one game share a long head (system prompt, rules), and on a CPU a
forward pass costs about the same per token however it is batched, so speed
comes from encoding fewer tokens. A batch's common head is encoded in a pass
of its own and its key/value cache repeated for every row (scoring and
generation alike); ``PrefixCache`` keeps the last few heads, so the next
batch of the game (or the next turn of a lone match) encodes only what its
head adds.

With causal attention the keys and values of a head's first k tokens depend
on those k tokens only, so a cached head serves any later prompt that starts
with part of it: it is sliced, never recomputed.

Bench (bench/local_agent.py, 32 Kuhn matches, SmolLM2 on 2 cores): see
docs/speed.md, "Local agent scoring".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

#: Shortest common head worth a forward pass of its own.
MIN_SHARED_PREFIX = 16

#: Keys and values of one encoded head: a (keys, values) pair per layer.
KV = list[tuple[Any, Any]]


def common_length(seqs: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading tokens all of ``seqs`` share, at most ``limit``."""
    first, k = seqs[0], 0
    while k < limit and all(s[k] == first[k] for s in seqs):
        k += 1
    return k


class PrefixCache:
    """Keys and values of the last few prompt heads encoded, per adapter, least recently used out.

    An adapter changes every key and value: entries are per adapter name, and
    the backend clears them all when an adapter is loaded or unloaded. Not
    thread-safe: the backend calls it under its lock.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[str | None, tuple[int, ...]], KV] = OrderedDict()

    def longest(self, adapter: str | None, tokens: Sequence[int]) -> tuple[int, KV]:
        """The cached head sharing most leading tokens with ``tokens``: (how many, its keys and values)."""
        best: tuple[str | None, tuple[int, ...]] | None = None
        known = 0
        for key in self.entries:
            if key[0] == adapter:
                n = common_length([key[1], tokens], min(len(key[1]), len(tokens)))
                if n > known:
                    best, known = key, n
        if best is None:
            return 0, []
        self.entries.move_to_end(best)
        return known, self.entries[best]

    def put(self, adapter: str | None, tokens: Sequence[int], kv: KV) -> None:
        self.entries[(adapter, tuple(tokens))] = kv
        self.entries.move_to_end((adapter, tuple(tokens)))
        self.trim()

    def trim(self) -> None:
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()

    def head_length(self, prompts: Sequence[Sequence[int]]) -> int:
        """Length of the head worth encoding on its own (0 when not worth it).

        The common prefix of the prompts, less one token (each row keeps at
        least one own token to predict from). A lone prompt is split only when
        its head can be cached: without the cache its extra pass would buy nothing.
        """
        if len(prompts) < 2 and not self.size:
            return 0
        k = common_length(prompts, min(len(p) for p in prompts) - 1)
        return k if k >= MIN_SHARED_PREFIX else 0

    def head_cache(
        self,
        model: Any,
        device: Any,
        head: list[int],
        rows: int,
        adapter: str | None,
        forward_kwargs: Callable[[], dict[str, Any]],
    ) -> tuple[Any, int]:
        """A key/value cache holding ``head`` for ``rows`` rows (None if empty), and the passes it took.

        Only the part of ``head`` that no cached head starts with is encoded
        (``forward_kwargs``: the adapter options of that one-row pass); the
        result is cached in turn. The rows get copies: the model appends to them.
        """
        import torch

        if not head:
            return None, 0
        known, kv = self.longest(adapter, head)
        passes = 0
        if known < len(head):
            out = model(
                input_ids=torch.tensor([head[known:]], device=device),
                position_ids=torch.arange(known, len(head), device=device)[None],
                past_key_values=repeat_cache(model, kv, known, 1) if known else None,
                use_cache=True,
                logits_to_keep=1,
                **forward_kwargs(),
            )
            passes = 1
            kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
            self.put(adapter, head, kv)
        return repeat_cache(model, kv, len(head), rows), passes


def repeat_cache(model: Any, kv: KV, length: int, rows: int) -> Any:
    """A fresh ``DynamicCache`` with the first ``length`` positions of ``kv``, for ``rows`` rows."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        cache.update(
            k[:, :, :length].expand(rows, -1, -1, -1),
            v[:, :, :length].expand(rows, -1, -1, -1),
            i,
        )
    return cache
