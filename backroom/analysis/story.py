"""What a run's results table means, in a few lines printed under it.

``backroom demo`` and ``backroom run`` end with a table of means per agent;
these lines say what the table cannot: how much was said on each private
channel and who overheard it, what the coalition earned against what the CFR
equilibrium gives the same seats (Kuhn), and which command shows more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any

from backroom.analysis.episodes import channel_stats, played
from backroom.analysis.kuhn import GAME as KUHN
from backroom.analysis.kuhn import (
    Reference,
    cfr_reference,
    collusion_reference,
    fixed_deal,
    mean_se,
    naive_values,
    solver_mean,
)
from backroom.solvers.collusion import CollusionReport, deal_of

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
    kinds: Mapping[str, str] | None = None,
    solver: CollusionReport | EllipsisType | None = ...,
) -> list[str]:
    """The lines under the table, from the run's episode records (JSON dicts).

    ``reference``: the all-CFR values for a Kuhn run when the caller already
    has them (the CLI computes them while the matches play), None to leave the
    comparison out; by default they are looked up here. ``kinds`` (agent id to
    kind) adds, for a Kuhn coalition, a line naming which colluders played and
    why they earn what they do, with the solver's value of their play
    (``solver``: the team solve, looked up by default). Only played episodes
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
        if kinds is not None and coalition[0]["game"] == KUHN:
            lines.extend(_why_line(coalition, kinds, reference, solver))
    hint = (
        " (per-seat chips, Table 1, the collusion heatmap)"
        if eps and eps[0]["game"] == KUHN
        else ""
    )
    lines.append(f"next: backroom analyze {run_dir}{hint}")
    return lines


def _coalition_rewards(
    eps: Sequence[Mapping[str, Any]],
) -> tuple[list[float], list[float], set[str], list[list[int]]]:
    """Per match: the coalition's reward, the overseers' penalty on it, and its seats; its agents."""
    rewards: list[float] = []
    penalties: list[float] = []
    agents: set[str] = set()
    seatings: list[list[int]] = []
    for e in eps:
        seats = [int(s) for s in e["spec"]["transform"]["members"]]
        # What the game gave the coalition (Loki eq. 1): its members' mean raw return; an
        # overseer's penalty comes off the reward after, and is said apart.
        shared = sum(float(e["raw_returns"][s]) for s in seats) / len(seats)
        rewards.append(shared)
        penalties.append(shared - sum(float(e["returns"][s]) for s in seats) / len(seats))
        agents.update(str(e["seats"][s]) for s in seats)
        seatings.append(seats)
    return rewards, penalties, agents, seatings


def _penalty_clause(penalties: Sequence[float], mean: float) -> str:
    """What the overseers took off the reward, or nothing when they took nothing."""
    if not any(penalties):
        return ""
    taken = sum(penalties) / len(penalties)
    flagged = sum(1 for x in penalties if x)
    return (
        f" before overseers' penalties ({flagged} of {len(penalties)} matches flagged: "
        f"{taken:.3f} a match taken, {mean - taken:+.3f} left)"
    )


def _cfr_clause(
    eps: Sequence[Mapping[str, Any]],
    reference: Reference,
    rewards: Sequence[float],
    seatings: Sequence[list[int]],
    mean: float,
    spread: str,
) -> str:
    """What all-CFR play gives the same seats, and what collusion earned over it."""
    # Each hand as it was dealt: a fixed deal (`deals:`) expects its own value.
    value = sum(
        reference.value(seats, fixed_deal(e)) for e, seats in zip(eps, seatings, strict=True)
    ) / len(seatings)
    same = "the same seats on the same hands" if any(map(fixed_deal, eps)) else "the same seats"
    # The same spread: the equilibrium value is exact, all the noise is the run's.
    clause = (
        f"; all three playing the CFR equilibrium ({reference.policy}) would give "
        f"{same} {value:+.3f}, so collusion earned {mean - value:+.3f}{spread}"
    )
    # The luck of the deal out: what the solver's per-hand values compare with.
    given, given_se = mean_se(
        [
            r - reference.value(seats, deal_of(e))
            for r, seats, e in zip(rewards, seatings, eps, strict=True)
        ]
    )
    if given is not None and given_se is not None:
        clause += f" ({given:+.3f} ± {given_se:.3f} with each deal's CFR value subtracted)"
    return clause


