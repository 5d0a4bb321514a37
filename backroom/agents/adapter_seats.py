"""Which LoRA adapter each match seat of a ``local`` agent plays.

Adapters: ``policy`` names the checkpoint stream to follow. A ``Checkpoint``
(``uri`` = a local peft adapter folder or an http(s) folder URL, with the
files' sha256 and size) is fetched and checked (``backroom.model.adapters``)
and loaded while play goes on; a checkpoint whose files do not match its hash,
or that has none, is refused (logged, counted in
``backroom_adapter_rejected_total``) and the agent keeps its adapter. A match
whose spec names a version for this agent's seat (``MatchStart.adapter``, a
buffer opponent) plays that version; any other match plays the adapter that
was current when it started. Either way a match seat keeps one version from
its first decision to its last, and its traces name the version that really
played. A few versions stay loaded (``max_adapters``, least recently used out
first, never one a running match plays).

Provenance: the digest proves a folder intact, not who chose it, and the referee
(or a runner, through ``MatchSpec.adapters``) writes ``MatchStart.adapter``. So
a named version is loaded only if a trainer announced exactly that reference
(policy, version, location, sha256 and size) on a topic only the trainer role
may write: a checkpoint, or ``models/{policy}/versions/{version}`` (retained,
one per version, so an agent that starts mid-run learns of the buffer's old
versions too). An announcement may trail the match's start (no order holds
across topics), so the seat waits for it a while (``announce_wait_s``, at most
half its first turn's budget); then the adapter is refused
(``backroom_adapter_rejected_total{reason="unannounced"}``) and the seat plays
no policy at all: each of its decisions is the documented fallback, marked
``adapter_refused`` (in the episode record and the trace), and a trainer drops
the match. Playing the current weights instead would pass another policy's
play off as the version the match asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from backroom import metrics
from backroom.agents.decisions import budget_s, deadline_detail
from backroom.agents.memory import MemoryAgent
from backroom.bus.wire import AdapterRef, Checkpoint, MatchEnd, MatchStart, Turn
from backroom.model.adapters import DEFAULT_MAX_BYTES, AdapterCache, AdapterRejected, fetch_adapter

log = logging.getLogger("backroom.agent.local")

#: What a trainer announced, compared whole: the location too, so a match cannot
#: send the agent to fetch announced bytes from a server of its own choosing.
Announced = tuple[str, str, str, str, int]


def announced_key(ref: AdapterRef) -> Announced:
    return (ref.policy, ref.version, ref.uri, ref.sha256, ref.size)


class AdapterRefused(Exception):
    """The seat's named adapter was refused: it plays no policy (see the module docstring)."""


#: The cache owner that holds the current adapter (match seats are "match/seat"; no match id has "<").
CURRENT = "<current>"

#: (adapter name in the backend, version): what one match seat plays; (None, None) is the base model.
Played = tuple[str | None, str | None]


