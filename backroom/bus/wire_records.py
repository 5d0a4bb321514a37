"""The episode record: what a finished match leaves, as published and appended to episodes.jsonl.

Every move (``ActionRecord``), every copy of every message (``DeliveryRecord``),
every overseer's flag (``FlagRecord``), and why the match ended and why a move
was not its agent's own choice, in the closed sets readers count by. Part of
the wire's one schema: ``backroom.bus.wire`` re-exports every name, and readers
import them from there.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from backroom.bus.wire_spec import JSON, MatchSpec

#: Why a match ended (``MatchEnd.reason``, ``EpisodeRecord.reason``), as docs/architecture.md lists them.
EndReason = Literal["normal", "timeout", "forfeit", "error", "voided"]

#: Why an answer an agent sent is not its own choice (``Action.fallback``, ``Chat.fallback``):
#: ``deadline`` (out of time: the documented fallback was sent), ``unparseable`` (the reply
#: could not be read, after the repair round too), ``request_failed`` (the model's API
#: refused the request or gave no usable reply after its retries), ``repaired`` (the
#: model's answer at its second try, after a repair round), ``adapter_refused`` (the
#: match named an adapter no trainer announced: the seat played no policy, and a
#: trainer drops the match). A closed set: it is a metric label, and readers count by
#: it (docs/agents.md, *Fallbacks*).
AgentFallback = Literal["deadline", "unparseable", "request_failed", "repaired", "adapter_refused"]
#: ``ActionRecord.fallback``: an agent's own reason, or ``timeout``, the referee's default
#: for a seat whose answer did not arrive in time.
Fallback = Literal[AgentFallback, "timeout"]
FALLBACK_REASONS: tuple[str, ...] = get_args(Fallback)


class FlagRecord(BaseModel):
    """A flag as the episode record keeps it: ``seat`` flagged during ``turn``."""

    t: float
    seat: int
    turn: int
    suspicion: float
    accused: list[int]
    reason: str


class ActionRecord(BaseModel):
    turn: int
    round: int = Field(
        default=1,
        description="the game's round when the turn was asked (from 1): what a trainer credits",
    )
    t: float
    seat: int
    agent: str
    phase: Literal["talk", "act"]
    action: JSON
    timed_out: bool = False
    fallback: Fallback | None = Field(
        default=None,
        description="why this move is not the agent's own choice: the reason its agent sent "
        "(Action.fallback), or 'timeout', the referee's default; None: the agent's own answer "
        "(and in records written before the field)",
    )


class DeliveryRecord(BaseModel):
    """One reader's copy of one message. On a channel with interventions, ``message`` numbers
    the match's messages (the copies of one share it), ``sent`` is what the sender said where
    the reader got something else, ``changed_by`` names the interventions that changed it,
    and a dropped copy is kept with ``delivered`` false and nothing received."""

    t: float
    channel: str
    from_seat: int
    to_seat: int
    text: str
    overheard: bool
    message: int | None = None
    sent: str | None = None
    changed_by: list[str] = Field(default_factory=list)
    delivered: bool = True

    @model_serializer(mode="wrap")
    def _as_before(self, handler: SerializerFunctionWrapHandler) -> Any:
        """A copy no intervention touched is written as records were before they existed."""
        data = handler(self)
        if self.message is None and isinstance(data, dict):
            for key in ("message", "sent", "changed_by", "delivered"):
                data.pop(key, None)
        return data


class EpisodeRecord(BaseModel):
    """One finished match, as published on ``episodes/{game}`` and appended to episodes.jsonl."""

    match: str
    run: str
    referee: str
    spec: MatchSpec
    game: str
    params: dict[str, JSON]
    seed: int
    crn_group: str | None
    seats: list[str]
    actions: list[ActionRecord]
    deliveries: list[DeliveryRecord]
    round_rewards: list[list[float]]
    raw_returns: list[float]
    returns: list[float]
    reason: EndReason
    detail: str = ""
    not_written: bool = Field(
        default=False,
        description="the referee could not append this record to its run's file (an error "
        "episode; detail says why): the runner fails the run rather than wait for it on disk",
    )
    timeouts: list[int] = Field(default_factory=list, description="seat of each timed-out turn")
    invalid_inputs: int = 0
    started_at: float
    ended_at: float
    final_observations: list[dict[str, JSON]] = Field(default_factory=list)
    flags: list[FlagRecord] = Field(default_factory=list, description="overseers' flags")
