"""Decisions per second of the ``local`` agent on SmolLM2: batched against unbatched, in one run.

    .venv/bin/python bench/local_agent.py                   # 1, 8 and 32 concurrent matches
    .venv/bin/python bench/local_agent.py --concurrency 32  # issue 13's figure alone
    .venv/bin/python bench/local_agent.py --quick           # fewer matches per run
    .venv/bin/python bench/local_agent.py --talk            # a colluders' talk turn before each act

Three ``local`` agents (one shared SmolLM2-135M-Instruct backend, CPU) play
Loki Kuhn poker; N matches run concurrently and every act decision scores the
legal actions (fold, call, raise) as completions of the prompt. The same
agents play the same deals with the same sampling draws three times per
setting:

* unbatched: ``max_batch`` 1 and no prompt-head cache (``prefix_cache_size``
  0) — one full forward pass per decision, the reference issue 13 measures
  against;
* unbatched + cache: ``max_batch`` 1 with the head cache, for the record (a
  lone match reuses its previous turn's prompt);
* batched: the backend's batching queue (``max_batch`` 32) with the cache.

The modes are interleaved (rotating which goes first), repeated, and the
fastest repeat of each is reported with the median beside it, since the
machine is shared and noisy: read the ratios. The last lines give issue 13's
figure (batched over unbatched at 32 matches, target 8x) and the largest
difference between log-probs of the batched path (the batch of play with
the most distinct prompts, scored again with a warm cache) and those of a
plain forward pass over each prompt and candidate (no mask, no cache), with
the unbatched path's beside it, in float32 and in float64: float32 alone
moves SmolLM2's log-probs by 2e-5 to 5e-5 when the same sums run in another
order, so only float64 can show whether two paths compute the same thing to
1e-5.

The engine drives the agents directly with the ``Turn`` a referee would send
(no broker): the model is the cost being measured, the bus adds well under a
millisecond per decision (bench/bus_overhead.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from backroom.agents.local_model import LocalAgent
from backroom.bus.wire import ChannelSpec, MatchEnd, MatchStart, Turn
from backroom.games import make_game
from backroom.model.backend import Backend, ModelSpec, Scored, shared_backend

COLLUDERS = ChannelSpec(name="colluders", members=[0, 1], eavesdroppers=[2], opens="before_act")
MODES = {  # name: (max_batch, prefix_cache_size)
    "unbatched": (1, 0),
    "unbatched+cache": (1, 8),
    "batched": (32, 8),
}
TARGET = 8.0  # issue 13: batched >= 8x unbatched at 32 matches

Request = tuple[list[int], list[list[int]], str | None]


async def play(agents: list[LocalAgent], match: str, seed: int, talk: bool) -> int:
    """One Loki Kuhn match played by ``agents``; returns how many decisions they made."""
    game = make_game("kuhn", variant="loki")
    state = game.new_initial_state(seed)
    channels = [COLLUDERS] if talk else []
    for seat, a in enumerate(agents):
        await a.on_match_start(
            MatchStart(
                match=match,
                seat=seat,
                seats=[x.id for x in agents],
                game="kuhn",
                params=game.params(),
                channels=channels,
                turn_timeout_s=600,
                seed=seed,
            )
        )
    decisions, turn_no = 0, 0
    while not state.is_terminal():
        (seat,) = state.current_players()
        if talk and seat in COLLUDERS.members:
            turn_no += 1
            text = await agents[seat].talk(
                Turn(
                    match=match,
                    turn=turn_no,
                    seat=seat,
                    phase="talk",
                    channel="colluders",
                    observation=state.observation(seat),
                    prompt=state.prompt(seat),
                    legal={"schema": {"type": "string", "maxLength": 500}},
                    deadline_s=600,
                )
            )
            decisions += 1
            # (delivery to the partner is the referee's job; its cost is not the model's)
            _ = text
        turn_no += 1
        turn = Turn(
            match=match,
            turn=turn_no,
            seat=seat,
            phase="act",
            observation=state.observation(seat),
            prompt=state.prompt(seat),
            legal=state.action_spec(seat).to_json(),
            deadline_s=600,
        )
        state.apply({seat: await agents[seat].act(turn)})
        decisions += 1
    for seat, a in enumerate(agents):
        await a.on_match_end(
            MatchEnd(
                match=match,
                seat=seat,
                returns=state.returns(),
                raw_returns=state.returns(),
                reason="normal",
            )
        )
    return decisions


async def run(
    agents: list[LocalAgent], concurrent: int, per_worker: int, talk: bool, tag: str
) -> tuple[float, int]:
    """``concurrent`` workers each play ``per_worker`` matches back to back; decisions per second."""

    async def worker(w: int) -> int:
        return sum(
            [await play(agents, f"{tag}-{w}-{i}", 1000 * w + i, talk) for i in range(per_worker)]
        )

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(worker(w) for w in range(concurrent)))
    elapsed = time.perf_counter() - t0
    return sum(counts) / elapsed, sum(counts)


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer matches per setting")
    ap.add_argument(
        "--talk", action="store_true", help="add a talk turn (sampled text) before colluder acts"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument(
        "--check",
        type=int,
        default=8,
        metavar="N",
        help="requests whose log-probs are checked against plain forward passes (0: none)",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        help="the model's dtype (default: bfloat16 on a GPU, float32 on a CPU), e.g. bfloat16 on a "
        "CPU to tell bf16's rounding from a GPU kernel's in the log-prob check",
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    backend: Backend = await asyncio.to_thread(shared_backend, ModelSpec(dtype=args.dtype))
    print(f"model: {backend.name} on {backend.device} (loaded in {time.perf_counter() - t0:.1f} s)")
    agents = [
        LocalAgent(
            f"p{i}",
            seed=i,
            max_new_tokens=args.max_new_tokens,
            collusion="explicit" if i < 2 else "baseline",
            dtype=args.dtype,
        )
        for i in range(3)
    ]
    for a in agents:
        await a.setup()
    await play(agents, "warmup", 0, args.talk)  # first calls pay one-off costs

    seen: list[list[Request]] = []  # the batches the batched mode scored, for the log-prob check
    score_batch = backend.score_batch

    def recording(requests: list[Request]) -> list[list[Scored]]:
        if backend.max_batch > 1:
            seen.append([(list(p), [list(c) for c in cs], a) for p, cs, a in requests])
        return score_batch(requests)

    backend.score_batch = recording  # type: ignore[method-assign]

    print(
        f"{'matches':>8} {'decisions':>9} | {'unbatched dec/s':>16} {'(median)':>9} | "
        f"{'+cache dec/s':>13} {'(median)':>9} | {'batched dec/s':>14} {'(median)':>9} | "
        f"{'ratio':>6} {'/+cache':>7} {'prompts/pass':>12}"
    )
    at_32: float | None = None
    for n in args.concurrency:
        per_worker = (2 if args.quick else 4) if n == 1 else 1
        results: dict[str, list[float]] = {m: [] for m in MODES}
        prompts_per_pass: list[float] = []
        decisions = 0
        for r in range(args.repeats):
            # the same work for every mode (same match seeds, hence the same sampling draws:
            # agents sample from the match's seed and their seat), in rotating order
            order = list(MODES)[r % len(MODES) :] + list(MODES)[: r % len(MODES)]
            for mode in order:
                backend.max_batch, backend.prefix_cache_size = MODES[mode]
                backend.clear_prefix_cache()  # every run starts cold
                batches, rows = backend.batches, backend.rows
                rate, decisions = await run(agents, n, per_worker, args.talk, f"{mode}{n}r{r}")
                results[mode].append(rate)
                if mode == "batched" and backend.batches > batches:
                    prompts_per_pass.append((backend.rows - rows) / (backend.batches - batches))
        best = {m: max(v) for m, v in results.items()}
        med = {m: statistics.median(v) for m, v in results.items()}
        ratio = best["batched"] / best["unbatched"]
        if n == 32:
            at_32 = ratio
        print(
            f"{n:>8} {decisions:>9} | {best['unbatched']:>16.2f} {med['unbatched']:>9.2f} | "
            f"{best['unbatched+cache']:>13.2f} {med['unbatched+cache']:>9.2f} | "
            f"{best['batched']:>14.2f} {med['batched']:>9.2f} | {ratio:>5.2f}x "
            f"{best['batched'] / best['unbatched+cache']:>6.2f}x "
            f"{statistics.mean(prompts_per_pass) if prompts_per_pass else 0:>12.1f}"
        )
    print(
        "ratio = best batched / best unbatched decisions per second at the same concurrency; "
        "/+cache = best batched / best unbatched with the head cache; prompts/pass = decisions per batch"
    )
    if at_32 is not None:
        verdict = "met" if at_32 >= TARGET else "NOT met"
        print(
            f"issue 13: batched / unbatched at 32 matches = {at_32:.2f}x (target {TARGET:.0f}x: {verdict})"
        )
    backend.score_batch = score_batch  # type: ignore[method-assign]
    if seen and args.check:
        varied = max(
            seen, key=lambda batch: len({tuple(p) for p, _, _ in batch})
        )  # the most distinct prompts
        await asyncio.to_thread(check_logprobs, backend, varied, args.check)


def plain_logprobs(backend: Backend, requests: list[Request]) -> list[list[list[float]]]:
    """Log-probs from one plain forward pass per prompt and candidate: no mask, no cache, no batch."""
    import torch

    out: list[list[list[float]]] = []
    with backend.lock, torch.inference_mode():
        for prompt, cands, _ in requests:
            out.append([])
            for cand in cands:
                logits = backend.model(
                    input_ids=torch.tensor([prompt + cand], device=backend.device)
                ).logits[0]
                logp = torch.log_softmax(logits.double(), dim=-1)
                out[-1].append([float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(cand)])
    return out


def max_difference(scored: list[list[Scored]], reference: list[list[list[float]]]) -> float:
    return max(
        abs(x - y)
        for s_row, r_row in zip(scored, reference, strict=True)
        for s, r in zip(s_row, r_row, strict=True)
        for x, y in zip(s.logprobs, r, strict=True)
    )


def differences(backend: Backend, batch: list[Request], checked: int) -> tuple[float, float]:
    """Largest log-prob differences to plain forward passes: (batched path, unbatched path).

    ``batch`` is scored as a whole with a warm head cache, as in play, and its
    first ``checked`` requests are compared; the unbatched path scores them one
    by one without the cache (the reference mode of the timings).
    """
    backend.max_batch, backend.prefix_cache_size = MODES["batched"]
    backend.score_batch(batch)  # warm the head cache
    fast = backend.score_batch(batch)[:checked]
    backend.prefix_cache_size = 0
    alone: list[list[Scored]] = [backend.score_batch([r])[0] for r in batch[:checked]]
    reference = plain_logprobs(backend, batch[:checked])
    return max_difference(fast, reference), max_difference(alone, reference)


def check_logprobs(backend: Backend, batch: list[Request], checked: int) -> None:
    """Print the log-prob check in the model's float32, and in float64 where rounding is out of the way."""
    cands = sum(len(c) for _, c, _ in batch[:checked])
    print(
        f"log-probs of {cands} candidates ({checked} prompts of a batch of {len(batch)}) against plain "
        "forward passes (one per prompt and candidate, no mask, no cache), max |difference|:"
    )
    exact = Backend(backend.spec.model_copy(update={"device": "cpu", "dtype": "float64"})).load()
    model_dtype = str(next(backend.model.parameters()).dtype).removeprefix("torch.")
    for label, b in ((model_dtype, backend), ("float64", exact)):
        batched, unbatched = differences(b, batch, checked)
        print(f"  {label:>8}: batched {batched:.1e}, unbatched {unbatched:.1e}")
    print(
        "  (issue 13 asks 1e-5: float64 shows the fast path computes the same log-probs; float32's rounding "
        "alone spreads them by 2e-5 to 5e-5 on SmolLM2, on the unbatched path as on the batched one)"
    )


if __name__ == "__main__":
    asyncio.run(main())
