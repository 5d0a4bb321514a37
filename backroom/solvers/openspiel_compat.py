"""Bridges to OpenSpiel, for tests and benchmarks that check our numbers against it.

OpenSpiel (``open_spiel``, a test extra) is imported lazily, so the solvers
themselves never need it. Classic Kuhn's information-state strings and action
numbers are OpenSpiel's, and an ``openspiel`` game's are OpenSpiel's own
(:mod:`backroom.games.openspiel`), so a policy converts by key.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backroom.solvers.tree import FloatArray, GameTree


def openspiel_game(tree: GameTree) -> Any:
    """The OpenSpiel game a tree was built from: an ``openspiel`` game, or classic Kuhn's twin."""
    import pyspiel

    if tree.game == "openspiel":
        params = dict(tree.params)
        game = pyspiel.load_game(str(params.pop("name")), params)
        if game.get_type().dynamics == pyspiel.GameType.Dynamics.SIMULTANEOUS:
            # OpenSpiel's solvers take turns; its wrapper sequentialises as our tree does
            return pyspiel.convert_to_turn_based(game)
        return game
    if tree.game != "kuhn" or tree.params.get("variant") != "classic":
        raise ValueError("only classic Kuhn and openspiel games have an OpenSpiel twin")
    return pyspiel.load_game("kuhn_poker", {"players": int(tree.params["players"])})


def openspiel_key(tree: GameTree, infoset: int, game: Any) -> str:
    """OpenSpiel's key for one of our information sets.

    The same string, except on OpenSpiel's turn-based wrapper of a simultaneous
    game, which writes ``Current player: p`` above the game's own string. Both
    sequentialise a simultaneous move alike (player 0, then 1 not seeing 0's
    choice), so the information sets correspond one to one.
    """
    key = tree.infoset_key[infoset]
    if game.get_type().short_name == "turn_based_simultaneous_game":
        return f"Current player: {int(tree.infoset_player[infoset])}\n{key}"
    return key


def to_tabular_policy(tree: GameTree, sigma: FloatArray, game: Any | None = None) -> Any:
    """Our slot probabilities as an ``open_spiel.python.policy.TabularPolicy``.

    Raises ``KeyError`` if an information state of ours is unknown to OpenSpiel,
    so a silent mismatch of keys cannot pass for agreement.
    """
    from open_spiel.python import policy as os_policy

    game = game or openspiel_game(tree)
    tab = os_policy.TabularPolicy(game)
    for i in tree.real_infosets():
        row = tab.state_lookup[openspiel_key(tree, i, game)]
        s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
        probs = np.zeros(tab.action_probability_array.shape[1])
        for a, p in zip(tree.infoset_actions[i], sigma[s : s + k], strict=True):
            probs[int(a)] = p
        tab.action_probability_array[row] = probs
    return tab


def from_openspiel_policy(tree: GameTree, policy: Any, game: Any | None = None) -> FloatArray:
    """Slot probabilities from an OpenSpiel policy: a Python ``TabularPolicy`` or a C++
    ``pyspiel`` tabular policy (what ``CFRSolver.average_policy()`` returns).

    ``game`` is the OpenSpiel game the policy is for (default: ``openspiel_game(tree)``)."""
    game = game or openspiel_game(tree)
    out = tree.uniform()
    for i in tree.real_infosets():
        key = openspiel_key(tree, i, game)
        if hasattr(policy, "policy_for_key"):
            row = policy.policy_for_key(key)
            probs = {a: float(row[a]) for a in range(len(row))}
        else:
            probs = {int(a): float(p) for a, p in policy.get_state_policy(key)}
        s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
        out[s : s + k] = [probs.get(int(a), 0.0) for a in tree.infoset_actions[i]]
    return out


def policy_json_to_tabular(tree: GameTree, policy: dict[str, dict[str, float]]) -> Any:
    """A policy file's mapping (``{info_state: {json action: prob}}``) as a TabularPolicy."""
    return to_tabular_policy(tree, tree.sigma_from_policy(policy))


__all__ = [
    "from_openspiel_policy",
    "openspiel_game",
    "openspiel_key",
    "policy_json_to_tabular",
    "to_tabular_policy",
]
