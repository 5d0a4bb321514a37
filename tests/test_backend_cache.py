"""Scoring with the prompt-head cache and token trees gives the log-probs of scoring without them.

``Backend.score`` keeps the keys and values of recent prompt heads
(``backroom.model.prefix_cache``) and packs prompts that start alike
into token trees (``backroom.model.scoring``). Here the same requests
go through a backend with the cache (cold, a head sliced
from a longer cached one, a head extended from a shorter one, a lone match's
next turn, an adapter swapped under the same name) and through a twin of it
on the same weights without the cache; and the packing is checked against
plain forward passes (one per prompt and candidate, no mask).

They agree to 1e-5 on the tiny random Qwen2 of ``test_local_agent`` and on
SmolLM2 in float64. SmolLM2 in float32 is held to 1e-4 only: float32 alone
moves its log-probs by 2e-5 to 5e-5 whenever the same sums run in another
order (two chunks instead of one, another row width), and the unbatched path
from before the cache differs from a plain pass by as much. float64 shows
that the fast path computes the same quantity; float32 adds rounding only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backroom.model.backend import Backend
from backroom.model.spec import ModelSpec

from .conftest import perturbed_adapter

Request = tuple[list[int], list[list[int]], str | None]

RULES = (
    "You play the iterated prisoner's dilemma against one opponent for ten rounds. "
    "Each round both of you choose A (cooperate) or B (defect) at the same time. "
    "Both A: 3 points each. Both B: 1 point each. B against A: 5 for B and 0 for A."
)


def prompt(backend: Backend, history: str) -> list[int]:
    """A decision's prompt: the game's head, then this match's history (appended before the end)."""
    rounds = [
        f"Round {i + 1}: you played {a}, they played {b}."
        for i, (a, b) in enumerate(history.split())
    ]
    return backend.encode_chat(
        [
            {"role": "system", "content": "You are a careful player."},
            {"role": "user", "content": "\n".join([RULES, *rounds, "Your move: A or B?"])},
        ]
    )


def candidates(backend: Backend) -> list[list[int]]:
    return [backend.completion_ids(t) for t in ("A", "B", "I cooperate")]


def twin(backend: Backend) -> Backend:
    """The same weights and adapters, without the head cache: the reference path."""
    ref = Backend(backend.spec, prefix_cache_size=0)
    ref.model, ref.tokenizer, ref.device = backend.model, backend.tokenizer, backend.device
    ref.adapters = backend.adapters  # the same dict: adapters loaded later are known to both
    return ref


def logprobs(backend: Backend, requests: list[Request]) -> list[list[list[float]]]:
    return [[s.logprobs for s in row] for row in backend.score_batch(requests)]


