"""Counterfactual regret minimisation on a :class:`~backroom.solvers.tree.GameTree`, as array work.

One iteration of CFR (Zinkevich et al. 2007) for player ``i``:

1. *Regret matching* turns cumulative regrets into the current strategy,
   ``σ(I, a) = R⁺(I, a) / Σ_b R⁺(I, b)`` (uniform when no regret is positive).
2. The *realization plan* ``x_p(s)`` of every sequence, top down by level.
3. Every terminal's weight for ``i``: ``w_i(z) = c(z) · Π_{j≠i} x_j(seq_j(z)) · u_i(z)``
   (chance and the opponents' reach times the payoff).
4. *Counterfactual values* bottom up, level by level:
   ``v(s) = Σ_{z: seq_i(z)=s} w_i(z) + Σ_{I: parent(I)=s} Σ_a σ(I,a) v(I a)``,
   so that ``v(I a)`` is ``Σ_{h∈I} π_{-i}(h) · u_i(ha)``, the counterfactual value.
5. Regrets: ``R(I, a) += v(I a) − Σ_b σ(I, b) v(I b)``; average strategy:
   ``S(I, a) += w_t · x_i(I a)`` (own reach times σ, i.e. the realization plan).

Each step is a gather, a multiply, or a segment sum (``np.bincount``) over
whole levels, so an iteration costs a few dozen numpy calls whatever the
tree's size. All players can be updated from the same pass (*simultaneous*
updates) or one after another (*alternating*, as OpenSpiel's ``CFRSolver``
does — our iterates then match OpenSpiel's to rounding error, which is how the
benchmark compares speed at equal NashConv per iteration).

Variants, chosen by ``algo``:

* ``cfr`` — vanilla CFR, uniform averaging.
* ``cfr+`` — CFR+ (Tammelin 2014): regret-matching⁺ ``R ← max(R + r, 0)`` and
  linear averaging weight ``w_t = t`` (OpenSpiel's ``CFRPlusSolver``; no delay).
* ``linear`` — Linear CFR (Brown & Sandholm 2019): regrets and averages weighted
  by ``t``, i.e. DCFR with α = β = γ = 1.
* ``dcfr`` — Discounted CFR (Brown & Sandholm 2019), default α = 1.5, β = 0,
  γ = 2: after iteration ``t`` positive regrets are multiplied by
  ``t^α/(t^α+1)``, negative ones by ``t^β/(t^β+1)`` and the average by ``(t/(t+1))^γ``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from backroom.solvers.tree import FloatArray, GameTree, IntArray

Algo = Literal["cfr", "cfr+", "linear", "dcfr"]
ALGOS: tuple[str, ...] = ("cfr", "cfr+", "linear", "dcfr")


@dataclass
class SolveResult:
    """What a solve hands back: the tree, the average policy, and a log of checkpoints."""

    tree: GameTree
    average: FloatArray
    iterations: int
    seconds: float
    algo: str
    alternating: bool
    checkpoints: list[dict[str, float]] = field(default_factory=list)

    def policy(self) -> dict[str, dict[str, float]]:
        return self.tree.policy_dict(self.average)


class CFRSolver:
    """Full-width CFR with precomputed index arrays; see the module docstring for the maths.

    ``alternating=True`` updates player 0, then player 1 (seeing 0's new
    strategy), …, within one iteration; ``False`` updates every player from the
    same strategy profile in one pass, which costs one pass instead of ``n``.
    """

    def __init__(
        self,
        tree: GameTree,
        algo: Algo | str = "cfr+",
        *,
        alternating: bool = True,
        alpha: float = 1.5,
        beta: float = 0.0,
        gamma: float = 2.0,
    ) -> None:
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, not {algo!r}")
        self.tree = tree
        self.algo = algo
        self.alternating = alternating
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.iteration = 0
        n, num_slots = tree.num_players, tree.num_slots
        self.n = n
        self.regret = np.zeros(num_slots)
        self.avg = np.zeros(num_slots)  # cumulative (weighted) realization plans
        self._uniform = tree.uniform()
        self._sigma = self._uniform.copy()
        self._x = np.ones(num_slots)
        self._v = np.zeros(num_slots)
        self._sv = np.zeros(num_slots)
        self._rp = np.zeros(num_slots)
        self._slot_iset = tree.slot_infoset
        self._num_isets = tree.num_infosets
        # Levels: (lo, hi, parent indices, parent level lo, parent level size, parents local)
        self._levels: list[tuple[int, int, IntArray, int, int, IntArray]] = []
        for d in range(1, tree.num_levels):
            lo, hi = tree.level_bounds[d]
            plo, phi = tree.level_bounds[d - 1]
            par = tree.slot_parent[lo:hi].copy()
            self._levels.append((lo, hi, par, plo, phi - plo, par - plo))
        # Terminals sharing every player's sequence are one column in the sequence
        # form: merge them (their c·u add up), which shrinks the per-iteration work.
        seq, inverse = np.unique(tree.term_seq, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        cu = np.stack(
            [
                np.bincount(inverse, tree.term_chance * tree.term_utility[:, p], minlength=len(seq))
                for p in range(n)
            ],
            axis=1,
        )
        self._seq = np.ascontiguousarray(seq)  # (Z', n)
        self._cu = np.ascontiguousarray(cu)  # (Z', n) c(z) u_p(z)
        self._cu_cols = [np.ascontiguousarray(cu[:, p]) for p in range(n)]
        self._seq_cols = [np.ascontiguousarray(seq[:, p]) for p in range(n)]
        # For player i, the other players' sequence columns (for Π_{j≠i} x_j).
        self._others = [[self._seq_cols[j] for j in range(n) if j != i] for i in range(n)]
        # Simultaneous pass: (Z', n) index arrays, column i holding player (i+k+1) % n's sequence.
        self._other_mats = [
            np.ascontiguousarray(seq[:, [(i + k) % n for i in range(n)]]) for k in range(1, n)
        ]
        self._seq_flat = self._seq.reshape(-1)

    # --- one iteration -------------------------------------------------------------

    def _match(self) -> FloatArray:
        """Regret matching: ``σ(I,a) = R⁺(I,a) / Σ_b R⁺(I,b)``, uniform where no regret is positive."""
        rp = np.maximum(self.regret, 0.0, out=self._rp)  # R⁺ (Zinkevich et al. eq. 8)
        denom = np.bincount(self._slot_iset, rp, minlength=self._num_isets)[self._slot_iset]
        sigma = self._sigma
        np.copyto(sigma, self._uniform)
        np.divide(rp, denom, out=sigma, where=denom > 0.0)
        return sigma

    def _realize(self, sigma: FloatArray) -> FloatArray:
        """Realization plan, top down: ``x(σ_I a) = x(parent(I)) · σ(I, a)``."""
        x = self._x
        for lo, hi, par, _plo, _psize, _plocal in self._levels:
            np.multiply(x[par], sigma[lo:hi], out=x[lo:hi])
        return x

    def _backup(self, sigma: FloatArray, v: FloatArray) -> FloatArray:
        """Counterfactual values bottom up: ``v(s) += Σ_{I: parent(I)=s} Σ_a σ(I,a) v(I a)``.

        Returns ``σ·v`` per slot, whose per-information-set sum is ``v(I)``.
        """
        sv = self._sv
        for lo, hi, _par, plo, psize, plocal in reversed(self._levels):
            np.multiply(sigma[lo:hi], v[lo:hi], out=sv[lo:hi])
            v[plo : plo + psize] += np.bincount(plocal, sv[lo:hi], minlength=psize)
        return sv

    def _regret_update(self, v: FloatArray, sv: FloatArray) -> None:
        """``r(I,a) = v(I a) − v(I)`` with ``v(I) = Σ_b σ(I,b) v(I b)``, accumulated per the variant."""
        value = np.bincount(self._slot_iset, sv, minlength=self._num_isets)[self._slot_iset]
        r = v - value  # instantaneous counterfactual regret r^t(I, a)
        if self.algo == "linear":
            r *= self.iteration  # Linear CFR: regret of iteration t weighted by t
        self.regret += r
        if self.algo == "cfr+":
            np.maximum(self.regret, 0.0, out=self.regret)  # regret-matching⁺: R ← max(R, 0)

    def _pass(self, player: int | None) -> None:
        sigma = self._match()
        x = self._realize(sigma)
        if player is None:
            # Simultaneous: w_i(z) = c(z) u_i(z) Π_{j≠i} x_j(seq_j(z)) for all i at once.
            w = x[self._other_mats[0]]
            for m in self._other_mats[1:]:
                w *= x[m]
            w *= self._cu
            v = np.bincount(self._seq_flat, w.reshape(-1), minlength=len(x))
            self._accumulate(x)
        else:
            others = self._others[player]
            w1 = x[others[0]]
            for col in others[1:]:
                w1 *= x[col]
            w1 *= self._cu_cols[player]
            v = np.bincount(self._seq_cols[player], w1, minlength=len(x))
        sv = self._backup(sigma, v)
        self._regret_update(v, sv)

    def _accumulate(self, x: FloatArray) -> None:
        """Average strategy numerator ``S(I,a) += w_t · x_i(I a)`` (own reach × σ)."""
        if self.algo in ("cfr+", "linear"):
            self.avg += self.iteration * x  # linear averaging, w_t = t
        else:
            self.avg += x

    def _discount(self) -> None:
        """DCFR: ``R⁺ ·= t^α/(t^α+1)``, ``R⁻ ·= t^β/(t^β+1)``, ``S ·= (t/(t+1))^γ``."""
        t = float(self.iteration)
        pos = t**self.alpha / (t**self.alpha + 1.0)
        neg = t**self.beta / (t**self.beta + 1.0)
        self.regret *= np.where(self.regret > 0.0, pos, neg)
        self.avg *= (t / (t + 1.0)) ** self.gamma

    def step(self) -> None:
        """One CFR iteration (every player updated once)."""
        self.iteration += 1
        if self.alternating:
            # The average uses each player's strategy from before its own update;
            # that is the strategy at the start of the iteration for every player.
            self._accumulate(self._realize(self._match()))
            for p in range(self.n):
                self._pass(p)
        else:
            self._pass(None)
        if self.algo == "dcfr":
            self._discount()

    def run(
        self,
        iterations: int,
        *,
        callback: Callable[[CFRSolver], None] | None = None,
        every: int = 0,
    ) -> None:
        """Run ``iterations`` iterations, calling ``callback`` every ``every`` of them."""
        step = self.step
        for k in range(1, iterations + 1):
            step()
            if callback is not None and every and k % every == 0:
                callback(self)

    # --- results -------------------------------------------------------------------

    def average_policy(self) -> FloatArray:
        """``σ̄(I,a) = S(I,a) / Σ_b S(I,b)`` (uniform where the information set was never reached)."""
        denom = np.bincount(self._slot_iset, self.avg, minlength=self._num_isets)[self._slot_iset]
        out = self._uniform.copy()
        np.divide(self.avg, denom, out=out, where=denom > 0.0)
        return out

    def current_policy(self) -> FloatArray:
        return self._match().copy()


def solve(
    tree: GameTree,
    iterations: int,
    algo: Algo | str = "cfr+",
    *,
    alternating: bool = True,
    checkpoints: int = 0,
    evaluate: Callable[[GameTree, FloatArray], float] | None = None,
    **kwargs: Any,
) -> SolveResult:
    """Run a solver for ``iterations`` and return its average policy.

    With ``checkpoints`` > 0 and an ``evaluate(tree, sigma)`` function (for
    example :func:`backroom.solvers.evaluate.nash_conv`), the average policy is
    scored that many times along the way; the time spent scoring is excluded
    from ``seconds``.
    """
    solver = CFRSolver(tree, algo, alternating=alternating, **kwargs)
    log: list[dict[str, float]] = []
    every = max(1, iterations // checkpoints) if checkpoints else 0
    spent = 0.0

    def score(s: CFRSolver) -> None:
        nonlocal spent
        t0 = time.perf_counter()
        if evaluate is not None:
            log.append({"iteration": s.iteration, "value": float(evaluate(tree, s.average_policy()))})
        spent += time.perf_counter() - t0

    start = time.perf_counter()
    solver.run(iterations, callback=score if evaluate else None, every=every)
    seconds = time.perf_counter() - start - spent
    return SolveResult(
        tree=tree,
        average=solver.average_policy(),
        iterations=iterations,
        seconds=seconds,
        algo=str(algo),
        alternating=alternating,
        checkpoints=log,
    )
