"""What every command of the CLI shares: its console, its options, its refusals, its serving.

A command module (``run.py``, ``train.py``, ...) imports from here and from
nothing else of the CLI (a contract in pyproject.toml), so each reads alone.

Every module of the CLI is imported for ``backroom --help`` and for every
subcommand's ``--help``, so at its top it imports only typer, rich's console
and the standard library: the bus, pydantic, numpy, the solvers and the model
stack are imported inside the commands that use them (tests/test_cli_startup.py
holds the list of what ``--help`` must not load; docs/speed.md its time).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperArgument, TyperCommand

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Iterable

    from typer._click import Context, HelpFormatter

    from backroom.bus.client import BusConfig

#: ``backroom.bus.broker.DEFAULT_PORT``, repeated here so that an option's default shown by
#: ``--help`` does not import the bus (tests/test_cli_startup.py checks that they agree).
DEFAULT_PORT = 1884

PIPED_WIDTH = 200
#: Piped or redirected, rich would lay tables out for 80 columns and cut their headers; a
#: log file has no width, so the lines keep what they hold (COLUMNS still wins).
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH)


def _broker_url(url: str | None) -> str | None:
    """Refuse a URL that is not MQTT's where it is typed, not in a traceback from the bus."""
    if url is not None:
        from backroom.bus.client import BusConfig

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


def listing_help(argument: str, names: Callable[[], Iterable[str]]) -> type[TyperCommand]:
    """A command class whose ``--help`` says "one of: ..." of ``names()`` for ``argument``.

    The names of the agent kinds and of the games are known by importing their
    modules (numpy, httpx, the wire's pydantic models), which ``backroom
    --help`` and every other command's help must not pay for: the list is made
    when this command's help is drawn, not when the CLI starts. Mount with
    ``app.command(cls=listing_help("kind", kinds))``.
    """

    class ListingHelp(TyperCommand):
        def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
            for param in self.params:
                if param.name == argument and isinstance(param, TyperArgument):
                    param.help = f"one of: {', '.join(names())}"
            super().format_help(ctx, formatter)

    return ListingHelp


def fail(message: str) -> NoReturn:
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
        root = Path(__file__).resolve().parents[2]
        target = (
            f"-e '{root}[{extra}]'"
            if (root / "pyproject.toml").exists()
            else f"'backroom[{extra}]'"
        )
        fail(
            f'{what} needs the "{extra}" extra ({", ".join(missing)} not installed): '
            f"pip install {target}{INSTALL_HINTS.get(extra, '')}"
        )


def require_kind(kind: str, options: dict[str, Any] | None = None) -> None:
    """Refuse an agent kind whose extra or default model is missing, before anything starts."""
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
        fail(f"{what} has no model given, and {exc}")


def setup_logging(verbose: bool = False) -> None:
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


#: The environment variable holding the *path* of a file with the password (``backroom run``
#: starts its processes so: ``backroom.runner.stack.PASSWORD_FILE_ENV``).
PASSWORD_FILE_ENV = "BACKROOM_PASSWORD_FILE"


def read_password_file(path: Path) -> str:
    """The password in ``path`` (its first line), or a one-line refusal naming the file."""
    try:
        return path.read_text().splitlines()[0]
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        raise typer.BadParameter(f"password file {path}: cannot read a password ({exc})") from None


def bus_config(
    broker: str | None,
    username: str,
    creds: Path | None,
    pattern: str | None = None,
    password_file: Path | None = None,
) -> BusConfig:
    """``pattern``: the ``{n}`` pool ``username`` is of; ``BACKROOM_PASSWORD`` (or the file
    ``BACKROOM_PASSWORD_FILE`` names) serves its names; ``password_file`` is this one's."""
    from backroom.bus.auth import CredentialStore
    from backroom.bus.broker import DEFAULT_URL
    from backroom.bus.client import BusConfig

    password = None
    if os.environ.get("BACKROOM_USERNAME", pattern or username) == (pattern or username):
        password = os.environ.get("BACKROOM_PASSWORD")
        if password is None and os.environ.get(PASSWORD_FILE_ENV):
            password = read_password_file(Path(os.environ[PASSWORD_FILE_ENV]))
    if password_file is not None:
        password = read_password_file(password_file)
    if creds is not None:
        try:
            password = CredentialStore(creds).get(username).password
        except KeyError as exc:
            raise typer.BadParameter(str(exc.args[0])) from None
    if password is None:
        raise typer.BadParameter(
            f"no password for {username!r}: set BACKROOM_PASSWORD, pass --password-file FILE "
            "or --credentials DIR"
        )
    return BusConfig.from_url(broker or DEFAULT_URL, username=username, password=password)


def stop_on_first_sigint(notice: Callable[[], None]) -> asyncio.Event:
    """An event the first Ctrl-C sets (after ``notice()``); a second one interrupts at once.

    ``run`` and ``league`` end on the first Ctrl-C with what was finished so far,
    summarised as such, and restore Python's handler so that a second Ctrl-C
    quits without waiting. Call it inside the running loop.
    """
    import asyncio  # here, not at the top: --help needs no event loop (test_cli_startup.py)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def first_sigint() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        notice()

    loop.add_signal_handler(signal.SIGINT, first_sigint)
    return stop


#: How long a service may take to clean up after SIGTERM/SIGINT before it is ended anyway.
SHUTDOWN_GRACE_S = 5.0


def serve_until_signal(coro: Any, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Run a service until SIGTERM/SIGINT, then let its context managers clean up.

    Cleaning up is bounded: a process stuck in a publish storm or a handler
    that swallows cancellation must not linger holding its MQTT identity
    (its will then tells the others it is gone). A thread, not the event
    loop, keeps the deadline, so a busy loop cannot delay it; a second
    signal ends the process at once.
    """
    import asyncio

    from backroom.bus.client import BusError, run

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
    except BusError as exc:  # a refused login, no broker: one line, its words not markup
        from rich.text import Text

        console.print(Text.assemble(("error:", "red"), f" {exc}"), soft_wrap=True)
        raise typer.Exit(2) from None


def _give_up(grace_s: float) -> None:
    sys.stderr.write(f"backroom: still cleaning up {grace_s:.0f} s after the signal; exiting now\n")
    sys.stderr.flush()
    os._exit(1)
