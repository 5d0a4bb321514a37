"""backroom: games with talk between AI agents over an MQTT bus.

One CLI starts every process of the stack (broker, referee, agents), on one
machine or many. Start with "backroom demo", then "backroom run CONFIG".

Connection settings come from options or from the environment that the
runner passes its children: BACKROOM_BROKER (mqtt://host:port),
BACKROOM_USERNAME and BACKROOM_PASSWORD; or --credentials DIR, the
directory of a broker's credentials.json.
"""

# This file is the whole command list: each command is a function of the module for its
# concern (run.py, analyze.py, train.py, league.py, processes.py, credentials.py, solve.py), mounted
# here; common.py holds what they share. The docstring above is `backroom --help`.

from __future__ import annotations

import typer

from backroom.cli import analyze, credentials, evaluate, league, processes, run, solve, train

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

# Playing and reading runs.
app.command()(run.demo)
app.command("run")(run.run_cmd)
app.command()(analyze.analyze)
app.command("train")(train.train_cmd)
app.command()(league.league)
app.command("eval")(evaluate.evaluate)
app.add_typer(
    solve.solve_app,
    name="solve",
    help="CFR solvers, exploitability and the Loki collusion analysis.",
)

# The processes of a stack, one command each.
app.command()(processes.broker)
app.command()(processes.referee)
app.command(cls=processes.AgentHelp)(processes.agent)  # --help lists the kinds
app.command("agent-host", hidden=True)(processes.agent_host)
app.command("serve-model")(processes.serve_model)
app.command()(processes.web)
app.command()(processes.replay)
app.command()(processes.health)

# Identities on a broker.
app.add_typer(credentials.credentials_app, name="credentials")
app.command("compose-init")(credentials.compose_init)


def main() -> None:
    """``python -m backroom`` (backroom/__main__.py); the console script calls ``app``."""
    app()
