"""The Loki paper's measures of a Kuhn poker run, side by side with the solver's.

From the played episodes (``normal`` and ``timeout`` ones; raw chips, before
any reward transform):

* each seat's mean chips per hand with its standard error, beside what the
  seat expects when every seat plays the shipped CFR policy (independent
  play, ``backroom/policies``: the policy the paper's player C plays);
* the coalition's payoff, Loki eq. 1 ``(R_A + R_B) / 2``, and its advantage
  over independent play: against the CFR value of the same seats, and
  against the CFR value of each hand's deal (the same advantage with the
  luck of the deal taken out, so a few hundred hands say more), beside the
  solver's advantage of colluding (team solve minus all-CFR, as in
  ``backroom solve collusion``);
* Table 1: the third player's chips per hand, measured, against the solver's
  expected values (CFR, CFR Collusion, CFR Collusion against an unaware C);
* message statistics on each channel (messages, deliveries, overheard);
* Figure 2: the per-deal collusion advantage, played beside the solver's.

A run with fixed deals (``deals:`` in the run config, ``params.deal`` in each
episode) is one game with its hands chosen: its episodes are analysed together,
and every comparison with the solver takes each hand's own value, so a run of
three hands is set against those three hands, not against the whole deck.

The solver's side needs the full game tree and a team solve (seconds), so its
numbers are cached on disk per policy, rules and coalition; see
:func:`cache_dir`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.table import Table

from backroom.analysis.episodes import Episode, channel_stats
from backroom.analysis.measures import GameMeasures
from backroom.analysis.plotting import figure, save
from backroom.games.base import CHANCE, State, make_game
from backroom.games.kuhn import KuhnPoker
from backroom.solvers.collusion import (
    PAPER_AVERAGE_ADVANTAGE,
    PAPER_HANDS,
    CollusionReport,
    Deal,
    advantage_grid,
    analyse_collusion,
    card_names,
    deal_of,
    per_deal_values,
)
from backroom.solvers.evaluate import expected_seat_returns
from backroom.solvers.tree import FloatArray, build_tree

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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


# --- measures -------------------------------------------------------------------------------


def mean_se(xs: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); None where undefined."""
    if not xs:
        return None, None
    mean = float(np.mean(xs))
    if len(xs) < 2:
        return mean, None
    return mean, float(np.std(xs, ddof=1) / math.sqrt(len(xs)))


def coalition_of(ep: Episode) -> tuple[tuple[int, ...], str] | None:
    """The colluding seats of an episode and where they come from.

    The reward transform's coalition when there is one (the run says who
    shares winnings); else the members of a private channel (talk without a
    shared reward); else, with three seats, seats 0 and 1 as in the paper,
    which for a run without collusion is the control: its advantage should be
    near zero.
    """
    spec = ep.get("spec") or {}
    transform = spec.get("transform") or {}
    if transform.get("kind") == "coalition" and len(transform.get("members") or []) >= 2:
        return tuple(sorted(int(s) for s in transform["members"])), "reward transform"
    for channel in spec.get("channels") or []:
        members = channel.get("members") or []
        if 2 <= len(members) < len(ep["seats"]):
            return tuple(sorted(int(s) for s in members)), f"channel {channel['name']}"
    if len(ep["seats"]) == 3:
        return (0, 1), "seats 0 and 1 (no coalition in the run)"
    return None


def _num(x: float) -> float | None:
    """JSON has no NaN: an empty cell is null."""
    return None if math.isnan(x) else float(x)


def _seat_row(eps: list[Episode], seat: int, reference: Reference | None) -> dict[str, Any]:
    """One seat's line: its agents, mean chips and reward with their errors, and what CFR gets."""
    chips = [float(e["raw_returns"][seat]) for e in eps]
    mean, se = mean_se(chips)
    reward, reward_se = mean_se([float(e["returns"][seat]) for e in eps])
    return {
        "seat": seat,
        "agents": sorted({str(e["seats"][seat]) for e in eps}),
        "hands": len(chips),
        "mean_chips": mean,
        "se": se,
        "mean_reward": reward,
        "reward_se": reward_se,
        "cfr_value": _expected(reference, (seat,), eps) if reference else None,
    }


