"""A coalition's exact exploitability, where its joint policy can be asked: ``kuhn-team`` pairs.

A ``kuhn-team`` agent plays its seat's part of the team solve (``solvers.team``):
at each act turn it looks up the row of the *joint* strategy keyed by every
colluder's information state, which it knows once its partners told it their
cards on the channel. Alone, its play is no function of its own information
state (it depends on what its partner said), so its per-agent exploitability
stays empirical. As a pair, though, their play is a function of the *team's*
information state, and that function is the policy file itself: the joint
policy can be asked exactly, on the team game's tree.

The pair plays the file's rows exactly, and nothing else, when three things
hold, and only then is a number given (``exact_coalition`` says which failed):

* every member is ``kuhn-team`` with the same team policy (the same file, the
  same ``meta.team`` seats), as many members as the policy's team;
* the members sit at the policy's team seats (a league rotates seats: at other
  seats the agents do not find their rows, or do not talk, and play a mix);
* the coalition's channel opens at ``start``: every member tells its card after
  the deal, before the first move, so no one acts uninformed (with
  ``before_act`` the first colluder to move has heard nothing yet).

The number: ``value − min_C u_team(τ, C)``, where ``τ`` is the joint policy (the
file's rows on the team tree; a key it lacks plays uniformly, as the agent
does), ``min_C`` the other seat best-responding (``S − BR_C``, ``S`` the game's
return sum) and ``value`` the team game's value as the league's coalition gain
reads it (CFR+ team solve, ``grounded.TEAM_ITERATIONS``, its ``guaranteed_value``).
It is the team game's exploitability of the coalition's side: what a best
responding opponent takes from the pair beyond what the best joint policy
concedes. The shipped ``kuhn_loki_team`` is that solve's output, so it reads
about 0 (its rows are rounded to six decimals); a pair playing worse reads more.
Only a team game with a single opponent (Loki: two colluders, one other seat)
has one best response to measure against.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The kind whose pairs play a joint policy that can be asked.
TEAM_KIND = "kuhn-team"
#: The channel opening under which every member knows its partners' cards before acting.
INFORMED_OPENING = "start"


@dataclass(frozen=True)
class TeamPolicy:
    """A team policy file's joint rows and the seats its solve teamed up."""

    seats: tuple[int, ...]
    rows: dict[str, dict[str, float]]


def team_policy(kind: str, options: dict[str, Any]) -> TeamPolicy | str:
    """The joint policy a ``kuhn-team`` agent plays, or why ``kind``/``options`` play none."""
    from backroom.agents.scripted.kuhn_team import DEFAULT_POLICY
    from backroom.solvers.policy_file import read_policy

    if kind != TEAM_KIND:
        return f"kind {kind!r} plays no joint policy (only {TEAM_KIND} does)"
    source = options.get("policy", DEFAULT_POLICY)
    try:
        data = source if isinstance(source, dict) else read_policy(str(source))
    except (OSError, ValueError) as exc:
        return f"its policy {source!r} cannot be read ({exc})"
    meta = data.get("meta") or {}
    if meta.get("kind") != "team" or len(meta.get("team") or []) < 2:
        return f"policy {source!r} is no team policy"
    return TeamPolicy(tuple(int(s) for s in meta["team"]), dict(data.get("policy") or {}))


def joint_policy(members: Sequence[tuple[str, dict[str, Any]]], opens: str) -> TeamPolicy | str:
    """The members' (kind, options) joint policy, or why they do not play one exactly."""
    policies = [team_policy(kind, options) for kind, options in members]
    if why := next((p for p in policies if isinstance(p, str)), None):
        return why
    first = policies[0]
    assert isinstance(first, TeamPolicy)
    if any(p != first for p in policies[1:]):
        return "the members play different team policies"
    if len(first.seats) != len(members):
        return f"the policy teams {len(first.seats)} seats, the coalition has {len(members)}"
    if opens != INFORMED_OPENING:
        return (
            f"the channel opens {opens!r}, not {INFORMED_OPENING!r}: a member may act before "
            "it hears its partners' cards, and then plays no row of the joint policy"
        )
    return first


def joint_sigma(tree: Any, policy: TeamPolicy) -> Any:
    """The team tree's profile with the team playing ``policy``'s rows as the agents weigh
    them (a row's negative or missing entries count 0; no row, or all zero: uniform)."""
    import numpy as np

    from backroom.solvers.team import TEAM

    sigma = tree.uniform()
    for i in tree.real_infosets():
        if int(tree.infoset_player[i]) != TEAM:
            continue
        row = policy.rows.get(tree.infoset_key[i]) or {}
        weights = np.array(
            [max(0.0, float(row.get(json.dumps(a), 0.0))) for a in tree.infoset_actions[i]]
        )
        if weights.sum() > 0:
            s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
            sigma[s : s + k] = weights / weights.sum()
    return sigma


def guaranteed_value(game: Any, policy: TeamPolicy) -> float:
    """``min_C u_team(τ, C)``: the joint policy's return sum when the other seat best-responds
    (NaN where the team game has no single opponent or no constant return sum)."""
    from backroom.solvers.evaluate import best_response
    from backroom.solvers.team import build_team_tree

    tree = build_team_tree(game, policy.seats)
    info = tree.info
    if tree.num_players != 2 or info is None or info.utility_sum is None:
        return float("nan")
    br, _ = best_response(tree, joint_sigma(tree, policy), 1)
    return float(info.utility_sum - br)


def exact_coalition(
    game: Any,
    members: Sequence[tuple[str, dict[str, Any]]],
    opens: str,
    team_value: Any,
) -> dict[str, Any]:
    """The coalition's exact entry: ``{"exploitability", "guaranteed", "team_value", "seats"}``,
    or ``{"why": ...}`` where its joint policy cannot be asked. ``team_value(seats)`` is the
    team game's value at those seats (``grounded.TeamValues``: solved once per league)."""
    policy = joint_policy(members, opens)
    if isinstance(policy, str):
        return {"why": policy}
    guaranteed = guaranteed_value(game, policy)
    value = float(team_value(policy.seats))
    if math.isnan(guaranteed) or math.isnan(value):
        return {"why": "the team game has more than one opponent: no single best response"}
    return {
        "exploitability": value - guaranteed,
        "guaranteed": guaranteed,
        "team_value": value,
        "seats": list(policy.seats),
    }
