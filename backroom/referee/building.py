"""Vetting a requested game off the referee's event loop, under a bound.

A match request names a game and its parameters, and anyone who may ask for
matches may name any. Most engines build in microseconds; an OpenSpiel game is
built in C++ that holds the GIL and cannot be interrupted, so one request for
``blotto(coins=1000, fields=10)`` would stop every match of the referee and its
answer to SIGTERM. So an OpenSpiel game with other parameters than its
defaults is vetted first (``backroom.games.openspiel_bounds``): what needs no
building at once, the rest in a child process that this coroutine awaits and
kills at the bound (or when the referee stops). The referee keeps serving
meanwhile, and a refused game gets its ``error`` episode like any bad request.

Each probe is a Python process with pyspiel loaded, so a flood of requests must
not become a flood of processes: requests for the same game share one probe,
at most ``MAX_PROBES`` run at once, and past ``MAX_VETTING`` distinct games
waiting, a request is refused at once (it may be asked again later).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from backroom.bus.wire import MatchSpec
from backroom.games import openspiel_bounds as bounds

#: Probe processes one referee runs at once.
MAX_PROBES = 2
#: Distinct games being vetted (running or waiting for a probe) at most; one more is refused.
MAX_VETTING = 32


class _Probes:
    """One event loop's probes: a slot each, and the probe of each game in flight."""

    def __init__(self) -> None:
        self.slots = asyncio.Semaphore(MAX_PROBES)
        self.running: dict[str, asyncio.Task[None]] = {}
        self.waiters: dict[str, int] = {}


_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Probes] = (
    weakref.WeakKeyDictionary()
)


def needs_vetting(spec: MatchSpec) -> bool:
    """Whether building ``spec``'s game here could take long (checked before building)."""
    return spec.game == "openspiel" and bool(set(spec.params) - {"name"})


async def vet(spec: MatchSpec) -> None:
    """Return when ``spec``'s game may be built here; ``ValueError`` (one line) when not."""
    from backroom.games.openspiel import checked

    name, declared, params = checked(spec.params)
    bounds.precheck(name, declared, params)
    if bounds.probe_command(name, declared, params) is None:
        return
    probes = _by_loop.setdefault(asyncio.get_running_loop(), _Probes())
    key = bounds.verdict_key(name, params)
    task = probes.running.get(key)
    if task is None:
        if len(probes.running) >= MAX_VETTING:
            raise ValueError(
                f"OpenSpiel game {name} {params}: {MAX_VETTING} games are being vetted here "
                "already (MAX_VETTING): refused; ask again later"
            )
        task = asyncio.ensure_future(_probe(probes.slots, name, declared, params))
        probes.running[key] = task
        task.add_done_callback(lambda _: probes.running.pop(key, None))
    probes.waiters[key] = probes.waiters.get(key, 0) + 1
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if probes.waiters.get(key) == 1:  # no one else waits for it: its process goes too
            task.cancel()
        raise
    finally:
        probes.waiters[key] -= 1
        if not probes.waiters[key]:
            del probes.waiters[key]


async def _probe(slots: asyncio.Semaphore, name: str, declared: Any, params: Any) -> None:
    """One probe process for ``name(params)``, once a slot is free; its verdict kept (``judge``)."""
    async with slots:
        command = bounds.probe_command(name, declared, params)  # judged while this waited?
        if command is not None:
            await _run(command, name, params)


async def _run(command: list[str], name: str, params: Any) -> None:
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    timed_out, stdout, stderr = False, b"", b""
    try:
        stdout, stderr = await asyncio.wait_for(
            proc.communicate(), bounds.MAX_BUILD_S + bounds.PROBE_START_S
        )
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:  # past the bound, or the referee stopping: never left behind
            proc.kill()
            await proc.wait()
    bounds.judge(name, params, None if timed_out else proc.returncode, stdout, stderr)
