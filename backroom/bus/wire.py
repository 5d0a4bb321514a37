"""Every message on the bus, as pydantic v2 models.

Each message carries the envelope ``v`` (schema version), ``type``, ``match``,
``seq`` (per-sender counter) and ``ts`` (sender's wall clock). ``type`` is the
discriminator of the ``Message`` union, so one ``parse()`` call validates any
payload in a single pass through pydantic-core.

The models are data only: routing lives in ``backroom.referee`` and rules in
``backroom.games``. Two families live beside this module and are re-exported
here, so every reader imports the wire from one place: a match's configuration
(``wire_spec``: ``MatchSpec``, channels, interventions) and the episode record
(``wire_records``: ``EpisodeRecord`` and the reasons it counts by).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from backroom.bus.wire_records import FALLBACK_REASONS as FALLBACK_REASONS
from backroom.bus.wire_records import ActionRecord as ActionRecord
from backroom.bus.wire_records import AgentFallback as AgentFallback
from backroom.bus.wire_records import DeliveryRecord as DeliveryRecord
from backroom.bus.wire_records import EndReason as EndReason
from backroom.bus.wire_records import EpisodeRecord as EpisodeRecord
from backroom.bus.wire_records import Fallback as Fallback
from backroom.bus.wire_records import FlagRecord as FlagRecord
from backroom.bus.wire_spec import JSON as JSON
from backroom.bus.wire_spec import MAX_CHAT_CHARS as MAX_CHAT_CHARS
from backroom.bus.wire_spec import MAX_PATTERN_CHARS as MAX_PATTERN_CHARS
from backroom.bus.wire_spec import PARAPHRASE_PROMPT as PARAPHRASE_PROMPT
from backroom.bus.wire_spec import AdapterRef as AdapterRef
from backroom.bus.wire_spec import AgentId as AgentId
from backroom.bus.wire_spec import Budget as Budget
from backroom.bus.wire_spec import ChannelSpec as ChannelSpec
from backroom.bus.wire_spec import Delay as Delay
from backroom.bus.wire_spec import Drop as Drop
from backroom.bus.wire_spec import Intervention as Intervention
from backroom.bus.wire_spec import MatchSpec as MatchSpec
from backroom.bus.wire_spec import Paraphrase as Paraphrase
from backroom.bus.wire_spec import Redact as Redact
from backroom.bus.wire_spec import RewardTransform as RewardTransform
from backroom.bus.wire_spec import ShuffleRoles as ShuffleRoles

SCHEMA_VERSION: Literal[1] = 1
#: Largest payload the referee accepts from an agent; bigger ones get an error.
MAX_PAYLOAD_BYTES = 64 * 1024
#: Largest message of any kind: an 800-round Bertrand episode is ~200 KB, and
#: the broker's max_packet_size is set to match.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: ``Error.reason``: why the referee refused a message, as docs/architecture.md lists them
#: (the first seven are ``WireError``'s, a payload that is no valid message).
ErrorReason = Literal[
    "malformed",
    "oversized",
    "too_deep",
    "batch_too_long",
    "unknown_type",
    "invalid",
    "unexpected_type",
    "unknown_match",
    "late",
    "not_seated",
    "not_your_seat",
    "not_your_turn",
    "bad_turn",
    "wrong_phase",
    "wrong_channel",
    "illegal_action",
    "too_long",
    "not_a_member",
    "channel_closed",
    "quota",
    "rate_limited",
]
#: The detail of the ``voided`` episodes of a stopping referee: not the match's doing, so
#: the runner asks for them again.
SHUTTING_DOWN = "referee shutting down"
#: The detail of the ``voided`` episodes of a referee whose broker connection was lost.
BROKER_LOST = "broker connection lost mid-match"
#: ``Event.kind``s a referee sends a match's requester (``reply_to``): it took the match,
#: it still runs it (asked again), it finished it and no longer keeps its episode.
ACCEPTED, RUNNING, FORGOTTEN = "accepted", "running", "forgotten"
#: Seconds a process starting under an identity that was used before stays ready to be
#: thrown off by a process still logged in under it (``IdentityInUse``). That process
#: reconnects within about 0.1 s of losing its connection (the bus's first backoff),
#: so a second leaves room for a busy one. Referees and agents alike.
IDENTITY_WINDOW_S = 1.0


class Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)

    v: Literal[1] = SCHEMA_VERSION
    match: str | None = Field(default=None, max_length=128)
    seq: int = Field(default=0, ge=0)
    ts: float = Field(default_factory=time.time)


# --- messages -----------------------------------------------------------------


MATCH_ID = r"^[A-Za-z0-9_.:-]{1,128}$"


class MatchRequest(Envelope):
    type: Literal["match_request"] = "match_request"
    match: str = Field(pattern=MATCH_ID)
    spec: MatchSpec
    reply_to: AgentId | None = Field(
        default=None, description="identity whose inbox gets the 'accepted' ack"
    )
    reply_batches: bool = Field(
        default=False, description="reply_to reads batched payloads (JSON arrays)"
    )
    run_key: str | None = Field(
        default=None,
        max_length=128,
        description="the secret of the run directory spec.run_stamp names: a referee writes "
        "there only for requests with the key it was bound to. Only referees read requests, "
        "and the key is no part of the spec, so episodes never carry it",
    )
    again: bool = Field(
        default=False,
        description="asked again for an acknowledged match with no episode: a referee that "
        "finished it publishes its episode again, one running it says 'running', any other "
        "referee ignores it (never plays it)",
    )


class MatchStart(Envelope):
    type: Literal["match_start"] = "match_start"
    seat: int
    seats: list[str]
    game: str
    params: dict[str, JSON] = Field(default_factory=dict)
    channels: list[ChannelSpec] = Field(
        default_factory=list, description="channels this seat is in or overhears"
    )
    turn_timeout_s: float
    adapter: AdapterRef | None = Field(
        default=None, description="the adapter version this seat plays with"
    )
    seed: int = Field(
        default=0,
        description="what agents seed their sampling from (with their seat): the match's seed, "
        "mixed with its crn_index past a CRN group's first match; rerunning a config replays it",
    )
    referee: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="the identity of the referee running this match: the seat's moves and chat "
        "go to agents/{agent}/outbox/{referee}, which only it reads (none: a referee from "
        "before outboxes per referee, which reads agents/{agent}/outbox)",
    )


class Turn(Envelope):
    """Your move: the observation, its text, and what you may answer."""

    type: Literal["turn"] = "turn"
    turn: int = Field(ge=0)
    seat: int
    #: ``review``: an observer's last word once the game is over (its flags, then an
    #: ``Action`` with no action; docs/collusion.md, "Overseers").
    phase: Literal["talk", "act", "review"]
    channel: str | None = None
    observation: dict[str, JSON]
    prompt: str = ""
    legal: dict[str, JSON] = Field(default_factory=dict)
    deadline_s: float


class Action(Envelope):
    type: Literal["action"] = "action"
    turn: int = Field(ge=0)
    action: JSON
    seat: int | None = Field(
        default=None, description="needed only when one agent holds several seats"
    )
    fallback: AgentFallback | None = Field(
        default=None,
        description="set when this action is not the agent's own choice, and why "
        "(the episode record keeps it: ActionRecord.fallback)",
    )


class Chat(Envelope):
    """A message to a channel; in a talk turn ``turn`` names it, free chat leaves it out."""

    type: Literal["chat"] = "chat"
    channel: str
    text: str = Field(max_length=MAX_CHAT_CHARS)
    turn: int | None = None
    seat: int | None = None
    fallback: AgentFallback | None = Field(
        default=None,
        description="as Action.fallback, for a talk turn's message (free chat is not recorded)",
    )


class Flag(Envelope):
    """An overseer's word on a match, at any time while it runs: how suspicious (0 to 1),
    whom it accuses (seats), and why. Any agent at the table may send one."""

    type: Literal["flag"] = "flag"
    suspicion: float = Field(ge=0.0, le=1.0)
    accused: list[int] = Field(default_factory=list, max_length=64)
    reason: str = Field(default="", max_length=500)
    seat: int | None = None


class Delivery(Envelope):
    """A chat message as delivered to one reader; ``overheard`` for eavesdroppers."""

    type: Literal["message"] = "message"
    channel: str
    sender: str
    sender_seat: int
    text: str
    overheard: bool = False


class Error(Envelope):
    type: Literal["error"] = "error"
    reason: ErrorReason
    detail: str = ""
    ref_seq: int | None = None


class MatchEnd(Envelope):
    type: Literal["match_end"] = "match_end"
    seat: int
    returns: list[float]
    raw_returns: list[float]
    reason: EndReason
    observation: dict[str, JSON] = Field(default_factory=dict)


class Status(Envelope):
    type: Literal["status"] = "status"
    state: Literal["online", "offline"]
    kind: str = Field(default="", max_length=64)
    batches: bool = Field(
        default=False,
        description="this agent reads batched inbox payloads (JSON arrays of messages)",
    )
    heartbeat_s: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description=(
            "while online, this status is published again at least this often (seconds); "
            "readers take an online status not renewed in time as gone (backroom.bus.presence)"
        ),
    )
    traces: bool = Field(
        default=False,
        description="this agent publishes a trace of each decision it makes (traces/{agent}): "
        "a runner recording traces waits for them after the last episode",
    )


class Event(Envelope):
    """A public event of a match (``matches/{match}/public``): nothing private goes here."""

    type: Literal["event"] = "event"
    kind: str
    data: dict[str, JSON] = Field(default_factory=dict)


class Episode(Envelope):
    type: Literal["episode"] = "episode"
    record: EpisodeRecord


#: Largest trace the trainer stores or the runner records (its JSON, one message). A
#: trace is one decision: its prompt and completion tokens, their log-probs, the raw
#: request and reply of an API model; a 32k-token prompt with its text is under 1 MiB.
MAX_TRACE_BYTES = 1024 * 1024


class Trace(Envelope):
    """One decision of a trainable agent, joined with episodes by (match, turn, seat).

    ``logprobs`` are the completion tokens' log-probs under the model at
    temperature 1. A decision made by scoring the legal actions also carries
    every candidate's token ids, their summed log-probs and the index chosen:
    the agent sampled from ``softmax(candidate_logprobs / temperature)``, and
    that renormalised distribution is the policy a trainer differentiates.
    """

    type: Literal["trace"] = "trace"
    agent: str
    turn: int
    seat: int | None = None
    phase: Literal["talk", "act", "review"]  # review: never traced (no model decides it)
    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    candidates: list[list[int]] = Field(default_factory=list)
    candidate_logprobs: list[float] = Field(default_factory=list)
    chosen: int | None = None
    temperature: float = 1.0
    adapter_version: str | None = None
    adapter_policy: str | None = Field(
        default=None, description="whose version played (co-trained policies share version names)"
    )
    request: JSON = None
    reply: JSON = None


class Checkpoint(Envelope):
    """A new adapter for ``policy`` (retained on ``models/{policy}/checkpoint``); agents load it
    only if the files' digest equals ``sha256`` (``backroom.model.adapters.adapter_digest``)."""

    type: Literal["checkpoint"] = "checkpoint"
    policy: str
    version: str
    uri: str
    sha256: str = ""
    size: int = 0

    def ref(self) -> AdapterRef:
        return AdapterRef(
            policy=self.policy,
            version=self.version,
            uri=self.uri,
            sha256=self.sha256,
            size=self.size,
        )