def default_adapter_cache() -> Path:
    """Where downloaded adapters are kept: ``$BACKROOM_ADAPTER_CACHE`` or ~/.cache/backroom/adapters."""
    env = os.environ.get("BACKROOM_ADAPTER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "backroom" / "adapters"


def checked_ref(checkpoint: Checkpoint) -> AdapterRef:
    """The checkpoint as an adapter reference; one without a usable hash is refused unfetched."""
    if not checkpoint.sha256:
        raise AdapterRejected("hash_missing", "the checkpoint carries no sha256")
    try:
        return checkpoint.ref()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        reason = "hash_missing" if where == "sha256" else "invalid"
        raise AdapterRejected(reason, f"{where}: {first['msg']}") from None


def adapter_name(policy: str, version: str, sha256: str) -> str:
    """The backend's name for a version: the digest in it, so a reused version string never
    aliases different weights; no dots, which torch module names refuse."""
    return f"{policy}@{version}-{sha256[:16]}".replace(".", "_")


class AdapterSeats(MemoryAgent):
    """The adapter each match seat plays (the module docstring says which, and why).

    The subclass sets ``cache`` once its model is loaded (``setup``) and
    ``deadline_margin_s`` (a named version's wait is bounded by the first turn's budget).
    """

    follows_announcements = True
    deadline_margin_s: float

    def __init__(
        self,
        agent_id: str,
        seed: int | None = None,
        *,
        policy: str | None = None,
        max_adapters: int = 4,
        adapter_cache: str | None = None,
        max_adapter_bytes: int = DEFAULT_MAX_BYTES,
        adapter_timeout_s: float = 120.0,
        announce_wait_s: float = 5.0,
        **options: Any,
    ) -> None:
        super().__init__(agent_id, seed=seed, **options)
        self.policy = policy
        if int(max_adapters) < 1:
            raise ValueError("max_adapters must be at least 1")
        self.max_adapters = int(max_adapters)
        self.adapter_cache = Path(adapter_cache) if adapter_cache else default_adapter_cache()
        self.max_adapter_bytes = int(max_adapter_bytes)
        self.adapter_timeout_s = float(adapter_timeout_s)
        self.announce_wait_s = float(announce_wait_s)
        #: Every adapter reference a trainer announced (see the module docstring).
        self.announced: set[Announced] = set()
        self._announcement = asyncio.Event()
        self.cache: AdapterCache | None = None
        #: What matches that start now play (unless their spec names a version).
        self.current: Played = (None, None)
        #: The policy of each loaded adapter name (traces say whose version played).
        self.policies: dict[str, str] = {}
        self._latest: Checkpoint | None = None
        #: The fetch of the latest checkpoint under way: set its event to abandon it.
        self._fetching: threading.Event | None = None
        self._fetch_ids = itertools.count()

    @property
    def version(self) -> str | None:
        return self.current[1]

    def on_announced(self, checkpoint: Checkpoint) -> None:
        try:
            ref = checked_ref(checkpoint)
        except AdapterRejected:
            return  # not loadable anyway: on_checkpoint counts it if it is this agent's
        self.announced.add(announced_key(ref))
        self._announcement.set()
        self._announcement = asyncio.Event()

    async def _until_announced(self, ref: AdapterRef, wait_s: float) -> bool:
        """Whether a trainer announced ``ref``, waiting up to ``wait_s`` for an announcement
        that may trail the match's start."""
        key = announced_key(ref)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while key not in self.announced:
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._announcement.wait(), left)
        return True

    async def _acquire(
        self, owner: str, ref: AdapterRef, cancel: threading.Event | None = None
    ) -> str:
        """Fetch, check, load and pin ``ref`` for ``owner``; ``AdapterRejected`` if it fails the check.

        The download has ``adapter_timeout_s`` in all, start to end (``fetch_adapter``).
        """
        assert self.cache is not None
        cache_dir, limit, timeout_s = (
            self.adapter_cache,
            self.max_adapter_bytes,
            self.adapter_timeout_s,
        )
        name = adapter_name(ref.policy, ref.version, ref.sha256)
        self.policies[name] = ref.policy
        return await self.cache.acquire(
            owner, name, lambda: fetch_adapter(ref, cache_dir, limit, timeout_s, cancel)
        )

    def _fallback_detail(self, turn: Turn, exc: Exception) -> str:
        """A fallback's ``reply.detail`` in the trace: the budget that ran out, or the refusal."""
        if isinstance(exc, AdapterRefused):
            return f"adapter refused: {exc}"
        return deadline_detail(turn, self.deadline_margin_s)

    def _rejected(self, what: str, exc: AdapterRejected, instead: str) -> None:
        metrics.ADAPTER_REJECTED.labels(reason=exc.reason).inc()
        log.warning(
            "%s: refused %s (%s): %s; %s %s",
            self.id,
            what,
            exc.reason,
            exc.detail,
            instead,
            self.version,
        )

    async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Check and load the new adapter now; matches that start from now on play it.

        The runtime runs each call in its own task, so a slow or dripping
        server delays only its own checkpoint. The newest arrival wins: it
        abandons the fetch of the one before (``fetch_adapter``'s ``cancel``),
        and a load that completes after a newer one has arrived is not made
        current. Each fetch has ``adapter_timeout_s`` in all.
        """
        if self.policy is not None and checkpoint.policy != self.policy:
            return
        self._latest = checkpoint
        if self._fetching is not None:
            self._fetching.set()  # overtaken: its download stops within moments
        cancel = self._fetching = threading.Event()
        owner = f"{CURRENT}#{next(self._fetch_ids)}"  # pinned here until it is current
        try:
            ref = checked_ref(checkpoint)
            if adapter_name(ref.policy, ref.version, ref.sha256) == self.current[0]:
                return
            name = await self._acquire(owner, ref, cancel)
        except AdapterRejected as exc:
            if not cancel.is_set():
                self._rejected(
                    f"checkpoint {checkpoint.version} from {checkpoint.uri}", exc, "keeping"
                )
            return
        except Exception:
            log.exception(
                "%s: could not load checkpoint %s from %s; keeping %s",
                self.id,
                checkpoint.version,
                checkpoint.uri,
                self.version,
            )
            return
        finally:
            if self._fetching is cancel:
                self._fetching = None
        assert self.cache is not None
        if checkpoint is self._latest:
            self.cache.pin(CURRENT, name)
            self.current = (name, ref.version)
            log.info("%s: now on adapter %s", self.id, ref.version)
        else:
            log.info("%s: adapter %s loaded after a newer one came; not used", self.id, ref.version)
        self.cache.unpin(owner)

    async def on_match_start(self, start: MatchStart) -> None:
        # A turn that overtook this message already fixed the seat's version: keep it.
        earlier = self.matches.get(start.match or "", {}).get("adapters", {}).get(start.seat)
        await super().on_match_start(start)
        # Set before any wait: a turn that follows at once must find this match's version.
        seats = self.memory(start.match).setdefault("adapters", {})
        owner = f"{start.match}/{start.seat}"
        if earlier is not None:
            seats[start.seat] = earlier
        elif start.adapter is None:
            seats[start.seat] = self._play_current(owner)
        else:
            # Half the first turn's budget at most: its decision must still see the refusal.
            first_turn_s = budget_s(start.turn_timeout_s, self.deadline_margin_s)
            wait_s = min(self.announce_wait_s, first_turn_s / 2)
            task = asyncio.get_running_loop().create_task(
                self._play_named(owner, start.adapter, wait_s), name=f"adapter-{owner}"
            )
            task.add_done_callback(_retrieve)
            seats[start.seat] = task

    async def on_match_end(self, end: MatchEnd) -> None:
        # Every seat of the match ends together: let go of all of them.
        seats: dict[int, asyncio.Future[Played]] = self.memory(end.match).get("adapters", {})
        for seat, played in seats.items():
            played.cancel()  # a load still under way goes on, unpinned, for whoever wants it next
            if self.cache is not None:
                self.cache.unpin(f"{end.match}/{seat}")
        await super().on_match_end(end)

    def _pin_current(self, owner: str) -> Played:
        name, version = self.current
        if name is not None and self.cache is not None:
            self.cache.pin(owner, name)
        return name, version

    def _play_current(self, owner: str) -> asyncio.Future[Played]:
        """The current adapter, pinned for ``owner``: known at once."""
        played: asyncio.Future[Played] = asyncio.get_running_loop().create_future()
        played.set_result(self._pin_current(owner))
        return played

    async def _play_named(self, owner: str, ref: AdapterRef, wait_s: float) -> Played:
        """The version a match names for this seat; the current one if it cannot be had;
        ``AdapterRefused`` if no trainer announced it."""
        if not await self._until_announced(ref, wait_s):
            exc = AdapterRejected(
                "unannounced",
                f"no trainer announced {ref.policy} {ref.version} "
                f"(sha256 {ref.sha256[:12]}..., at {ref.uri})",
            )
            metrics.ADAPTER_REJECTED.labels(reason=exc.reason).inc()
            log.warning(
                "%s: refused the adapter for %s: %s; it plays no policy", self.id, owner, exc
            )
            raise AdapterRefused(exc.detail)
        try:
            async with asyncio.timeout(self.adapter_timeout_s):
                return await self._acquire(owner, ref), ref.version
        except asyncio.CancelledError:  # the match ended first
            if self.cache is not None:
                self.cache.unpin(owner)
            raise
        except AdapterRejected as exc:
            self._rejected(f"adapter {ref.version} from {ref.uri} for {owner}", exc, "playing")
        except TimeoutError:
            log.warning(
                "%s: adapter %s for %s not loaded within %.0f s; playing %s",
                self.id,
                ref.version,
                owner,
                self.adapter_timeout_s,
                self.version,
            )
        except Exception:
            log.exception(
                "%s: could not load adapter %s for %s; playing %s",
                self.id,
                ref.version,
                owner,
                self.version,
            )
        return self._pin_current(owner)

    async def _adapter_for(self, turn: Turn) -> Played:
        """This match seat's version, waiting for its load if it is still under way."""
        seats = self.memory(turn.match).setdefault("adapters", {})
        played = seats.get(turn.seat)
        if played is None:  # a turn that overtook its match_start
            played = seats[turn.seat] = self._play_current(f"{turn.match}/{turn.seat}")
        return await asyncio.shield(played)  # a decision's deadline must not cancel the load

    def _settled(self, turn: Turn) -> Played:
        """What this seat plays if settled by now; (None, None) if not (a deadline may strike
        before it is) or if it is the base model."""
        played = self.memory(turn.match).get("adapters", {}).get(turn.seat)
        if played is None or not played.done() or played.cancelled() or played.exception():
            return None, None
        return played.result()

    def _settled_policy(self, turn: Turn) -> str | None:
        """Whose adapter this seat plays, if settled (None: the base model, or not known yet)."""
        name = self._settled(turn)[0]
        return None if name is None else self.policies.get(name)

    def _settled_version(self, turn: Turn) -> str | None:
        """The version this seat plays if known by now (a deadline may strike before it is)."""
        return self._settled(turn)[1]


def _retrieve(task: asyncio.Future[Played]) -> None:
    """A refused seat's outcome is read by its turns; one with no turn left must not warn."""
    if not task.cancelled():
        task.exception()