def _coalition_line(
    eps: Sequence[Mapping[str, Any]], reference: Reference | EllipsisType | None
) -> str:
    """The coalition's mean reward per match, and for Kuhn what all-CFR play gives its seats."""
    game = str(eps[0]["game"])
    rewards, penalties, agents, seatings = _coalition_rewards(eps)
    mean, se = mean_se(rewards)
    assert mean is not None  # eps is not empty
    spread = f" ± {se:.3f}" if se is not None else ""
    line = (
        f"coalition {' + '.join(sorted(agents))}: mean reward {mean:+.3f}{spread} "
        f"{return_unit(game)} per match"
    )
    line += _penalty_clause(penalties, mean)
    if game == KUHN:
        if reference is ...:
            reference = cfr_reference(eps[0]["params"])
        if isinstance(reference, Reference):
            line += _cfr_clause(eps, reference, rewards, seatings, mean, spread)
    return line


#: Interventions that change what a message says (delay and shuffle_roles change only when
#: it arrives and whom it names; drop is a copy not delivered at all).
CHANGES_WORDS = frozenset({"redact", "budget", "drop"})


def informed_decisions(eps: Sequence[Mapping[str, Any]], team: Sequence[int]) -> tuple[int, int]:
    """Colluders' act turns taken after every partner's message had reached them, and all of them.

    From the record alone: a decision counts as informed when each partner
    had a message delivered to the mover (not overheard) before the referee
    recorded the move, and no intervention changed what it said (a redacted
    or cut copy, or a dropped one, informs nobody). What it said is not read.
    """
    informed = total = 0
    for e in eps:
        heard: dict[tuple[int, int], float] = {}
        for d in e["deliveries"]:
            if not d.get("delivered", True) or CHANGES_WORDS & set(d.get("changed_by") or ()):
                continue
            if not d["overheard"] and d["from_seat"] in team and d["to_seat"] in team:
                key = (int(d["from_seat"]), int(d["to_seat"]))
                heard[key] = min(heard.get(key, math.inf), float(d["t"]))
        for a in e["actions"]:
            seat = int(a["seat"])
            if a["phase"] != "act" or seat not in team:
                continue
            total += 1
            t = float(a["t"])
            informed += all(heard.get((p, seat), math.inf) <= t for p in team if p != seat)
    return informed, total


#: The team solve's readings the why-line quotes: against C's CFR policy, the team game's value.
PROFILES = ("team_vs_unaware", "team")


def _changed_on_the_way(eps: Sequence[Mapping[str, Any]], team: Sequence[int]) -> str:
    """ "3 of 400 of their messages (redact)": the partners' copies an intervention altered."""
    copies = [
        d
        for e in eps
        for d in e["deliveries"]
        if not d["overheard"] and d["from_seat"] in team and d["to_seat"] in team
    ]
    hit = [
        d
        for d in copies
        if not d.get("delivered", True) or CHANGES_WORDS & set(d.get("changed_by") or ())
    ]
    if not hit:
        return ""
    kinds = sorted({k for d in hit for k in d.get("changed_by") or ()})
    return f"{len(hit)} of {len(copies)} of their messages ({', '.join(kinds)})"


#: The colluder kinds the why-line knows, and what each does with the channel.
TEAM_KIND, NAIVE_KIND = "kuhn-team", "kuhn-colluder"


def _fixed_team(eps: Sequence[Mapping[str, Any]]) -> list[int] | None:
    """The coalition's seats when every match seats it the same; None when they rotate."""
    team = [int(s) for s in eps[0]["spec"]["transform"]["members"]]
    if any([int(s) for s in e["spec"]["transform"]["members"]] != team for e in eps):
        return None
    return team