def analyze(episodes: list[Episode], out_dir: Path | None = None) -> dict[str, Any]:
    """Measures of played Kuhn episodes (see the module docstring); plots go to ``out_dir``."""

    def rules_json(e: Episode) -> str:
        return json.dumps(rules_of(e.get("params", {})), sort_keys=True)

    by_rules = Counter(rules_json(e) for e in episodes)
    most = by_rules.most_common(1)[0][0] if episodes else "{}"
    eps = [e for e in episodes if rules_json(e) == most]
    eps.sort(key=lambda e: float(e.get("started_at", 0.0)))
    params = json.loads(most)
    result: dict[str, Any] = {
        "game": GAME,
        "episodes": len(eps),
        "other_rules": len(episodes) - len(eps),
        "params": params,
        "dealt": _dealt(eps, params),
        "policy": None,
        "seats": [],
        "coalition": None,
        "table1": None,
        "channels": channel_stats(eps),
        "heatmap": None,
        "solver": None,
        "plots": [],
    }
    if not eps:
        return result
    reference = cfr_reference(params)
    result["policy"] = reference.policy if reference else None
    result["seats"] = [_seat_row(eps, seat, reference) for seat in range(len(eps[0]["seats"]))]
    coalitions = Counter(c for e in eps if (c := coalition_of(e)) is not None)
    if coalitions:
        _coalition(result, eps, coalitions.most_common(1)[0][0], reference)
    if out_dir is not None:
        result["plots"] = _plots(result, out_dir)
    return result


def _dealt(eps: Sequence[Episode], params: Mapping[str, Any]) -> dict[str, Any]:
    """How the hands were dealt: by chance, or fixed (how many hands, how often each).

    ``every_deal``: the fixed hands are every deal of the deck, each as often,
    so whole-game means (the solver's "all hands") are what they estimate.
    """
    fixed = Counter(d for e in eps if (d := fixed_deal(e)) is not None)
    out: dict[str, Any] = {"chance": len(eps) - fixed.total(), "fixed": fixed.total()}
    if fixed:
        try:
            game = make_game(GAME, **params)
        except ValueError:
            game = None
        deck = game.deals() if isinstance(game, KuhnPoker) else []
        out["hands"] = len(fixed)
        out["per_hand"] = [min(fixed.values()), max(fixed.values())]
        out["every_deal"] = (
            not out["chance"] and set(fixed) == set(deck) and len(set(fixed.values())) == 1
        )
    return out


def _whole_deck(result: Mapping[str, Any]) -> bool:
    """Whether the hands played weigh every deal alike: dealt by chance, or every deal k times."""
    dealt = result.get("dealt") or {}
    return not dealt.get("fixed") or bool(dealt.get("every_deal"))


def _expected(reference: Reference, seats: Sequence[int], eps: Sequence[Episode]) -> float:
    """What all-CFR play gives ``seats`` on these episodes, each as it was dealt.

    A hand dealt by chance expects the seats' whole-game value; a fixed hand,
    that deal's value. Without fixed deals this is the whole-game value itself.
    """
    deals = [fixed_deal(e) for e in eps]
    if all(d is None for d in deals):
        return reference.value(seats)
    return float(np.mean([reference.value(seats, d) for d in deals]))


