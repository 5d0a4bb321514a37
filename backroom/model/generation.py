"""Sampling free text for many prompts together, with per-token log-probs and per-row seeds.

Our own sampling loop rather than transformers' ``generate``: it starts from
the shared-head cache (``prefix_cache``), and yields each sampled token's
log-prob under the model itself (temperature 1, no top-p), which is what a
trainer recomputes.

A row may have a seeded generator of its own (``generators``), so its tokens
follow from its seed and its logits alone, whatever else shares the batch: an
agent's sampled text then replays from the match's seed. The logits
themselves can differ in the last bits with the batch's shape (padding, the
cached prefix), which flips a draw only at a near tie.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Generated:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


@dataclass
class Prompts:
    """Prompt tails after the shared head, right-aligned in padded rows (new tokens go on the right)."""

    ids: Any
    attention: Any  # over the head and the tails: 1 where a row has a token
    positions: Any
    next_positions: Any  # per row, the position of its first new token

    @classmethod
    def pad(cls, prompts: Sequence[Sequence[int]], shared: int, pad_id: int) -> Prompts:
        import torch

        rows = len(prompts)
        width = max(len(p) - shared for p in prompts)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        att = torch.zeros((rows, shared + width), dtype=torch.long)
        att[:, :shared] = 1
        pos = torch.zeros((rows, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            tail = p[shared:]
            ids[r, width - len(tail) :] = torch.tensor(tail)
            att[r, shared + width - len(tail) :] = 1
            pos[r, width - len(tail) :] = torch.arange(shared, len(p))
        return cls(ids, att, pos, torch.tensor([len(p) for p in prompts]))


def generators(rows: int, seed: int | None, seeds: Sequence[int | None] | None) -> Any:
    """What ``sample`` draws from: None (torch's global generator), one generator, or one per row.

    ``seed`` seeds one generator for the whole batch. ``seeds`` gives each row
    a generator of its own (a None seed: the batch's generator, or the global one).
    """
    import torch

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    if seeds is not None and len(seeds) != rows:
        raise ValueError(f"{len(seeds)} seeds for {rows} rows")
    if seeds is not None and any(s is not None for s in seeds):
        return [torch.Generator().manual_seed(s) if s is not None else gen for s in seeds]
    return gen


def sample(logits: Any, temperature: float, top_p: float, gen: Any) -> Any:
    """One token per row; ``gen``: a generator for the batch, or a list with one per row.

    With one generator per row, each row draws one uniform number from its
    own generator and takes the token where it falls in the row's
    cumulative distribution (inverse CDF, in float64): a row's draws never
    depend on its neighbours, at the cost of one tiny draw per row rather
    than a ``multinomial`` per row, which is several times slower.
    """
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
    if isinstance(gen, list):
        u = torch.tensor(
            [float(torch.rand((), generator=g, dtype=torch.float64)) for g in gen],
            dtype=torch.float64,
        )
        cdf = probs.double().cumsum(dim=-1)
        at = (u * cdf[:, -1]).unsqueeze(-1)
        # "right": the first token whose cumulative mass exceeds the draw, never a
        # zero-probability one (top-p's cut); past the end only by rounding
        idx = torch.searchsorted(cdf, at, right=True).view(-1)
        return torch.where(idx < probs.shape[-1], idx, probs.argmax(dim=-1))
    return torch.multinomial(probs, 1, generator=gen).view(-1)


def sample_replies(
    model: Any,
    device: Any,
    prompts: Prompts,
    cache: Any,
    forward_kwargs: dict[str, Any],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gen: Any,
    end_id: int,
    pad_id: int,
) -> tuple[list[list[int]], list[list[float]], int]:
    """Sample up to ``max_new_tokens`` per row, each row until its ``end_id``.

    Returns, per row, the sampled tokens (the end token included) and their
    log-probs, and the forward passes run. A finished row is fed padding
    until the others finish. The caller holds the model's lock and inference mode.
    """
    import torch

    rows = prompts.ids.shape[0]
    att, next_pos = prompts.attention, prompts.next_positions
    toks: list[list[int]] = [[] for _ in range(rows)]
    lps: list[list[float]] = [[] for _ in range(rows)]
    done = [False] * rows
    out = model(
        input_ids=prompts.ids.to(device),
        attention_mask=att.to(device),
        position_ids=prompts.positions.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **forward_kwargs,
    )
    passes = 1
    for step in range(max(1, int(max_new_tokens))):
        logits = out.logits[:, -1, :].float().cpu()
        logp = torch.log_softmax(logits, dim=-1)
        nxt = sample(logits, temperature, top_p, gen)
        for r in range(rows):
            if done[r]:
                continue
            t = int(nxt[r])
            toks[r].append(t)
            lps[r].append(float(logp[r, t]))
            if t == end_id:
                done[r] = True
        if all(done) or step == max_new_tokens - 1:
            break
        feed = torch.where(torch.tensor(done), torch.tensor(pad_id), nxt).view(rows, 1)
        att = torch.cat([att, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        out = model(
            input_ids=feed.to(device),
            attention_mask=att.to(device),
            position_ids=next_pos.view(rows, 1).to(device),
            past_key_values=out.past_key_values,
            use_cache=True,
            **forward_kwargs,
        )
        next_pos = next_pos + 1
        passes += 1
    return toks, lps, passes


def replies(
    toks: Sequence[list[int]],
    lps: Sequence[list[float]],
    end_id: int,
    decode: Callable[[Sequence[int]], str],
) -> list[Generated]:
    """Each row's reply: its text without the end token, and why it stopped."""
    results = []
    for ids, logprobs in zip(toks, lps, strict=True):
        finish = "stop" if ids and ids[-1] == end_id else "length"
        text_ids = ids[:-1] if finish == "stop" else ids
        results.append(Generated(decode(text_ids), ids, logprobs, finish))
    return results
