"""The trainer's credit, run for the paper's scale of steps on a memory-one IPD policy.

The LLM experiment cannot reach the paper's 3000 steps on a CPU; this checks,
in seconds, that the credit functions the trainer uses (``advantages.py``)
do what the paper says when the policy can follow them: naive multi-agent GRPO
ends at always-B (figure 2), Advantage Alignment at tit-for-tat (figure 3,
appendix figure 10), from SmolLM2's cooperative start (P(A) 0.97).
"""

from __future__ import annotations

import numpy as np
import pytest

from backroom.trainer.memory_one import Settings, train


@pytest.mark.parametrize("seed", [0, 1])
def test_naive_grpo_ends_at_always_b(seed: int) -> None:
    r = train(Settings(algorithm="grpo"), seed)
    assert r.is_always_b, r.p_a
    assert r.returns["always-a"] > 45  # it exploits a cooperator (5 per round)
    assert r.returns["self"] < 15  # and gets mutual defection (1 per round) with itself


@pytest.mark.parametrize("seed", [0, 1])
def test_advantage_alignment_ends_at_tit_for_tat(seed: int) -> None:
    """With the paper's per-seat baseline, in 400 steps (8/8 seeds; 2/8 by step 150, where the
    batch-pooled baseline that took the own match's opponent in had 8/8: docs/training.md)."""
    r = train(Settings(algorithm="adalign", beta=0.5, steps=400), seed)
    assert r.is_tit_for_tat, r.p_a
    assert r.returns["self"] > 25 and r.returns["tft"] > 25  # cooperates (3 per round) with both
    assert r.returns["always-b"] > 8  # and loses only the first round to always-B (10 at most)
    assert min(r.coop_by_step[40:80]) < 0.5  # through a dip: reciprocity is learnt from defections


def test_paying_both_rewards_ends_at_an_exploitable_cooperator() -> None:
    """The sum-of-rewards variant: cooperating is then dominant, so it cooperates with
    everyone, always-B included; the paper's reason to prefer opponent shaping."""
    r = train(Settings(algorithm="grpo_sum"), 0)
    assert r.is_always_a, r.p_a
    assert r.returns["self"] > 29 and r.returns["always-b"] < 2


def test_without_the_shaping_term_advantage_alignment_is_grpo() -> None:
    """beta = 0 leaves A_t^1: the same credit, so the same run as GRPO, step for step."""
    grpo = train(Settings(algorithm="grpo", steps=60), 3)
    no_shaping = train(Settings(algorithm="adalign", beta=0.0, steps=60), 3)
    assert no_shaping.coop_by_step == grpo.coop_by_step
    assert no_shaping.p_a == grpo.p_a


def test_the_same_seed_plays_and_learns_the_same() -> None:
    a, b = (train(Settings(steps=30), 5) for _ in range(2))
    assert a.coop_by_step == b.coop_by_step and a.p_a == b.p_a
    assert train(Settings(steps=30), 6).coop_by_step != a.coop_by_step


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="algorithm must be 'grpo', 'grpo_sum' or 'adalign'"):
        train(Settings(algorithm="dpo"), 0)


def test_the_fixed_policies_score_the_paper_payoffs() -> None:
    """The state index (own move, then the other's) read the right way round: tit-for-tat copies."""
    from backroom.trainer.memory_one import BASELINES, play

    rng = np.random.default_rng(0)
    _, actions, rewards = play(BASELINES["tft"], BASELINES["always-b"], 4, 10, rng)
    assert (actions[:, 0, 0] == 0).all() and (actions[:, 0, 1:] == 1).all()  # A, then B for ever
    assert rewards[:, 0].sum(axis=1).tolist() == [9.0] * 4  # S then 9 x P
    assert rewards[:, 1].sum(axis=1).tolist() == [14.0] * 4  # T then 9 x P
    _, _, rewards = play(BASELINES["tft"], BASELINES["always-a"], 4, 10, rng)
    assert rewards.sum(axis=2).tolist() == [[30.0, 30.0]] * 4


def test_states_tied_as_an_llm_s_still_reach_tit_for_tat_in_more_steps() -> None:
    """One set of weights for every state (a step on one moves the others 0.87-0.98 as
    far, as SmolLM2's LoRA does): GRPO falls to always-B at once, Advantage Alignment
    dips deeper and longer, and in some seeds reaches tit-for-tat by step 400 (3/8 with
    the per-seat baseline, the other 5 always-B: ``bench/ipd_memory_one.py --tied 256
    --lr 0.1 --steps 400``); seed 1 is one that does."""
    grpo = train(Settings(algorithm="grpo", steps=60, tied_features=256, lr=0.1), 0)
    assert grpo.is_always_b, grpo.p_a
    r = train(Settings(algorithm="adalign", beta=0.5, steps=400, tied_features=256, lr=0.1), 1)
    assert r.is_tit_for_tat, r.p_a
    assert r.returns["tft"] > 25 and r.returns["always-b"] > 8
    assert np.mean(r.coop_by_step[20:60]) < 0.6 < np.mean(r.coop_by_step[-50:])
