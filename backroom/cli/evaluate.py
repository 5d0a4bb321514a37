"""``backroom eval AGENTS... --game G``: exact numbers for agents whose policy can be asked.

No match is played: the game's tree is enumerated once, each agent is asked
its policy at every information state (``backroom.league.policies``), and the
numbers are computed on the tree: each agent's exploitability and NashConv
(and OpenSpiel's exploitability of the same table where OpenSpiel has the
game), and for a two-seat game the exact meta-game with its Nash averaging
and α-Rank. Heavy modules (torch for ``local`` agents, numpy, scipy,
OpenSpiel) are imported when the command runs, not when the CLI starts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from backroom.cli.common import console, fail, require_kind


def parse_agent(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``[ID=]KIND[:JSON]`` -> (id, kind, options); the id defaults to the kind."""
    head, _, options = spec.partition(":")
    agent_id, _, kind = head.rpartition("=")
    kind = kind.strip()
    try:
        opts = json.loads(options) if options else {}
    except json.JSONDecodeError as e:
        fail(f"{spec}: the options after ':' must be a JSON object ({e.msg})")
    if not kind or not isinstance(opts, dict):
        fail(
            f"{spec}: name an agent as [ID=]KIND[:JSON options], e.g. bet=always:"
            + '{"action": "bet"}'
        )
    return agent_id or kind, kind, opts


def evaluate(
    agents: Annotated[
        list[str],
        typer.Argument(
            help='[ID=]KIND[:JSON], e.g. cfr:{"variant": "classic"} bet=always:{"action": "bet"}'
        ),
    ],
    game: Annotated[str, typer.Option("--game", "-g", help="the game (as in run configs)")],
    params: Annotated[str, typer.Option(help="the game's parameters, one JSON object")] = "{}",
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
    max_nodes: Annotated[
        int, typer.Option("--max-nodes", min=1, help="refuse games with more histories")
    ] = 200_000,  # league.policies.MAX_NODES: the bound a league asks models within too
) -> None:
    """Exact exploitability (and, for two-seat games, the exact meta-game) without playing."""
    import asyncio

    try:
        game_params = json.loads(params)
    except json.JSONDecodeError as e:
        fail(f"--params: not JSON ({e.msg})")
    specs = [parse_agent(s) for s in agents]
    ids = [s[0] for s in specs]
    if len(set(ids)) != len(ids):
        fail(f"agent ids must differ: {', '.join(ids)} (name them ID=KIND)")
    for _, kind, opts in specs:
        require_kind(kind, opts)
    from backroom.league.policies import NotAskable, info_states
    from backroom.solvers.tree import TreeTooLargeError

    try:
        states = info_states(game, game_params, max_nodes)
    except (TreeTooLargeError, ValueError, TypeError) as e:
        fail(f"{game} {game_params}: {e}")
    try:
        doc = asyncio.run(_evaluate(specs, states))
    except (NotAskable, ValueError) as e:
        fail(str(e))
    doc.update(game=game, params=game_params)
    if as_json:
        typer.echo(json.dumps(doc, indent=1))
    else:
        _print(doc)


async def _evaluate(specs: list[tuple[str, str, dict[str, Any]]], states: Any) -> dict[str, Any]:
    from backroom.agents.kinds import make_agent
    from backroom.league.policies import ask_policy, exact_exploitability, exact_metagame
    from backroom.solvers.metagame import alpharank, alpharank_available, nash_averaging

    policies = {}
    rows = []
    for agent_id, kind, opts in specs:
        agent = make_agent(kind, agent_id, **opts)
        await agent.setup()
        try:
            policies[agent_id] = await ask_policy(agent, states)
        finally:
            await agent.close()
        e = exact_exploitability(agent_id, policies[agent_id], states)
        rows.append(
            {
                "agent": agent_id,
                "exploitability": e.value,
                "nash_conv": e.nash_conv,
                "openspiel": e.openspiel,
                "states": e.states,
            }
        )
    doc: dict[str, Any] = {"agents": rows, "policies": policies}
    if states.tree.num_players == 2 and len(specs) > 1:
        m = exact_metagame(policies, states)
        rating, mass = nash_averaging(m)
        doc["metagame"] = {
            "agents": list(policies),
            "mean": [[None if x != x else float(x) for x in row] for row in m],
            "nash_averaging": [float(x) for x in rating],
            "nash_mass": [float(x) for x in mass],
            "alpharank": None if alpharank_available() else [float(x) for x in alpharank(m)],
        }
        if states.tree.info.zero_sum:
            doc["metagame"]["gain"] = _gains(m, policies, states)
    return doc


def _gains(m: Any, policies: dict[str, Any], states: Any) -> list[float]:
    """Each agent's gain over the equilibrium against the others (``league/grounded.py``), exact."""
    from backroom.league.policies import equilibrium, pair_value

    tree = states.tree
    star = equilibrium(tree)
    eq = [pair_value(tree, star, tree.sigma_from_policy(p)) for p in policies.values()]
    n = len(eq)
    return [float(sum(m[i][j] - eq[j] for j in range(n) if j != i) / (n - 1)) for i in range(n)]


def _print(doc: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"{doc['game']} {doc['params']}: exact, every policy asked at every state")
    for col in ("agent", "exploitability", "NashConv", "OpenSpiel", "states asked"):
        table.add_column(col, justify="left" if col == "agent" else "right")
    for r in doc["agents"]:
        spiel = "-" if r["openspiel"] is None else f"{r['openspiel']:.4f}"
        table.add_row(
            r["agent"],
            f"{r['exploitability']:.4f}",
            f"{r['nash_conv']:.4f}",
            spiel,
            str(r["states"]),
        )
    console.print(table)
    meta = doc.get("metagame")
    if not meta:
        return
    table = Table(title="exact meta-game: row's expected return against column (both seat orders)")
    table.add_column("")
    for a in meta["agents"]:
        table.add_column(a, justify="right")
    for cols in ("Nash avg", "Nash mass", "α-Rank", "gain over eq."):
        table.add_column(cols, justify="right")
    alpha = meta["alpharank"] or [None] * len(meta["agents"])
    gain = meta.get("gain") or [None] * len(meta["agents"])
    for i, a in enumerate(meta["agents"]):
        cells = [f"{x:.4f}" for x in meta["mean"][i]]
        table.add_row(
            a,
            *cells,
            f"{meta['nash_averaging'][i]:.4f}",
            f"{meta['nash_mass'][i]:.3f}",
            "-" if alpha[i] is None else f"{alpha[i]:.3f}",
            "-" if gain[i] is None else f"{gain[i]:.4f}",
        )
    console.print(table)
