"""A small random transformer with a cooperative prior, for the paper's IPD on a CPU.

What an instruction-tuned LLM brings to the IPD and a random model lacks is a
prior: SmolLM2 plays A with P 0.97 on the paper's prompt, a random Qwen2
about 0.5. This gives a random Qwen2 of hidden size 128 (``RANDOM_QWEN_SHAPES
["small"]``, SmolLM2's tokenizer) that prior by a short supervised warm-up:
the same prompts the ``local`` agent sends (the IPD prompt of either seat,
0-9 rounds of random history in, no system prompt, as the examples play),
the same candidates ``<A>`` / ``<B>``, and the loss -[p log P(A) - (1 - p)
log P(B)] on the renormalised choice, with p the target (0.95), until the
mean P(A) over held-out prompts is within 0.02 of it. The learner's own
code (``Learner.action_logprobs`` on a LoRA), merged into the weights and
saved as a model folder that ``model: {path: ...}`` loads.

    .venv/bin/python bench/ipd_warmup.py --out runs/ipd-small/model   # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from backroom.games import make_game
from backroom.model.backend import shared_backend
from backroom.model.loading import save_random_qwen
from backroom.model.spec import ModelSpec
from backroom.trainer.learner import Learner, LoraSettings, Sample, StepSettings


def ipd_prompts(encode: object, n: int, seed: int) -> list[list[int]]:
    """The local agent's prompt ids for ``n`` IPD states of either seat, 0-9 random rounds in."""
    game = make_game("ipd", rounds=10)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        state = game.new_initial_state(rng.randrange(1 << 30))
        for _ in range(rng.randrange(10)):
            state.apply({0: rng.choice("AB"), 1: rng.choice("AB")})
        out.append(encode([{"role": "user", "content": state.prompt(i % 2)}]))  # type: ignore[operator]
    return out


def p_a(learner: Learner, prompts: list[list[int]], cands: list[list[int]]) -> torch.Tensor:
    samples = [Sample(p, cands, 0, [0.0], True, 1.0, 0.0) for p in prompts]
    lps, _ = learner.action_logprobs(samples)
    return torch.cat(lps).exp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the model folder to write")
    ap.add_argument("--target", type=float, default=0.95, help="P(A) to reach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32, help="prompts a step")
    ap.add_argument("--max-steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tokenizer = shared_backend().tokenizer
    base = save_random_qwen(args.out / "random", tokenizer, "small")
    learner = Learner(
        ModelSpec(path=str(base), device="cpu"),
        lora=LoraSettings(rank=16, alpha=32),
        step=StepSettings(lr=args.lr),
        seed=args.seed,
    )
    encode = shared_backend().encode_chat
    cands = [shared_backend().completion_ids("<A>"), shared_backend().completion_ids("<B>")]
    held_out = ipd_prompts(encode, 64, args.seed + 10_000)
    with torch.no_grad():
        start = p_a(learner, held_out, cands)
    print(
        f"random small Qwen2: P(A) {start.mean():.3f} (min {start.min():.3f}, max {start.max():.3f})"
    )
    target = torch.tensor(args.target)
    for step in range(args.max_steps):
        batch = ipd_prompts(encode, args.batch, args.seed * 1_000_003 + step)
        pa = p_a(learner, batch, cands)
        # -[p log P(A) + (1 - p) log P(B)] on the renormalised choice
        loss = -(target * pa.log() + (1 - target) * torch.log1p(-pa)).mean()
        learner.optimizer.zero_grad()
        loss.backward()
        learner.optimizer.step()
        with torch.no_grad():
            now = p_a(learner, held_out, cands)
        if step % 10 == 0:
            print(
                f"step {step}: loss {loss.item():.4f}, held-out P(A) {now.mean():.3f}", flush=True
            )
        if abs(float(now.mean()) - args.target) < 0.02 and float(now.min()) > args.target - 0.1:
            break
    print(
        f"warm-up done after {step + 1} steps ({time.perf_counter() - t0:.0f} s): held-out P(A) "
        f"{now.mean():.3f} (min {now.min():.3f}, max {now.max():.3f})"
    )
    merged = learner.model.merge_and_unload()
    merged.save_pretrained(args.out)
    learner.tokenizer.save_pretrained(args.out)
    print(f"model: {args.out}")


if __name__ == "__main__":
    main()
