"""The suite's own time limit stretches with load as its waits do (conftest's timer).

Run in a pytest of its own (a subprocess: its SIGALRM would otherwise be this test's)
with the load pinned by the inner tests, so the outcome does not hang on this machine's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INNER = """
import time

import pytest

import tests.conftest as shared


@pytest.mark.timeout(1)
def test_slow_only_because_of_load(monkeypatch):
    monkeypatch.setattr(shared, "load_factor", lambda: 4.0)
    time.sleep(2)  # past the configured 1 s, within 4 x 1 s


@pytest.mark.timeout(1)
def test_hung_even_for_the_load(monkeypatch):
    monkeypatch.setattr(shared, "load_factor", lambda: 2.0)
    started = time.monotonic()
    try:
        time.sleep(30)
    finally:
        print(f"stopped after {time.monotonic() - started:.1f}s")
"""


def test_a_limit_stretches_with_load_and_still_stops_a_hung_test(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_timeout_set_timer  # noqa: F401\n"
    )
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert "1 failed, 1 passed" in out, out
    assert "FAILED test_inner.py::test_hung_even_for_the_load" in out, out
    stopped = float(out.split("stopped after ")[1].split("s")[0])
    assert 1.5 <= stopped < 20, out  # the 2x stretch, not the configured 1 s nor the 30 s sleep