def max_difference(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    assert [[len(c) for c in row] for row in a] == [[len(c) for c in row] for row in b]
    return max(
        abs(x - y)
        for ra, rb in zip(a, b, strict=True)
        for ca, cb in zip(ra, rb, strict=True)
        for x, y in zip(ca, cb, strict=True)
    )


def plain(backend: Backend, requests: list[Request]) -> list[list[list[float]]]:
    """One unmasked forward pass per prompt and candidate (adapter-free requests only)."""
    import torch

    out: list[list[list[float]]] = []
    with torch.inference_mode():
        for p, cands, adapter in requests:
            assert adapter is None
            out.append([])
            for c in cands:
                logits = backend.model(input_ids=torch.tensor([p + c])).logits[0]
                lp = torch.log_softmax(logits.double(), dim=-1)
                out[-1].append([float(lp[len(p) - 1 + i, t]) for i, t in enumerate(c)])
    return out


@pytest.fixture
def tiny(tiny_qwen: tuple[Path, Path]) -> Backend:
    """A backend of its own (adapters are loaded and unloaded here), on the tiny Qwen2."""
    return Backend(ModelSpec(path=str(tiny_qwen[0]), device="cpu")).load()


@pytest.fixture
def smol32(smol: Backend) -> Iterator[Backend]:
    """The session's SmolLM2 backend (float32), its cache emptied before and after."""
    smol.clear_prefix_cache()
    yield smol
    smol.clear_prefix_cache()


@pytest.fixture(scope="module")
def smol64(smol: Backend) -> Backend:
    """SmolLM2 in float64: rounding out of the way, what is left is the method's own error."""
    return Backend(smol.spec.model_copy(update={"device": "cpu", "dtype": "float64"})).load()


#: (fixture, tolerance): float32 SmolLM2's rounding alone reaches 5e-5 (see the module doc)
MODELS = {
    "tiny": ("tiny", 1e-5),
    "smol-float64": ("smol64", 1e-5),
    "smol-float32": ("smol32", 1e-4),
}


@pytest.fixture(
    params=[
        # SmolLM2's cases took 123-174 s each on a busy 2-core machine (against the 300 s
        # limit): the slow set holds them, the tiny model shows the method in the default suite
        name if name == "tiny" else pytest.param(name, marks=pytest.mark.slow)
        for name in MODELS
    ]
)
def model(request: pytest.FixtureRequest) -> tuple[Backend, float]:
    name, tolerance = MODELS[request.param]
    return request.getfixturevalue(name), tolerance


def test_cached_heads_score_like_no_cache(model: tuple[Backend, float]) -> None:
    backend, tolerance = model
    ref = twin(backend)
    cands = candidates(backend)
    histories = ["AA AB BB", "AB BA BB", "BB BB AA", "AA AA AA"]

    def check(requests: list[Request]) -> None:
        assert max_difference(logprobs(backend, requests), logprobs(ref, requests)) <= tolerance

    # cold: the batch's head (rules and round 1 of every history) is encoded and kept
    check([(prompt(backend, h), cands, None) for h in histories])
    assert len(backend._prefixes.entries) == 1
    # round 1 of the same matches and a first decision: a shorter head, sliced from the cached one
    passes = backend.forward_passes
    check(
        [(prompt(backend, h.split()[0]), cands, None) for h in histories]
        + [(prompt(backend, ""), cands, None)]
    )
    assert backend.forward_passes == passes + 1  # the scoring pass only
    # two matches with the same history so far: a longer head, extended from the cached one
    check([(prompt(backend, h), cands, None) for h in ("AA AA AA AB", "AA AA AA BA")])
    # one match alone, turn after turn: each turn reuses the previous turn's prompt
    for t in range(1, 4):
        check([(prompt(backend, " ".join(histories[1].split()[:t])), cands, None)])
    # the same prompt twice and a prompt that a candidate of another one starts
    p = prompt(backend, "AB")
    check([(p, cands, None), (p, cands[::-1], None), (p + cands[0][:-1], cands, None)])


def test_token_trees_score_like_plain_forward_passes(model: tuple[Backend, float]) -> None:
    backend, tolerance = model
    cands = candidates(backend)
    p = prompt(backend, "AB BA")
    requests: list[Request] = [
        (p, cands, None),
        (p, [cands[1]], None),  # the same prompt, asked again in the batch
        (prompt(backend, "AB BB"), cands, None),
        (p + cands[2][:2], [cands[0], cands[2][2:]], None),  # a prompt that a candidate starts
        (backend.encode_chat([{"role": "user", "content": "Pick one: A or B."}]), cands, None),
    ]
    for row_tokens in (backend.row_tokens, 8):  # one tree per row, and trees split over rows
        backend.row_tokens, saved = row_tokens, backend.row_tokens
        try:
            assert (
                max_difference(logprobs(backend, requests), plain(backend, requests)) <= tolerance
            )
        finally:
            backend.row_tokens = saved


def test_cache_follows_adapter_swaps(
    tiny: Backend,
    tiny_qwen: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    ref = twin(tiny)
    cands = candidates(tiny)
    v1 = tiny_qwen[1]
    v2 = perturbed_adapter(v1, tmp_path / "v2", seed=7)
    tiny.load_adapter("keep", str(v1))  # the backend keeps its last adapter: let "x" be unloadable
    tiny.load_adapter("x", str(v1))

    def batch(adapter: str | None) -> list[Request]:
        return [(prompt(tiny, h), cands, adapter) for h in ("AA AB", "BB AB")]

    def check(adapter: str | None) -> list[list[list[float]]]:
        ref.model = tiny.model  # the peft wrapper, once the first adapter is loaded
        got = logprobs(tiny, batch(adapter))
        assert max_difference(got, logprobs(ref, batch(adapter))) <= 1e-5
        return got

    base, x_v1 = check(None), check("x")
    assert {a for a, _ in tiny._prefixes.entries} == {None, "x"}  # one head per adapter
    assert max_difference(base, x_v1) > 1e-3  # the adapter changes the keys and values
    tiny.release_adapter("x")  # unloaded: its cached heads would be stale
    assert "x" not in tiny.adapters and not tiny._prefixes.entries
    tiny.load_adapter("x", str(v2))  # the same name, other weights
    x_v2 = check("x")
    assert max_difference(x_v1, x_v2) > 1e-3
    assert max_difference(check(None), base) <= 1e-5
