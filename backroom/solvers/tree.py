"""An explicit, array-shaped game tree enumerated once from a pure engine.

CFR touches every history of the game on every iteration. Walking engine
``State`` objects (clone, apply, string keys) each time is what makes a
generic solver slow, so we walk the engine exactly once and keep only what the
algorithms need, in the *sequence form* (Koller, Megiddo & von Stengel 1994;
von Stengel 1996):

* a **slot** is one (information set, action) pair, i.e. one *sequence* of the
  acting player's own moves. Each player also has one empty root sequence,
  treated as a dummy information set with one action so the iteration needs
  no special cases.
* every information set records its **parent sequence**: the player's previous
  slot on the path. Perfect recall makes that unique; we check it, because the
  whole sequence form (and CFR's guarantees) rest on it.
* every terminal history ``z`` records its chance probability ``c(z)``, the
  utility of every (solver) player, each seat's raw return, and for every
  player the last slot ``seq_p(z)`` that player played on the way.

With that, the probability of reaching ``z`` under a behaviour profile ``σ`` is
``c(z) · Π_p x_p(seq_p(z))`` where the *realization plan* ``x`` is computed top
down, level by level: ``x(σ_I a) = x(parent(I)) · σ(I, a)``. Slots are ordered
by player, then level (own-move depth), with each information set's slots
contiguous, so each (player, level) *block* is one slice, a player's slots are
one slice too, and the solver's iteration is a handful of
gather/scatter/multiply operations per block, not Python per node.

Simultaneous moves are sequentialised: the movers choose one after another,
each keyed by the information-state string of the state *before* anyone moved,
so a later mover learns nothing from an earlier one.

The tree can be built with a different *owner* map and key function, which is
how the team (collusion) solve turns two seats into one solver player that
knows both private cards: see :mod:`backroom.solvers.team`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from backroom.games.base import CHANCE, Action, Game, GameInfo, State

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
#: ``key(state, seat) -> str``: the information-state string that seat acts on.
InfosetKey = Callable[[State, int], str]

#: Default ceiling on histories (chance + decision + terminal nodes) we enumerate.
DEFAULT_MAX_NODES = 2_000_000


class TreeTooLargeError(ValueError):
    """The game has more histories than ``max_nodes``: too big to enumerate."""


class NotPerfectRecallError(ValueError):
    """An information set is reached after different own sequences: CFR needs perfect recall."""


def default_key(state: State, seat: int) -> str:
    return state.information_state(seat)


@dataclass
class GameTree:
    """The sequence-form view of a game; see the module docstring for the terms.

    Arrays indexed by slot have length ``num_slots``; by information set,
    ``num_infosets``; by terminal, ``num_terminals``. ``root_slot[p]`` is player
    ``p``'s empty sequence, the first slot of its range ``player_bounds[p]``.
    """

    game: str
    params: dict[str, Any]
    num_players: int  # solver players (a team counts once)
    num_seats: int  # engine seats
    owner: tuple[int, ...]  # seat -> solver player
    # information sets
    infoset_player: IntArray
    infoset_key: list[str]  # "" for the root dummies
    infoset_actions: list[tuple[Action, ...]]
    infoset_start: IntArray  # first slot of each information set
    infoset_size: IntArray
    infoset_parent: IntArray  # parent sequence (slot) of each information set
    # slots
    slot_infoset: IntArray
    slot_parent: IntArray  # = infoset_parent[slot_infoset]
    slot_level: IntArray
    blocks: list[tuple[int, int, int, int]]  # (player, level, lo, hi), sorted; level 0 = root
    root_slot: IntArray  # (num_players,)
    player_bounds: list[tuple[int, int]]  # slot range [lo, hi) of each player, root first
    # terminals
    term_chance: FloatArray  # c(z)
    term_utility: FloatArray  # (Z, num_players) u_p(z)
    term_returns: FloatArray  # (Z, num_seats) raw engine returns
    term_seq: IntArray  # (Z, num_players) seq_p(z)
    term_path: IntArray  # index into chance_paths
    chance_paths: list[tuple[Action, ...]]  # distinct sequences of chance outcomes
    chance_path_prob: FloatArray
    # decision nodes (for reach probabilities of information sets and distillation)
    node_infoset: IntArray
    node_chance: FloatArray
    node_seq: IntArray  # (H, num_players): each player's current sequence at the node
    node_seat: IntArray
    node_label: list[str]  # the engine's own information-state string of the mover
    num_nodes: int = 0  # histories enumerated (chance + decision + terminal)
    meta: dict[str, Any] = field(default_factory=dict)
    #: ``features(state, mover)`` of every decision node when the tree was built with
    #: ``features=`` (a coarser view of the mover's situation, e.g. Loki Algorithm 3's
    #: {hand, bets, folds}); empty otherwise.
    node_features: list[str] = field(default_factory=list)
    #: The engine's declared facts (per seat), checked against every terminal by
    #: :func:`build_tree`. Solver players' utilities are sums of seats' returns, so a
    #: constant-sum game stays constant-sum, with the same sum, on a team tree.
    info: GameInfo | None = None

    @property
    def num_slots(self) -> int:
        return len(self.slot_infoset)

    @property
    def num_infosets(self) -> int:
        return len(self.infoset_key)

    @property
    def num_terminals(self) -> int:
        return len(self.term_chance)

    @property
    def num_levels(self) -> int:
        return int(self.slot_level.max()) + 1

    def real_infosets(self) -> list[int]:
        """Information sets of the game proper (the root dummies excluded)."""
        roots = set(self.slot_infoset[self.root_slot].tolist())
        return [i for i in range(self.num_infosets) if i not in roots]

    def uniform(self) -> FloatArray:
        """The uniform behaviour profile, one probability per slot."""
        return 1.0 / self.infoset_size[self.slot_infoset].astype(np.float64)

    def policy_dict(self, sigma: FloatArray) -> dict[str, dict[str, float]]:
        """``{info_state: {json.dumps(action): prob}}``: the policy file format the ``table`` agent plays."""
        out: dict[str, dict[str, float]] = {}
        for i in self.real_infosets():
            s = int(self.infoset_start[i])
            out[self.infoset_key[i]] = {
                json.dumps(a): float(sigma[s + k]) for k, a in enumerate(self.infoset_actions[i])
            }
        return out

    def sigma_from_policy(
        self,
        policy: dict[str, dict[str, float]] | Callable[[str, tuple[Action, ...]], Sequence[float]],
    ) -> FloatArray:
        """Slot probabilities from a policy mapping (file format) or a function.

        Missing information sets, or all-zero rows, play uniformly — the same
        rule the ``table`` agent applies at the table.
        """
        sigma = self.uniform()
        for i in self.real_infosets():
            s, k = int(self.infoset_start[i]), int(self.infoset_size[i])
            actions = self.infoset_actions[i]
            if callable(policy):
                row = np.asarray(policy(self.infoset_key[i], actions), dtype=np.float64)
            else:
                probs = policy.get(self.infoset_key[i])
                if not probs:
                    continue
                row = np.array([float(probs.get(json.dumps(a), 0.0)) for a in actions])
            row = np.maximum(row, 0.0)
            total = row.sum()
            if total > 0:
                sigma[s : s + k] = row / total
        return sigma

    def realization(self, sigma: FloatArray) -> FloatArray:
        """Sequence-form realization plan ``x``: ``x(σ_I a) = x(parent(I)) σ(I, a)``, roots 1."""
        x = np.empty_like(sigma)
        x[self.root_slot] = 1.0
        for _p, d, lo, hi in self.blocks:
            if d:
                x[lo:hi] = x[self.slot_parent[lo:hi]] * sigma[lo:hi]
        return x

    def terminal_reach(self, sigma: FloatArray) -> FloatArray:
        """``π(z) = c(z) Π_p x_p(seq_p(z))`` for every terminal."""
        x = self.realization(sigma)
        return self.term_chance * np.prod(x[self.term_seq], axis=1)

    def infoset_reach(self, sigma: FloatArray) -> FloatArray:
        """Probability that play reaches each information set (the paper's "CFR state probability")."""
        x = self.realization(sigma)
        reach = self.node_chance * np.prod(x[self.node_seq], axis=1)
        return cast(FloatArray, np.bincount(self.node_infoset, reach, minlength=self.num_infosets))

    def describe(self) -> dict[str, Any]:
        return {
            "nodes": self.num_nodes,
            "terminals": self.num_terminals,
            "infosets": self.num_infosets - self.num_players,
            "sequences": self.num_slots - self.num_players,
            "max_own_moves": self.num_levels - 1,
        }


# --- size estimate -------------------------------------------------------------


def _no_actions(state: State, seat: int) -> str:
    spec = state.action_spec(seat)
    what = f"the {state.phase!r} phase" + (
        f" with an action described as {spec.schema}" if spec.schema else ""
    )
    return (
        f"seat {seat} must move in {what} but the engine lists no finite legal actions; "
        "only games whose moves are finite lists (no free talk, no continuous ranges) can be enumerated"
    )


def estimate_tree_size(game: Game, samples: int = 64, seed: int = 0) -> float:
    """Knuth's (1975) unbiased estimate of the number of histories, from random walks.

    On a walk, a node at depth d stands for ``Π_{k<d} b_k`` nodes (the product
    of branching factors above it); summing that over the walk and averaging
    over walks estimates the tree size without enumerating it. Simultaneous
    moves branch on the product of the movers' action counts.
    """
    rng = random.Random(seed)
    total = 0.0
    for _ in range(samples):
        state = game.new_initial_state()
        weight, count = 1.0, 0.0
        while True:
            count += weight
            if state.is_terminal():
                break
            movers = sorted(state.current_players())
            if movers == [CHANCE]:
                outcomes = [o for o, _ in state.chance_outcomes()]
                weight *= len(outcomes)
                move: dict[int, Action] = {CHANCE: rng.choice(outcomes)}
            else:
                move = {}
                for p in movers:
                    legal = list(state.legal_actions(p))
                    if not legal:
                        raise ValueError(_no_actions(state, p))
                    weight *= len(legal)
                    move[p] = rng.choice(legal)
            state.apply(move)
            if weight > 1e15:
                return float("inf")
        total += count
    return total / samples


# --- enumeration -----------------------------------------------------------------


class _Builder:
    def __init__(
        self,
        game: Game,
        owner: tuple[int, ...],
        key: InfosetKey,
        label: InfosetKey,
        max_nodes: int,
        features: InfosetKey | None = None,
    ) -> None:
        self.game = game
        self.owner = owner
        self.n = max(owner) + 1
        self.key = key
        self.label = label
        self.features = features
        self.node_features: list[str] = []
        self.max_nodes = max_nodes
        self.count = 0
        # information sets; ids 0..n-1 are the root dummies with one action each
        self.iset_id: dict[tuple[int, str], int] = {}
        self.iset_player: list[int] = list(range(self.n))
        self.iset_key: list[str] = [""] * self.n
        self.iset_actions: list[tuple[Action, ...]] = [(None,)] * self.n
        self.iset_parent: list[int] = list(range(self.n))  # parent slot (provisional ids)
        self.iset_start: list[int] = list(range(self.n))
        self.num_slots = self.n
        self.terms: list[tuple[float, tuple[int, ...], list[float], int]] = []
        self.paths: dict[tuple[Action, ...], int] = {}
        self.path_prob: list[float] = []
        self.nodes: list[tuple[int, float, tuple[int, ...], int, str]] = []

    def tick(self) -> None:
        self.count += 1
        if self.count > self.max_nodes:
            raise TreeTooLargeError(
                f"{self.game.name} {self.game.params()} has more than max_nodes={self.max_nodes:,} "
                "histories; too large to enumerate (raise max_nodes if you have the memory)"
            )

    def infoset(self, player: int, key: str, legal: tuple[Action, ...], parent: int) -> int:
        idx = self.iset_id.get((player, key))
        if idx is None:
            idx = len(self.iset_player)
            self.iset_id[(player, key)] = idx
            self.iset_player.append(player)
            self.iset_key.append(key)
            self.iset_actions.append(legal)
            self.iset_parent.append(parent)
            self.iset_start.append(self.num_slots)
            self.num_slots += len(legal)
            return idx
        if self.iset_actions[idx] != legal:
            raise ValueError(
                f"information state {key!r} of player {player} has different legal actions "
                f"in different histories: {self.iset_actions[idx]} vs {legal}"
            )
        if self.iset_parent[idx] != parent:
            raise NotPerfectRecallError(
                f"information state {key!r} of player {player} follows different own moves "
                "in different histories; CFR and best responses here need perfect recall"
            )
        return idx

    def visit(
        self, state: State, cp: float, seqs: tuple[int, ...], path: tuple[Action, ...]
    ) -> None:
        self.tick()
        if state.is_terminal():
            returns = [float(r) for r in state.returns()]
            utility = [0.0] * self.n
            for seat, r in enumerate(returns):
                utility[self.owner[seat]] += r
            pidx = self.paths.get(path)
            if pidx is None:
                pidx = self.paths[path] = len(self.path_prob)
                self.path_prob.append(cp)
            self.terms.append((cp, seqs, utility + returns, pidx))
            return
        movers = sorted(state.current_players())
        if movers == [CHANCE]:
            for outcome, prob in state.chance_outcomes():
                if prob <= 0:
                    continue
                child = state.clone()
                child.apply({CHANCE: outcome})
                self.visit(child, cp * prob, seqs, (*path, outcome))
            return
        if not movers:
            raise ValueError("a non-terminal state has no player to move")
        self.decide(state, movers, {}, cp, seqs, path)

    def decide(
        self,
        state: State,
        movers: list[int],
        chosen: dict[int, Action],
        cp: float,
        seqs: tuple[int, ...],
        path: tuple[Action, ...],
    ) -> None:
        if len(movers) == len(chosen):
            child = state.clone()
            child.apply(chosen)
            self.visit(child, cp, seqs, path)
            return
        if chosen:
            self.tick()  # a sequentialised simultaneous move is a node of its own
        seat = movers[len(chosen)]
        player = self.owner[seat]
        key = self.key(state, seat)
        # Two seats of one solver player moving at once: the later one knows the earlier's choice.
        own = [json.dumps(chosen[s]) for s in movers[: len(chosen)] if self.owner[s] == player]
        if own:
            key = f"{key} |{','.join(own)}"
        legal = tuple(state.legal_actions(seat))
        if not legal:
            raise ValueError(_no_actions(state, seat))
        iset = self.infoset(player, key, legal, seqs[player])
        label = self.label(state, seat)
        self.nodes.append((iset, cp, seqs, seat, label))
        if self.features is not None:
            self.node_features.append(self.features(state, seat))
        start = self.iset_start[iset]
        for k, action in enumerate(legal):
            new = (*seqs[:player], start + k, *seqs[player + 1 :])
            self.decide(state, movers, {**chosen, seat: action}, cp, new, path)

    def check_info(self, info: GameInfo) -> None:
        """Every terminal keeps the engine's declared bounds and sum, or the declaration is wrong.

        Solvers rely on the facts (a team's guaranteed value is ``utility_sum``
        minus a best response), so an engine that misstates them is stopped here.
        """
        returns = np.array([t[2][self.n :] for t in self.terms], dtype=np.float64)
        tol = 1e-9 * max(1.0, abs(info.min_utility), abs(info.max_utility))
        what = f"{self.game.name} {self.game.params()} declares {info}, but a terminal"
        if returns.min() < info.min_utility - tol or returns.max() > info.max_utility + tol:
            raise ValueError(f"{what} returns {returns.min()}..{returns.max()}")
        if info.utility_sum is not None:
            sums = returns.sum(axis=1)
            if np.abs(sums - info.utility_sum).max() > tol * len(self.owner):
                raise ValueError(
                    f"{what} sums to {sums[np.argmax(np.abs(sums - info.utility_sum))]}"
                )

    def _iset_levels(self) -> list[int]:
        """Each information set's level: its player's own-move depth (roots 0)."""
        slot_owner_iset = np.empty(self.num_slots, dtype=np.int64)
        for i, (s, acts) in enumerate(zip(self.iset_start, self.iset_actions, strict=True)):
            slot_owner_iset[s : s + len(acts)] = i
        level = [0] * len(self.iset_player)
        for i in range(self.n, len(self.iset_player)):  # parents are created before children
            level[i] = level[int(slot_owner_iset[self.iset_parent[i]])] + 1
        return level

    def _renumbering(self, order: list[int]) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """Information sets and slots numbered in ``order``: each set's new index, each slot's
        new index, and each set's new first slot and size."""
        new_iset = np.empty(len(order), dtype=np.int64)
        new_iset[order] = np.arange(len(order))
        old_to_new_slot = np.empty(self.num_slots, dtype=np.int64)
        starts, sizes, pos = [], [], 0
        for i in order:
            k = len(self.iset_actions[i])
            old_to_new_slot[self.iset_start[i] : self.iset_start[i] + k] = np.arange(pos, pos + k)
            starts.append(pos)
            sizes.append(k)
            pos += k
        return (
            new_iset,
            old_to_new_slot,
            np.array(starts, dtype=np.int64),
            np.array(sizes, dtype=np.int64),
        )

    def finish(self, meta: dict[str, Any]) -> GameTree:
        n = self.n
        num_isets = len(self.iset_player)
        # Order by (player, level) so every block and every player is one slice.
        level = self._iset_levels()
        order = sorted(range(num_isets), key=lambda i: (self.iset_player[i], level[i], i))
        new_iset, old_to_new_slot, infoset_start, infoset_size = self._renumbering(order)
        infoset_parent = old_to_new_slot[
            np.array([self.iset_parent[i] for i in order], dtype=np.int64)
        ]
        infoset_player = np.array([self.iset_player[i] for i in order], dtype=np.int64)
        slot_infoset = np.repeat(np.arange(num_isets, dtype=np.int64), infoset_size)
        slot_level = np.array([level[i] for i in order], dtype=np.int64)[slot_infoset]
        slot_player = infoset_player[slot_infoset]
        blocks = _blocks(slot_player, slot_level)
        root_slot = np.array([lo for p, d, lo, hi in blocks if d == 0], dtype=np.int64)
        player_bounds = _player_bounds(slot_player, n)
        assert all(lo == root_slot[p] for p, (lo, _hi) in enumerate(player_bounds))

        z_seq = _column(self.terms, 1, np.int64).reshape(-1, n)
        vals = _column(self.terms, 2, np.float64).reshape(len(self.terms), -1)
        h_seq = _column(self.nodes, 2, np.int64).reshape(-1, n)
        return GameTree(
            game=self.game.name,
            params=dict(self.game.params()),
            num_players=n,
            num_seats=len(self.owner),
            owner=self.owner,
            infoset_player=infoset_player,
            infoset_key=[self.iset_key[i] for i in order],
            infoset_actions=[self.iset_actions[i] for i in order],
            infoset_start=infoset_start,
            infoset_size=infoset_size,
            infoset_parent=infoset_parent,
            slot_infoset=slot_infoset,
            slot_parent=infoset_parent[slot_infoset],
            slot_level=slot_level,
            blocks=blocks,
            root_slot=root_slot,
            player_bounds=player_bounds,
            term_chance=_column(self.terms, 0, np.float64),
            term_utility=vals[:, :n].copy(),
            term_returns=vals[:, n:].copy(),
            term_seq=old_to_new_slot[z_seq],
            term_path=_column(self.terms, 3, np.int64),
            chance_paths=list(self.paths),
            chance_path_prob=np.array(self.path_prob, dtype=np.float64),
            node_infoset=new_iset[_column(self.nodes, 0, np.int64)],
            node_chance=_column(self.nodes, 1, np.float64),
            node_seq=old_to_new_slot[h_seq],
            node_seat=_column(self.nodes, 3, np.int64),
            node_label=[t[4] for t in self.nodes],
            num_nodes=self.count,
            meta=meta,
            node_features=self.node_features,
            info=self.game.info,
        )


def _column(rows: Sequence[tuple[Any, ...]], i: int, dtype: type[np.generic]) -> np.ndarray:
    """Field ``i`` of every terminal or node record, as one array."""
    return np.array([row[i] for row in rows], dtype=dtype)


def _player_bounds(slot_player: np.ndarray, n: int) -> list[tuple[int, int]]:
    """Each player's slice of the slots, which are ordered by player."""
    return [
        (
            int(np.searchsorted(slot_player, p, "left")),
            int(np.searchsorted(slot_player, p, "right")),
        )
        for p in range(n)
    ]


def _blocks(slot_player: np.ndarray, slot_level: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(player, level, first slot, end slot) of each run of slots of one player and level."""
    blocks: list[tuple[int, int, int, int]] = []
    for s in range(len(slot_level)):
        p, d = int(slot_player[s]), int(slot_level[s])
        if blocks and blocks[-1][:2] == (p, d):
            blocks[-1] = (p, d, blocks[-1][2], s + 1)
        else:
            blocks.append((p, d, s, s + 1))
    return blocks


def build_tree(
    game: Game,
    *,
    max_nodes: int = DEFAULT_MAX_NODES,
    owner: Sequence[int] | None = None,
    key: InfosetKey | None = None,
    estimate_samples: int = 64,
    features: InfosetKey | None = None,
) -> GameTree:
    """Enumerate ``game`` once into a :class:`GameTree`.

    ``owner[seat]`` maps engine seats to solver players (default: each seat is
    its own player); a solver player's utility is the sum of its seats'
    returns. ``key(state, seat)`` names the information set a seat acts in
    (default: the engine's ``information_state``). Before enumerating we
    estimate the size from random walks and refuse games estimated at more
    than ``max_nodes`` histories; the enumeration also stops with
    :class:`TreeTooLargeError` the moment it passes ``max_nodes``.
    ``features(state, seat)``, if given, is recorded for every decision node
    (``node_features``): the tree walk is the one place that sees engine
    states, so coarser views of a node (Loki Algorithm 3's query) are taken here.
    The game's declared :class:`~backroom.games.base.GameInfo` is checked
    against every terminal and kept as ``tree.info``.
    """
    info = game.info
    seats = info.num_players
    own = tuple(range(seats)) if owner is None else tuple(int(o) for o in owner)
    if len(own) != seats or sorted(set(own)) != list(range(max(own) + 1)):
        raise ValueError(
            f"owner must map all {seats} seats onto players 0..k without gaps, got {own}"
        )
    estimate = estimate_tree_size(game, samples=estimate_samples) if estimate_samples else 0.0
    if estimate > max_nodes:
        raise TreeTooLargeError(
            f"{game.name} {game.params()} has an estimated {estimate:,.0f} histories (inf: over 1e15), more than "
            f"max_nodes={max_nodes:,}; too large to enumerate (raise max_nodes if you have the memory)"
        )
    builder = _Builder(game, own, key or default_key, default_key, max_nodes, features)
    import sys

    # The walk recurses once per chance node and, per move, once per mover plus
    # twice more (``visit``, the last ``decide``): the declared longest play bounds it.
    depth = info.max_chance_nodes + info.max_game_length * (seats + 2) + 1
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 1_000 + 2 * depth))
    try:
        builder.visit(game.new_initial_state(), 1.0, tuple(range(builder.n)), ())
    finally:
        sys.setrecursionlimit(limit)
    builder.check_info(info)
    return builder.finish({"estimated_nodes": estimate})
