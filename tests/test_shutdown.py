"""SIGTERM ends a backroom service within seconds, whatever it is doing (``cli.common.serve_until_signal``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

STUBBORN = """
import asyncio, sys
from backroom.cli.common import serve_until_signal

async def stubborn():
    print("ready", flush=True)
    while True:  # swallows every cancellation, as a handler stuck in a publish storm would
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue

serve_until_signal(stubborn(), grace_s=1.0)
"""

POLITE = STUBBORN.replace("continue", "print('cleaned up', flush=True); raise")


def start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_service_that_ignores_cancellation_is_ended_after_the_grace() -> None:
    proc = start(STUBBORN)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == 1
    assert time.monotonic() - t0 < 10  # 1 s of grace, not forever
    assert "exiting now" in (proc.stderr.read() if proc.stderr else "")


def test_a_second_signal_ends_it_at_once_and_a_polite_one_exits_cleanly() -> None:
    proc = start(STUBBORN)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 1
    polite = start(POLITE)
    polite.send_signal(signal.SIGTERM)
    assert polite.wait(timeout=30) == 0
    assert polite.stdout is not None and "cleaned up" in polite.stdout.read()
