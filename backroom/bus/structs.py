"""The move path's messages as compiled msgspec structs, with the same JSON as ``wire``'s models.

A refereed move is a ``Turn`` out of the referee, an ``Action`` or ``Chat``
back (and ``Delivery``s of what was said); at a hundred matches in flight,
building, serialising and validating those as pydantic models was a sizeable
part of the referee's profile and of an agent's (docs/speed.md). These
structs are the same messages, field for field, in the same order, with the
same constraints, read and written by msgspec's compiled codec. Each struct's
``type`` is its msgspec tag, so it is written first (``{"type":"turn","v":1,
...}``); every JSON reader takes the object as before, and the schema version
``v`` is unchanged. ``wire``'s pydantic models stay for everything else and
stay the reference: what people write (configs, match requests), and every
payload the structs do not take.

``parse_all`` judges a payload with the structs first and, for anything they
do not take whole (another message type, a bad field, a number written
``3.0`` where an integer belongs), hands the payload to ``wire.parse_all``:
a refusal is always pydantic's, with the same ``WireError`` reason and
detail as before. The structs accept a subset of what the models accept,
never more, and a message of a struct's type that only the models took comes
back as the struct, so a reader sees one class per type.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeAlias

import msgspec
from pydantic import BaseModel

from backroom.bus import wire
from backroom.bus.wire import (
    MAX_BATCH_MESSAGES,
    MAX_CHAT_CHARS,
    MAX_JSON_DEPTH,
    MAX_MESSAGE_BYTES,
    AgentFallback,
    EndReason,
    ErrorReason,
    WireError,
)

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
MatchField = Annotated[str, msgspec.Meta(max_length=128)] | None


class Envelope(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """``wire.Envelope``: schema version, match, the sender's counter and clock."""

    v: Literal[1] = wire.SCHEMA_VERSION
    match: MatchField = None
    seq: NonNegative = 0
    ts: float = msgspec.field(default_factory=time.time)

    @property
    def type(self) -> str:
        """The message's ``type``, as the models have it (here, the struct's tag)."""
        return self.__struct_config__.tag  # type: ignore[return-value]


class Turn(Envelope, kw_only=True, tag="turn"):
    """``wire.Turn``: your move, the observation, its text, and what you may answer."""

    turn: NonNegative
    seat: int
    phase: Literal["talk", "act", "review"]
    channel: str | None = None
    observation: dict[str, Any]
    prompt: str = ""
    legal: dict[str, Any] = {}
    deadline_s: float


class Action(Envelope, kw_only=True, tag="action"):
    """``wire.Action``: a seat's move for a turn."""

    turn: NonNegative
    action: Any
    seat: int | None = None
    fallback: AgentFallback | None = None


class Chat(Envelope, kw_only=True, tag="chat"):
    """``wire.Chat``: a message to a channel (``turn`` names a talk turn; free chat has none)."""

    channel: str
    text: Annotated[str, msgspec.Meta(max_length=MAX_CHAT_CHARS)]
    turn: int | None = None
    seat: int | None = None
    fallback: AgentFallback | None = None


class Flag(Envelope, kw_only=True, tag="flag"):
    """``wire.Flag``: an overseer's suspicion of a match, whom it accuses and why."""

    suspicion: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    accused: Annotated[list[int], msgspec.Meta(max_length=64)] = []
    reason: Annotated[str, msgspec.Meta(max_length=500)] = ""
    seat: int | None = None


class Delivery(Envelope, kw_only=True, tag="message"):
    """``wire.Delivery``: a chat message as one reader gets it (``overheard`` for eavesdroppers)."""

    channel: str
    sender: str
    sender_seat: int
    text: str
    overheard: bool = False


class Error(Envelope, kw_only=True, tag="error"):
    """``wire.Error``: why the referee refused a message."""

    reason: ErrorReason
    detail: str = ""
    ref_seq: int | None = None


class MatchEnd(Envelope, kw_only=True, tag="match_end"):
    """``wire.MatchEnd``: a seat's returns and why the match ended."""

    seat: int
    returns: list[float]
    raw_returns: list[float]
    reason: EndReason
    observation: dict[str, Any] = {}


class Event(Envelope, kw_only=True, tag="event"):
    """``wire.Event``: a public event of a match; nothing private goes here."""

    kind: str
    data: dict[str, Any] = {}


class Status(Envelope, kw_only=True, tag="status"):
    """``wire.Status``: an identity's presence (online, offline) and what it reads."""

    state: Literal["online", "offline"]
    kind: Annotated[str, msgspec.Meta(max_length=64)] = ""
    batches: bool = False
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] | None = None
    traces: bool = False


Struct: TypeAlias = Turn | Action | Chat | Flag | Delivery | Error | MatchEnd | Event | Status
#: Each struct by its ``type``, and the pydantic model it mirrors.
STRUCTS: dict[str, type[Struct]] = {
    s.__struct_config__.tag: s  # type: ignore[misc]
    for s in (Turn, Action, Chat, Flag, Delivery, Error, MatchEnd, Event, Status)
}
MODELS: dict[type[Struct], type[BaseModel]] = {
    s: getattr(wire, s.__name__) for s in STRUCTS.values()
}

_DECODER = msgspec.json.Decoder(Struct | list[Struct])  # one message, or a batch
_ENCODER = msgspec.json.Encoder()
#: Brackets a payload may hold and still be read by the structs: fewer than
#: ``wire.MAX_JSON_DEPTH`` cannot nest that deep, whatever the order. msgspec has no
#: depth limit of its own, so a deeper-looking payload goes to the models, which refuse
#: one that is (``too_deep``). Counted in C, brackets in strings too.
_MAX_BRACKETS = MAX_JSON_DEPTH - 10


def encode(msg: Struct) -> bytes:
    """The JSON of ``msg``: ``wire.dump`` of its model, but ``type`` first."""
    return _ENCODER.encode(msg)


def parse_all(
    payload: bytes, max_bytes: int = MAX_MESSAGE_BYTES
) -> list[Struct | wire.Message | WireError]:
    """``wire.parse_all``, with the struct of each message of a struct's type.

    A payload of structs only (one message or a batch) is read by msgspec;
    any other goes to ``wire.parse_all`` whole, so what is refused is refused
    as before (the same ``WireError``), and nothing the models took is lost.
    """
    if len(payload) <= max_bytes and payload.count(b"[") + payload.count(b"{") < _MAX_BRACKETS:
        try:
            read = _DECODER.decode(payload)
        except msgspec.DecodeError:  # a ValidationError too: the models say why
            pass
        else:
            if not isinstance(read, list):
                return [read]
            if 0 < len(read) <= MAX_BATCH_MESSAGES:
                return read
    return [_struct_of(m) for m in wire.parse_all(payload, max_bytes)]


def _struct_of(msg: wire.Message | WireError) -> Struct | wire.Message | WireError:
    """A message of a struct's type that only the models took (say ``"turn": 3.0``), as the struct."""
    struct = STRUCTS.get(getattr(msg, "type", ""))
    if struct is None:
        return msg
    return msgspec.convert(msg.model_dump(), struct)  # type: ignore[union-attr]


def model_of(msg: Struct) -> BaseModel:
    """The pydantic model of ``msg``, validated (for readers that want ``wire``'s classes)."""
    return MODELS[type(msg)].model_validate(msgspec.to_builtins(msg))
