"""The public agent API: subclass ``Agent``, implement ``act``; optionally ``talk``.

An agent sees exactly what the referee sends its seat: a ``Turn`` (the
observation as data and as prompt text, the legal answers, the deadline) and
the chat ``Delivery`` messages of the channels it is in or overhears. The
runtime (``backroom.agents.runtime``) connects it to the bus; the same class
runs from the CLI (``backroom agent KIND``), a script or a notebook.

Kinds are registered by name so configs and the CLI can build them::

    @register_agent("always")
    class Always(Agent): ...
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from backroom.bus.wire import Chat, Checkpoint, Delivery, MatchEnd, MatchStart, Trace, Turn

JSON = Any


class Agent:
    """Base class for every agent kind.

    Per-match memory: ``self.matches[match_id]`` is a dict that lives from
    ``match_start`` to ``match_end``, holding the seat, the messages heard and
    anything a subclass stores there.
    """

    kind: ClassVar[str] = "custom"
    #: Decisions may run concurrently across matches; set False to serialise them.
    concurrent: ClassVar[bool] = True
    #: Run ``act``, ``talk`` and the hooks inside the delivery callback up to
    #: their first real wait, with no task and no loop iteration before the
    #: answer leaves (``bus.eager``). For policies that answer at once; until
    #: that first wait they have no task of their own, so ``asyncio.timeout``
    #: and ``asyncio.current_task()`` are out. Off by default, on for scripted kinds.
    inline: ClassVar[bool] = False
    #: Name of the policy whose checkpoint messages this agent follows (trainable agents).
    policy: str | None = None

    def __init__(self, agent_id: str, seed: int | None = None, **options: Any) -> None:
        if options:
            raise TypeError(f"agent kind {self.kind!r} takes no options {sorted(options)}")
        self.id = agent_id
        self.rng = random.Random(seed)
        self.matches: dict[str, dict[str, Any]] = {}
        self._trace_sink: Callable[[Trace], Awaitable[None]] | None = None
        self._chat_sink: Callable[[Chat], Awaitable[None]] | None = None

    async def act(self, turn: Turn) -> JSON:
        """Return one legal action for an act turn (``turn.legal`` lists or describes them)."""
        raise NotImplementedError

    async def talk(self, turn: Turn) -> str | None:
        """Return a message for a talk turn on ``turn.channel``, or None to stay silent."""
        return None

    # --- hooks the runtime calls; override to keep memory --------------------

    async def on_match_start(self, start: MatchStart) -> None:
        self.matches[start.match or ""] = {"seat": start.seat, "start": start, "heard": []}

    async def on_message(self, delivery: Delivery) -> None:
        self.memory(delivery.match)["heard"].append(delivery)

    async def on_match_end(self, end: MatchEnd) -> None:
        self.matches.pop(end.match or "", None)

    async def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        """A trainer published a new adapter for ``self.policy``; swap it in between matches."""

    async def on_error(self, error: Any) -> None:
        """The referee rejected something this agent sent (``backroom.bus.wire.Error``)."""

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

    async def setup(self) -> None:
        """Load models or files once before the first match (runs inside the event loop)."""

    async def close(self) -> None:
        """Release what ``setup`` acquired."""

    def memory(self, match: str | None) -> dict[str, Any]:
        return self.matches.setdefault(match or "", {"heard": []})


A = TypeVar("A", bound=type[Agent])
_KINDS: dict[str, type[Agent]] = {}


class ScriptedAgent(Agent):
    """A policy computed from the turn alone, at once: it runs inline (see ``Agent.inline``)."""

    inline = True


def register_agent(name: str) -> Callable[[A], A]:
    def deco(cls: A) -> A:
        cls.kind = name
        _KINDS[name] = cls
        return cls

    return deco


def agent_kinds() -> dict[str, type[Agent]]:
    from backroom.agents import scripted as _scripted  # noqa: F401  (registers kinds)

    return dict(_KINDS)


def make_agent(kind: str, agent_id: str, **options: Any) -> Agent:
    kinds = agent_kinds()
    if kind not in kinds:
        raise ValueError(f"unknown agent kind {kind!r}; known: {sorted(kinds)}")
    try:
        return kinds[kind](agent_id, **options)
    except TypeError as exc:
        raise ValueError(f"bad options for agent kind {kind!r}: {exc}") from None


def choices(turn: Turn) -> list[JSON]:
    """The finite legal answers of a turn (empty when the game describes a range instead)."""
    return list(turn.legal.get("choices", []))
