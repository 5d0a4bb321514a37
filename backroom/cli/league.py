"""``backroom league CONFIG.yaml`` plays a league; ``backroom league show DIR`` shows one.

One command, not a group: ``league CONFIG`` is what a user types most, and a
group could not take a config path in front of its subcommand. Everything
heavy is imported when the command runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from backroom.cli.common import BrokerOpt, CredsOpt, console, stop_on_first_sigint

SHOW = "show"


def league(
    target: Annotated[
        str, typer.Argument(help="a league config (YAML) to play, or `show` to show DIR")
    ],
    directory: Annotated[
        Path | None,
        typer.Argument(help="show: the league directory (leagues/<league>)"),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--dir", help="the league directory (default leagues/<league>)"),
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="go on with the league in --dir: play what is not counted")
    ] = False,
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    spawn: Annotated[bool, typer.Option(help="start the referees and agents")] = True,
    metrics_port: Annotated[
        int,
        typer.Option(
            "--metrics-port", help="P: the league's gauges on P, referee and agents on P+1, ..."
        ),
    ] = 0,
    ready_timeout: Annotated[float, typer.Option(min=0.1)] = 60.0,
    plots: Annotated[bool, typer.Option(help="show: write PNG plots to DIR/plots")] = True,
    refresh: Annotated[
        bool, typer.Option(help="show: recompute the standings from the store first")
    ] = False,
    hold: Annotated[
        bool,
        typer.Option(
            help="after the league, keep serving its rating gauges until stopped (compose)"
        ),
    ] = False,
) -> None:
    """Rate agents against each other: play a league (CONFIG.yaml) or show one (show DIR)."""
    if target == SHOW:
        if directory is None:
            raise typer.BadParameter("`backroom league show DIR` needs the league directory")
        show(directory, plots, refresh, console)
        return
    if directory is not None:
        raise typer.BadParameter(f"a league plays into --dir DIR, not {directory}")
    if not spawn and broker_url is None:
        raise typer.BadParameter("--no-spawn needs --broker and --credentials of the stack")
    play(
        Path(target),
        out,
        resume,
        broker_url,
        credentials,
        spawn,
        metrics_port,
        ready_timeout,
        hold,
        console,
    )


#: Where a league's tracking failures are said (logged as warnings while it plays).
WARNINGS = "the warnings above"


def _plots_for(tracking: bool) -> Callable[[dict[str, Any], Path], list[str]] | None:
    """With tracking on, the league draws ``show``'s plots at its end and logs them."""
    if not tracking:
        return None
    from backroom.analysis.league import plot_standings

    return plot_standings


def show(directory: Path, plots: bool, refresh: bool, console: Console) -> None:
    from backroom.analysis.league import plot_standings, print_standings
    from backroom.league.standings import read_standings, refresh_standings

    try:
        doc = refresh_standings(directory) if refresh else read_standings(directory)
    except (FileNotFoundError, ValueError) as exc:  # ValueError: a store's config refused
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    print_standings(doc, console)
    if plots:
        for path in plot_standings(doc, directory / "plots"):
            console.print(f"plot: {path}")


def play(
    path: Path,
    out: Path | None,
    resume: bool,
    broker_url: str | None,
    credentials: Path | None,
    spawn: bool,
    metrics_port: int,
    ready_timeout: float,
    hold: bool,
    console: Console,
) -> None:
    from backroom import metrics
    from backroom.bus.broker import BrokerError
    from backroom.bus.client import run
    from backroom.bus.errors import BusError
    from backroom.league.config import load_league
    from backroom.league.handoff import with_handed_entrants
    from backroom.league.play import LeagueError, run_league
    from backroom.runner.config import ConfigError

    try:
        config = load_league(path)
    except ConfigError as exc:
        console.print(f"[red]bad league config:[/red] {exc}")
        raise typer.Exit(2) from None
    directory = out or Path("leagues") / config.league

    def refused(line: str) -> None:  # a hostile or stale file: set aside, the league goes on
        console.print(f"refused: {line}", style="yellow", markup=False, highlight=False)

    try:  # checkpoints training runs handed over (`league:` in a training config)
        config, handed = with_handed_entrants(config, directory, refused)
    except ConfigError as exc:
        console.print(f"[red]bad league config:[/red] {exc}")
        raise typer.Exit(2) from None
    if handed:
        console.print(f"entrants handed over by training runs: {', '.join(handed)}", markup=False)
    metrics.serve(metrics_port)

    def notice(message: str) -> None:
        console.print(message, style="yellow", markup=False, highlight=False, soft_wrap=True)

    import asyncio
    import signal

    async def main() -> None:
        stop = stop_on_first_sigint(
            lambda: notice("Ctrl-C: stopping; what is counted stays counted (--resume goes on)")
        )
        summary = await run_league(
            config,
            directory,
            resume=resume,
            broker_url=broker_url,
            credentials_dir=credentials,
            spawn=spawn,
            metrics_port=metrics_port,
            on_notice=notice,
            ready_timeout_s=ready_timeout,
            stop=stop,
            plots=_plots_for(config.tracking is not None),
        )
        _say_summary(summary, directory, config.tracking is not None, notice)
        if hold and not stop.is_set():
            console.print("holding: the rating gauges stay served until Ctrl-C or SIGTERM")
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await stop.wait()

    try:
        run(main())
    except (LeagueError, BrokerError, BusError) as exc:  # as `backroom run` says them
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


def _say_summary(
    summary: Any, directory: Path, tracked: bool, notice: Callable[[str], None]
) -> None:
    """The standings, what this session counted, the tracker's line, who never came online."""
    from backroom.analysis.league import print_standings
    from backroom.tracking import tracking_summary

    print_standings(summary.standings, console)
    console.print(
        f"{summary.played} matches counted this session ({summary.matches_per_second:.1f}/s "
        f"of play), {summary.pending} pending; `backroom league show {directory}` for plots"
    )
    if tracked and (line := tracking_summary(directory, WARNINGS)):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    if summary.skipped:
        notice(f"optional entrants not online (their matches wait): {', '.join(summary.skipped)}")
