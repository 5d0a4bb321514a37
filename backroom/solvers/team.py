"""The colluders as one team: a two-player zero-sum solve, and the Loki paper's strategy distillation.

Modelling choice (documented in docs/solvers.md). Colluders on a private
channel that "tells all" know each other's private card, and by Loki's
coalition payoff (eq. 1, ``R = (R_A + R_B) / 2``) they want the sum of their
rewards. So the two seats become **one solver player**, the *team*:

* its information set at a colluder's turn is both colluders' information
  states together (the mover's card, the partner's card, the public
  history), so the team plays a *joint* strategy with perfect recall;
* its utility is ``u_A + u_B``; the third player's is ``u_C``. Kuhn is zero-sum
  (its ``GameInfo`` says so, and the tree builder checks it on every terminal),
  so ``u_team = −u_C``: the team game is a **two-player zero-sum game**.

We run CFR on that game for both sides at once — the third player *runs CFR
against the team* — so the average strategies converge to a Nash equilibrium
of the team game, i.e. the team's max-min strategy and a third player who best
responds to it (the gap is the team game's exploitability, which we report).
This is our reading of the Loki paper's "CFR Collusion" row. Why this is the
right yardstick: at a Nash equilibrium of the three-player game the third
player already best-responds to the colluders, so in a zero-sum game the
colluders' value there is ``min_C u_team(σ_A, σ_B, C) ≤ max_team min_C u_team``
— the team solve can only gain, up to the solvers' own gaps. Two other
readings are computed too (see :mod:`backroom.solvers.collusion`): the team's
strategy against an *unaware* third player who keeps its three-player CFR
policy, and the team's best response to that fixed policy (an upper bound on
what collusion can extract from a player who does not adapt).

Algorithm 3 of the paper (*Distill CFR Strategies*) averages, for a partly
specified state (a hand, the bets, the folds), the strategies of every CFR
state that matches it, weighted by the probability that play reaches that
state. :func:`distill_strategy` is that algorithm as written;
:func:`distill_team_policy` applies it to the team strategy to get, for each
colluder, a policy keyed by its *own* information state (partner's card
marginalised out), which the ``table`` agent can play without a channel.
:func:`distill_individual_policy` is the paper's own use of it: the input is
the colluders' *individual* three-player CFR strategies, and the query is the
paper's coarse state {hand, bets, folds} (:func:`paper_state`), so both
colluders play one strategy pooled over every state of either colluder with
the same card, bets and folds — no card is shared.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backroom.games.base import Game, State
from backroom.solvers.cfr import CFRSolver
from backroom.solvers.evaluate import best_response, expected_returns, exploitability
from backroom.solvers.tree import DEFAULT_MAX_NODES, FloatArray, GameTree, build_tree

TEAM = 0  # the team is solver player 0 in a team tree


def team_key(team: Sequence[int]) -> Callable[[State, int], str]:
    """Information-set key: colluders see both colluders' information states.

    ``"team[0] 0:<seat 0's info state> / 1:<seat 1's info state>"`` — the mover
    first in brackets, then every colluder's own string, so the key holds
    every private card the team knows plus the public history.
    """
    members = tuple(team)

    def key(state: State, seat: int) -> str:
        if seat not in members:
            return state.information_state(seat)
        return joint_key(seat, {s: state.information_state(s) for s in members})

    return key


def joint_key(seat: int, info_states: Mapping[int, str]) -> str:
    """The team's key at ``seat``'s turn from every colluder's information state, in team order.

    What a colluder at the table rebuilds to look up its move in a team
    policy file, once its partners' private information has reached it.
    """
    parts = " / ".join(f"{s}:{state}" for s, state in info_states.items())
    return f"team[{seat}] {parts}"


def team_owner(num_seats: int, team: Sequence[int]) -> tuple[int, ...]:
    """Seat → solver player: the team is player 0, every other seat its own player after it."""
    if len(set(team)) != len(team) or not all(0 <= s < num_seats for s in team) or len(team) < 2:
        raise ValueError(
            f"a team needs two or more distinct seats of 0..{num_seats - 1}, got {team}"
        )
    owner, nxt = [], 1
    for seat in range(num_seats):
        if seat in team:
            owner.append(TEAM)
        else:
            owner.append(nxt)
            nxt += 1
    return tuple(owner)


def build_team_tree(
    game: Game, team: Sequence[int] = (0, 1), *, max_nodes: int = DEFAULT_MAX_NODES
) -> GameTree:
    """The game tree with ``team``'s seats merged into one player that sees both private states."""
    tree = build_tree(
        game, owner=team_owner(game.num_players, team), key=team_key(team), max_nodes=max_nodes
    )
    tree.meta["team"] = list(team)
    return tree


