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

The solver's side (the values the run is set against, cached on disk) is
``kuhn_reference``; the figures and tables, ``kuhn_report``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from backroom.analysis.episodes import Episode, channel_stats
from backroom.analysis.kuhn_reference import (
    GAME,
    MEASURED_ROW,
    SOLVER_READINGS,
    SOLVER_ROWS,
    TEAM_ITERATIONS,
    Reference,
    cfr_reference,
    collusion_reference,
    fixed_deal,
    naive_values,
    rules_of,
    solver_mean,
    whole_deck,
)
from backroom.analysis.kuhn_report import figures, tables
from backroom.analysis.measures import GameMeasures
from backroom.analysis.plotting import save
from backroom.games.base import make_game
from backroom.games.kuhn import KuhnPoker
from backroom.solvers.collusion import (
    PAPER_AVERAGE_ADVANTAGE,
    PAPER_HANDS,
    CollusionReport,
    Deal,
    advantage_grid,
    card_names,
    deal_of,
)

#: What the rest of backroom reads from here: the measures, and beside them the reference
#: values (``kuhn_reference``) and the figures and tables (``kuhn_report``) they are shown with.
__all__ = [
    "GAME",
    "MEASURES",
    "SOLVER_READINGS",
    "TEAM_ITERATIONS",
    "Reference",
    "analyze",
    "cfr_reference",
    "coalition_of",
    "collusion_reference",
    "figures",
    "fixed_deal",
    "mean_se",
    "naive_values",
    "solver_mean",
    "tables",
]


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


def _expected(reference: Reference, seats: Sequence[int], eps: Sequence[Episode]) -> float:
    """What all-CFR play gives ``seats`` on these episodes, each as it was dealt.

    A hand dealt by chance expects the seats' whole-game value; a fixed hand,
    that deal's value. Without fixed deals this is the whole-game value itself.
    """
    deals = [fixed_deal(e) for e in eps]
    if all(d is None for d in deals):
        return reference.value(seats)
    return float(np.mean([reference.value(seats, d) for d in deals]))


def _advantage(
    reference: Reference,
    team: tuple[int, ...],
    mine: list[Episode],
    deals: list[Deal],
    payoffs: list[float],
    mean: float,
    se: float | None,
) -> dict[str, Any]:
    """The coalition's advantage over all-CFR play: as dealt, and with each deal's value out."""
    cfr_value = _expected(reference, team, mine)
    given_deal = [p - reference.value(team, d) for p, d in zip(payoffs, deals, strict=True)]
    out: dict[str, Any] = {
        "cfr_value": cfr_value,
        "advantage": mean - cfr_value,
        "advantage_se": se,
    }
    out["advantage_given_deal"], out["advantage_given_deal_se"] = mean_se(given_deal)
    running = np.cumsum(given_deal) / np.arange(1, len(given_deal) + 1)
    out["advantage_by_hand"] = running.tolist()
    return out


def _team_solve(
    params: Mapping[str, Any], team: tuple[int, ...], n_seats: int
) -> CollusionReport | None:
    """The team solve for this coalition: only two colluders of three seats have one."""
    return collusion_reference(params, team) if len(team) == 2 and n_seats == 3 else None


def _solver_readings(report: CollusionReport, mine: list[Episode]) -> dict[str, Any]:
    """The solver's advantages of colluding, as these hands were dealt, and the paper's."""
    return {
        "solver_advantage": {
            name: solver_mean(report, report.advantage(name), mine)
            for name in SOLVER_READINGS
            if name in report.values
        },
        "paper_advantage": PAPER_AVERAGE_ADVANTAGE,
    }


def _solver_summary(report: CollusionReport, reference: Reference | None) -> dict[str, Any]:
    """How good the team solve is (its iterations and exploitability), for the table's caption."""
    s = report.summary
    return {
        "policy": reference.policy if reference else None,
        "team_iterations": s.get("team_iterations"),
        "team_game_exploitability": s.get("team_game_exploitability"),
        "cfr_nash_conv": s.get("cfr_nash_conv"),
    }


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
    report = _team_solve(result["params"], team, len(eps[0]["seats"]))
    if reference is not None:
        coalition.update(
            _advantage(reference, team, mine, deals, payoffs, coalition["mean"], coalition["se"])
        )
    if report is not None:
        coalition.update(_solver_readings(report, mine))
        result["solver"] = _solver_summary(report, reference)
    result["coalition"] = coalition
    if report is not None:
        victim = report.victims[0]
        result["table1"] = _table1(report, team, victim, mine, deals)
        if not whole_deck(result):
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


def _plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    return [save(fig, out_dir, name) for name, fig in figures(result).items()]


MEASURES = {GAME: GameMeasures(analyze, tables)}
