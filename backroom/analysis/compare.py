"""A coalition's gain from one run to another: the same table with and without an intervention.

Two runs of one config with the same seed deal the same hands (every random choice
derives from the match seed), so their matches pair one to one, and the
difference of the coalition's payoff is taken hand by hand: the luck of the deal
cancels, and what is left is the intervention's effect (common random numbers).
Matches pair on (seed, CRN index, seats); where none pair, the two means are
compared unpaired (Welch's standard error), and the result says which it is.

The coalition is the reward transform's; its payoff is the members' mean raw
return (Loki eq. 1). The interval is mean ± 1.96 standard errors (normal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from backroom.analysis.episodes import Episode, played
from backroom.analysis.generic import coalition_seats, mean_se

#: The normal quantile of a two-sided 95% interval.
Z95 = 1.959964


def _payoffs(episodes: Sequence[Episode]) -> dict[tuple[Any, ...], float]:
    out: dict[tuple[Any, ...], float] = {}
    for e in played(episodes):
        seats = coalition_seats(e)
        raw = e.get("raw_returns") or []
        if seats is None or not raw:
            continue
        key = (
            e.get("seed"),
            (e.get("spec") or {}).get("crn_index", 0),
            tuple(e.get("seats") or ()),
        )
        out.setdefault(key, math.fsum(float(raw[s]) for s in seats) / len(seats))
    return out


def coalition_gain(treated: Sequence[Episode], control: Sequence[Episode]) -> dict[str, Any]:
    """The coalition's payoff per match in ``treated`` minus in ``control``, with its interval."""
    a, b = _payoffs(treated), _payoffs(control)
    if not a or not b:
        raise ValueError("both runs need played matches whose reward transform names a coalition")
    keys = [k for k in a if k in b]
    if keys:
        mean, se = mean_se([a[k] - b[k] for k in keys])
        how = "paired"
    else:
        (ma, sa), (mb, sb) = mean_se(list(a.values())), mean_se(list(b.values()))
        assert ma is not None and mb is not None
        mean = ma - mb
        se = (
            math.sqrt((sa or 0.0) ** 2 + (sb or 0.0) ** 2)
            if sa is not None and sb is not None
            else None
        )
        how = "unpaired"
    assert mean is not None
    return {
        "how": how,
        "pairs": len(keys),
        "treated": {"matches": len(a), "mean": mean_se(list(a.values()))[0]},
        "control": {"matches": len(b), "mean": mean_se(list(b.values()))[0]},
        "difference": mean,
        "se": se,
        "ci95": [mean - Z95 * se, mean + Z95 * se] if se is not None else None,
    }


def describe(gain: dict[str, Any], against: str) -> str:
    """One line for the terminal and the report."""
    spread = f" ± {gain['se']:.3f}" if gain["se"] is not None else ""
    ci = gain["ci95"]
    interval = f" (95% interval {ci[0]:+.3f} to {ci[1]:+.3f})" if ci else ""
    how = (
        f"paired over {gain['pairs']} matches of the same seeds"
        if gain["how"] == "paired"
        else f"unpaired: no match of one shares a seed with the other "
        f"({gain['treated']['matches']} and {gain['control']['matches']} matches)"
    )
    return (
        f"against {against}: the coalition's payoff changed by {gain['difference']:+.3f}"
        f"{spread} a match{interval}, {how}"
    )
