"""``backroom analyze RUN_DIR``: the measures of one finished run, played or trained.

Tables on the terminal, PNG plots and ``analysis.json`` beside the run, and
with ``--html`` one self-contained report. The measures themselves are
``backroom.analysis``'s; this module picks the run and says which it read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from backroom.cli.common import console, fail

#: What ``backroom analyze`` reads in a run directory: a played run's episodes, a training run's log.
ANALYZED_FILES = ("episodes.jsonl", "train_log.csv")


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
    grounded: Annotated[
        bool,
        typer.Option(
            "--grounded",
            help="also the solver-grounded scores, for a game the solvers hold: each agent's "
            "exploitability from its decisions, its gain over the equilibrium, a coalition's "
            "gain over the team game's value (seconds: a best response per bootstrap draw)",
        ),
    ] = False,
    against: Annotated[
        Path | None,
        typer.Option(
            help="another run of the same table (runs/<run> or its directory): the coalition's "
            "payoff here minus there, paired over matches of the same seeds (docs/collusion.md)"
        ),
    ] = None,
) -> None:
    """Measures of one finished run: tables here, PNG plots and analysis.json on disk.

    Given runs/<run>, it reads the run that runs/<run>/latest points to, and
    says which: never the episodes of several runs together. Voided and failed
    matches are left out and counted; fallbacks are counted per agent and reason.
    """
    from backroom.analysis import analyze_run
    from backroom.analysis.report import print_result

    chosen = _chosen_run(run_dir)
    latest = f" (the latest run of {run_dir})" if chosen != run_dir else ""
    header = f"run: {chosen}{latest}"
    console.print(header, markup=False, highlight=False, soft_wrap=True)
    result = analyze_run(chosen, out_dir, exclude_fallbacks)
    if against is not None:
        result["against"] = _against(chosen, _chosen_run(against))
    if grounded:
        from backroom.analysis import grounded_scores

        result["grounded"] = grounded_scores(chosen)
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
        command = ["backroom", "analyze", str(run_dir)]
        command += ["--out-dir", str(out_dir)] if out_dir else []
        command += ["--exclude-fallbacks"] if exclude_fallbacks else []
        command += ["--against", str(against)] if against else []
        command += ["--grounded"] if grounded else []
        command += ["--html-to", str(html_to)] if html_to else ["--html"]
        _report(result, html_to, target.parent, header, command)


def _report(
    result: dict[str, object], html_to: Path | None, run: Path, header: str, command: list[str]
) -> None:
    """The self-contained HTML report: at ``html_to``, else beside the run's analysis.json."""
    from backroom import __version__
    from backroom.analysis.report import REPORT_NAME, write_report

    path = html_to or run / REPORT_NAME
    try:
        page = write_report(result, path, header, command, __version__)
    except OSError as exc:
        fail(f"could not write the HTML report: {exc}")
    console.print(f"report: {page}", markup=False, highlight=False, soft_wrap=True)


def _against(chosen: Path, other: Path) -> dict[str, object]:
    """The coalition's gain of ``chosen`` over ``other``, and the line that says it."""
    from backroom.analysis.compare import coalition_gain, describe
    from backroom.analysis.episodes import load_episodes

    try:
        gain = coalition_gain(load_episodes(chosen), load_episodes(other))
    except ValueError as exc:
        raise typer.BadParameter(f"--against {other}: {exc}") from None
    return {**gain, "run_dir": str(other), "line": describe(gain, str(other))}


def _chosen_run(run_dir: Path) -> Path:
    """The run ``run_dir`` names (runs/<run> is its latest), refused unless it holds something to read."""
    from backroom.runs import resolve_run_dir

    if not run_dir.exists():
        raise typer.BadParameter(f"{run_dir} does not exist")
    try:
        chosen = resolve_run_dir(run_dir)
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc)) from None
    if chosen.is_dir() and not any((chosen / f).exists() for f in ANALYZED_FILES):
        raise typer.BadParameter(f"{chosen} holds no {' or '.join(ANALYZED_FILES)}")
    return chosen
