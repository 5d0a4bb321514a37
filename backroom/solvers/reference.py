"""A readable reference CFR: the textbook recursion over engine states, kept as a test oracle.

Vanilla CFR (Zinkevich et al. 2007) as papers and OpenSpiel's Python
``CFRSolver`` write it: walk the game from its root with ``State.clone`` and
``apply``, enumerate chance with ``chance_outcomes``, keep regrets and
strategy sums in dicts keyed by information state. Every iteration walks the
engine again, so it is far too slow to solve with; it is what
:mod:`backroom.solvers.cfr` — the same arithmetic as array work on a tree
enumerated once — is checked against where OpenSpiel has no counterpart: Loki
Kuhn and the team trees of :mod:`backroom.solvers.team` (``owner`` and ``key``
as :func:`~backroom.solvers.tree.build_tree` takes them). The two follow the
same order of updates, so their regrets and average policies agree to rounding
error — except where every action is worth exactly the same (regrets exactly
0): regret matching is discontinuous there, and rounding picks the strategy;
``tests/test_reference_cfr.py`` explains and compares around it.

Updates alternate by default (player 0, then player 1 seeing 0's new
strategy, ...), as the vectorised solver and OpenSpiel do; with
``alternating=False`` every player is updated from the same profile. Turn-based
games only: the vectorised tree sequentialises simultaneous moves, and writing
that here too would hide the algorithm.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from backroom.games.base import CHANCE, Action, Game, State

Policy = dict[str, dict[str, float]]
Infoset = tuple[int, str]  # (solver player, information-state key)


def regret_matching(regrets: Sequence[float]) -> list[float]:
    """The current strategy from cumulative regrets (Hart & Mas-Colell 2000)."""
    positive = [max(r, 0.0) for r in regrets]
    total = sum(positive)
    if total <= 0.0:
        return [1.0 / len(regrets)] * len(regrets)  # no positive regret: uniform
    return [r / total for r in positive]  # σ(I,a) = R⁺(I,a) / Σ_b R⁺(I,b)


class ReferenceCFR:
    """Vanilla CFR by recursion; ``owner[seat]`` is a seat's solver player, ``key`` its information set."""

    def __init__(
        self,
        game: Game,
        *,
        owner: Sequence[int] | None = None,
        key: Callable[[State, int], str] | None = None,
    ) -> None:
        self.game = game
        self.owner = tuple(owner) if owner is not None else tuple(range(game.info.num_players))
        self.num_players = max(self.owner) + 1
        self.key = key or (lambda state, seat: state.information_state(seat))
        self.actions: dict[Infoset, list[Action]] = {}
        self.regret: dict[Infoset, list[float]] = {}  # R(I, a)
        self.strategy_sum: dict[Infoset, list[float]] = {}  # S(I, a)

    def iteration(self, alternating: bool = True) -> None:
        """Update every solver player's regrets and strategy sum once."""
        pending: list[dict[Infoset, list[float]]] = []
        for player in range(self.num_players):
            # Regrets wait in ``delta`` until the walk ends: the walk plays the current strategy.
            delta: dict[Infoset, list[float]] = {}
            self._walk(self.game.new_initial_state(), player, 1.0, 1.0, delta)
            pending.append(delta)
            if alternating:  # the next player already meets this one's new strategy
                self._add(pending.pop())
        for delta in pending:
            self._add(delta)

    def _add(self, delta: dict[Infoset, list[float]]) -> None:
        for info, r in delta.items():
            self.regret[info] = [old + new for old, new in zip(self.regret[info], r, strict=True)]

    def _walk(
        self,
        state: State,
        player: int,
        own: float,
        others: float,
        delta: dict[Infoset, list[float]],
    ) -> float:
        """``player``'s expected utility from ``state``; ``own`` = π_i(h), ``others`` = π_{-i}(h) with chance."""
        if state.is_terminal():
            return sum(r for seat, r in enumerate(state.returns()) if self.owner[seat] == player)
        movers = state.current_players()
        if movers == {CHANCE}:
            value = 0.0
            for outcome, prob in state.chance_outcomes():
                child = state.clone()
                child.apply({CHANCE: outcome})
                value += prob * self._walk(child, player, own, others * prob, delta)
            return value
        if len(movers) != 1:
            raise ValueError("the reference CFR plays turn-based games only")
        (seat,) = movers
        mover = self.owner[seat]
        info = (mover, self.key(state, seat))
        actions = self.actions.setdefault(info, list(state.legal_actions(seat)))
        sigma = regret_matching(self.regret.setdefault(info, [0.0] * len(actions)))
        values = []  # u_i(h·a)
        for action, p in zip(actions, sigma, strict=True):
            child = state.clone()
            child.apply({seat: action})
            if mover == player:
                values.append(self._walk(child, player, own * p, others, delta))
            else:
                values.append(self._walk(child, player, own, others * p, delta))
        # u_i(h) = Σ_a σ(I,a) u_i(h·a)
        value = sum(p * v for p, v in zip(sigma, values, strict=True))
        if mover == player:
            regret = delta.setdefault(info, [0.0] * len(actions))
            total = self.strategy_sum.setdefault(info, [0.0] * len(actions))
            for a, p in enumerate(sigma):
                # r(I,a) = Σ_{h∈I} π_{-i}(h) (u_i(h·a) − u_i(h)), one h ∈ I at a time
                regret[a] += others * (values[a] - value)
                # S(I,a) += π_i(h) σ(I,a); π_i(h) is one value on all of I (perfect recall),
                # so the number of h ∈ I cancels out of the average σ̄
                total[a] += own * p
        return value

    def average_policy(self) -> Policy:
        """``σ̄(I,a) = S(I,a) / Σ_b S(I,b)``, in the policy-file format (``{key: {json action: p}}``)."""
        out: Policy = {}
        for info, total in self.strategy_sum.items():
            norm = sum(total)
            probs = [s / norm for s in total] if norm > 0 else [1.0 / len(total)] * len(total)
            out[info[1]] = {
                json.dumps(a): p for a, p in zip(self.actions[info], probs, strict=True)
            }
        return out
