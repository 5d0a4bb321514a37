"""Every advantage function against small cases computed by hand (the numbers in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from backroom.bus.wire import EpisodeRecord, MatchSpec
from backroom.trainer.advantages import (
    Hyper,
    advantage_alignment,
    assign_credit,
    discounted_returns,
    loo_advantages,
    sum_of_rewards,
)
from backroom.trainer.store import Joined, Request


def test_discounted_returns_discount_and_normalisation() -> None:
    # G_2 = 3; G_1 = 2 + 0.5 * 3 = 3.5; G_0 = 1 + 0.5 * 3.5 = 2.75
    assert discounted_returns([1, 2, 3], gamma=0.5).tolist() == [2.75, 3.5, 3.0]
    # divided by c = 5
    np.testing.assert_allclose(discounted_returns([1, 2, 3], gamma=0.5, norm=5.0), [0.55, 0.7, 0.6])
    # gamma 0: each round's own reward; gamma 1: the sum of what is left
    assert discounted_returns([1, 2, 3], gamma=0.0).tolist() == [1, 2, 3]
    assert discounted_returns([1, 2, 3], gamma=1.0).tolist() == [6, 5, 3]


def test_loo_with_group_size_8() -> None:
    g = np.arange(8.0)[:, None]  # one round, returns 0..7, one group of k = 8
    adv = loo_advantages(g, ["g"] * 8)
    # A_i = i - (28 - i) / 7
    np.testing.assert_allclose(adv[:, 0], [(8 * i - 28) / 7 for i in range(8)])
    assert adv[0, 0] == pytest.approx(-4) and adv[7, 0] == pytest.approx(4)


def test_loo_within_groups_only() -> None:
    adv = loo_advantages(np.array([[1.0], [3.0], [10.0], [20.0]]), ["a", "a", "b", "b"])
    assert adv[:, 0].tolist() == [-2, 2, -10, 10]


def test_loo_with_group_size_1_uses_the_whole_batch() -> None:
    g = np.array([[1.0, 0.0], [2.0, 0.0], [6.0, 3.0]])
    adv = loo_advantages(g, ["a", "b", "c"])
    # trajectory 0: baseline ((2 + 6) / 2, (0 + 3) / 2) = (4, 1.5)
    np.testing.assert_allclose(adv[0], [-3, -1.5])
    # trajectory 2: baseline ((1 + 2) / 2, 0) = (1.5, 0)
    np.testing.assert_allclose(adv[2], [4.5, 3])
    # alone in the whole batch: no baseline
    assert loo_advantages(np.array([[5.0, 1.0]]), ["x"]).tolist() == [[5, 1]]


def test_loo_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one group each"):
        loo_advantages(np.zeros((3, 2)), ["a", "b"])


def test_sum_of_rewards() -> None:
    assert sum_of_rewards(np.array([[3.0, 0.0], [3.0, 5.0]])).tolist() == [[6, 5], [6, 5]]


def test_advantage_alignment_by_hand() -> None:
    own, opp = [1.0, 2.0, -1.0], [0.5, -1.0, 2.0]
    out = advantage_alignment(own, opp, beta=0.5, gamma=0.9)
    # t=0: the sum over k < 0 is empty -> A_0^1 = 1, whatever A_0^2 is
    # t=1: 2 + 0.5 * 0.9 * (0.9 * 1) * (-1) = 1.595
    # t=2: -1 + 0.5 * 0.9 * (0.81 * 1 + 0.9 * 2) * 2 = 1.349
    np.testing.assert_allclose(out, [1.0, 1.595, 1.349])


def test_advantage_alignment_first_round_and_beta_zero() -> None:
    assert advantage_alignment([3.0], [100.0], beta=2.0, gamma=0.9).tolist() == [3.0]
    own = [1.0, -2.0, 0.5]
    assert advantage_alignment(own, [4.0, 5.0, 6.0], beta=0.0, gamma=0.9).tolist() == own


def _joined(
    match: str, group: str, rounds: list[list[float]], trainable: tuple[int, ...] = (0, 1)
) -> Joined:
    spec = MatchSpec(game="ipd", seats=["p0", "p1"], run="t")
    record = EpisodeRecord(
        match=match,
        run="t",
        referee="r",
        spec=spec,
        game="ipd",
        params={},
        seed=0,
        crn_group=group,
        seats=["p0", "p1"],
        actions=[],
        deliveries=[],
        round_rewards=rounds,
        raw_returns=[sum(r[s] for r in rounds) for s in (0, 1)],
        returns=[sum(r[s] for r in rounds) for s in (0, 1)],
        reason="normal",
        started_at=0,
        ended_at=1,
    )
    request = Request(
        match=match, step=0, group=group, kind="train", spec=spec, trainable=trainable
    )
    return Joined(request=request, record=record, decisions=[])


def test_assign_credit_by_hand() -> None:
    # round_rewards[round][seat]; gamma 1, c 1
    eps = [_joined("m1", "g1", [[3, 3], [0, 5]]), _joined("m2", "g2", [[1, 1], [1, 1]])]
    hp = Hyper(discount=1.0, reward_norm=1.0, beta=1.0, aa_gamma=0.5)
    # G: (m1,0) [3,0]  (m1,1) [8,5]  (m2,0) [2,1]  (m2,1) [2,1]; batch totals [15, 7], k = 1
    grpo = assign_credit(eps, "grpo", hp)
    np.testing.assert_allclose(grpo[("m1", 0)], [3 - 12 / 3, 0 - 7 / 3])
    np.testing.assert_allclose(grpo[("m1", 1)], [8 - 7 / 3, 5 - 2 / 3])
    np.testing.assert_allclose(grpo[("m2", 0)], [2 - 13 / 3, 1 - 6 / 3])
    # Advantage Alignment for (m1, 0): own [-1, -7/3], opponent [17/3, 13/3]
    # t=1: -7/3 + 1 * 0.5 * (0.5 * -1) * 13/3 = -41/12
    aa = assign_credit(eps, "adalign", hp)
    np.testing.assert_allclose(aa[("m1", 0)], [-1, -41 / 12])
    # sum of rewards: both seats of m1 get [3+3, 0+5] -> G [11, 5]; of m2 [2, 2] -> G [4, 2]
    # totals [11+11+4+4, 5+5+2+2] = [30, 14]; (m1,0): [11 - 19/3, 5 - 9/3]
    sr = assign_credit(eps, "grpo_sum", hp)
    np.testing.assert_allclose(sr[("m1", 0)], [11 - 19 / 3, 5 - 9 / 3])


def test_assign_credit_only_for_trained_seats_but_uses_the_opponents_advantage() -> None:
    rounds1, rounds2 = [[3, 3], [3, 3]], [[0, 5], [0, 5]]
    eps = [_joined("m1", "g", rounds1, trainable=(0,)), _joined("m2", "g", rounds2, trainable=(0,))]
    hp = Hyper(discount=1.0, reward_norm=1.0, beta=1.0, aa_gamma=1.0)
    # one CRN group of k = 2 per seat; G seat 0: m1 [6, 3], m2 [0, 0]; seat 1: m1 [6, 3], m2 [10, 5]
    # LOO (k = 2: G_i - G_j): A(m1,0) [6, 3], A(m2,0) [-6, -3], A(m1,1) [-4, -2], A(m2,1) [4, 2]
    credit = assign_credit(eps, "grpo", hp)
    assert set(credit) == {("m1", 0), ("m2", 0)}  # the untrained seat gets no credit
    np.testing.assert_allclose(credit[("m1", 0)], [6, 3])
    np.testing.assert_allclose(credit[("m2", 0)], [-6, -3])
    # Advantage Alignment reads the untrained opponent's advantage:
    # (m1,0) t=1: 3 + 1 * 1 * (1 * 6) * (-2) = -9; (m2,0) t=1: -3 + (1 * -6) * 2 = -15
    aa = assign_credit(eps, "adalign", hp)
    np.testing.assert_allclose(aa[("m1", 0)], [6, -9])
    np.testing.assert_allclose(aa[("m2", 0)], [-6, -15])


def test_assign_credit_refuses_ragged_batches() -> None:
    eps = [_joined("m1", "g1", [[1, 1]]), _joined("m2", "g2", [[1, 1], [1, 1]])]
    with pytest.raises(ValueError, match="same number of rounds"):
        assign_credit(eps, "grpo", Hyper(discount=0.9, reward_norm=1.0))
