"""What a run's results table means, in a few lines printed under it.

``backroom demo`` and ``backroom run`` end with a table of means per agent;
these lines say what the table cannot: how much was said on each private
channel and who overheard it, what the coalition earned against what the CFR
equilibrium gives the same seats (Kuhn), and which command shows more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any

from backroom.analysis.episodes import channel_stats, played
from backroom.analysis.kuhn import GAME as KUHN
from backroom.analysis.kuhn import Reference, cfr_reference, fixed_deal, mean_se

#: What one unit of each game's returns is, for column headings ("mean chips").
RETURN_UNITS = {
    "kuhn": "chips",
    "bertrand": "profit",
    "ipd": "points",
    "split_nocomm": "points",
    "trust_and_split": "points",
    "beauty_contest": "points",
}


def return_unit(game: str) -> str:
    """The unit of ``game``'s raw returns; "return" for a game this table does not know."""
    return RETURN_UNITS.get(game, "return")


def _names(agents: Sequence[str]) -> str:
    agents = list(agents)
    if len(agents) <= 2:
        return " and ".join(agents)
    return ", ".join(agents[:-1]) + f" and {agents[-1]}"


def story_lines(
    episodes: Sequence[Mapping[str, Any]],
    run_dir: Path,
    *,
    reference: Reference | EllipsisType | None = ...,
) -> list[str]:
    """The lines under the table, from the run's episode records (JSON dicts).

    ``reference``: the all-CFR values for a Kuhn run when the caller already
    has them (the CLI computes them while the matches play), None to leave the
    comparison out; by default they are looked up here. Only played episodes
    count, as in ``backroom analyze``.
    """
    eps = played(dict(e) for e in episodes)
    lines: list[str] = []
    for name, ch in channel_stats(eps).items():
        heard = (
            f"{_names(ch['overhearers'])} overheard {ch['overheard_messages']} of them"
            if ch["overhearers"]
            else "nobody overheard them"
        )
        n = int(ch["messages"])
        if n == 0:
            lines.append(f"channel {name}: no messages were sent")
            continue
        sent = f"{n} message" if n == 1 else f"{n} messages"
        lines.append(f"channel {name}: {_names(ch['senders'])} sent {sent}; {heard}")
    coalition = [
        e for e in eps if (e.get("spec") or {}).get("transform", {}).get("kind") == "coalition"
    ]
    if coalition:
        lines.append(_coalition_line(coalition, reference))
    hint = (
        " (per-seat chips, Table 1, the collusion heatmap)"
        if eps and eps[0]["game"] == KUHN
        else ""
    )
    lines.append(f"next: backroom analyze {run_dir}{hint}")
    return lines


def _coalition_line(
    eps: Sequence[Mapping[str, Any]], reference: Reference | EllipsisType | None
) -> str:
    """The coalition's mean reward per match, and for Kuhn what all-CFR play gives its seats."""
    game = str(eps[0]["game"])
    unit = return_unit(game)
    rewards: list[float] = []
    agents: set[str] = set()
    seatings: list[list[int]] = []
    for e in eps:
        seats = [int(s) for s in e["spec"]["transform"]["members"]]
        rewards.append(sum(float(e["returns"][s]) for s in seats) / len(seats))
        agents.update(str(e["seats"][s]) for s in seats)
        seatings.append(seats)
    mean, se = mean_se(rewards)
    assert mean is not None  # eps is not empty
    spread = f" ± {se:.3f}" if se is not None else ""
    line = (
        f"coalition {' + '.join(sorted(agents))}: mean reward {mean:+.3f}{spread} {unit} per match"
    )
    if game == KUHN:
        if reference is ...:
            reference = cfr_reference(eps[0]["params"])
        if isinstance(reference, Reference):
            # Each hand as it was dealt: a fixed deal (`deals:`) expects its own value.
            value = sum(
                reference.value(seats, fixed_deal(e))
                for e, seats in zip(eps, seatings, strict=True)
            ) / len(seatings)
            same = (
                "the same seats on the same hands"
                if any(map(fixed_deal, eps))
                else "the same seats"
            )
            # The same spread: the equilibrium value is exact, all the noise is the run's.
            line += (
                f"; all three playing the CFR equilibrium ({reference.policy}) would give "
                f"{same} {value:+.3f}, so collusion earned {mean - value:+.3f}{spread}"
            )
    return line
