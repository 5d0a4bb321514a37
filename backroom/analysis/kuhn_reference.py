"""What a Kuhn run is set against: the shipped CFR policy's values and the team solve.

Both need the full game tree (the team solve, seconds of CFR+), so their numbers
are cached on disk per policy, rules and coalition (:func:`cache_dir`) and in
memory per process. A fixed deal (``params.deal``) picks a hand, not the rules:
runs with and without one share these values, and each comparison takes each
hand's own value (:func:`solver_mean`, :func:`whole_deck`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from backroom.games.base import CHANCE, State, make_game
from backroom.solvers.collusion import (
    CollusionReport,
    Deal,
    analyse_collusion,
    per_deal_values,
)
from backroom.solvers.evaluate import expected_seat_returns
from backroom.solvers.tree import FloatArray, build_tree

GAME = "kuhn"
#: CFR+ iterations of the team solve behind "CFR Collusion" (its exploitability is reported;
#: the tree build, not the iterations, is most of the cost).
TEAM_ITERATIONS = 5000
#: Bump when what the cache holds changes meaning; old files are then never read.
CACHE_VERSION = 1
#: The solver's readings shown beside the played advantage (those the report has).
SOLVER_READINGS = {
    "team": "solver: team game's value (C solves against the team)",
    "team_vs_unaware": "solver: team solve vs C's CFR policy",
    "paper": "solver: paper's construction",
}
#: Table 1's rows from the solver, by the profile that gives them (those the report has).
SOLVER_ROWS = {
    "CFR": "cfr",
    "CFR Collusion": "team",
    "CFR Collusion vs unaware C": "team_vs_unaware",
    "CFR Collusion, paper's construction": "paper",
}
MEASURED_ROW = "this run"
#: The game parameter that fixes the cards; not a rule: policies and solver values ignore it.
DEAL = "deal"


def rules_of(params: Mapping[str, Any]) -> dict[str, Any]:
    """The rules of an episode's game: its parameters but a fixed ``deal``.

    A fixed deal chooses which hand is played, not the game the policies were
    solved for, so runs with and without one share policies and solver values.
    """
    return {k: v for k, v in params.items() if k != DEAL}


def fixed_deal(ep: Mapping[str, Any]) -> Deal | None:
    """The deal an episode's parameters fixed (``deals:`` in the run config), else None."""
    deal = (ep.get("params") or {}).get(DEAL)
    return None if deal is None else tuple(int(c) for c in deal)


def whole_deck(result: Mapping[str, Any]) -> bool:
    """Whether the hands played weigh every deal alike: dealt by chance, or every deal k times."""
    dealt = result.get("dealt") or {}
    return not dealt.get("fixed") or bool(dealt.get("every_deal"))


def cache_dir() -> Path:
    """Where solver values are kept: ``$BACKROOM_SOLVER_CACHE``, default ``~/.cache/backroom/solver``.

    Beside the model cache (``~/.cache/backroom/models``). Entries are keyed
    by a hash of the policy's content, the rules, the coalition and the
    solvers' source, so a remade policy or a changed solver never meets
    values computed for an older one.
    """
    env = os.environ.get("BACKROOM_SOLVER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "backroom" / "solver"


def _cached(kind: str, key: Mapping[str, Any], compute: Callable[[], dict[str, Any]]) -> Any:
    """``compute()``'s JSON, read from the cache when there; a cache that cannot be written is skipped."""
    stamp = {"version": CACHE_VERSION, "solvers": _solver_fingerprint(), "kind": kind}
    text = json.dumps({**stamp, **key}, sort_keys=True)
    path = cache_dir() / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    data = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, default=float))
        os.replace(tmp, path)  # whole or absent: readers in other processes never see half a file
    except OSError:
        pass
    return data


