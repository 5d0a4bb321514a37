"""The public agent API: subclass ``Agent``, implement ``act``; optionally ``talk``.

An agent sees exactly what the referee sends its seat: a ``Turn`` (the
observation as data and as prompt text, the legal answers, the deadline) and
the chat ``Delivery`` messages of the channels it is in or overhears. The
runtime (``backroom.agents.runtime``) connects it to the bus; the same class
runs from the CLI (``backroom agent KIND``), a script or a notebook.

Kinds are registered by name so configs and the CLI can build them
(``backroom.agents.kinds``)::

    @register_agent("always")
    class Always(Agent): ...
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from backroom.bus.wire import (
    AgentFallback,
    Chat,
    Checkpoint,
    Delivery,
    Flag,
    MatchEnd,
    MatchStart,
    Trace,
    Turn,
)
from backroom.seeds import derive_seed

JSON = Any


class Agent:
    """Base class for every agent kind.

    Per-match memory: ``self.matches[match_id]`` is a dict that lives from
    ``match_start`` to ``match_end``, holding the seat, the messages heard and
    anything a subclass stores there.

    Randomness: a policy that samples draws from ``self.rng_for(turn.match,
    turn.seat)``, a generator of its own per match and seat seeded from
    ``MatchStart.seed`` (and the agent's ``seed`` option, if given). Draws then
    depend only on the match's seed, the seat and the decisions before in that
    match, so rerunning a config replays every action: other matches,
    concurrency, process layout and timing do not enter. ``self.rng`` is the
    agent's own generator for what should not replay (retry jitter).
    """

    kind: ClassVar[str] = "custom"
    #: Decisions may run concurrently across matches; set False to serialise them.
    concurrent: ClassVar[bool] = True
    #: Run ``act``, ``talk`` and the hooks inside the delivery callback up to
    #: their first real wait, with no task and no loop iteration before the
    #: answer leaves (``agents.eager``). For policies that answer at once; until
    #: that first wait they have no task of their own, so ``asyncio.timeout``
    #: and ``asyncio.current_task()`` are out. Off by default, on for scripted kinds.
    inline: ClassVar[bool] = False
    #: Name of the policy whose checkpoint messages this agent follows (trainable agents).
    policy: str | None = None
    #: Hand this agent every adapter version a trainer announced (``on_announced``): an
    #: agent that loads the adapters a match names must know which ones a trainer chose.
    follows_announcements: ClassVar[bool] = False
    #: Publishes a trace of every decision (``publish_trace``), a fallback's too; said in
    #: the agent's status, so a runner recording traces knows whose to wait for.
    traces_decisions: ClassVar[bool] = False

    def __init__(self, agent_id: str, seed: int | None = None, **options: Any) -> None:
        if options:
            raise TypeError(f"agent kind {self.kind!r} takes no options {sorted(options)}")
        self.id = agent_id
        #: The agent's ``seed`` option, mixed into every per-match generator when given.
        self.seed = seed
        #: Agent-wide, not replayable across runs: for timing (backoff jitter), never for play.
        self.rng = random.Random(seed)
        self.matches: dict[str, dict[str, Any]] = {}
        self._trace_sink: Callable[[Trace], Awaitable[None]] | None = None
        self._chat_sink: Callable[[Chat | Flag], Awaitable[None]] | None = None
        self._fallbacks: dict[tuple[str | None, int, int], AgentFallback] = {}

    async def act(self, turn: Turn) -> JSON:
        """Return one legal action for an act turn (``turn.legal`` lists or describes them)."""
        raise NotImplementedError

    async def talk(self, turn: Turn) -> str | None:
        """Return a message for a talk turn on ``turn.channel``, or None to stay silent."""
        return None

    async def review(self, turn: Turn) -> None:
        """An observer's last word on a finished game (``send_flag`` here); default: none."""

    # --- hooks the runtime calls; override to keep memory --------------------

    async def on_match_start(self, start: MatchStart) -> None:
        self.matches[start.match or ""] = {"seat": start.seat, "start": start, "heard": []}

    async def on_message(self, delivery: Delivery) -> None:
        self.memory(delivery.match)["heard"].append(delivery)

    async def on_match_end(self, end: MatchEnd) -> None:
        self.matches.pop(end.match or "", None)

    async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        """A trainer published a new adapter for ``self.policy``; swap it in between matches."""

    def on_announced(self, checkpoint: Checkpoint) -> None:
        """A trainer announced this adapter version (a checkpoint, or ``models/+/versions/+``).

        Called in the delivery callback, before anything that follows it: only
        the trainer role writes those topics, so this is what proves a version
        was the trainer's choice (``follows_announcements``).
        """

    async def on_error(self, error: Any) -> None:
        """The referee rejected something this agent sent (``backroom.bus.wire.Error``)."""

    def mark_fallback(self, turn: Turn, reason: AgentFallback) -> None:
        """Say that the answer ``act`` or ``talk`` returns for ``turn`` is not the policy's own
        choice (a default sent at the deadline, after an unreadable reply, ...), and why.

        The runtime sends the reason with the answer (``Action.fallback``) and the
        referee writes it into the episode record, where every count and
        ``backroom analyze --exclude-fallbacks`` find it: a default must never pass
        for a decision. Reasons: ``backroom.bus.wire.AgentFallback``.
        """
        self._fallbacks[(turn.match, turn.turn, turn.seat)] = reason

    def take_fallback(self, turn: Turn) -> AgentFallback | None:
        """The reason ``mark_fallback`` gave for ``turn``, forgotten once read (the runtime's)."""
        marks = getattr(self, "_fallbacks", None)  # None: a subclass that skipped __init__
        return marks.pop((turn.match, turn.turn, turn.seat), None) if marks else None

    async def publish_trace(self, trace: Trace) -> None:
        """Send one decision's trace to ``traces/{agent}`` (a no-op outside a runtime)."""
        if self._trace_sink is not None:
            trace.agent = self.id
            await self._trace_sink(trace)

    async def send_chat(self, match: str, channel: str, text: str, seat: int | None = None) -> None:
        """Free chat on a channel that is always open, outside any turn (people use this)."""
        if self._chat_sink is None:
            raise RuntimeError(f"agent {self.id!r} is not connected to a bus")
        await self._chat_sink(Chat(match=match, channel=channel, text=text, seat=seat))

    async def send_flag(
        self, match: str, suspicion: float, accused: list[int], reason: str = ""
    ) -> None:
        """An overseer's flag on a running match (the referee records it; docs/collusion.md)."""
        if self._chat_sink is None:
            raise RuntimeError(f"agent {self.id!r} is not connected to a bus")
        flag = Flag(match=match, suspicion=suspicion, accused=accused, reason=reason[:500])
        await self._chat_sink(flag)

    async def setup(self) -> None:
        """Load models or files once before the first match (runs inside the event loop)."""

    async def close(self) -> None:
        """Release what ``setup`` acquired."""

    def memory(self, match: str | None) -> dict[str, Any]:
        return self.matches.setdefault(match or "", {"heard": []})

    def decision_seed(self, turn: Turn, *parts: object, bits: int = 63) -> int:
        """A seed for one decision's sampler (a model's generator, an API's ``seed``).

        From the match's seed, the seat, the turn and ``parts`` (which call of
        the decision: ``"act"``, ``"repair"``...), so it does not depend on how
        many draws came before: a decision replays even if an earlier one was
        cut short by a deadline.
        """
        start: MatchStart | None = self.memory(turn.match).get("start")
        if start is None:  # the turn overtook its match_start: no seed to replay from
            return self.rng.getrandbits(bits)
        return derive_seed(
            "backroom", start.seed, self.seed, turn.seat, turn.turn, *parts, bits=bits
        )

    def rng_for(self, match: str | None, seat: int | None = None) -> random.Random:
        """This seat's generator for ``match``: replays from ``MatchStart.seed`` and the seat.

        Made at the first draw and kept in the match's memory (gone at
        ``match_end``), so draws follow one another per seat within the match
        whatever other matches do meanwhile. ``seat`` defaults to the seat
        this agent holds (pass ``turn.seat`` where one agent holds several).
        Should a turn overtake its ``match_start`` (the seed is not known
        yet), the generator comes from ``self.rng`` and that match does not
        replay.
        """
        mem = self.memory(match)
        if seat is None:
            seat = int(mem.get("seat", 0))
        rngs: dict[int, random.Random] = mem.setdefault("rngs", {})
        rng = rngs.get(seat)
        if rng is None:
            start: MatchStart | None = mem.get("start")
            if start is not None:
                seed = derive_seed("backroom", start.seed, self.seed, seat)
            else:
                seed = self.rng.getrandbits(63)
            rng = rngs[seat] = random.Random(seed)
        return rng


class ScriptedAgent(Agent):
    """A policy computed from the turn alone, at once: it runs inline (see ``Agent.inline``)."""

    inline = True


def choices(turn: Turn) -> list[JSON]:
    """The finite legal answers of a turn (empty when the game describes a range instead)."""
    return list(turn.legal.get("choices", []))
