"""``backroom solve ...``: solve games, score policy files, run the collusion analysis.

Mounted by the CLI (``backroom/cli/__init__.py``) as ``app.add_typer(solve_app, name="solve")``::

    backroom solve kuhn --variant loki --iterations 100000 --algo cfr+ --out loki.json
    backroom solve game kuhn -p variant=classic -p players=3 --iterations 20000
    backroom solve evaluate loki.json
    backroom solve collusion --iterations 100000 --out-dir results/collusion
    backroom solve team --out backroom/policies/kuhn_loki_team.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from backroom.cli.common import listing_help

#: ``solvers.cfr.ALGOS`` and ``solvers.tree.DEFAULT_MAX_NODES``, repeated for ``--help``: the
#: solvers import numpy, which ``--help`` does not need (tests/test_cli_startup.py checks
#: that these agree with the solvers').
ALGO_NAMES = ("cfr", "cfr+", "linear", "dcfr")
DEFAULT_MAX_NODES = 2_000_000

solve_app = typer.Typer(
    help="CFR solvers, exploitability / NashConv, collusion analysis.", no_args_is_help=True
)

AlgoOpt = Annotated[str, typer.Option("--algo", help=f"one of {', '.join(ALGO_NAMES)}")]
ItersOpt = Annotated[int, typer.Option("--iterations", "-n", min=1, help="CFR iterations")]
OutOpt = Annotated[
    Path | None, typer.Option("--out", "-o", help="write the average policy here (JSON)")
]
SimOpt = Annotated[
    bool,
    typer.Option("--simultaneous", help="update all players from one pass (default: alternating)"),
]
MaxNodesOpt = Annotated[int, typer.Option("--max-nodes", help="refuse games with more histories")]


def _check_algo(algo: str) -> None:
    from backroom.solvers.cfr import ALGOS

    if algo not in ALGOS:
        raise typer.BadParameter(f"--algo must be one of {ALGOS}")


def _parse_params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"expected key=value, got {item!r}")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def _run(
    name: str,
    params: dict[str, Any],
    iterations: int,
    algo: str,
    out: Path | None,
    simultaneous: bool,
    max_nodes: int,
) -> None:
    from backroom.solvers.cfr import policy_document, solve_game
    from backroom.solvers.policy_file import write_policy

    _check_algo(algo)
    try:
        result = solve_game(
            name, params, iterations, algo, alternating=not simultaneous, max_nodes=max_nodes
        )
    except ValueError as exc:  # unknown game, bad params, too large, not perfect recall
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    doc = policy_document(result)
    meta = doc["meta"]
    typer.echo(f"{name} {json.dumps(doc['params'])}: {meta['tree']}")
    typer.echo(
        f"{algo} x {iterations} in {result.seconds:.2f}s ({iterations / max(result.seconds, 1e-9):,.0f} it/s)"
    )
    typer.echo("values: " + ", ".join(f"p{i} {v:+.6f}" for i, v in enumerate(meta["values"])))
    typer.echo(f"NashConv: {meta['nash_conv']:.3g}")
    if out is not None:
        write_policy(out, doc)
        typer.echo(f"policy -> {out}")


@solve_app.command("kuhn")
def kuhn(
    variant: Annotated[str, typer.Option(help="classic (OpenSpiel) or loki")] = "classic",
    players: Annotated[int | None, typer.Option(help="classic only: number of players")] = None,
    iterations: ItersOpt = 10_000,
    algo: AlgoOpt = "cfr+",
    out: OutOpt = None,
    simultaneous: SimOpt = False,
    max_nodes: MaxNodesOpt = DEFAULT_MAX_NODES,
) -> None:
    """Solve Kuhn poker (classic n-player or the Loki variant) and write the policy."""
    params: dict[str, Any] = {"variant": variant}
    if players is not None:
        params["players"] = players
    _run("kuhn", params, iterations, algo, out, simultaneous, max_nodes)


def _game_names() -> list[str]:
    from backroom.games import registered_games

    return list(registered_games())


@solve_app.command("game", cls=listing_help("name", _game_names))  # --help lists the games
def game(
    name: Annotated[str, typer.Argument(help="a registered game (--help lists them)")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="key=value (JSON value)")
    ] = None,
    iterations: ItersOpt = 10_000,
    algo: AlgoOpt = "cfr+",
    out: OutOpt = None,
    simultaneous: SimOpt = False,
    max_nodes: MaxNodesOpt = DEFAULT_MAX_NODES,
) -> None:
    """Solve any registered game small enough to enumerate."""
    _run(name, _parse_params(param or []), iterations, algo, out, simultaneous, max_nodes)


@solve_app.command("evaluate")
def evaluate(
    policy: Annotated[Path, typer.Argument(help="a policy file (JSON or YAML)")],
) -> None:
    """Expected returns, best-response values and NashConv of a policy file."""
    from backroom.games.base import make_game
    from backroom.solvers.evaluate import best_response_values, expected_returns, nash_conv
    from backroom.solvers.policy_file import read_policy
    from backroom.solvers.tree import build_tree

    data = read_policy(policy)
    tree = build_tree(make_game(data["game"], **data.get("params", {})))
    sigma = tree.sigma_from_policy(data["policy"])
    missing = sum(1 for i in tree.real_infosets() if tree.infoset_key[i] not in data["policy"])
    values, br = expected_returns(tree, sigma), best_response_values(tree, sigma)
    for p in range(tree.num_players):
        typer.echo(
            f"p{p}: value {values[p]:+.6f}  best response {br[p]:+.6f}  gain {br[p] - values[p]:.3g}"
        )
    typer.echo(f"NashConv: {nash_conv(tree, sigma):.6g}")
    if missing:
        typer.echo(
            f"warning: {missing} information states are missing (played uniformly)", err=True
        )


@solve_app.command("collusion")
def collusion(
    iterations: ItersOpt = 20_000,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="where to write results")] = Path(
        "collusion"
    ),
    algo: AlgoOpt = "cfr+",
    team: Annotated[str, typer.Option(help="colluding seats, comma separated")] = "0,1",
    episodes: Annotated[
        list[str] | None,
        typer.Option(help="LABEL=RUN_DIR: a Table 1 row measured from a run's Loki episodes"),
    ] = None,
    cfr_policy: Annotated[
        str | None,
        typer.Option(
            "--cfr-policy",
            help="a Loki policy file (or shipped name, e.g. kuhn_loki_cfr) to use as the "
            "three-player CFR baseline instead of solving it; picks the equilibrium",
        ),
    ] = None,
) -> None:
    """Loki's CFR analyses: all-CFR vs team-CFR per deal, Figure 2 heatmaps, Table 1.

    Readings, each against the all-CFR baseline: the team solve (colluders
    share cards), the team strategy vs an unaware C, the team's best response,
    the team strategy distilled to own cards, and the paper's construction
    (Algorithm 3 on the colluders' individual CFR strategies).
    """
    from backroom.games.base import make_game
    from backroom.runs import read_episodes
    from backroom.solvers.collusion import READINGS, analyse_collusion, why_different, write_report

    measured = {}
    for item in episodes or []:
        label, _, run_dir = item.partition("=")
        if not run_dir:
            raise typer.BadParameter(f"--episodes wants LABEL=RUN_DIR, not {item!r}")
        measured[label] = [r for r in read_episodes(run_dir) if r.get("game") == "kuhn"]
    seats = tuple(int(s) for s in team.split(","))
    baseline = None
    if cfr_policy is not None:
        from backroom.solvers.policy_file import read_policy

        try:
            doc = read_policy(cfr_policy)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if doc.get("game") != "kuhn" or doc.get("params", {}).get("variant") != "loki":
            raise typer.BadParameter(f"--cfr-policy {cfr_policy} is not a Loki Kuhn policy")
        baseline = doc["policy"]
    report = analyse_collusion(
        make_game("kuhn", variant="loki"), iterations, team=seats, algo=algo, cfr_policy=baseline
    )
    files = write_report(report, out_dir, measured)
    s = report.summary
    typer.echo(
        f"3-player CFR NashConv {s['cfr_nash_conv']:.3g}; team game exploitability {s['team_game_exploitability']:.3g}"
    )
    typer.echo(
        f"team value (R_A+R_B): {s['team_value_sum']:+.4f}; vs all-CFR {sum(s['mean_values']['cfr'][i] for i in seats):+.4f}"
    )
    for name, adv in s["average_advantage"].items():
        typer.echo(
            f"average collusion advantage ({name} - cfr), coalition payoff (R_A+R_B)/2: "
            f"{adv:+.4f}  [{READINGS.get(name, name)}]"
        )
    typer.echo(f"paper: {s['paper_average_advantage']}")
    typer.echo(why_different(report))
    typer.echo(files["table"].read_text())
    typer.echo(_beside_analyze(cfr_policy, iterations, algo))
    for key, path in files.items():
        typer.echo(f"{key}: {path}")


def _beside_analyze(cfr_policy: str | None, iterations: int, algo: str) -> str:
    """Why this Table 1 may differ from ``backroom analyze``'s in the second decimal.

    Three-player Kuhn has many equilibria: a CFR solved here is another one than the
    shipped policy ``analyze`` (and the demo's carol) uses, and C's chips differ with it
    (3.06 against 3.04 on [0, 1, 4] with the defaults).
    """
    from backroom.analysis.kuhn import TEAM_ITERATIONS

    shipped = cfr_policy in ("kuhn_loki_cfr", "kuhn_loki_cfr.json")
    if shipped and iterations == TEAM_ITERATIONS and algo == "cfr+":
        return "these are backroom analyze's numbers: the shipped CFR policy and its team solve"
    return (
        f"backroom analyze's Table 1 uses the shipped CFR policy kuhn_loki_cfr (what the demo's "
        f"carol plays) and a {TEAM_ITERATIONS:,}-iteration CFR+ team solve, so its numbers may "
        f"differ in the second decimal; --cfr-policy kuhn_loki_cfr --iterations "
        f"{TEAM_ITERATIONS} --algo cfr+ gives them exactly"
    )


@solve_app.command("team")
def team_cmd(
    variant: Annotated[str, typer.Option(help="classic (OpenSpiel) or loki")] = "loki",
    team: Annotated[str, typer.Option(help="colluding seats, comma separated")] = "0,1",
    iterations: ItersOpt = 5000,
    algo: AlgoOpt = "cfr+",
    out: OutOpt = None,
    digits: Annotated[
        int, typer.Option(min=1, help="decimals kept per probability in the file")
    ] = 6,
) -> None:
    """The colluders' joint strategy of the Kuhn team solve, as the `kuhn-team` agent plays it.

    The same solve as `backroom analyze`'s "team game's value" reading (CFR+,
    5,000 iterations by default); backroom/policies/kuhn_loki_team.json is
    this command's output for the Loki rules.
    """
    from backroom.games.base import make_game
    from backroom.solvers.policy_file import write_policy
    from backroom.solvers.team import solve_team, team_policy_document

    _check_algo(algo)
    try:
        seats = tuple(int(s) for s in team.split(","))
        solution = solve_team(make_game("kuhn", variant=variant), seats, iterations, algo)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    doc = team_policy_document(solution, digits)
    meta = doc["meta"]
    typer.echo(
        f"team {list(seats)}: {algo} x {iterations}; team value (sum of the colluders' "
        f"returns) {meta['team_value_sum']:+.4f}; team game exploitability "
        f"{meta['team_game_exploitability']:.3g}; {len(doc['policy'])} team information sets"
    )
    if out is not None:
        write_policy(out, doc)
        typer.echo(f"policy -> {out}")
