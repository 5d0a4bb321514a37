"""The learner against the agents' own backend, on a tiny random Qwen2 (no broker needed).

* traces made by the ``local`` agent's code path (``Backend.score`` for legal
  actions, ``Backend.generate`` for free text) under an adapter have the same
  log-probs when the learner recomputes them with that adapter: TIS weights 1;
* gradient accumulation over micro-batches gives the same step as one batch;
* a positive credit on an action makes it more likely; KL is 0 before any step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from backroom.bus.wire import Trace
from backroom.model.backend import Backend
from backroom.model.spec import ModelSpec
from backroom.trainer.learner import (
    MICRO_BATCH_TOKENS,
    Learner,
    LoraSettings,
    Sample,
    StepSettings,
    sample_of,
)


@pytest.fixture(scope="module")
def perturbed_adapter(tiny_qwen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter with visibly non-zero weights, saved by the learner itself."""
    learner = Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"),
        lora=LoraSettings(rank=4, alpha=8),
        seed=1,
    )
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return learner.save(tmp_path_factory.mktemp("adapter") / "v1")


def agent_traces(model: Path, adapter: Path) -> list[Trace]:
    """Decisions as the local agent makes them: scored <A>/<B> and sampled text, with the adapter on."""
    backend = Backend(ModelSpec(path=str(model), device="cpu")).load()
    backend.load_adapter("v1", str(adapter))

    async def decide() -> list[Trace]:
        out = []
        cands = [backend.completion_ids("<A>"), backend.completion_ids("<B>")]
        for i in range(3):
            prompt = backend.encode_chat(
                [{"role": "user", "content": f"Round {i}: play <A> or <B>."}]
            )
            scored = await backend.score(prompt, cands, "v1")
            out.append(
                Trace(
                    agent="a",
                    turn=i,
                    seat=0,
                    phase="act",
                    prompt_ids=prompt,
                    completion_ids=cands[i % 2],
                    logprobs=scored[i % 2].logprobs,
                    candidates=cands,
                    candidate_logprobs=[s.total for s in scored],
                    chosen=i % 2,
                )
            )
            gen = await backend.generate(prompt, 10, 1.0, 1.0, "v1")
            out.append(
                Trace(
                    agent="a",
                    turn=i,
                    seat=0,
                    phase="talk",
                    prompt_ids=prompt,
                    completion_ids=gen.token_ids,
                    logprobs=gen.logprobs,
                )
            )
        return out

    return asyncio.run(decide())


def test_recomputed_logprobs_equal_the_traced_ones(
    tiny_qwen_model: Path, perturbed_adapter: Path
) -> None:
    traces = agent_traces(tiny_qwen_model, perturbed_adapter)
    samples = [s for t in traces if (s := sample_of(t, 1.0)) is not None]
    assert len(samples) == 6 and sum(s.scored for s in samples) == 3
    learner = Learner(ModelSpec(path=str(tiny_qwen_model), device="cpu"), adapter=perturbed_adapter)
    with torch.no_grad():
        now, _ = learner.action_logprobs(samples)
    for s, lp in zip(samples, now, strict=True):
        ratio = torch.exp(lp - torch.tensor(s.behaviour))
        assert len(lp) == (1 if s.scored else len(s.completions[0]))
        torch.testing.assert_close(
            ratio, torch.ones_like(ratio), atol=1e-5, rtol=0
        )  # TIS weights 1
    # a scored decision's log-prob is over the legal set: the two choices' probabilities sum to 1
    scored = samples[0]
    other = Sample(scored.prompt_ids, scored.completions, 1 - scored.chosen, [0.0], True, 1.0, 0.0)
    with torch.no_grad():
        (a,), (b,) = learner.action_logprobs([scored])[0], learner.action_logprobs([other])[0]
    assert float(a.exp() + b.exp()) == pytest.approx(1.0, abs=1e-6)


