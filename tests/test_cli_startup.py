"""``backroom --help`` and every subcommand's ``--help`` start at once (issue 37 item 4).

Every typo costs a ``--help``'s start: at 2 s idle (5 s on a loaded machine)
the CLI imported torch's neighbours, numpy, the bus and the solvers before it
printed a line. The command modules now import those inside the commands;
this reads ``python -X importtime`` of each help and fails on any module of
``HEAVY``. Times are bench/cli_startup.py's (docs/speed.md), not a test's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: What ``--help`` must not import: the model stack, the solvers' numpy, the bus client and
#: its wire, the runner, the agents, the trainer, the analysis, metrics' server.
HEAVY = (
    "torch",
    "transformers",
    "peft",
    "trl",
    "pyspiel",
    "open_spiel",
    "numpy",
    "matplotlib",
    "aiomqtt",
    "paho",
    "httpx",
    "prometheus_client",
    "backroom.trainer",
    "backroom.model",
    "backroom.solvers",
    "backroom.runner",
    "backroom.agents",
    "backroom.referee",
    "backroom.analysis",
    "backroom.league",
    "backroom.human",
    "backroom.bus.client",
    "backroom.bus.wire",
    "backroom.bus.broker",
    "backroom.games",  # light, but 50 ms of engines: only `solve game --help` lists them
    "asyncio",  # 40 ms with ssl and concurrent.futures: a help runs no event loop
)

#: What not even ``backroom agent --help`` imports: it lists the agent kinds, so it imports
#: their modules (numpy for ``cfr``, httpx for ``llm``, the wire), and nothing more.
MODEL_STACK = ("torch", "transformers", "peft", "trl", "pyspiel", "open_spiel", "backroom.trainer")

SUBCOMMANDS = (
    [],
    ["demo"],
    ["run"],
    ["analyze"],
    ["train"],
    ["league"],
    ["eval"],
    ["solve"],
    ["solve", "kuhn"],
    ["solve", "game"],
    ["solve", "evaluate"],
    ["solve", "collusion"],
    ["solve", "team"],
    ["broker"],
    ["referee"],
    ["agent"],
    ["agent-host"],
    ["serve-model"],
    ["web"],
    ["replay"],
    ["health"],
    ["credentials"],
    ["credentials", "add"],
    ["credentials", "remove"],
    ["credentials", "list"],
    ["compose-init"],
)


def imported_at_help(args: list[str]) -> tuple[set[str], str]:
    """The modules ``python -m backroom ARGS --help`` imports, and what it printed."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "backroom", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return modules, proc.stdout


def heavy(modules: set[str], names: tuple[str, ...] = HEAVY) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in names))


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda a: " ".join(a) or "backroom")
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    modules, out = imported_at_help(args)
    assert "Usage" in out
    assert "backroom.cli" in modules  # the importtime lines were read
    if args == ["agent"]:  # its help is the list of kinds: made when it is drawn
        assert heavy(modules, MODEL_STACK) == []
        assert "kuhn-colluder" in out and "tit-for-tat" in out
        return
    if args == ["solve", "game"]:  # its help is the list of games: made when it is drawn
        assert "trust_and_split" in out
        modules -= {m for m in modules if m.startswith("backroom.games")}
    assert heavy(modules) == []
    assert "backroom.agents.kinds" not in modules


def test_every_command_is_in_the_list() -> None:
    """A command added to the CLI without a line above would go unchecked."""
    import typer.main

    from backroom.cli import app

    group = typer.main.get_command(app)
    listed = {tuple(a) for a in SUBCOMMANDS}
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        assert (name,) in listed, name
        for sub in getattr(cmd, "commands", {}):
            assert (name, sub) in listed, (name, sub)


def test_defaults_repeated_for_help_agree_with_their_source() -> None:
    """``--help`` shows the bus's port, the solvers' algorithms and node bound without
    importing them: the copies must be what the bus and the solvers use."""
    from backroom.bus.broker import DEFAULT_PORT
    from backroom.cli import common, solve
    from backroom.solvers.cfr import ALGOS
    from backroom.solvers.tree import DEFAULT_MAX_NODES

    assert common.DEFAULT_PORT == DEFAULT_PORT
    assert solve.ALGO_NAMES == ALGOS
    assert solve.DEFAULT_MAX_NODES == DEFAULT_MAX_NODES


def test_a_command_still_imports_what_it_needs() -> None:
    """Lazy imports move the cost, not the checks: ``run`` of a bad config still says so."""
    proc = subprocess.run(
        [sys.executable, "-m", "backroom", "run", "no/such/config.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "cannot read config no/such/config.yaml" in proc.stdout + proc.stderr