@dataclass
class TeamSolution:
    """A solved team game: the joint team strategy and the other seats' strategy."""

    tree: GameTree
    sigma: FloatArray
    team: tuple[int, ...]
    iterations: int
    algo: str
    values: FloatArray  # expected utility per solver player (team first)
    exploitability: float  # of the team game (two-player constant-sum: NashConv / 2; else NaN)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def team_value(self) -> float:
        """Expected sum of the colluders' rewards (twice Loki's coalition payoff)."""
        return float(self.values[TEAM])

    def guaranteed_value(self) -> float:
        """``min_C u_team(τ, C)``: the team's value when every other seat best-responds.

        With one opponent in a game whose returns sum to a constant ``S`` (the
        engine's ``GameInfo.utility_sum``; 0 for Kuhn), ``u_team = S − u_C``, so the
        minimum is ``S − BR_C``; otherwise no one best response gives it, and it is NaN.
        """
        info = self.tree.info
        if self.tree.num_players != 2 or info is None or info.utility_sum is None:
            return float("nan")
        br, _ = best_response(self.tree, self.sigma, 1)
        return info.utility_sum - br

    def policy(self) -> dict[str, dict[str, float]]:
        """Team keys for colluders' turns, plain information states for the others."""
        return self.tree.policy_dict(self.sigma)


