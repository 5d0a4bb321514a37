"""The reference CFR is OpenSpiel's CFR on classic Kuhn, and the vectorised CFR is the reference's
on the trees OpenSpiel lacks (Loki Kuhn, the team trees), iterate for iterate.

Both do the same arithmetic in a different order (a recursion over engine
states; array passes over a tree enumerated once), so the average policies
agree to rounding error, about 1e-15 — with one exception, on team trees. Once
the third player has folded, every play left gives the team the same utility,
so at those information sets every action's regret is exactly 0; rounding
leaves the vectorised sums at ±1e-18 instead, and regret matching, which is
discontinuous at 0 (uniform at 0, all on one action at +1e-18), turns that into
a different strategy. Any strategy is as good as any other there, so the
regrets (everywhere), the values and NashConv still agree to rounding error,
and the average strategies are compared everywhere else
(:func:`constant_utility_infosets` finds those sets: a fifth to a third of the team's).

Loki runs with ``start`` fixed, to keep the reference's walks short, except
one test that keeps the random first player, whose chance node the reference
enumerates. The whole file takes about 6 s of one core.
"""

from __future__ import annotations

import numpy as np
import pyspiel
import pytest

from backroom.games import make_game
from backroom.solvers.cfr import CFRSolver
from backroom.solvers.evaluate import expected_returns, nash_conv
from backroom.solvers.openspiel_compat import from_openspiel_policy
from backroom.solvers.reference import ReferenceCFR, regret_matching
from backroom.solvers.team import build_team_tree, team_key, team_owner
from backroom.solvers.tree import GameTree, build_tree

TOL = 1e-12


def reference_average(ref: ReferenceCFR, iterations: int, alternating: bool = True) -> ReferenceCFR:
    for _ in range(iterations):
        ref.iteration(alternating)
    return ref


def constant_utility_infosets(tree: GameTree) -> set[int]:
    """Information sets below which every terminal gives the mover the same utility.

    Per slot, the least and greatest utility of its player over the terminals
    below it (its own, then pushed up to the parent sequence, deepest first).
    """
    lo = np.full(tree.num_slots, np.inf)
    hi = np.full(tree.num_slots, -np.inf)
    for p in range(tree.num_players):
        np.minimum.at(lo, tree.term_seq[:, p], tree.term_utility[:, p])
        np.maximum.at(hi, tree.term_seq[:, p], tree.term_utility[:, p])
    for _p, level, a, b in reversed(tree.blocks):
        if level:
            np.minimum.at(lo, tree.slot_parent[a:b], lo[a:b])
            np.maximum.at(hi, tree.slot_parent[a:b], hi[a:b])
    out = set()
    for i in tree.real_infosets():
        s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
        if lo[s : s + k].min() == hi[s : s + k].max():
            out.add(i)
    return out


def check_same_iterates(
    tree: GameTree, ref: ReferenceCFR, iterations: int, *, alternating: bool = True
) -> set[int]:
    """Run both for ``iterations``; compare; return the constant-utility sets left out."""
    reference_average(ref, iterations, alternating)
    solver = CFRSolver(tree, "cfr", alternating=alternating)
    solver.run(iterations)
    policy = ref.average_policy()
    real = tree.real_infosets()
    assert set(policy) == {tree.infoset_key[i] for i in real}
    slots = np.concatenate(
        [
            np.arange(tree.infoset_start[i], tree.infoset_start[i] + tree.infoset_size[i])
            for i in real
        ]
    )
    regret = np.concatenate(
        [ref.regret[(int(tree.infoset_player[i]), tree.infoset_key[i])] for i in real]
    )
    assert np.abs(regret - solver.regret[slots]).max() < TOL
    ours, theirs = tree.sigma_from_policy(policy), solver.average_policy()
    skip = constant_utility_infosets(tree)
    compared = ~np.isin(tree.slot_infoset, sorted(skip))
    assert np.abs(ours - theirs)[compared].max() < TOL
    assert abs(nash_conv(tree, ours) - nash_conv(tree, theirs)) < TOL
    np.testing.assert_allclose(
        expected_returns(tree, ours), expected_returns(tree, theirs), atol=TOL
    )
    assert np.abs(ours - tree.uniform()).max() > 0.05  # the iterates moved: not a trivial match
    return skip


def test_regret_matching() -> None:
    assert regret_matching([2.0, -1.0, 6.0]) == [0.25, 0.0, 0.75]  # R⁺ / Σ R⁺
    assert regret_matching([-1.0, 0.0]) == [0.5, 0.5]  # no positive regret: uniform


@pytest.mark.parametrize(("players", "iterations"), [(2, 60), (3, 12)])
def test_reference_is_openspiels_cfr_on_classic_kuhn(players: int, iterations: int) -> None:
    game = make_game("kuhn", players=players)
    tree = build_tree(game)
    ref = reference_average(ReferenceCFR(game), iterations)
    theirs = pyspiel.CFRSolver(pyspiel.load_game("kuhn_poker", {"players": players}))
    for _ in range(iterations):
        theirs.evaluate_and_update_policy()
    expected = from_openspiel_policy(tree, theirs.average_policy())
    assert np.abs(tree.sigma_from_policy(ref.average_policy()) - expected).max() < TOL


def test_vectorised_cfr_is_the_reference_on_loki() -> None:
    game = make_game("kuhn", variant="loki", start=0)
    assert not check_same_iterates(build_tree(game), ReferenceCFR(game), 3)


def test_simultaneous_updates_too_with_a_random_first_player() -> None:
    game = make_game("kuhn", variant="loki")
    assert not check_same_iterates(build_tree(game), ReferenceCFR(game), 2, alternating=False)


@pytest.mark.parametrize(("team", "alternating"), [((0, 1), True), ((1, 2), False)])
def test_vectorised_cfr_is_the_reference_on_the_team_tree(
    team: tuple[int, int], alternating: bool
) -> None:
    game = make_game("kuhn", variant="loki", start=0)
    tree = build_team_tree(game, team)
    ref = ReferenceCFR(game, owner=team_owner(3, team), key=team_key(team))
    skipped = check_same_iterates(tree, ref, 3, alternating=alternating)
    # Left out: only team sets (those after the third player folded), a minority of them.
    assert skipped and all(tree.infoset_player[i] == 0 for i in skipped)
    team_sets = [i for i in tree.real_infosets() if tree.infoset_player[i] == 0]
    assert len(skipped) < 0.4 * len(team_sets)


def test_simultaneous_moves_are_refused() -> None:
    ref = ReferenceCFR(make_game("ipd", rounds=1))
    with pytest.raises(ValueError, match="turn-based"):
        ref.iteration()
