"""Matplotlib without pyplot: figures drawn on the Agg canvas, safe in any thread or process.

Matplotlib is imported when the first figure is made, not with this module:
``backroom demo`` reads the solver's reference values through this package
after its table and must not pay for loading a plotting library it never uses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def figure(width: float = 7.0, height: float = 4.0) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, out_dir: Path, name: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{safe_name(name)}.png"
    fig.savefig(path, dpi=110)
    return str(path)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "plot"