def _coalition(
    result: dict[str, Any],
    eps: list[Episode],
    coalition_source: tuple[tuple[int, ...], str],
    reference: Reference | None,
) -> None:
    """The coalition's payoff and advantage, Table 1 and the heatmap, into ``result``.

    Only episodes with the run's most common coalition count: with rotated
    seats, a deal's CFR value and the team solve are per seating.
    """
    team, source = coalition_source
    params = result["params"]
    n_seats = len(eps[0]["seats"])
    mine = [e for e in eps if coalition_of(e) == coalition_source]
    deals = [deal_of(e) for e in mine]
    payoffs = [float(np.mean([e["raw_returns"][s] for s in team])) for e in mine]
    coalition: dict[str, Any] = {
        "seats": list(team),
        "agents": sorted({str(e["seats"][s]) for e in mine for s in team}),
        "source": source,
        "episodes": len(mine),
    }
    coalition["mean"], coalition["se"] = mean_se(payoffs)
    report = collusion_reference(params, team) if len(team) == 2 and n_seats == 3 else None
    if reference is not None:
        cfr_value = _expected(reference, team, mine)
        given_deal = [p - reference.value(team, d) for p, d in zip(payoffs, deals, strict=True)]
        coalition["cfr_value"] = cfr_value
        coalition["advantage"] = coalition["mean"] - cfr_value
        coalition["advantage_se"] = coalition["se"]
        coalition["advantage_given_deal"], coalition["advantage_given_deal_se"] = mean_se(
            given_deal
        )
        coalition["advantage_by_hand"] = np.cumsum(given_deal) / np.arange(1, len(given_deal) + 1)
        coalition["advantage_by_hand"] = coalition["advantage_by_hand"].tolist()
    if report is not None:
        coalition["solver_advantage"] = {
            name: solver_mean(report, report.advantage(name), mine)
            for name in SOLVER_READINGS
            if name in report.values
        }
        coalition["paper_advantage"] = PAPER_AVERAGE_ADVANTAGE
        s = report.summary
        result["solver"] = {
            "policy": reference.policy if reference else None,
            "team_iterations": s.get("team_iterations"),
            "team_game_exploitability": s.get("team_game_exploitability"),
            "cfr_nash_conv": s.get("cfr_nash_conv"),
        }
    result["coalition"] = coalition
    if report is not None:
        victim = report.victims[0]
        result["table1"] = _table1(report, team, victim, mine, deals)
        if not _whole_deck(result):
            result["table1"]["last"] = "hands played"
        result["heatmap"] = _heatmap(report, mine, deals, reference)


def _table1(
    report: CollusionReport,
    team: tuple[int, ...],
    victim: int,
    eps: list[Episode],
    deals: list[Deal],
) -> dict[str, Any]:
    """C's chips per hand: the paper's three hands (cards of A, B, C) and, last, all hands."""
    hands = [list(h) for h in PAPER_HANDS if max(h) < 1 + max(max(d) for d in report.deals)]

    def deal(hand: Sequence[int]) -> Deal:
        cards = [0] * (len(team) + 1)
        for seat, card in zip((*team, victim), hand, strict=True):
            cards[seat] = card
        return tuple(cards)

    rows: dict[str, list[Any]] = {}
    for label, profile in SOLVER_ROWS.items():
        if profile not in report.values:
            continue
        values = report.values[profile][:, victim]
        rows[label] = [report.hand_value(profile, deal(h), victim) for h in hands]
        rows[label].append(solver_mean(report, values, eps))
    measured: list[Any] = []
    for h in [*hands, None]:
        chips = [
            float(e["raw_returns"][victim])
            for e, d in zip(eps, deals, strict=True)
            if h is None or d == deal(h)
        ]
        mean, se = mean_se(chips)
        measured.append({"mean": mean, "se": se, "n": len(chips)})
    rows[MEASURED_ROW] = measured
    return {"seat": victim, "hands": hands, "rows": rows, "last": "all hands"}


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


