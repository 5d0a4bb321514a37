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

Each step is a gather, a multiply, or a segment sum (``np.bincount``, ``np.add.reduceat``) over
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

Full-width CFR is deterministic and starts from the uniform strategy. Games
with several equilibria (three-player Kuhn, Loki) may end on a different one
from a different start, so ``seed`` starts from random positive regrets
instead, ``R⁰(I, a) ~ Exp(init_scale)`` — a random first strategy by regret
matching. Regret matching's bound ``‖R⁺_T‖² ≤ ‖R⁺_0‖² + Σ_t ‖r_t‖²`` only gains
that constant term, so average regret still vanishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

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


class BackwardBlock(NamedTuple):
    """One depth level of a player's slots, for the backward (value) pass; local indices."""

    lo: int  #: first slot of the level
    hi: int  #: one past its last slot
    plocal: IntArray | None  #: each slot's parent, relative to ``plo`` (None at depth 1: the root)
    plo: int  #: first slot of the parent level
    psize: int  #: slots in the parent level


class _Plan:
    """Everything one player's pass needs, precomputed as index arrays and views.

    Player ``p`` owns the slot range ``[root, hi)`` (its root sequence first);
    "local" indices count from ``root``. Arrays named ``*_v`` are views into
    the solver's global arrays, so no slicing happens inside the loop.
    """

    def __init__(self, solver: CFRSolver, p: int) -> None:
        tree = solver.tree
        root, hi = tree.player_bounds[p]
        self.root, self.lo, self.hi = root, root + 1, hi
        size = hi - root
        self.size = size
        iset = tree.slot_infoset[root + 1 : hi]
        self.iset_local = iset - iset[0] if len(iset) else iset
        self.num_isets = int(self.iset_local.max()) + 1 if len(iset) else 0
        self.uniform = tree.uniform()[root + 1 : hi]
        # views into the solver's global arrays
        self.regret_v = solver.regret[root + 1 : hi]
        self.sigma_v = solver._sigma[root + 1 : hi]
        self.sigma_all_v = solver._sigma[root:hi]
        self.rp = np.zeros(size - 1)
        self.sv = np.zeros(size)
        # forward blocks: (x view, parents (global), sigma view); level 1's parent is the root (x = 1)
        self.fwd: list[tuple[FloatArray, IntArray | None, FloatArray]] = []
        # backward blocks, deepest first
        self.bwd: list[BackwardBlock] = []
        blocks = [(d, lo, bhi) for q, d, lo, bhi in tree.blocks if q == p and d > 0]
        prev = {0: (root, root + 1)}
        for d, lo, bhi in blocks:
            par = tree.slot_parent[lo:bhi]
            plo, phi = prev[d - 1]
            prev[d] = (lo, bhi)
            self.fwd.append(
                (solver._x[lo:bhi], None if d == 1 else par.copy(), solver._sigma[lo:bhi])
            )
            # Level 1 feeds only the root, whose value no regret needs: no scatter there.
            self.bwd.append(
                BackwardBlock(
                    lo - root, bhi - root, None if d == 1 else par - plo, plo - root, phi - plo
                )
            )
        self.bwd.reverse()


