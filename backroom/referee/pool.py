"""Referee replicas that share one name pattern: each takes a name of the pool that is free."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from backroom.bus.connection import broker_reachable
from backroom.bus.errors import ConnectTimeout, IdentityInUse
from backroom.bus.wire import IDENTITY_WINDOW_S
from backroom.referee.service import Referee

#: Passes over a referee name pool before ``claim_pooled`` gives up.
CLAIM_PASSES = 3


async def claim_pooled(
    names: list[str],
    make: Callable[[str], Referee],
    say: Callable[[str], None],
    passes: int = CLAIM_PASSES,
) -> Referee:
    """The first referee of ``names`` whose identity no other process holds, started.

    For replicas of one service (``docker compose up --scale referee=4``): they
    share one env file, so one name pattern and one password, and each takes
    a name of the pool that is free. Trying a name a running referee holds
    throws that one off (once or twice: the bus's clean-start pre-login and its
    login; it reconnects at once and keeps its name, voiding the matches it had
    in flight); that try also reads every pool name's status, so later tries skip
    the names online and a pass throws off at most one referee.

    Replicas racing for one name settle it within the identity window, since
    every try waits it (``contested``): the later login keeps the name. A
    replica that lost every name of a pass waits until the rivals that were
    still starting have settled, and tries again the names it saw no started
    referee under (``RefereeGroup.name_announced``), up to ``passes`` times: three
    replicas started at once on a pool of three could leave one without a
    name. Raises ``IdentityInUse`` when every name is taken.
    """
    pool = list(names)
    held: set[str] = set()  # names seen online or announced by a started referee
    for n in range(passes):
        if n:
            say(f"no name of the pool was free; trying {', '.join(names)} again")
            # Rivals in their identity window are online after it: wait it out, with
            # jitter so that two replicas that lost the same name do not meet again.
            await asyncio.sleep(IDENTITY_WINDOW_S * (1.0 + random.random()))
        usable: list[str] = []
        for name in names:
            if name in held:
                continue
            try:
                ref = make(name)
            except KeyError as exc:  # no credentials for this name of the pool
                say(f"skipping {name!r}: {exc.args[0]}")
                continue
            ref.watch = pool  # a referee reads only the statuses it is told to
            usable.append(name)
            try:
                return await ref.open()
            except IdentityInUse:
                # It read the pool's retained statuses meanwhile: skip the names
                # online, so the rest of the pass throws nobody else off.
                held |= ref.peers.online
                if ref.peers.name_announced():
                    held.add(name)
                say(f"referee identity {name!r} is in use; trying a free name of the pool")
            except ConnectTimeout:
                # Two replicas logging in under one name at once can throw each other off
                # until the first connection's deadline (seen on a loaded 2-core machine):
                # contested, not a broker that is away. The name stays for the next pass.
                if not await broker_reachable(ref.config):
                    raise
                say(f"referee identity {name!r} is contested; trying a free name of the pool")
        names = [name for name in usable if name not in held]
        if not names:
            break
    raise IdentityInUse(
        f"every referee identity of the pool ({pool[0]} to {pool[-1]}) is in use: stop a "
        "referee, or make the pool larger (`--pool N`, and identities for the new names)"
    )