def _heatmap(
    report: CollusionReport,
    eps: list[Episode],
    deals: list[Deal],
    reference: Reference | None,
) -> dict[str, Any]:
    """Figure 2's grid (A's card x B's card, mean over C's card): played and solver.

    The played cell is the mean over its hands of the coalition's chips minus
    what all-CFR play gives the same deal. C's card is uniform given A's and
    B's, so it estimates what the solver's cell is exactly, the advantage
    averaged over C's card, for the strategies that were played instead of
    the team solve's. Cells never dealt stay empty (grey).
    """
    solver = advantage_grid(report)
    cards = solver.shape[1]
    a_seat, b_seat = report.team[:2]
    sums = np.zeros((cards, cards))
    counts = np.zeros((cards, cards), dtype=np.int64)
    if reference is not None:
        for e, d in zip(eps, deals, strict=True):
            payoff = float(np.mean([e["raw_returns"][s] for s in report.team]))
            sums[d[a_seat], d[b_seat]] += payoff - reference.value(report.team, d)
            counts[d[a_seat], d[b_seat]] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        played = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return {
        "cards": card_names(report, cards),
        "seats": [a_seat, b_seat],
        "played": [[_num(x) for x in row] for row in played],
        "hands": counts.tolist(),
        "solver": [[_num(x) for x in row] for row in solver[cards]],
        # the whole grid's mean (every deal), whatever hands the run played
        "solver_mean": report.average_advantage("team"),
    }


# --- plots ----------------------------------------------------------------------------------


def _plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    return [save(fig, out_dir, name) for name, fig in figures(result).items()]


def figures(result: dict[str, Any]) -> dict[str, Figure]:
    """The figures of an ``analyze`` result by file name (unsaved: tests read their legends)."""
    out: dict[str, Figure] = {"kuhn_seats": _seats_figure(result)}
    coalition = result.get("coalition") or {}
    if coalition.get("advantage_by_hand"):
        out["kuhn_coalition_advantage"] = _advantage_figure(result)
    if result.get("heatmap"):
        out["kuhn_collusion_heatmap"] = _heatmap_figure(result)
    return out


def _seats_figure(result: dict[str, Any]) -> Figure:
    seats = result["seats"]
    fig = figure(6.0, 3.8)
    ax = fig.add_subplot()
    x = np.arange(len(seats))
    labels = [f"seat {s['seat']}\n{', '.join(s['agents'])}" for s in seats]
    means = [s["mean_chips"] or 0.0 for s in seats]
    errs = [s["se"] or 0.0 for s in seats]
    ax.bar(x, means, 0.6, yerr=errs, capsize=4, label="played (± 1 s.e.)")
    if all(s["cfr_value"] is not None for s in seats):
        # Markers, not bars: equilibrium values near zero would be bars nobody can see.
        ax.plot(
            x,
            [s["cfr_value"] for s in seats],
            ls="none",
            marker="D",
            color="black",
            label=f"all play CFR ({result['policy']})",
        )
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("mean chips per hand (± 1 s.e.)")
    ax.set_title(f"kuhn: chips per seat over {result['episodes']} hands")
    ax.legend(loc="best", fontsize="small")
    return fig


def _advantage_figure(result: dict[str, Any]) -> Figure:
    from matplotlib.ticker import MaxNLocator

    c = result["coalition"]
    running = c["advantage_by_hand"]
    fig = figure(7.0, 3.8)
    ax = fig.add_subplot()
    hands = np.arange(1, len(running) + 1)
    ax.plot(hands, running, label="played: running mean, deal's CFR value subtracted")
    if c.get("advantage_given_deal_se") is not None:
        m, se = c["advantage_given_deal"], c["advantage_given_deal_se"]
        ax.axhspan(m - se, m + se, color="tab:blue", alpha=0.15, label="played: mean ± 1 s.e.")
    ax.axhline(0.0, color="black", lw=0.8, label="independent play (all CFR)")
    # Both solver readings: what colluders playing the team solve expect against C's CFR
    # policy (the demo's +0.059), and the team game's value, which they keep against any C.
    solver = c.get("solver_advantage") or {}
    for name, style in (("team_vs_unaware", "-."), ("team", "--")):
        if name in solver:
            ax.axhline(solver[name], color="tab:red", ls=style, label=SOLVER_READINGS[name])
    if c.get("paper_advantage") is not None:
        ax.axhline(c["paper_advantage"], color="tab:green", ls=":", label="Loki paper")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("hand")
    ax.set_ylabel("coalition advantage (chips)")
    who = " + ".join(c["agents"])
    ax.set_title(f"kuhn: collusion advantage of {who}, (R_A + R_B) / 2 per hand")
    ax.legend(loc="best", fontsize="small")
    return fig


