"""What ``backroom train`` shows while it runs (``backroom run`` too), and what it keeps in its log file.

A terminal gets rich's live progress bar. Anything else (a pipe, ``tee``, a
file, a notebook's subprocess) gets one plain line per step, flushed as the
step ends: rich's live display renders only at its end when the output is no
terminal, and a piped run would show nothing until it finished.

Libraries' deprecation notices (transformers' ``FutureWarning``s, its
"... is deprecated" log lines; Python warnings raised outside backroom) say
nothing about the run and buried its progress. They go to
``RUN_DIR/logs/trainer.log`` with everything else the trainer logs, and the
terminal is told how many were kept there (``LibraryNoise.held``).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: backroom's own source folder: a warning raised from a file under it is ours, and shown.
_OURS = str(Path(__file__).resolve().parent.parent)


class LibraryNoise(logging.Filter):
    """Keeps libraries' warnings off the terminal; counts what it held back."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if is_library_noise(record):
            self.held += 1
            return False
        return True


def is_library_noise(record: logging.LogRecord) -> bool:
    """A Python warning raised outside backroom, or a library's deprecation log line.

    Errors always show; so do backroom's own warnings and log lines.
    """
    if record.levelno >= logging.ERROR:
        return False
    if record.name == "py.warnings":
        return not str(getattr(record, "warning_file", "")).startswith(_OURS)
    if record.name == "backroom" or record.name.startswith("backroom."):
        return False
    return "deprecat" in record.getMessage().lower()


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` as a log record that knows which file raised it."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    logging.getLogger("py.warnings").warning(
        "%s", text, extra={"warning_file": filename, "warning_category": category.__name__}
    )


@contextmanager
def train_logging(log_file: Path) -> Iterator[LibraryNoise]:
    """Everything at INFO and above (and every warning) to ``log_file``; the terminal's
    handlers keep their level and lose the libraries' noise (``is_library_noise``).

    Also routes transformers' own log handler (it does not propagate by default)
    through the root logger, when transformers is installed.
    """
    root = logging.getLogger()
    noise = LibraryNoise()
    console_level = root.level
    consoles = {h: h.level for h in root.handlers}
    for h in consoles:
        h.addFilter(noise)
        h.setLevel(max(h.level, console_level))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    to_file.setLevel(min(console_level, logging.INFO))
    root.addHandler(to_file)
    root.setLevel(min(console_level, logging.INFO))
    shown, warnings.showwarning = warnings.showwarning, _log_warning
    hf = _route_transformers()
    try:
        yield noise
    finally:
        warnings.showwarning = shown
        if hf is not None:
            hf_logging, propagate, bars = hf
            hf_logging.enable_default_handler()
            logging.getLogger("transformers").propagate = propagate
            if bars:
                hf_logging.enable_progress_bar()
        root.removeHandler(to_file)
        to_file.close()
        root.setLevel(console_level)
        for h, level in consoles.items():
            h.removeFilter(noise)
            h.setLevel(level)


def _route_transformers() -> tuple[Any, bool, bool] | None:
    """transformers' logger through the root's handlers, its progress bars off; its module,
    old ``propagate`` and whether its bars were on.

    Its "Loading weights" bar reached the terminal, drawn through the trainer's
    own progress bar, where the docs said library output goes to the log; a bar
    in a log file is a line of carriage returns, so while the trainer logs,
    transformers draws no bar at all (its log lines still reach the file).
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    hf_logging.get_logger()  # its handler is made on first use
    propagate = logging.getLogger("transformers").propagate
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    return hf_logging, propagate, bars


class StepProgress:
    """A run's progress: rich's bar on a terminal, else one flushed line every ``every`` steps.

    ``unit`` and ``units`` name what is counted: training steps, or ``backroom
    run``'s matches ("match 40/200 [0:00:03]").
    """

    def __init__(
        self,
        console: Console,
        title: str,
        total: int,
        every: int = 1,
        unit: str = "step",
        units: str = "steps",
    ) -> None:
        self.console, self.title, self.total, self.every = console, title, total, max(1, every)
        self.unit, self.units = unit, units
        self.live = console.is_terminal
        self.started = time.monotonic()
        self._bar: Progress | None = None
        if self.live:
            self._bar = Progress(
                TextColumn(f"[bold]{title}[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=console,
            )
            self._task = self._bar.add_task("", total=total)

    def __enter__(self) -> StepProgress:
        if self._bar is not None:
            self._bar.__enter__()
        else:
            self.line(f"{self.title}: {self.total} {self.units}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)

    def line(self, text: str) -> None:
        """A plain line, whole and flushed (no wrapping, no markup, no colour guesses)."""
        self.console.print(text, soft_wrap=True, markup=False, highlight=False)
        self.console.file.flush()

    def step(self, step: int, summary: str) -> None:
        """Step ``step`` (0-based) has ended."""
        self.advance(step + 1, summary)

    def advance(self, done: int, summary: str = "") -> None:
        """``done`` of ``total`` have ended."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=summary)
        elif done % self.every == 0 or done == self.total:
            elapsed = timedelta(seconds=round(time.monotonic() - self.started))
            tail = f" {summary}" if summary else ""
            self.line(f"{self.unit} {done}/{self.total} [{elapsed}]{tail}")
