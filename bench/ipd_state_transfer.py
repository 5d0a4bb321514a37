"""How much one IPD state's update moves the others: SmolLM2 against the memory-one policy.

The memory-one policy (``backroom/trainer/memory_one.py``) learns tit-for-tat
with the trainer's credit in 150 steps of 8 matches; SmolLM2 under the same
credit moves every state the same way (docs/training.md). Tit-for-tat needs
P(A | the other played A last) up and P(A | the other played B last) down.
This bench measures how far apart the LLM can move them, with no sampling
noise and nothing else pushing.

The states: the first round, and round 5 after three rounds of mutual A and a
last round of AA, AB, BA or BB ("AB": I played A, the other B), as the local
agent's prompt ids. Every step is a real step of the trainer's learner
(``Learner.step``: REINFORCE, Adam, gradient clip 1, the LoRA of
``examples/ipd_adalign.yaml``), given REINFORCE's expectation over both
actions: an advantage of +c for A and -c for B in state s is two samples,
each with its advantage times its probability as credit, so the step ascends
c (P(A|s) - P(B|s)). The memory-one policy takes the same steps on its five
logits with its own Adam (lr 0.2, as ``memory_one.Settings``).

1. Transfer: from a fresh adapter, ONE step with c = +1 in one state s, and
   the change of the logit of A (log P(A) - log P(B)) in every state. Row s
   of the matrix is that change over the change in s itself: 1 on the
   diagonal, the transfer off it. The memory-one policy's is the identity.
2. The tit-for-tat step, c = +1 after AA and c = -1 after AB: how much of one
   step separated the two, (change after AA - change after AB) / (|change
   after AA| + |change after AB|): 1 when apart, 0 when they move together.
3. That step again and again (``--tft-steps``), Adam state kept: P(A) after
   AA and after AB, step by step, for both policies.

    .venv/bin/python bench/ipd_state_transfer.py            # SmolLM2, about 4 min on 2 cores
    .venv/bin/python bench/ipd_state_transfer.py --lr 1e-4  # the step size of examples/ipd_adalign.yaml
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from backroom.games import make_game
from backroom.model.backend import Backend
from backroom.model.spec import ModelSpec
from backroom.trainer.learner import Learner, LoraSettings, Sample, StepSettings
from backroom.trainer.memory_one import STATES  # "first", then (my last move, the other's)


def prompts(backend: Backend) -> dict[str, list[int]]:
    """The token ids the local agent sends for each state (no system prompt, as in the examples)."""
    game = make_game("ipd", rounds=10)
    out = {}
    for name in STATES:
        state = game.new_initial_state(0)
        if name != "first":  # three rounds of AA, then this one
            for _ in range(3):
                state.apply({0: "A", 1: "A"})
            state.apply({0: name[0], 1: name[1]})
        out[name] = backend.encode_chat([{"role": "user", "content": state.prompt(0)}])
    return out


def logits_of_a(
    learner: Learner, ids: dict[str, list[int]], cands: list[list[int]]
) -> torch.Tensor:
    """log P(A) - log P(B) in each state, the renormalised choice the agent samples from."""
    samples = [Sample(p, cands, 0, [0.0], True, 1.0, 0.0) for p in ids.values()]
    with torch.no_grad():
        lps, _ = learner.action_logprobs(samples)
    log_pa = torch.cat(lps)
    return log_pa - torch.log1p(-log_pa.exp())


def one_step(
    learner: Learner,
    ids: dict[str, list[int]],
    cands: list[list[int]],
    credits: dict[str, float],
) -> torch.Tensor:
    """The change of every state's logit of A after one learner step.

    ``credits[s]`` is the advantage of A in state s (B's is its negative), and
    the step is REINFORCE's expectation over both actions, with no sampling
    noise: each action is a sample whose credit is its advantage times its
    probability, so the gradient is that of sum_s credit_s (P(A|s) - P(B|s)).
    """
    before = logits_of_a(learner, ids, cands)
    names = list(ids)
    samples = []
    for name, credit in credits.items():
        logp = torch.log_softmax(torch.stack([before[names.index(name)], torch.tensor(0.0)]), 0)
        for action, sign in ((0, 1.0), (1, -1.0)):
            p = float(logp[action].exp())
            samples.append(
                Sample(
                    ids[name], cands, action, [float(logp[action])], True, 1.0, sign * credit * p
                )
            )
    learner.step(samples)
    return logits_of_a(learner, ids, cands) - before


def fresh(learner: Learner, initial: dict[str, torch.Tensor], lr: float) -> None:
    """Back to the untrained adapter and a new Adam (every measured step is a first step)."""
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if name in initial:
                p.copy_(initial[name])
    params = [p for p in learner.model.parameters() if p.requires_grad]
    learner.optimizer = torch.optim.Adam(params, lr=lr)


def memory_one_steps(credits: dict[str, float], lr: float, steps: int = 1) -> list[torch.Tensor]:
    """The memory-one policy's logits of A after each of ``steps`` Adam steps (the reference)."""
    names = list(STATES)
    logits = torch.full((len(names),), 3.5, requires_grad=True)  # P(A) 0.97, as memory_one starts
    opt = torch.optim.Adam([logits], lr=lr)
    out = [logits.detach().clone()]
    for _ in range(steps):
        loss = torch.zeros(())
        for name, credit in credits.items():
            p_a = torch.sigmoid(logits[names.index(name)])
            loss = loss - credit * (p_a - (1 - p_a))  # as ``one_step``: the expected step
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([logits], 1.0)
        opt.step()
        out.append(logits.detach().clone())
    return out


def memory_one_step(credits: dict[str, float], lr: float) -> torch.Tensor:
    """The memory-one policy's change of logit of A after one Adam step."""
    before, after = memory_one_steps(credits, lr)
    return after - before


def show(title: str, rows: dict[str, torch.Tensor]) -> None:
    names = list(STATES)
    print(title)
    print(f"{'trained':>10} | " + " ".join(f"{n:>7}" for n in names))
    for name, delta in rows.items():
        own = delta[names.index(name)]
        print(f"{name:>10} | " + " ".join(f"{float(d / own):7.3f}" for d in delta))


def separation(delta: torch.Tensor) -> float:
    names = list(STATES)
    aa, ab = float(delta[names.index("AA")]), float(delta[names.index("AB")])
    return (aa - ab) / (abs(aa) + abs(ab))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lr", type=float, default=4e-5, help="the learner's step size (default 4e-5)")
    ap.add_argument("--memory-one-lr", type=float, default=0.2, help="memory_one's (default 0.2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tft-steps",
        type=int,
        default=30,
        help="then repeat the tit-for-tat step this many times, Adam state kept (default 30)",
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    learner = Learner(
        ModelSpec(device="cpu"),
        lora=LoraSettings(rank=32, alpha=64),
        step=StepSettings(lr=args.lr),
        seed=args.seed,
    )
    backend = Backend(
        ModelSpec(device="cpu")
    )  # for its chat encoding: the learner's tokenizer, no second model
    backend.tokenizer = learner.tokenizer
    ids = prompts(backend)
    cands = [backend.completion_ids("<A>"), backend.completion_ids("<B>")]
    initial = {
        n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad
    }
    start = logits_of_a(learner, ids, cands)
    print(
        "P(A) before any step: "
        + ", ".join(f"{n} {float(torch.sigmoid(v)):.3f}" for n, v in zip(ids, start, strict=True))
    )

    llm: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name in ids:
        fresh(learner, initial, args.lr)
        llm[name] = one_step(learner, ids, cands, {name: 1.0})
        ref[name] = memory_one_step({name: 1.0}, args.memory_one_lr)
    show(
        f"\nSmolLM2 + LoRA 32/64, one step at lr {args.lr:g}: change of each state's logit of A / the trained state's",
        llm,
    )
    show(f"\nmemory-one policy, one step at lr {args.memory_one_lr:g}: the same", ref)

    tft = {"AA": 1.0, "AB": -1.0}
    fresh(learner, initial, args.lr)
    d_llm = one_step(learner, ids, cands, tft)
    d_ref = memory_one_step(tft, args.memory_one_lr)
    names = list(ids)
    print("\nthe tit-for-tat step (+1 on A after AA, -1 on A after AB):")
    for label, d in (("SmolLM2", d_llm), ("memory-one", d_ref)):
        moved = ", ".join(f"{n} {float(d[names.index(n)]):+.4f}" for n in names)
        print(f"{label:>10}: change of logit of A: {moved}; separated: {separation(d):.3f}")
    print(f"\nseparated, SmolLM2 / memory-one: {separation(d_llm) / separation(d_ref):.3f}")

    # The same step again and again: with nothing else pushing, can the LLM tell
    # the two states apart, and in how many steps?
    fresh(learner, initial, args.lr)
    ref_path = memory_one_steps(tft, args.memory_one_lr, args.tft_steps)
    print(f"\n{args.tft_steps} tit-for-tat steps in a row: P(A) after AA / after AB")
    print(f"{'step':>5} | {'SmolLM2':>15} | {'memory-one':>15}")
    now = logits_of_a(learner, ids, cands)
    for step in range(args.tft_steps + 1):
        if step:
            one_step(learner, ids, cands, tft)
            now = logits_of_a(learner, ids, cands)
        if step in (0, 1, 2, 3, 5) or step % 5 == 0 or step == args.tft_steps:
            p = torch.sigmoid(now)
            r = torch.sigmoid(ref_path[step])
            aa, ab = names.index("AA"), names.index("AB")
            print(
                f"{step:>5} | {float(p[aa]):.3f} / {float(p[ab]):.3f}   "
                f"| {float(r[aa]):.3f} / {float(r[ab]):.3f}   "
                f"(SmolLM2 first {float(p[0]):.3f}, BA {float(p[3]):.3f}, BB {float(p[4]):.3f})"
            )
    print(f"wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
