"""Scoring legal candidates: the exact log-probability of each completion, many prompts in one pass.

All candidates of all prompts in a batch go through ONE forward pass. What
follows the batch's shared head (``prefix_cache``) is packed into rows of token
trees (``TokenTree``): a prompt's tail, then its candidates as branches;
prompts that start alike share their first tokens. A 4D attention mask lets
every token see the head and its own tree path only, so a token that several
prompts or candidates share at the same place is encoded once. Matches in the
same state ask with the same prompt; candidates share their prompt. Logits
are computed only at the positions that predict candidate tokens.

``chunks`` splits a batch to stay within memory bounds, ``pack`` builds a
chunk's tensors, ``forward`` runs the model on them, and ``Packed.read`` turns
the log-probs back into one ``Scored`` per candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: One prompt to score: its token ids, its candidate completions, its adapter (None: the base model).
ScoreRequest = tuple[list[int], list[list[int]], str | None]


@dataclass
class Scored:
    """Log-probabilities of one candidate completion, token by token."""

    token_ids: list[int]
    logprobs: list[float]

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


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


class TokenTree:
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
class Placed:
    """Where a candidate of a scoring batch went: its row, and the nodes that predict its tokens."""

    request: int
    candidate: int
    row: int
    predictors: list[int]  # the tail's last node, then the candidate's own nodes but its last
    tokens: list[int]


def chunks(
    requests: Sequence[ScoreRequest], max_batch_tokens: int, max_scored_positions: int
) -> list[list[ScoreRequest]]:
    """Split a batch so that tokens and scored positions stay within memory bounds.

    The bounds are those of one row per prompt; packing shared tokens only
    shrinks it. A chunk holds one adapter's requests only.
    """
    out: list[list[ScoreRequest]] = []
    cur: list[ScoreRequest] = []
    longest = kept = 0
    for r in requests:
        length = len(r[0]) + sum(len(c) for c in r[1])
        positions = sum(len(c) for c in r[1])
        if cur and (
            (len(cur) + 1) * max(longest, length) > max_batch_tokens
            or kept + positions > max_scored_positions
            or r[2] != cur[0][2]
        ):
            out.append(cur)
            cur, longest, kept = [], 0, 0
        cur.append(r)
        longest = max(longest, length)
        kept += positions
    if cur:
        out.append(cur)
    return out


def check(requests: Sequence[ScoreRequest]) -> None:
    """Refuse what has nothing to predict from or nothing to score."""
    for prompt, cands, _ in requests:
        if not prompt:
            raise ValueError("an empty prompt cannot be scored")
        if any(not c for c in cands):
            raise ValueError("an empty candidate cannot be scored")


@dataclass
class Packed:
    """A chunk's forward-pass inputs, and where each candidate's tokens went.

    ``allowed`` is the boolean attention pattern (row, position, head +
    position): what each position sees; ``keep`` marks the positions whose
    logits are wanted, the ones that predict candidate tokens.
    """

    ids: Any
    pos: Any
    allowed: Any
    keep: Any
    placed: list[Placed]
    candidates: list[int]  # per request, how many candidates it has

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    def read(self, logp: Any) -> list[list[Scored]]:
        """Per request, per candidate, the log-probs of its tokens, from ``forward``'s output."""
        import torch

        rows, width = self.keep.shape
        # kept positions come out flattened in row-major order: a position's index is
        # the number of kept positions before it
        slot = (self.keep.flatten().cumsum(0) - 1).view(rows, width)
        at = torch.cat([slot[pl.row, pl.predictors] for pl in self.placed])
        lps = logp[at, torch.tensor([t for pl in self.placed for t in pl.tokens])].tolist()
        scored: dict[tuple[int, int], Scored] = {}
        start = 0
        for pl in self.placed:
            scored[pl.request, pl.candidate] = Scored(
                pl.tokens, lps[start : start + len(pl.tokens)]
            )
            start += len(pl.tokens)
        return [[scored[r, c] for c in range(n)] for r, n in enumerate(self.candidates)]


def pack(
    requests: Sequence[ScoreRequest], shared: int, row_tokens: int, pad_id: int
) -> Packed | None:
    """Pack what follows the first ``shared`` tokens into rows of token trees (None: nothing to score).

    Rows hold at most about ``row_tokens`` tokens (attention grows with the
    square of a row) and are padded to the longest, so the nodes are shared
    out evenly over the rows needed.
    """
    import torch

    # Each (prompt tail + candidate) is one path from a root of a token tree.
    # Sorted, similar prompts fall into the same row, and a tree's nodes come
    # out in depth-first order (what ``TokenTree.sees`` relies on).
    paths = sorted(
        (prompt[shared:] + cand, r, c)
        for r, (prompt, cands, _) in enumerate(requests)
        for c, cand in enumerate(cands)
    )
    if not paths:
        return None
    whole = TokenTree()
    for seq, _, _ in paths:
        whole.add(seq)
    budget = math.ceil(len(whole.tokens) / math.ceil(len(whole.tokens) / row_tokens))
    trees: list[TokenTree] = []
    placed: list[Placed] = []
    for seq, r, c in paths:
        if not trees or (trees[-1].tokens and trees[-1].size_with(seq) > budget):
            trees.append(TokenTree())
        nodes = trees[-1].add(seq)
        tail = len(requests[r][0]) - shared
        placed.append(Placed(r, c, len(trees) - 1, nodes[tail - 1 : -1], seq[tail:]))
    rows, width = len(trees), max(len(t.tokens) for t in trees)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
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
    return Packed(ids, pos, allowed, keep, placed, [len(cands) for _, cands, _ in requests])


def forward(
    model: Any, device: Any, packed: Packed, cache: Any, forward_kwargs: dict[str, Any]
) -> Any:
    """One forward pass over a packed chunk: log-probs at the kept positions, on the CPU.

    ``cache`` holds the shared head (None: no head); ``forward_kwargs`` the
    adapter options. The caller holds the model's lock and inference mode.
    """
    import torch

    dtype = next(model.parameters()).dtype
    rows, width = packed.keep.shape
    shared = packed.allowed.shape[-1] - width
    mask = torch.zeros((rows, 1, width, shared + width), dtype=dtype)
    mask.masked_fill_(~packed.allowed[:, None], torch.finfo(dtype).min)
    outputs = model(
        input_ids=packed.ids.to(device),
        attention_mask=mask.to(device),
        position_ids=packed.pos.to(device),
        past_key_values=cache,
        use_cache=cache is not None,
        logits_to_keep=packed.keep.to(device),
        **forward_kwargs,
    )
    logits = outputs.logits  # log-probs in float32 at least (a float64 model keeps its precision)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if logits.dim() == 3:  # a model that ignored the boolean selection
        logits = logits[packed.keep.to(logits.device)]
    return torch.log_softmax(logits, dim=-1).cpu()
