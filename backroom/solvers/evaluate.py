"""Expected returns, best responses, exploitability and NashConv of a behaviour profile.

All on the sequence form of :mod:`backroom.solvers.tree`, so an evaluation is
a few array passes and needs no engine calls:

* expected return ``u_i(σ) = Σ_z c(z) Π_p x_p(seq_p(z)) u_i(z)``;
* best-response value for ``i``: the same bottom-up pass as CFR's
  counterfactual values, with a max instead of the σ-weighted sum at ``i``'s
  information sets: ``BR(s) = Σ_{z: seq_i(z)=s} w_i(z) + Σ_{I: parent(I)=s} max_a BR(I a)``
  (valid under perfect recall, which the tree builder checks);
* ``NashConv(σ) = Σ_i [BR_i(σ_{-i}) − u_i(σ)]`` (OpenSpiel's ``nash_conv``);
* ``exploitability(σ) = (Σ_i BR_i(σ_{-i}) − Σ_i u_i) / n``, which for two-player
  zero-sum games is ``NashConv / 2`` (OpenSpiel's ``exploitability``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from backroom.solvers.tree import FloatArray, GameTree

Policy = Mapping[str, Mapping[str, float]]


def _sigma(tree: GameTree, sigma: FloatArray | Policy) -> FloatArray:
    if isinstance(sigma, np.ndarray):
        return sigma
    return tree.sigma_from_policy(dict(sigma))  # type: ignore[arg-type]


def expected_returns(tree: GameTree, sigma: FloatArray | Policy) -> FloatArray:
    """Expected utility of every solver player: ``Σ_z π(z) u(z)``."""
    reach = tree.terminal_reach(_sigma(tree, sigma))
    return reach @ tree.term_utility


def expected_seat_returns(tree: GameTree, sigma: FloatArray | Policy) -> FloatArray:
    """Expected raw engine return of every seat (differs from the above for a team tree)."""
    reach = tree.terminal_reach(_sigma(tree, sigma))
    return reach @ tree.term_returns


def best_response(
    tree: GameTree, sigma: FloatArray | Policy, player: int, *, with_response: bool = False
) -> tuple[float, FloatArray | None]:
    """Value of ``player``'s best response to the others' part of ``sigma`` (and the response).

    With ``with_response`` the response comes back as a full profile: ``sigma``
    with ``player``'s slots replaced by a pure strategy (the first maximising
    action, as OpenSpiel breaks ties).
    """
    sig = _sigma(tree, sigma)
    x = tree.realization(sig)
    # w_i(z) = c(z) u_i(z) Π_{j≠i} x_j(seq_j(z))
    w = tree.term_chance * tree.term_utility[:, player]
    for j in range(tree.num_players):
        if j != player:
            w = w * x[tree.term_seq[:, j]]
    v = np.bincount(tree.term_seq[:, player], w, minlength=tree.num_slots)
    blocks = [(lo, hi) for p, d, lo, hi in tree.blocks if p == player and d > 0]
    for lo, hi in reversed(blocks):  # deepest own moves first
        first, last = int(tree.slot_infoset[lo]), int(tree.slot_infoset[hi - 1]) + 1
        best = np.maximum.reduceat(v[lo:hi], tree.infoset_start[first:last] - lo)
        # BR(parent(I)) += max_a BR(I a)
        v += np.bincount(tree.infoset_parent[first:last], best, minlength=tree.num_slots)
    response = None
    if with_response:
        response = sig.copy()
        for i in tree.real_infosets():
            if tree.infoset_player[i] != player:
                continue
            s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
            response[s : s + k] = 0.0
            response[s + int(np.argmax(v[s : s + k]))] = 1.0
    return float(v[tree.root_slot[player]]), response


def best_response_values(tree: GameTree, sigma: FloatArray | Policy) -> FloatArray:
    sig = _sigma(tree, sigma)
    return np.array([best_response(tree, sig, p)[0] for p in range(tree.num_players)])


def nash_conv(tree: GameTree, sigma: FloatArray | Policy) -> float:
    """``Σ_i [max_{σ'_i} u_i(σ'_i, σ_{-i}) − u_i(σ)]``: zero exactly at a Nash equilibrium."""
    sig = _sigma(tree, sigma)
    return float(np.sum(best_response_values(tree, sig) - expected_returns(tree, sig)))


def exploitability(tree: GameTree, sigma: FloatArray | Policy) -> float:
    """``(Σ_i BR_i − Σ_i u_i) / n``; for two-player zero-sum games, NashConv / 2."""
    sig = _sigma(tree, sigma)
    utility_sum = float(np.sum(expected_returns(tree, sig)))
    return float((np.sum(best_response_values(tree, sig)) - utility_sum) / tree.num_players)