def _heatmap_figure(result: dict[str, Any]) -> Figure:
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    h = result["heatmap"]
    grids = {
        "played": np.array([[np.nan if v is None else v for v in r] for r in h["played"]]),
        "solver": np.array([[np.nan if v is None else v for v in r] for r in h["solver"]]),
    }
    limit = max(
        float(np.nanmax(np.abs(g))) if np.isfinite(g).any() else 0.0 for g in grids.values()
    )
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-(limit or 1.0), vmax=limit or 1.0)
    cmap = colormaps["RdBu_r"].with_extremes(bad="#d9d9d9")  # grey: impossible or never dealt
    names = h["cards"]
    a_seat, b_seat = h["seats"]
    coalition = result["coalition"]
    solver_adv = h.get("solver_mean", (coalition.get("solver_advantage") or {}).get("team"))
    titles = {
        "played": f"played: {coalition['episodes']} hands, "
        f"mean {_fmt(coalition.get('advantage_given_deal'))}",
        "solver": f"solver (team CFR − CFR): mean {_fmt(solver_adv)}",
    }
    fig = figure(10.0, 4.6)
    axes = fig.subplots(1, 2)
    im = None
    for ax, (name, grid) in zip(axes, grids.items(), strict=True):
        im = ax.imshow(grid, cmap=cmap, norm=norm, origin="lower")
        ax.set_xticks(range(len(names)), names)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel(f"colluder B's card (seat {b_seat})")
        ax.set_ylabel(f"colluder A's card (seat {a_seat})")
        ax.set_title(titles[name], fontsize=10)
        for a in range(len(names)):
            for b in range(len(names)):
                if math.isnan(grid[a, b]):
                    continue
                text = f"{grid[a, b]:+.2f}"
                if name == "played":
                    text += f"\nn={h['hands'][a][b]}"
                dark = abs(grid[a, b]) > 0.6 * (limit or 1.0)
                ax.text(
                    b, a, text, ha="center", va="center", fontsize=7, color="w" if dark else "k"
                )
    assert im is not None
    fig.colorbar(im, ax=list(axes), shrink=0.85, label="Δ coalition payoff vs all-CFR, per deal")
    fig.suptitle("collusion advantage by colluders' cards, mean over C's card (Loki Figure 2)")
    return fig


# --- tables ---------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) < 0.5 * 10**-digits:
        x = 0.0  # an equilibrium value of -8e-05 reads "+0.000", not "-0.000"
    return f"{x:+.{digits}f}"


def _pm(mean: float | None, se: float | None) -> str:
    return _fmt(mean) + (f" ± {se:.3f}" if se is not None else "")


def _measured_cell(c: Mapping[str, Any]) -> str:
    """A Table 1 cell from play: mean ± s.e. (n hands), two decimals as the solver's cells."""
    if not c["n"]:
        return "–"
    se = f" ± {c['se']:.2f}" if c["se"] is not None else ""
    return f"{c['mean']:+.2f}{se} (n={c['n']})"


def _dealt_line(dealt: Mapping[str, Any]) -> str:
    """How the hands were dealt, for a caption; empty when chance dealt them all."""
    if not dealt.get("fixed"):
        return ""
    low, high = dealt["per_hand"]
    each = f"{low}" if low == high else f"{low} to {high}"
    which = "every deal" if dealt.get("every_deal") else f"{dealt['hands']} hands"
    line = f"fixed deals: {which}, {each} each"
    if dealt.get("chance"):
        line += f"; {dealt['chance']} dealt by chance"
    return line


def tables(run: str, r: dict[str, Any]) -> list[Table]:
    """Rich tables of :func:`analyze`'s result: seats, coalition, Table 1, channels."""
    out = [_seats_table(run, r)]
    if c := r.get("coalition"):
        out.append(_coalition_table(r, c))
    if tab := r.get("table1"):
        out.append(_table1_table(tab))
    if r.get("channels"):
        out.append(_channels_table(r["channels"]))
    return out


