"""The registry of trainer algorithms (``trainer/algorithms.py``): one entry is all an algorithm is.

The LoRA trainer's credit (``advantages.assign_credit``) and the memory-one
harness's (``memory_one.credit``) read the same entry, so they must give the
same numbers for the same rewards; a config is checked and defaulted by its
algorithm's entry.
"""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from backroom.bus.wire import EpisodeRecord, MatchSpec
from backroom.runner.config import ConfigError
from backroom.trainer.advantages import Hyper, assign_credit
from backroom.trainer.algorithms import ALGORITHMS, CREDITED, AlgorithmName, credited
from backroom.trainer.config import TrainConfig, parse_train_config
from backroom.trainer.memory_one import Settings, credit
from backroom.trainer.store import Joined, Request


def test_every_name_has_one_entry_with_a_doc_line() -> None:
    assert list(ALGORITHMS) == list(get_args(AlgorithmName))
    assert all(name == a.name and len(a.doc.split()) >= 4 for name, a in ALGORITHMS.items())
    assert CREDITED == ("grpo", "grpo_sum", "adalign")  # dpo learns from a finished run
    assert not ALGORITHMS["dpo"].rollouts
    # the config's field tells each one's doc line
    description = TrainConfig.model_fields["algorithm"].description or ""
    assert all(f"{a.name}: {a.doc}" in description for a in ALGORITHMS.values())


def test_only_a_credited_algorithm_is_asked_for_credit() -> None:
    with pytest.raises(ValueError, match="algorithm must be 'grpo', 'grpo_sum' or 'adalign'"):
        credited("dpo")
    with pytest.raises(ValueError, match="got 'ppo'"):
        credited("ppo")


def test_a_config_takes_its_algorithms_defaults_and_checks() -> None:
    base = {"game": "ipd", "preset": "ipd"}
    grpo = parse_train_config({**base, "algorithm": "grpo"})
    adalign = parse_train_config({**base, "algorithm": "adalign"})
    assert grpo.method is ALGORITHMS["grpo"] and grpo.hp is not None and adalign.hp is not None
    assert (grpo.hp.rho, adalign.hp.rho) == (0.0, 0.5)  # GRPO's entry: no buffer
    turned_on = parse_train_config({**base, "algorithm": "grpo", "hyper": {"rho": 0.25}})
    assert turned_on.hp is not None and turned_on.hp.rho == 0.25  # the file's hyper wins
    with pytest.raises(ConfigError, match="dpo: only algorithm: dpo reads it"):
        parse_train_config({**base, "algorithm": "adalign", "dpo": {"source": "runs/x"}})


def _joined(match: str, rewards: np.ndarray) -> Joined:
    """An IPD match of ``rewards`` (seats, rounds), its own CRN group (k = 1), both seats trained."""
    spec = MatchSpec(game="ipd", seats=["p0", "p1"], run="t")
    rounds = rewards.T.tolist()
    record = EpisodeRecord(
        match=match,
        run="t",
        referee="r",
        spec=spec,
        game="ipd",
        params={},
        seed=0,
        crn_group=match,
        seats=["p0", "p1"],
        actions=[],
        deliveries=[],
        round_rewards=rounds,
        raw_returns=rewards.sum(axis=1).tolist(),
        returns=rewards.sum(axis=1).tolist(),
        reason="normal",
        started_at=0,
        ended_at=1,
    )
    request = Request(match=match, step=0, group=match, kind="train", spec=spec, trainable=(0, 1))
    return Joined(request=request, record=record, decisions=[])


@pytest.mark.parametrize("algorithm", CREDITED)
def test_the_lora_trainer_and_the_memory_one_harness_credit_alike(algorithm: str) -> None:
    rng = np.random.default_rng(7)
    rewards = rng.choice([0.0, 1.0, 3.0, 5.0], size=(6, 2, 4))  # (matches, seats, rounds)
    s = Settings(algorithm=algorithm, beta=0.5, aa_gamma=0.9, discount=0.9, reward_norm=5.0)
    harness = credit(rewards, s)
    hp = Hyper(discount=0.9, reward_norm=5.0, beta=0.5, aa_gamma=0.9)
    episodes = [_joined(f"m{i}", r) for i, r in enumerate(rewards)]
    lora = assign_credit(episodes, algorithm, hp)  # type: ignore[arg-type]
    for i in range(len(rewards)):
        for seat in (0, 1):
            np.testing.assert_allclose(lora[(f"m{i}", seat)], harness[i, seat])
