"""``play(plan, bus, sink, options)``: the one operation that plays a batch of matches.

``backroom run`` (its run directory as the sink, ``runner.local``) and the
league (its store as the sink, ``league.play``) both play through it, on a
connection it opens (``play.wiring.Wiring``). The trainer plays the same loop
on its own persistent session (``play.loop.Batch``, ``trainer.batch``). What
is done when requests are lost or referees die is the ``MatchLedger``'s, the
same for all (docs/architecture.md, "One batch, three callers").
"""

from __future__ import annotations

from backroom.bus.client import BusConfig
from backroom.bus.wire import EpisodeRecord
from backroom.play.plan import MatchPlan, PlayOptions, Sink
from backroom.play.wiring import Wiring


async def play(
    plan: MatchPlan, bus: BusConfig, sink: Sink, options: PlayOptions
) -> list[EpisodeRecord]:
    """Ask for ``plan``'s matches (``options.concurrency`` in flight) logged in as ``bus``;
    return one episode per match played, in the order they came.

    Waits first for ``options.presence.wait_for`` and one referee (any status of
    kind ``referee`` that a roster record proves); a wait for a process nobody
    starts is said (``sink.fault``), at once for ``presence.external``, after
    ``SLOW_START_S`` for any. While the batch plays, a submitting task fills
    the window and this one watches the referees, so a submit waiting on a full
    window never keeps a dead referee from being noticed. With no referee
    left, the batch fails (``RunError``): at once when the caller's own
    referees all died, after ``waits.ready_s`` when others may come back. Once
    ``options.stop`` is set, it returns the matches finished by then and
    ``faults.interrupted`` says that it stopped short. Then, unless it stopped
    or failed, the sink ``settle``s with the bus still open, waiting up to
    ``waits.trace_s`` for traces trailing their episodes (``None``: not at all).
    """
    wiring = Wiring(plan, bus, sink, options)
    ledger, faults, stop = wiring.ledger, options.faults, options.stop
    async with wiring.bus:
        await wiring.claim()
        if await wiring.wait_ready(list(options.presence.external), stop):
            await wiring.narrow()
            await wiring.play()
        faults.interrupted = stop is not None and stop.is_set() and ledger.unfinished > 0
        # a batch stopped or failed need not wait for what trails its episodes
        complete = not (faults.interrupted or ledger.failure)
        await sink.settle(
            list(ledger.episodes.values()), faults, options.waits.trace_s if complete else None
        )
    return ledger.result()