def _seats_table(run: str, r: dict[str, Any]) -> Table:
    title = f"{run} kuhn: {r['episodes']} hands".strip()
    if r.get("other_rules"):
        title += f" ({r['other_rules']} with other rules left out)"
    t = Table(title=title)
    for col in ("seat", "agent", "hands", "mean chips ± s.e.", "all play CFR", "mean reward"):
        t.add_column(col, justify="left" if col == "agent" else "right")
    for s in r["seats"]:
        t.add_row(
            str(s["seat"]),
            ", ".join(s["agents"]),
            str(s["hands"]),
            _pm(s["mean_chips"], s["se"]),
            _fmt(s["cfr_value"]),
            _fmt(s["mean_reward"]),
        )
    if r.get("policy"):
        t.caption = f"all play CFR: every seat plays {r['policy']} (expected chips per hand)"
        if not _whole_deck(r):
            t.caption += ", on the hands played"
    if dealt := _dealt_line(r.get("dealt") or {}):
        t.caption = f"{t.caption}\n{dealt}" if t.caption else dealt
    return t


def _coalition_table(r: dict[str, Any], c: dict[str, Any]) -> Table:
    t = Table(title=f"coalition {' + '.join(c['agents'])} (seats {c['seats']}; {c['source']})")
    t.add_column("(R_A + R_B) / 2 per hand")
    t.add_column("value", justify="right")
    t.add_row("played", _pm(c["mean"], c["se"]))
    if "cfr_value" in c:
        t.add_row("all play CFR (same seats)", _fmt(c["cfr_value"]))
        t.add_row("advantage over independent play", _pm(c["advantage"], c["advantage_se"]))
        t.add_row(
            "advantage, deal's CFR value subtracted",
            _pm(c["advantage_given_deal"], c["advantage_given_deal_se"]),
        )
    for name, adv in (c.get("solver_advantage") or {}).items():
        t.add_row(SOLVER_READINGS.get(name, name), _fmt(adv))
    if c.get("paper_advantage") is not None:
        t.add_row("Loki paper (Figure 2 average)", _fmt(c["paper_advantage"], 4))
    if solver := r.get("solver"):
        t.caption = (
            f"team solve: CFR+ x {solver['team_iterations']}, "
            f"exploitability {solver['team_game_exploitability']:.2g}"
        )
    if not _whole_deck(r):
        more = "CFR and solver values are on the hands played, not the whole deck"
        t.caption = f"{t.caption}\n{more}" if t.caption else more
    return t


def _table1_table(tab: dict[str, Any]) -> Table:
    t = Table(title=f"Table 1: expected chips of player C (seat {tab['seat']}) per hand [A, B, C]")
    t.add_column("")
    for h in tab["hands"]:
        t.add_column(f"[{', '.join(map(str, h))}]", justify="right")
    t.add_column(tab.get("last", "all hands"), justify="right")
    for label, cells in tab["rows"].items():
        if label == MEASURED_ROW:
            t.add_row(label, *(_measured_cell(c) for c in cells))
        else:
            t.add_row(label, *(_fmt(v, 2) for v in cells))
    return t


def _channels_table(channels: dict[str, Any]) -> Table:
    t = Table(title="messages per channel")
    for col in ("channel", "messages", "overheard", "deliveries", "senders", "overheard by"):
        t.add_column(
            col, justify="right" if col in ("messages", "overheard", "deliveries") else "left"
        )
    for name, ch in channels.items():
        t.add_row(
            name,
            str(ch["messages"]),
            str(ch["overheard_messages"]),
            str(ch["deliveries"]),
            ", ".join(ch["senders"]) or "-",
            ", ".join(ch["overhearers"]) or "-",
        )
    t.caption = "overheard: messages an eavesdropper read; deliveries: one per reader"
    return t


MEASURES = {GAME: GameMeasures(analyze, tables)}