def _team_worth(solver: CollusionReport, eps: Sequence[Mapping[str, Any]], against: str) -> str:
    """What the team solve's joint strategy is worth, against ``against`` and any third player."""
    # A run of chosen hands (`deals:`) is worth what the solver gives those hands,
    # not the whole deck's average.
    versus, value = (solver_mean(solver, solver.advantage(p), eps) for p in PROFILES)
    hands = " on the hands played" if any(map(fixed_deal, eps)) else ""
    return (
        f"{versus:+.3f} a hand{hands} against {against} and at least {value:+.3f} against "
        f"any third player (the team game's value)"
    )


def _team_solve_line(
    who: str,
    eps: Sequence[Mapping[str, Any]],
    team: Sequence[int],
    knew: str,
    team_worth: str | None,
) -> str:
    """The team solve's colluders: told each other their cards, unless the referee got between."""
    if changed := _changed_on_the_way(eps, team):
        line = (
            f"why: {who} played the team solve ({TEAM_KIND}) and each told its partner its "
            f"card, but the referee's interventions changed {changed} on the way ({knew}); "
            f"not knowing, each plays the joint strategy averaged over the cards its partner "
            f"may hold"
        )
        return f"{line}; told, the solve is worth {team_worth}" if team_worth else line
    line = (
        f"why: {who} played the team solve ({TEAM_KIND}): each told its partner its card "
        f"before the first move, as the solve assumes ({knew}), and played its seat's part "
        f"of the joint strategy"
    )
    return f"{line}, worth {team_worth}" if team_worth else line


def _naive_line(
    who: str,
    params: Mapping[str, Any],
    team: Sequence[int],
    knew: str,
    ref: Reference | None,
    team_worth: str | None,
) -> str:
    """The naive card-tellers: their fixed rule, its exact worth, and what the solve would add."""
    line = (
        f"why: {who} played naive card-telling ({NAIVE_KIND}): a fixed rule in place of the "
        f"equilibrium's mixed play (the lower card folds to any bet, the higher raises only "
        f"a King or an Ace, nobody bluffs), {knew} (the first to act has not heard yet)"
    )
    values = naive_values(params, team)
    if values is not None and ref is not None:
        worth = sum(values[s] for s in team) / len(team) - ref.value(team)
        line += f", worth {worth:+.3f} a hand against {ref.policy} by the game tree"
    if team_worth:
        line += f"; the team solve (backroom demo without --naive) is worth {team_worth}"
    return line


def _why_line(
    eps: Sequence[Mapping[str, Any]],
    kinds: Mapping[str, str],
    reference: Reference | EllipsisType | None,
    solver: CollusionReport | EllipsisType | None,
) -> list[str]:
    """One sentence: which colluders played, what they knew, and what the solver says that is worth.

    The solver's numbers are advantages over all three playing the shipped CFR
    policy, as "collusion earned" in the line above: the team solve's joint
    strategy against that policy (what ``backroom demo`` plays) and against a
    third player who best-responds (the team game's value, which the joint
    strategy guarantees), and the naive rule against that policy, exactly.
    """
    first = eps[0]
    team = _fixed_team(eps)
    if team is None:
        return []  # rotated seats: one sentence cannot hold every seating's values
    agents = [str(first["seats"][s]) for s in team]
    played_kinds = sorted({kinds.get(a, "unknown") for a in agents})
    informed, total = informed_decisions(eps, team)
    knew = f"the partner's card known at {informed} of {total} decisions"
    if reference is ...:
        reference = cfr_reference(first["params"])
    if solver is ...:
        solver = collusion_reference(first["params"], team)
    ref = reference if isinstance(reference, Reference) else None
    against = ref.policy if ref else "the CFR policy"
    team_worth = _team_worth(solver, eps, against) if isinstance(solver, CollusionReport) else None
    who = _names(agents)
    if played_kinds == [TEAM_KIND]:
        return [_team_solve_line(who, eps, team, knew, team_worth)]
    if played_kinds == [NAIVE_KIND]:
        return [_naive_line(who, first["params"], team, knew, ref, team_worth)]
    line = f"why: {who} played {', '.join(played_kinds)}, {knew}"
    return [f"{line}; the team solve is worth {team_worth}" if team_worth else line]
