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
"""

from __future__ import annotations

import asyncio

from backroom.bus.wire import MatchSpec
from backroom.games import openspiel_bounds as bounds


def needs_vetting(spec: MatchSpec) -> bool:
    """Whether building ``spec``'s game here could take long (checked before building)."""
    return spec.game == "openspiel" and bool(set(spec.params) - {"name"})


async def vet(spec: MatchSpec) -> None:
    """Return when ``spec``'s game may be built here; ``ValueError`` (one line) when not."""
    from backroom.games.openspiel import checked

    name, declared, params = checked(spec.params)
    bounds.precheck(name, declared, params)
    command = bounds.probe_command(name, declared, params)
    if command is None:
        return
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
