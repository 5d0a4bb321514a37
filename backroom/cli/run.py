"""``backroom run CONFIG`` and ``backroom demo``: play a config's matches, then report them.

What a run prints: its progress (rich's bar on a terminal; piped, a plain line
every 5% of the matches, ``cli.progress.StepProgress``), then the results
table (``results_table``), its warnings (fallbacks, timeout defaults), and the
story under it (``analysis.story``: channels, a Kuhn coalition against CFR,
what to run next). A run whose matches end in error exits 1; Ctrl-C, 130.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from backroom.cli.common import (
    BrokerOpt,
    CredsOpt,
    MetricsOpt,
    RunsOpt,
    console,
    require_kind,
    stop_on_first_sigint,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from rich.table import Table

    from backroom.analysis.kuhn import Reference
    from backroom.runner.config import RunConfig
    from backroom.runner.results import RunResult


def run_cmd(
    config_path: Annotated[Path, typer.Argument(help="run config (YAML)")],
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    runs_dir: RunsOpt = Path("runs"),
    matches: Annotated[
        int | None,
        typer.Option(
            help="override the config's match count (with `deals:`, fewer or more matches per "
            "hand, said in one line)"
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="override any config field, validated as the file is: concurrency=4, "
            "deals.each=2, turn_timeout_s=300, params.rounds=5; repeatable",
        ),
    ] = None,
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
    from backroom.runner.config import ConfigError
    from backroom.runner.overrides import load_run_config

    try:
        config, note = load_run_config(config_path, overrides or [], matches)
    except ConfigError as exc:
        console.print(f"[red]bad config:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    if note is not None:
        _plain(note)
    if not spawn and broker_url is None:
        raise typer.BadParameter("--no-spawn needs --broker and --credentials of the running stack")
    execute(config, runs_dir, broker_url, credentials, metrics_port, spawn, ready_timeout)


def demo_config(naive: bool = False) -> RunConfig:
    """The demo's run config: team-solve colluders (demo.yaml), or naive ones (demo_naive.yaml)."""
    import yaml

    from backroom.runner.config import parse_config

    name = "demo_naive.yaml" if naive else "demo.yaml"
    text = resources.files("backroom").joinpath(name).read_text()
    return parse_config(yaml.safe_load(text), source=name)


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
    execute(config, runs_dir, None, None, metrics_port)


def execute(
    config: RunConfig,
    runs_dir: Path,
    broker_url: str | None,
    credentials: Path | None,
    metrics_port: int,
    spawn: bool = True,
    ready_timeout_s: float = 60.0,
) -> None:
    """Play ``config`` with its progress shown, then print what happened and exit as it went."""
    from backroom import metrics
    from backroom.bus.broker import BrokerError
    from backroom.bus.client import BusError, run
    from backroom.cli.progress import StepProgress
    from backroom.runner.local import RunError, run_local

    if spawn:  # refuse before anything starts, not when a spawned agent dies
        for a in config.agents:
            require_kind(a.kind, a.options)
    metrics.serve(metrics_port)
    reference = _prefetch_reference(config)
    # Piped, a line every 5% of the matches: a log gets its progress as it happens.
    progress = StepProgress(
        console,
        f"{config.run} {config.game}",
        config.matches,
        every=max(1, config.matches // 20),
        unit="match",
        units="matches",
    )

    import asyncio
    import signal

    async def play() -> RunResult:
        stop = stop_on_first_sigint(
            lambda: _notice(
                "Ctrl-C: stopping; the table holds the matches finished so far (again: quit now)"
            )
        )
        loop = asyncio.get_running_loop()
        try:
            return await run_local(
                config,
                runs_dir=runs_dir,
                broker_url=broker_url,
                credentials_dir=credentials,
                on_episode=lambda _rec, n: progress.advance(n),
                spawn=spawn,
                metrics_port=metrics_port,
                on_notice=_notice,
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
    report(result, reference)


def _notice(message: str) -> None:
    # soft_wrap: a command in the message stays one line, to copy.
    console.print(message, style="yellow", markup=False, highlight=False, soft_wrap=True)


def _plain(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def report(result: RunResult, reference: Future[Reference | None] | None) -> None:
    """The table, its warnings and story; exit 130 when interrupted, 1 when matches failed."""
    from rich.text import Text

    from backroom.runner.results import summarize

    summary = summarize(result)
    console.print(results_table(result, summary))
    for line in summary["warnings"]:
        _notice(line)
    if summary["warnings"]:
        _plain(
            f"(measures without those matches: backroom analyze {result.run_dir} --exclude-fallbacks)"
        )
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(summary["outcomes"].items()))
    # The title's time includes starting the broker, referee and agents; say what play took.
    console.print(
        f"outcomes: {outcomes}; {result.matches_per_second:.3g} matches/s while playing "
        f"({result.play_seconds:.3g}s of the {result.seconds:.1f}s; the rest is starting and "
        "stopping the processes)"
    )
    console.print(f"episodes: {result.run_dir / 'episodes.jsonl'}")
    for line in _story(result, reference):
        _plain(line)
    if result.faults.interrupted:
        n, late = len(result.episodes), result.faults.read_back
        read_back = (
            f" ({late} of them read back from episodes.jsonl: their episode had not reached "
            "the runner when it stopped)"
            if late
            else ""
        )
        console.print(
            f"[yellow]interrupted:[/yellow] Ctrl-C after {n} of {result.config.matches} "
            f"matches; everything above is of those {n}{read_back}",
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
    moves, by reason (``backroom.records``), the referee's timeout
    defaults among them: a mean over defaults must not pass for the agent's play.

    "chips" is Kuhn's unit only: a Bertrand firm makes profit, the others score
    points. An agent holding several seats of a match (the beauty contest's
    four agents in 24 seats) played it once: ``matches`` counts matches, and a
    ``seats`` column appears, since the means are per seat.
    """
    from rich.table import Table

    from backroom.analysis.story import return_unit
    from backroom.records import describe as describe_fallbacks

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
    from concurrent.futures import ThreadPoolExecutor

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
