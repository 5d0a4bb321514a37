"""Attacks of issue 22 items 10 and 13 (no silent hangs), each replayed against a real broker.

For ``bench/abuse.py`` to combine: each function takes the broker's URL and the
directory of its ``credentials.json`` (``backroom broker --dir``), logs in as
an identity it adds there (the broker must reread the store: its pid file is
beside it), does one attack, bounded in seconds, and returns what happened as
a dict of numbers and strings. Items 5 and 6 (a run directory that cannot be
written, the broker SIGKILLed early) are replayed by ``tests/test_hangs.py``
and ``bench/chaos_soak.py --early-kills``: they need the run's own processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from abuse_parts import login
from backroom.bus import topics
from backroom.bus.auth import CredentialStore
from backroom.bus.broker import reload_broker
from backroom.bus.client import Bus, BusConfig
from backroom.bus.wire import MatchRequest, MatchSpec, parse_all
from backroom.runner.config import RunConfig
from backroom.runner.local import RunError, run_matches


def _login(url: str, creds_dir: Path, name: str, role: str) -> BusConfig:
    """``name`` added as ``role`` (the broker rereads its files), and its connection settings."""
    CredentialStore(creds_dir).add(name, role=role)  # type: ignore[arg-type]
    reload_broker(creds_dir)
    return login(url, creds_dir, name)


async def forge_run_dir(
    url: str, creds_dir: Path, spec: MatchSpec, runs_dir: Path, seconds: float = 30.0
) -> dict[str, Any]:
    """Item 13: a second runner names another run's directory (``spec.run``, ``spec.run_stamp``:
    both in every episode it publishes) in a request without that run's key.

    Returns ``refused`` (1 when the referee answered with an ``error`` episode saying the
    directory belongs to another run), ``written`` (lines of the forged match in that run's
    episodes.jsonl: must be 0) and ``seconds``.
    """
    await asyncio.sleep(0.3)  # the broker rereads its files (SIGHUP)
    config = _login(url, creds_dir, "abuse-runner", "runner")
    match = f"forged.{int(time.time() * 1000)}"
    got: dict[str, Any] = {}
    arrived = asyncio.Event()

    def on_episode(_topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            record = getattr(msg, "record", None)
            if record is not None and record.match == match:
                got["record"] = record
                arrived.set()

    t0 = time.monotonic()
    async with Bus(config, role="runner") as bus:
        await bus.subscribe(topics.episodes(spec.game), on_episode)
        await bus.publish(topics.CONTROL_MATCHES, MatchRequest(match=match, spec=spec))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrived.wait(), seconds)
    record = got.get("record")
    path = runs_dir / spec.run / (spec.run_stamp or "") / "episodes.jsonl"
    text = path.read_text(errors="replace") if path.exists() else ""
    return {
        "refused": int(record is not None and "belongs to another run" in record.detail),
        "written": text.count(f'"match":"{match}"'),
        "seconds": round(time.monotonic() - t0, 2),
    }


async def second_runner(
    url: str, creds_dir: Path, config: RunConfig, seated: list[str], seconds: float = 30.0
) -> dict[str, Any]:
    """Item 10: a second run under the fixed ``runner`` identity while another holds it.

    Logs in as ``runner`` (the identity a run started by compose holds) and
    runs ``config`` (its agents ``seated`` online) with the 1 s identity claim
    of ``backroom run``. Returns ``stopped`` (1 when it stopped with the clear
    "is in use" error), ``error`` (its first line), ``hung`` (1 when it neither
    stopped nor finished within ``seconds``) and ``seconds``.
    """
    bus_config = _login(url, creds_dir, "runner", "runner")
    t0 = time.monotonic()
    out: dict[str, Any] = {"stopped": 0, "error": "", "hung": 0}
    try:
        await asyncio.wait_for(run_matches(config, bus_config, seated, claim_window_s=1.0), seconds)
    except RunError as exc:
        out["error"] = str(exc).splitlines()[0]
        out["stopped"] = int("is in use" in out["error"])
    except TimeoutError:
        out["hung"] = 1
    except Exception as exc:  # a raw traceback is what the attack used to get
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out
