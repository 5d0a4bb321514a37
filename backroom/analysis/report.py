"""``backroom analyze --html``: one self-contained HTML file to share a run's measures.

The page holds what ``analyze`` prints (the same rich tables and notes, recorded
and exported by rich, which escapes every character of text) and every PNG plot
as a ``data:`` URI, so the file can be mailed or attached anywhere and opens
with no network and no files beside it. A plot file that is gone is said on
the page, never left out silently. Every string that reaches the page (run
directory, command, agent ids, a record's game name) is escaped; a
Content-Security-Policy that allows no script and no fetch but ``data:``
images holds even if some text slipped through.
"""

from __future__ import annotations

import base64
import io
import shlex
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

from rich.console import Console

from backroom.analysis import notes, render_tables

REPORT_NAME = "report.html"
WIDTH = 130  # columns the tables are laid out in: Kuhn's widest fits
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
pre.tables { font-family: Menlo, "DejaVu Sans Mono", Consolas, monospace; font-size: 13px;
  line-height: 1.15; background: #fdfdfd; border: 1px solid #ddd; padding: 1em; overflow-x: auto; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; word-break: break-all; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption, .meta { color: #555; font-size: 0.9em; }
.missing { color: #a00; }
"""


def plot_paths(result: dict[str, Any]) -> list[str]:
    """Every plot ``analyze_run`` wrote, in the order ``analyze`` lists them."""
    return [
        *result.get("training", {}).get("plots", []),
        *(p for g in result.get("games", {}).values() for p in g.get("plots", [])),
    ]


def printed_lines(result: dict[str, Any]) -> list[str]:
    """The lines ``analyze`` prints under its tables: notes, then skipped lines."""
    lines = notes(result)
    lines += [f"warning: {line}" for line in result.get("training", {}).get("unplayed", [])]
    if skipped := result.get("unreadable_lines"):
        lines.append(f"skipped {skipped} unreadable lines in {result['episodes_file']}")
    return lines


def print_result(console: Console, result: dict[str, Any]) -> None:
    """What ``backroom analyze`` prints of a result: its tables, then its notes (warnings
    in yellow); the terminal and the report print the same."""
    for table in render_tables(result):
        console.print(table)
    for line in printed_lines(result):
        warn = line.startswith("warning:")
        console.print(
            line, style="yellow" if warn else None, markup=False, highlight=False, soft_wrap=True
        )


def tables_html(header: str, result: dict[str, Any]) -> str:
    """The tables and notes as ``analyze`` prints them, as escaped, inline-styled HTML."""
    console = Console(
        record=True,
        file=io.StringIO(),
        width=WIDTH,
        force_terminal=True,
        color_system="truecolor",
    )
    console.print(header, markup=False, highlight=False, soft_wrap=True)
    print_result(console, result)
    return console.export_html(inline_styles=True, code_format='<pre class="tables">{code}</pre>')


def figure_html(path: str) -> str:
    name = escape(Path(path).name)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return f'<p class="missing">plot {escape(path)} could not be read: {escape(str(exc))}</p>'
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return f'<figure><img src="{uri}" alt="{name}"><figcaption>{name}</figcaption></figure>'


def render_report(
    result: dict[str, Any], header: str, command: Sequence[str], version: str = ""
) -> str:
    """The whole page: title, run directory, command, tables and notes, plots."""
    run = str(result.get("run", ""))
    run_dir = str(result.get("run_dir", header))
    plots = plot_paths(result)
    written = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    figures = "\n".join(figure_html(p) for p in plots) or "<p>no plots for this run</p>"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>backroom analyze: {escape(run)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>backroom analyze: {escape(run)}</h1>
<p class="meta">run directory: <code id="run-dir">{escape(run_dir)}</code><br>
command: <code id="command">{escape(shlex.join(command))}</code><br>
written {written}{escape(f" by backroom {version}" if version else "")}</p>
<h2>Tables</h2>
{tables_html(header, result)}
<h2>Plots ({len(plots)})</h2>
{figures}
</body>
</html>
"""


def write_report(
    result: dict[str, Any], path: Path, header: str, command: Sequence[str], version: str = ""
) -> Path:
    """Write the page to ``path`` (its directory made if needed) and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(result, header, command, version), encoding="utf-8")
    return path