def solve_team(
    game: Game,
    team: Sequence[int] = (0, 1),
    iterations: int = 10_000,
    algo: str = "cfr+",
    *,
    tree: GameTree | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> TeamSolution:
    """CFR on the team game (team vs the other seats, all running CFR); see the module docstring."""
    tree = tree or build_team_tree(game, team, max_nodes=max_nodes)
    solver = CFRSolver(tree, algo)
    solver.run(iterations)
    sigma = solver.average_policy()
    info = tree.info
    two_player_constant_sum = tree.num_players == 2 and info is not None and info.constant_sum
    expl = exploitability(tree, sigma) if two_player_constant_sum else float("nan")
    return TeamSolution(
        tree=tree,
        sigma=sigma,
        team=tuple(team),
        iterations=iterations,
        algo=algo,
        values=expected_returns(tree, sigma),
        exploitability=expl,
    )


#: Decimals of the probabilities in a team policy file (``team_policy_document``).
TEAM_POLICY_DIGITS = 6


def team_policy_document(
    solution: TeamSolution, digits: int | None = TEAM_POLICY_DIGITS
) -> dict[str, Any]:
    """The team's joint strategy as a policy file: the colluders' rows, keyed by :func:`joint_key`.

    What the ``kuhn-team`` agent plays. The other seats' rows (the solve's
    third player) are left out: at the table that seat plays its own policy.
    Probabilities are rounded to ``digits`` decimals (None: kept whole) so the
    shipped file stays small; ``meta`` holds the unrounded solve's values.
    """
    tree = solution.tree
    policy = {
        key: {a: (round(p, digits) if digits is not None else p) for a, p in row.items()}
        for key, row in solution.policy().items()
        if key.startswith("team[")
    }
    meta = {
        "solver": "backroom.solvers.team",
        "kind": "team",
        "team": list(solution.team),
        "algo": solution.algo,
        "iterations": solution.iterations,
        "digits": digits,
        "team_value_sum": solution.team_value,
        "team_guaranteed_value_sum": solution.guaranteed_value(),
        "team_game_exploitability": solution.exploitability,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return {"game": tree.game, "params": tree.params, "policy": policy, "meta": meta}


def lift_policy(tree: GameTree, policy: dict[str, dict[str, float]]) -> FloatArray:
    """A per-seat policy (engine information states) played on a team tree.

    Each team information set plays what the mover's own information state
    says, ignoring the partner's card: how independent players look to the team game.
    """
    labels: dict[int, str] = {}
    for iset, label in zip(tree.node_infoset.tolist(), tree.node_label, strict=True):
        labels.setdefault(iset, label)
    sigma = tree.uniform()
    for i in tree.real_infosets():
        probs = policy.get(labels.get(i, tree.infoset_key[i]))
        if not probs:
            continue
        s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
        row = np.array(
            [max(0.0, float(probs.get(json.dumps(a), 0.0))) for a in tree.infoset_actions[i]]
        )
        if row.sum() > 0:
            sigma[s : s + k] = row / row.sum()
    return sigma


# --- Algorithm 3: strategy distillation ---------------------------------------------------


def distill_strategy(
    entries: Iterable[tuple[int, str, Sequence[float], float]],
    players: Collection[int],
    matches: Callable[[str], bool],
    num_actions: int,
) -> list[float]:
    """Loki Algorithm 3, *Distill CFR Strategies*, line by line.

    ``entries`` are the CFR strategies as ``(player, state, strategy, weight)``
    with ``weight`` the CFR state probability; ``matches(state)`` says whether
    the state contains the queried {hand, bets, folds}.
    """
    distill = np.zeros(num_actions)  # 1: distill_strategy ← 0
    norm = 0.0  # 2: norm_factor ← 0
    # 3: for player, state, strategy in CFR strategies
    for player, state, strategy, weight in entries:
        if player not in players:  # 4-5: skip players outside the coalition
            continue
        if matches(state):  # 7: if {hand, bets, folds} ∈ state
            s = np.asarray(strategy, dtype=np.float64)
            distill += weight * s / s.sum()  # 8-9: distill += weight · strategy / Σ strategy
            norm += weight  # 10: norm_factor += weight
    if norm > 0:  # 13-14
        return (distill / norm).tolist()
    return [1.0 / num_actions] * num_actions  # 15-16: uniform


def distill_team_policy(solution: TeamSolution) -> dict[str, dict[str, float]]:
    """Per-colluder policies keyed by the engine's own information states (Algorithm 3).

    For a colluder's own information state (its card, the bets, the folds),
    average the team's strategy over every team information set that matches
    it — one per partner card — weighted by the probability that play reaches
    that set under the solved profile. Grouped rather than scanned, so it is
    linear in the tree; :func:`distill_strategy` is the same sum.
    """
    tree, sigma = solution.tree, solution.sigma
    x = tree.realization(sigma)
    node_reach = tree.node_chance * np.prod(x[tree.node_seq], axis=1)
    team_nodes = tree.infoset_player[tree.node_infoset] == TEAM
    num: dict[str, np.ndarray] = {}
    den: dict[str, float] = defaultdict(float)
    actions: dict[str, tuple[Any, ...]] = {}
    owners: dict[str, int] = {}
    for h in np.flatnonzero(team_nodes):
        iset = int(tree.node_infoset[h])
        label = tree.node_label[h]
        s, k = int(tree.infoset_start[iset]), int(tree.infoset_size[iset])
        w = float(node_reach[h])
        seat = int(tree.node_seat[h])
        if owners.setdefault(label, seat) != seat:
            raise ValueError(f"seats {owners[label]} and {seat} share information state {label!r}")
        num[label] = num.get(label, np.zeros(k)) + w * sigma[s : s + k]
        den[label] += w
        actions[label] = tree.infoset_actions[iset]
    out: dict[str, dict[str, float]] = {}
    for label, acts in actions.items():
        row = num[label] / den[label] if den[label] > 0 else np.full(len(acts), 1.0 / len(acts))
        out[label] = {json.dumps(a): float(p) for a, p in zip(acts, row, strict=True)}
    return out


def paper_state(state: State, seat: int) -> str:
    """Algorithm 3's query for ``seat``'s turn: {hand, bets, folds}, plus the legal actions.

    The paper's states are "hand, bets, folds": the mover's card, every seat's
    chips in the pot and who has folded, in seat order (the engine's
    ``card``/``contributions``/``folded`` observation fields) — not the order
    of moves nor who started, which the engine's information state keeps. The
    legal actions are part of the key because under the one-raise-per-player
    rule two such states can differ in whether the mover may still raise; the
    paper's fixed three-action space hides that, and pooling a raise
    probability into a state that cannot raise would not be a strategy.
    """
    obs = state.observation(seat)
    missing = [f for f in ("card", "contributions", "folded") if obs.get(f) is None]
    if missing:
        raise ValueError(f"{state.game.name} observations lack {missing}: no {{hand, bets, folds}}")
    return json.dumps(
        [obs["card"], obs["contributions"], obs["folded"], list(state.legal_actions(seat))]
    )


def distill_individual_policy(
    tree: GameTree, sigma: FloatArray, seats: Collection[int]
) -> dict[str, dict[str, float]]:
    """Loki Algorithm 3 on individual strategies: the paper's "CFR Collusion" construction.

    ``tree`` is the per-seat game tree built with ``features=paper_state`` and
    ``sigma`` the three-player CFR profile. For each of ``seats``' information
    states the query is its {hand, bets, folds}; the answer averages the CFR
    strategy of every information state of *any* of ``seats`` with that same
    query, weighted by the probability that play reaches it under ``sigma``
    (the "CFR state probability"):
    ``σ̂(q) = Σ_{I: q(I)=q, player(I)∈seats} reach(I) σ(I) / Σ reach(I)``, uniform if
    that sum is 0 (lines 13-16). Returns ``{information state: {action: prob}}``
    for the seats' own states, playable as they are. Grouped rather than
    scanned, so linear in the tree; :func:`distill_strategy` is the same sum.
    """
    if not tree.node_features:
        raise ValueError(
            "build the tree with features=paper_state to distill individual strategies"
        )
    if tree.num_players != tree.num_seats:
        raise ValueError("individual strategies live on a per-seat tree, not a team tree")
    feature: dict[int, str] = {}
    for iset, feat in zip(tree.node_infoset.tolist(), tree.node_features, strict=True):
        if feature.setdefault(iset, feat) != feat:
            raise ValueError(
                f"information state {tree.infoset_key[iset]!r} has different features in "
                f"different histories: {feature[iset]} vs {feat}"
            )
    reach = tree.infoset_reach(sigma)  # weight ← CFR state probability
    members = [i for i in tree.real_infosets() if int(tree.infoset_player[i]) in seats]
    num: dict[str, FloatArray] = {}
    den: dict[str, float] = defaultdict(float)
    for i in members:
        s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
        q = feature[i]
        num[q] = num.get(q, np.zeros(k)) + reach[i] * sigma[s : s + k]  # 9: += weight · strategy
        den[q] += float(reach[i])  # 10: norm_factor += weight
    out: dict[str, dict[str, float]] = {}
    for i in members:
        q, k = feature[i], int(tree.infoset_size[i])
        row = num[q] / den[q] if den[q] > 0 else np.full(k, 1.0 / k)  # 13-16
        acts = tree.infoset_actions[i]
        out[tree.infoset_key[i]] = {json.dumps(a): float(p) for a, p in zip(acts, row, strict=True)}
    return out