Message = Annotated[
    MatchRequest
    | MatchStart
    | Turn
    | Action
    | Chat
    | Flag
    | Delivery
    | Error
    | MatchEnd
    | Status
    | Event
    | Episode
    | Trace
    | Checkpoint,
    Field(discriminator="type"),
]

_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


class WireError(ValueError):
    """A payload that is not a valid message; ``reason`` is a short code for metrics."""

    def __init__(self, reason: ErrorReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def parse(payload: bytes | str, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Validate any wire payload; raise ``WireError`` with a reason an agent can act on.

    The referee passes ``MAX_PAYLOAD_BYTES`` for what agents send; records
    travelling between services (episodes) may be far larger.
    """
    if len(payload) > max_bytes:
        raise WireError("oversized", f"payload of {len(payload)} bytes exceeds {max_bytes}")
    try:
        return _ADAPTER.validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        kind = first["type"]
        loc = ".".join(str(x) for x in first["loc"])
        if kind == "json_invalid":
            raise _not_json(first["msg"]) from None
        if kind in ("union_tag_invalid", "union_tag_not_found", "model_attributes_type"):
            raise WireError("unknown_type", f"{first['msg']}") from None
        raise WireError("invalid", f"{loc}: {first['msg']}") from None


#: Largest status any reader parses. A status is some 150 bytes; it is retained and
#: handed to every reader of ``agents/+/status`` (referees, runners, the web
#: server), and Mosquitto has no size limit per topic (``max_packet_size`` is one
#: for all messages, and episodes need 16 MB), so each reader drops a bigger one
#: unread.
MAX_STATUS_BYTES = 1024


def parse_status(payload: bytes | str) -> Status:
    """A status, or ``WireError``: ``oversized`` past ``MAX_STATUS_BYTES`` (checked before
    parsing), ``unexpected_type`` for any other message."""
    msg = parse(payload, MAX_STATUS_BYTES)
    if not isinstance(msg, Status):
        raise WireError("unexpected_type", f"a status topic carries statuses, not {msg.type!r}")
    return msg


#: How deep pydantic-core's JSON parser nests before it gives up; no message needs more than a few levels.
MAX_JSON_DEPTH = 200


def _not_json(msg: str) -> WireError:
    """The error for a payload the JSON parser refused; nesting past its limit gets its own reason."""
    if "recursion limit" in msg:
        return WireError("too_deep", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return WireError("malformed", f"not JSON: {msg}")


#: Most messages one batch may hold. ``Bus.publish`` batches at most
#: ``publish.BATCH_MAX_BYTES`` (32 KB) of messages of 90 bytes or more, some 360;
#: a longer array is refused whole, unread.
MAX_BATCH_MESSAGES = 1024

_BATCH: TypeAdapter[list[Message]] = TypeAdapter(
    Annotated[list[Message], Field(max_length=MAX_BATCH_MESSAGES, fail_fast=True)]
)


def parse_all(
    payload: bytes | str, max_bytes: int = MAX_MESSAGE_BYTES
) -> list[Message | WireError]:
    """Validate a payload that is one message or a batch of them: every message, or one error.

    A batch is a JSON array of messages (what ``Bus.publish(..., batch=True)``
    writes when one event-loop iteration sends several messages to one topic).
    The cost of judging it is bounded by the payload, never by what is in it:
    one pass of pydantic-core, stopped at the first bad message, and the whole
    batch is refused with that one ``WireError`` (its index in the detail).
    A writer that follows the schema never sends a bad message, so nothing a
    well-behaved sender batched is lost (docs/operations.md, *Incidents*).
    ``max_bytes`` bounds the whole payload, ``MAX_BATCH_MESSAGES`` its length.
    """
    if len(payload) > max_bytes:
        return [WireError("oversized", f"payload of {len(payload)} bytes exceeds {max_bytes}")]
    if payload.lstrip()[:1] not in (b"[", "["):
        try:
            return [parse(payload, max_bytes)]
        except WireError as exc:
            return [exc]
    try:
        return list(_BATCH.validate_json(payload))
    except ValidationError as exc:
        return [_batch_error(exc.errors()[0])]


def _batch_error(first: Any) -> WireError:
    """The one error for a refused batch, from pydantic's first error."""
    kind, loc = first["type"], first["loc"]
    if kind == "json_invalid":
        return _not_json(first["msg"])
    if kind == "too_long":
        return WireError("batch_too_long", f"a batch holds at most {MAX_BATCH_MESSAGES} messages")
    if kind == "list_type":
        return WireError("malformed", "a batch must be a JSON array of messages")
    where = f"message {loc[0]} of the batch" if loc else "the batch"
    if kind in ("union_tag_invalid", "union_tag_not_found", "model_attributes_type", "dict_type"):
        return WireError("unknown_type", f"{where}: {first['msg']} (batch refused)")
    path = ".".join(str(x) for x in loc[2:])  # past the index and the union's tag
    return WireError("invalid", f"{where}: {path}: {first['msg']} (batch refused)")


def dump(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=False).encode()


class _EpisodeEnvelope(Envelope):
    type: Literal["episode"] = "episode"


def dump_episode(match: str, record_json: bytes) -> bytes:
    """An ``Episode`` message around a record already serialised (for episodes.jsonl):
    the same bytes as ``dump(Episode(match=match, record=record))`` without serialising it twice."""
    head = _EpisodeEnvelope(match=match).model_dump_json().encode()
    return head[:-1] + b',"record":' + record_json + b"}"