@lru_cache(maxsize=1)
def _solver_fingerprint() -> str:
    """A hash of the solvers' source: values an older solver computed are never read back."""
    import backroom.solvers

    h = hashlib.sha256()
    for f in sorted(Path(backroom.solvers.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def shipped_policy(params: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The policy file in ``backroom/policies`` solved for these Kuhn rules: (name, document)."""
    try:
        rules = dict(make_game(GAME, **rules_of(params)).params())
    except (TypeError, ValueError):
        return None
    folder = resources.files("backroom").joinpath("policies")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        doc = json.loads(entry.read_text())
        if (doc.get("meta") or {}).get("kind") == "team":
            continue  # the colluders' joint strategy (kuhn_loki_team), not every seat's
        if doc.get("game") == GAME and doc.get("params") == rules:
            return entry.name.removesuffix(".json"), doc
    return None


def _policy_key(params: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    found = shipped_policy(params)
    if found is None:
        return None
    name, doc = found
    digest = hashlib.sha256(json.dumps(doc["policy"], sort_keys=True).encode()).hexdigest()
    return name, doc, {"policy": digest, "params": doc["params"]}


@dataclass(frozen=True)
class Reference:
    """Every seat plays the shipped CFR policy on its own: what each seat expects, overall and per deal."""

    policy: str
    params: dict[str, Any]
    seat_values: tuple[float, ...]
    deal_values: dict[Deal, tuple[float, ...]]

    def value(self, seats: Sequence[int], deal: Deal | None = None) -> float:
        """The mean over ``seats`` of their expected chips (given ``deal``, when named)."""
        row = self.seat_values if deal is None else self.deal_values[deal]
        return float(np.mean([row[s] for s in seats]))


def cfr_reference(params: Mapping[str, Any]) -> Reference | None:
    """The all-CFR reference for these rules, or None when no shipped policy fits them.

    Costs one game-tree build (about a second for Loki) the first time for a
    policy file, then a cache read (milliseconds); kept in memory after that.
    """
    return _cfr_reference(json.dumps(rules_of(params), sort_keys=True))


@lru_cache(maxsize=8)
def _cfr_reference(params_json: str) -> Reference | None:
    found = _policy_key(json.loads(params_json))
    if found is None:
        return None
    name, doc, key = found

    def compute() -> dict[str, Any]:
        tree = build_tree(make_game(GAME, **doc["params"]))
        sigma = tree.sigma_from_policy(doc["policy"])
        deals, values = per_deal_values(tree, sigma)
        return {
            "seat_values": expected_seat_returns(tree, sigma).tolist(),
            "deals": [list(d) for d in deals],
            "deal_values": values.tolist(),
        }

    data = _cached("cfr-values", key, compute)
    return Reference(
        policy=name,
        params=dict(doc["params"]),
        seat_values=tuple(float(v) for v in data["seat_values"]),
        deal_values={
            tuple(int(c) for c in d): tuple(float(x) for x in v)
            for d, v in zip(data["deals"], data["deal_values"], strict=True)
        },
    )


def collusion_reference(params: Mapping[str, Any], team: Sequence[int]) -> CollusionReport | None:
    """``backroom solve collusion``'s per-deal values with the shipped policy as all-CFR (cached).

    None unless a shipped policy fits the rules and ``team`` is two seats of three.
    """
    return _collusion_reference(json.dumps(rules_of(params), sort_keys=True), tuple(team))


@lru_cache(maxsize=8)
def _collusion_reference(params_json: str, team: tuple[int, ...]) -> CollusionReport | None:
    found = _policy_key(json.loads(params_json))
    if found is None:
        return None
    _, doc, key = found
    game = make_game(GAME, **doc["params"])
    seats = game.info.num_players
    if seats != 3 or len(set(team)) != 2 or not all(0 <= s < seats for s in team):
        return None

    def compute() -> dict[str, Any]:
        report = analyse_collusion(
            game,
            TEAM_ITERATIONS,
            team=team,
            cfr_policy=doc["policy"],
        )
        return {
            "deals": [list(d) for d in report.deals],
            "values": {name: v.tolist() for name, v in report.values.items()},
            "summary": report.summary,
        }

    data = _cached("collusion", {**key, "team": list(team), "iterations": TEAM_ITERATIONS}, compute)
    return CollusionReport(
        game=GAME,
        params=dict(doc["params"]),
        team=team,
        deals=[tuple(int(c) for c in d) for d in data["deals"]],
        values={name: np.asarray(v, dtype=np.float64) for name, v in data["values"].items()},
        summary=data["summary"],
    )


def naive_values(params: Mapping[str, Any], team: Sequence[int]) -> tuple[float, ...] | None:
    """Every seat's expected chips when ``team`` plays the naive rule and the rest the shipped policy.

    The naive rule is the ``kuhn-colluder`` kind's, on a ``before_act``
    channel: a colluder knows its partner's card once the partner has acted
    (it talked just before). Exact: the game tree walked with the rule's moves
    and the policy's probabilities, in milliseconds, so nothing is cached.
    None unless a shipped policy fits the rules and ``team`` is two seats of three.
    """
    from backroom.agents.scripted.kuhn_colluder import naive_choice

    found = shipped_policy(params)
    if found is None:
        return None
    policy = found[1]["policy"]
    game = make_game(GAME, **found[1]["params"])
    seats = game.info.num_players
    if seats != 3 or len(set(team)) != 2 or not all(0 <= s < seats for s in team):
        return None

    def walk(state: State) -> FloatArray:
        if state.is_terminal():
            return np.asarray(state.returns(), dtype=np.float64)
        movers = state.current_players()
        if movers == {CHANCE}:
            branches = list(state.chance_outcomes())
        else:
            (seat,) = movers
            spec = state.action_spec(seat)
            obs = state.observation(seat)
            if seat in team:
                (partner,) = (s for s in team if s != seat)
                heard = any(h["player"] == partner for h in obs["history"])
                card = state.observation(partner)["card"] if heard else None
                branches = [(naive_choice(obs, spec.choices, spec.names, card), 1.0)]
            else:
                row = policy.get(state.information_state(seat), {})
                branches = [(a, float(row.get(json.dumps(a), 0.0))) for a in spec.choices]
        total = np.zeros(seats)
        for action, p in branches:
            if p > 0:
                child = state.clone()
                child.apply({next(iter(movers)): action})
                total += p * walk(child)
        return total

    return tuple(float(v) for v in walk(game.new_initial_state(None)))


def solver_mean(
    report: CollusionReport, per_deal: np.ndarray, eps: Sequence[Mapping[str, Any]]
) -> float:
    """A solver reading (one value per deal) averaged as these episodes were dealt.

    Deals are equally likely, so a hand dealt by chance counts the mean over
    every deal, and a fixed hand its own deal's value: for a run of chosen
    hands, the solver's number for those hands.
    """
    deals = [fixed_deal(e) for e in eps]
    whole = float(np.mean(per_deal))
    if all(d is None for d in deals):
        return whole
    return float(np.mean([whole if d is None else per_deal[report.deals.index(d)] for d in deals]))