class CFRSolver:
    """Full-width CFR with precomputed index arrays; see the module docstring for the maths.

    ``alternating=True`` updates player 0, then player 1 (seeing 0's new
    strategy), …, within one iteration, as OpenSpiel's solvers do; ``False``
    updates every player from the same profile. Both cost about the same per
    iteration here (the work is per player either way), and alternating
    converges faster per iteration, so it is the default. ``seed`` starts from
    random regrets instead of zero (see the module docstring), to look for
    other equilibria.
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
        seed: int | None = None,
        init_scale: float = 1.0,
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
        if seed is not None:  # R⁰(I, a) ~ Exp(init_scale): a random first strategy
            self.regret[:] = np.random.default_rng(seed).exponential(init_scale, num_slots)
        self.avg = np.zeros(num_slots)  # cumulative (weighted) realization plans
        self._sigma = tree.uniform()
        self._x = np.ones(num_slots)
        self._plans = [_Plan(self, p) for p in range(n)]
        # Terminals sharing every player's sequence are one column in the sequence
        # form: merge them (their c·u add up), which shrinks the per-iteration work.
        seq, inverse = np.unique(tree.term_seq, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        self._num_columns = len(seq)
        cu = [
            np.bincount(inverse, tree.term_chance * tree.term_utility[:, p], minlength=len(seq))
            for p in range(n)
        ]  # c(z) u_p(z)
        # Per player, the columns sorted by that player's own sequence, so the
        # scatter onto its sequences is a segment sum over runs (np.add.reduceat,
        # about twice as fast as np.bincount on the large Loki arrays).
        self._cu: list[FloatArray] = []
        self._others: list[list[IntArray]] = []  # other players' sequences, for Π_{j≠i} x_j
        self._runs: list[tuple[IntArray, IntArray | None]] = []  # (run starts, run's local slot)
        self._own: list[IntArray] = []  # each column's own sequence (local), sorted
        # On small arrays np.bincount has less overhead than reduceat; pick by size.
        self._use_runs = len(seq) >= 2048
        for i in range(n):
            own = seq[:, i] - self._plans[i].root
            order = np.argsort(own, kind="stable")
            own = own[order]
            starts = np.flatnonzero(np.r_[True, own[1:] != own[:-1]])
            slots = own[starts]
            dense = len(slots) == self._plans[i].size  # every own sequence heads some column
            self._runs.append((starts, None if dense else slots))
            self._own.append(own)
            self._cu.append(np.ascontiguousarray(cu[i][order]))
            self._others.append([np.ascontiguousarray(seq[order, j]) for j in range(n) if j != i])
        for p in range(n):
            self._refresh(p)

    # --- one iteration -------------------------------------------------------------

    def _refresh(self, p: int) -> None:
        """Player ``p``'s current strategy and realization plan from its regrets.

        Regret matching (Zinkevich et al. 2007, eq. 8 / Hart & Mas-Colell 2000):
        ``σ(I,a) = R⁺(I,a) / Σ_b R⁺(I,b)``, uniform where no regret is positive.
        Then top down: ``x(σ_I a) = x(parent(I)) · σ(I, a)``.
        """
        plan = self._plans[p]
        # R⁺ = max(R, 0); under regret-matching⁺ the stored regrets already are R⁺.
        rp = plan.regret_v if self.algo == "cfr+" else np.maximum(plan.regret_v, 0.0, out=plan.rp)
        il = plan.iset_local
        denom = np.bincount(il, rp, minlength=plan.num_isets)[il]  # Σ_b R⁺(I,b), per slot
        sigma = plan.sigma_v
        np.copyto(sigma, plan.uniform)
        np.divide(rp, denom, out=sigma, where=denom > 0.0)
        x = self._x
        for xv, par, sv in plan.fwd:
            if par is None:
                np.copyto(xv, sv)  # parent is the root: x = 1 · σ
            else:
                np.multiply(x[par], sv, out=xv)

    def _counterfactual(self, p: int) -> tuple[FloatArray, FloatArray]:
        """``v(s)`` for player ``p``'s sequences and ``σ·v`` per slot (local indices).

        ``w_p(z) = c(z) u_p(z) Π_{j≠p} x_j(seq_j(z))``, scattered onto ``seq_p(z)``, then
        bottom up ``v(s) += Σ_{I: parent(I)=s} Σ_a σ(I,a) v(I a)``.
        """
        plan = self._plans[p]
        x = self._x
        others = self._others[p]
        w = x[others[0]] if others else np.ones(self._num_columns)
        for col in others[1:]:
            w *= x[col]
        w *= self._cu[p]
        if not self._use_runs:
            v = cast(FloatArray, np.bincount(self._own[p], w, minlength=plan.size))
        else:
            starts, slots = self._runs[p]
            if slots is None:
                v = np.add.reduceat(w, starts)
            else:
                v = np.zeros(plan.size)
                v[slots] = np.add.reduceat(w, starts)
        sig = plan.sigma_all_v
        sv = plan.sv
        for lo, hi, plocal, plo, psize in plan.bwd:  # BackwardBlock
            np.multiply(sig[lo:hi], v[lo:hi], out=sv[lo:hi])
            if plocal is not None:
                v[plo : plo + psize] += np.bincount(plocal, sv[lo:hi], minlength=psize)
        return v, sv

    def _update(self, p: int, v: FloatArray, sv: FloatArray) -> None:
        """``r(I,a) = v(I a) − v(I)``, ``v(I) = Σ_b σ(I,b) v(I b)``, accumulated per the variant."""
        plan = self._plans[p]
        il = plan.iset_local
        value = np.bincount(il, sv[1:], minlength=plan.num_isets)[il]
        r = v[1:] - value  # instantaneous counterfactual regret r^t(I, a)
        if self.algo == "linear":
            r *= self.iteration  # Linear CFR: iteration t's regret weighted by t
        reg = plan.regret_v
        reg += r
        if self.algo == "cfr+":
            np.maximum(reg, 0.0, out=reg)  # regret-matching⁺: R ← max(R + r, 0)

    def _accumulate(self) -> None:
        """Average-strategy numerator ``S(I,a) += w_t · x_i(I a)`` (own reach × σ), all players."""
        if self.algo in ("cfr+", "linear"):
            self.avg += self.iteration * self._x  # linear averaging, w_t = t
        else:
            self.avg += self._x

    def _discount(self) -> None:
        """DCFR: ``R⁺ ·= t^α/(t^α+1)``, ``R⁻ ·= t^β/(t^β+1)``, ``S ·= (t/(t+1))^γ``."""
        t = float(self.iteration)
        pos = t**self.alpha / (t**self.alpha + 1.0)
        neg = t**self.beta / (t**self.beta + 1.0)
        self.regret *= np.where(self.regret > 0.0, pos, neg)
        self.avg *= (t / (t + 1.0)) ** self.gamma
        for p in range(self.n):
            self._refresh(p)

    def step(self) -> None:
        """One CFR iteration (every player updated once).

        The average takes every player's strategy from the start of the
        iteration, which under alternating updates is the strategy each
        player had just before its own update (OpenSpiel's convention).
        """
        self.iteration += 1
        self._accumulate()
        if self.alternating:
            for p in range(self.n):
                v, sv = self._counterfactual(p)
                self._update(p, v, sv)
                self._refresh(p)
        else:
            values = [self._counterfactual(p) for p in range(self.n)]
            for p, (v, sv) in enumerate(values):
                self._update(p, v, sv)
            for p in range(self.n):
                self._refresh(p)
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
        il = self.tree.slot_infoset
        denom = np.bincount(il, self.avg, minlength=self.tree.num_infosets)[il]
        out = self.tree.uniform()
        np.divide(self.avg, denom, out=out, where=denom > 0.0)
        return out

    def current_policy(self) -> FloatArray:
        return self._sigma.copy()


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
            log.append(
                {"iteration": s.iteration, "value": float(evaluate(tree, s.average_policy()))}
            )
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


def policy_document(result: SolveResult, **meta: Any) -> dict[str, Any]:
    """The policy file the ``table`` and ``cfr`` agents play (``{"game", "params", "policy", "meta"}``)."""
    from backroom.solvers.evaluate import expected_returns, nash_conv

    tree = result.tree
    info: dict[str, Any] = {
        "solver": "backroom.solvers.cfr",
        "algo": result.algo,
        "alternating": result.alternating,
        "iterations": result.iterations,
        "seconds": round(result.seconds, 3),
        "values": expected_returns(tree, result.average).tolist(),
        "nash_conv": nash_conv(tree, result.average),
        "tree": tree.describe(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    info.update(meta)
    return {"game": tree.game, "params": tree.params, "policy": result.policy(), "meta": info}


def solve_game(
    name: str,
    params: dict[str, Any] | None = None,
    iterations: int = 10_000,
    algo: Algo | str = "cfr+",
    *,
    alternating: bool = True,
    max_nodes: int | None = None,
) -> SolveResult:
    """Build a registered game's tree and solve it: the one call the CLI and the ``cfr`` agent use."""
    from backroom.games.base import make_game
    from backroom.solvers.tree import DEFAULT_MAX_NODES, build_tree

    game = make_game(name, **(params or {}))
    tree = build_tree(game, max_nodes=max_nodes or DEFAULT_MAX_NODES)
    return solve(tree, iterations, algo, alternating=alternating)
