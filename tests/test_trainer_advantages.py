"""Every advantage function against small cases computed by hand (the numbers in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from backroom.bus.wire import EpisodeRecord, MatchSpec
from backroom.trainer.advantages import (
    Hyper,
    Trajectory,
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


def _who(*rows: tuple[object, object, int] | tuple[object, object, int, bool]) -> list[Trajectory]:
    """Trajectories from (group, match, seat[, trained]) rows."""
    return [Trajectory(*row) for row in rows]  # type: ignore[arg-type]


def test_loo_with_group_size_8() -> None:
    # one CRN group of k = 8 matches, seat 0 only, one round: returns 0..7
    g = np.arange(8.0)[:, None]
    adv = loo_advantages(g, _who(*(("g", m, 0) for m in range(8))))
    # A_i = i - (28 - i) / 7
    np.testing.assert_allclose(adv[:, 0], [(8 * i - 28) / 7 for i in range(8)])
    assert adv[0, 0] == pytest.approx(-4) and adv[7, 0] == pytest.approx(4)


def test_loo_within_groups_only() -> None:
    who = _who(("a", "m1", 0), ("a", "m2", 0), ("b", "m3", 0), ("b", "m4", 0))
    adv = loo_advantages(np.array([[1.0], [3.0], [10.0], [20.0]]), who)
    assert adv[:, 0].tolist() == [-2, 2, -10, 10]


def test_group_size_1_compares_with_the_other_matches_of_the_batch_in_the_same_seat() -> None:
    # three matches, each its own CRN group (k = 1), two seats, two rounds
    g = np.array(
        [
            [1.0, 0.0],  # m1 seat 0
            [9.0, 9.0],  # m1 seat 1: never in m1 seat 0's baseline
            [2.0, 0.0],  # m2 seat 0
            [7.0, 1.0],  # m2 seat 1
            [6.0, 3.0],  # m3 seat 0
            [5.0, 5.0],  # m3 seat 1
        ]
    )
    who = _who(*((m, m, seat) for m in ("m1", "m2", "m3") for seat in (0, 1)))
    adv = loo_advantages(g, who, "per_seat")
    # m1 seat 0: baseline seat 0 of m2, m3 = ((2 + 6) / 2, (0 + 3) / 2) = (4, 1.5)
    np.testing.assert_allclose(adv[0], [-3, -1.5])
    # m1 seat 1: baseline seat 1 of m2, m3 = (6, 3)
    np.testing.assert_allclose(adv[1], [3, 6])
    # m3 seat 0: baseline (1.5, 0)
    np.testing.assert_allclose(adv[4], [4.5, 3])
    # pooled_other_matches: both seats of the other matches, never the own match
    pooled = loo_advantages(g, who, "pooled_other_matches")
    # m1 seat 0: (2 + 7 + 6 + 5) / 4 = 5, (0 + 1 + 3 + 5) / 4 = 2.25
    np.testing.assert_allclose(pooled[0], [1 - 5, 0 - 2.25])
    # m1 seat 1: the same pool as its partner
    np.testing.assert_allclose(pooled[1], [9 - 5, 9 - 2.25])
    # alone in the whole batch: no baseline
    assert loo_advantages(np.array([[5.0, 1.0]]), _who(("x", "x", 0))).tolist() == [[5, 1]]


def test_an_asymmetric_group_of_k_matches_compares_seats_with_themselves() -> None:
    # a CRN group of k = 3 in a game where seat 1 earns ten times more (one round)
    g = np.array([[1.0], [10.0], [2.0], [20.0], [3.0], [30.0]])
    who = _who(*(("g", m, seat) for m in ("m1", "m2", "m3") for seat in (0, 1)))
    adv = loo_advantages(g, who, "per_seat")
    # seat 0: 1 - 2.5, 2 - 2, 3 - 1.5; seat 1: 10 - 25, 20 - 20, 30 - 15
    np.testing.assert_allclose(adv[:, 0], [-1.5, -15, 0, 0, 1.5, 15])
    # pooled mixes the scales: m1 seat 0 against (2 + 20 + 3 + 30) / 4 = 13.75
    pooled = loo_advantages(g, who, "pooled_other_matches")
    assert pooled[0, 0] == pytest.approx(1 - 13.75)


def test_a_frozen_seat_is_never_in_a_trained_seats_baseline() -> None:
    # k = 1; m2's seat 1 is a frozen buffer adapter with a huge return
    g = np.array([[1.0], [1.0], [2.0], [100.0], [3.0], [3.0]])
    who = _who(
        ("m1", "m1", 0), ("m1", "m1", 1), ("m2", "m2", 0),
        ("m2", "m2", 1, False), ("m3", "m3", 0), ("m3", "m3", 1),
    )  # fmt: skip
    for baseline in ("per_seat", "pooled_other_matches"):
        adv = loo_advantages(g, who, baseline)  # type: ignore[arg-type]
        # m1 seat 1 (trained): per seat, only m3 seat 1 = 3; pooled, m2 seat 0, m3 seats = 8 / 3
        expected = 1 - 3 if baseline == "per_seat" else 1 - 8 / 3
        assert adv[1, 0] == pytest.approx(expected), baseline
    # the frozen seat's own advantage (Advantage Alignment's A^2) compares it with frozen seats;
    # with none other it falls back to every other match's seat 1 (m1 1, m3 3), not to A = G:
    # an uncentred A^2 would scale the shaping term by the raw return
    assert loo_advantages(g, who)[3, 0] == 100 - 2
    # with a frozen peer it keeps to frozen seats
    more = [*who, *_who(("m4", "m4", 0), ("m4", "m4", 1, False))]
    g4 = np.vstack([g, [[5.0], [40.0]]])
    assert loo_advantages(g4, more)[3, 0] == 100 - 40


def test_a_group_left_with_one_match_is_compared_with_the_whole_batch() -> None:
    # k = 2, but group "b" lost its second match (dropped): like k = 1, the rest of the batch
    g = np.array([[1.0], [3.0], [8.0]])
    who = _who(("a", "m1", 0), ("a", "m2", 0), ("b", "m3", 0))
    adv = loo_advantages(g, who)
    assert adv[:, 0].tolist() == [-2, 2, 8 - 2]


def test_loo_rejects_mismatched_shapes_and_unknown_baselines() -> None:
    with pytest.raises(ValueError, match="one Trajectory each"):
        loo_advantages(np.zeros((3, 2)), _who(("a", "a", 0), ("b", "b", 0)))
    with pytest.raises(ValueError, match="baseline must be one of"):
        loo_advantages(np.zeros((1, 2)), _who(("a", "a", 0)), "pooled")  # type: ignore[arg-type]


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
    # round_rewards[round][seat]; gamma 1, c 1; k = 1 (each match its own group)
    eps = [
        _joined("m1", "g1", [[3, 3], [0, 5]]),
        _joined("m2", "g2", [[1, 1], [1, 1]]),
        _joined("m3", "g3", [[5, 0], [1, 1]]),
    ]
    hp = Hyper(discount=1.0, reward_norm=1.0, beta=1.0, aa_gamma=0.5)
    # G: (m1,0) [3,0] (m1,1) [8,5]; (m2,0) [2,1] (m2,1) [2,1]; (m3,0) [6,1] (m3,1) [1,1]
    # per seat: seat 0 of the other matches; seat 1 likewise
    grpo = assign_credit(eps, "grpo", hp)
    np.testing.assert_allclose(grpo[("m1", 0)], [3 - 4, 0 - 1])  # vs m2, m3 seat 0: [4, 1]
    np.testing.assert_allclose(grpo[("m1", 1)], [8 - 1.5, 5 - 1])  # vs m2, m3 seat 1: [1.5, 1]
    np.testing.assert_allclose(grpo[("m2", 0)], [2 - 4.5, 1 - 0.5])  # vs m1, m3 seat 0
    # Advantage Alignment for (m1, 0): own [-1, -1], opponent (m1, 1) [6.5, 4]
    # t=1: -1 + 1 * 0.5 * (0.5 * -1) * 4 = -2
    aa = assign_credit(eps, "adalign", hp)
    np.testing.assert_allclose(aa[("m1", 0)], [-1, -2])
    # sum of rewards: both seats of m1 get [6, 5] -> G [11, 5]; m2 [2, 2] -> G [4, 2];
    # m3 [5, 2] -> G [7, 2]; (m1,0) vs seat 0 of m2, m3: [5.5, 2]
    sr = assign_credit(eps, "grpo_sum", hp)
    np.testing.assert_allclose(sr[("m1", 0)], [11 - 5.5, 5 - 2])
    # the pooled variant: both seats of m2 and m3, (2 + 2 + 6 + 1) / 4, (1 + 1 + 1 + 1) / 4
    pooled = assign_credit(
        eps, "grpo", Hyper(discount=1.0, reward_norm=1.0, baseline="pooled_other_matches")
    )
    np.testing.assert_allclose(pooled[("m1", 0)], [3 - 11 / 4, 0 - 1])


def test_no_trained_seats_baseline_contains_its_own_match() -> None:
    """Moving the opponent's return in the same match leaves a seat's credit unchanged."""
    hp = Hyper(discount=0.9, reward_norm=5.0)
    rng = np.random.default_rng(0)
    rounds = [rng.integers(0, 6, size=(3, 2)).tolist() for _ in range(6)]
    eps = [_joined(f"m{i}", f"g{i}", r) for i, r in enumerate(rounds)]
    for baseline in ("per_seat", "pooled_other_matches"):
        hp = Hyper(discount=0.9, reward_norm=5.0, baseline=baseline)  # type: ignore[arg-type]
        before = assign_credit(eps, "grpo", hp)
        changed = [*eps[:2], _joined("m2", "g2", [[r[0], r[1] + 50] for r in rounds[2]]), *eps[3:]]
        after = assign_credit(changed, "grpo", hp)
        np.testing.assert_allclose(after[("m2", 0)], before[("m2", 0)])


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