def _text_samples(n: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(10, 5000, (20 + 3 * i,), generator=g).tolist()
        completion = torch.randint(10, 5000, (4 + i % 3,), generator=g).tolist()
        out.append(
            Sample(prompt, [completion], 0, [-8.0] * len(completion), False, 1.0, (-1.0) ** i)
        )
    return out


def test_micro_batches_accumulate_to_the_same_step(tiny_qwen_model: Path) -> None:
    samples = _text_samples(6)
    settings = [
        StepSettings(lr=1e-2, micro_batch_tokens=m, kl_coef=0.1, entropy_coef=0.01)
        for m in (10_000, 40)
    ]
    learners = [
        Learner(
            ModelSpec(path=str(tiny_qwen_model), device="cpu"),
            lora=LoraSettings(rank=4, alpha=8),
            step=s,
            seed=3,
        )
        for s in settings
    ]
    assert len(list(learners[1].micro_batches(samples))) > 2  # really split
    stats = [lr.step(samples) for lr in learners]
    assert stats[0].action_tokens == stats[1].action_tokens == sum(s.action_tokens for s in samples)
    assert stats[0].loss == pytest.approx(stats[1].loss, rel=1e-4)
    assert stats[0].grad_norm == pytest.approx(stats[1].grad_norm, rel=1e-4)
    a, b = (dict(lr.model.named_parameters()) for lr in learners)
    for name in a:
        if "lora_" in name:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-4)
    # unset, the size is the device's default (a GPU packs 8x more a pass; MICRO_BATCH_TOKENS)
    default = Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"), lora=LoraSettings(rank=4, alpha=8)
    )
    assert default.micro_batch_tokens == MICRO_BATCH_TOKENS["cpu"] == 1024
    assert [lr.micro_batch_tokens for lr in learners] == [10_000, 40]


def test_positive_credit_makes_the_action_more_likely(tiny_qwen_model: Path) -> None:
    learner = Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"),
        lora=LoraSettings(rank=4, alpha=8),
        step=StepSettings(lr=5e-3, kl_coef=0.05),
        seed=0,
    )
    tok = learner.tokenizer
    prompt = tok("Play <A> or <B>:", add_special_tokens=False)["input_ids"]
    cands = [
        tok("<A>", add_special_tokens=False)["input_ids"],
        tok("<B>", add_special_tokens=False)["input_ids"],
    ]
    probe = Sample(prompt, cands, 1, [0.0], True, 1.0, 0.0)

    def p_b() -> float:
        with torch.no_grad():
            return float(learner.action_logprobs([probe])[0][0].exp())

    before = p_b()
    # B rewarded, A punished; behaviour log-probs = the current ones (on-policy)
    first = None
    for _ in range(5):
        with torch.no_grad():
            lp_b = float(learner.action_logprobs([probe])[0][0])
        lp_a = float(torch.log1p(-torch.tensor(lp_b).exp()))
        batch = [
            Sample(prompt, cands, 1, [lp_b], True, 1.0, 1.0),
            Sample(prompt, cands, 0, [lp_a], True, 1.0, -1.0),
        ]
        stats = learner.step(batch)
        first = stats if first is None else first
    assert first is not None and first.kl == pytest.approx(
        0.0, abs=1e-9
    )  # fresh LoRA (B = 0) is the base model
    assert stats.kl > 0 and stats.tis_clamped == 0.0
    assert p_b() > before + 0.05


def test_a_stopped_step_applies_nothing(tiny_qwen_model: Path) -> None:
    """``Learner.stop`` (Ctrl-C from the trainer's loop) ends a step before Adam's update."""
    from backroom.trainer.learner import StepInterrupted

    learner = Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"),
        lora=LoraSettings(rank=4, alpha=8),
        seed=3,
    )
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n}
    learner.stop.set()
    with pytest.raises(StepInterrupted):
        learner.step(_text_samples(6))
    for name, p in learner.model.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), name
    assert not learner.optimizer.state  # Adam never stepped
