"""A short chaos soak: agents, referees and the broker killed while a run plays (slow).

``bench/chaos_soak.py`` runs the long one; this one runs it for about half a
minute with events every 1.5 s on average, and asserts what the bench
promises: every match requested ends with exactly one kept episode, in the
runner's result and in the run's file, whatever was killed meanwhile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_short_chaos_soak_loses_and_duplicates_no_match(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "chaos_soak.py"),
            "--matches",
            "8000",
            "--duration",
            "40",
            "--interval",
            "1.5",
            "--seed",
            "3",
            "--timeout",
            "240",
            "--runs-dir",
            str(tmp_path),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    text = out.stdout
    assert out.returncode == 0, text + out.stderr[-3000:]
    events = re.search(r"chaos events:\s+agent (\d+), referee (\d+), broker (\d+)", text)
    assert events and sum(map(int, events.groups())) >= 3, text  # chaos did happen
    assert re.search(r"requested:\s+8000\b", text), text
    assert re.search(r"finished:\s+8000\b", text), text
    assert re.search(r"lost:\s+0 \(in the file: 0\)", text), text
    assert re.search(r"duplicated:\s+0 \(in the file: 0\)", text), text
