"""A match's configuration as a match request carries it (``MatchSpec``) and its parts.

The channels and what the referee does to their messages (interventions), the
reward transform, the adapter versions seats play: what a run config's author
writes, checked once here by the referee that takes the request. Part of the
wire's one schema: ``backroom.bus.wire`` re-exports every name, and readers
import them from there.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Longest chat text (the Trust-and-Split paper allows 500 characters).
MAX_CHAT_CHARS = 2000

JSON = Any
AgentId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


#: The longest regular expression a ``redact`` intervention takes (Python's ``re`` has no
#: time limit: a short pattern bounds what the referee's matching can cost).
MAX_PATTERN_CHARS = 200


class Redact(BaseModel):
    """Every match of each pattern (a Python regular expression) is replaced by ``mark``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["redact"] = "redact"
    patterns: list[str] = Field(min_length=1, max_length=32)
    mark: str = Field(default="[redacted]", max_length=32)

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"a pattern is at most {MAX_PATTERN_CHARS} characters")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is no regular expression: {exc}") from None
        return patterns


class Budget(BaseModel):
    """A message cut to a length, ``per`` message or out of what the sender has left in the match.

    One unit of ``chars``, ``tokens`` (words: runs of non-space characters; the referee
    has no model's tokenizer) or ``bits`` (8 per UTF-8 byte, cut at a character's end).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["budget"] = "budget"
    chars: int | None = Field(default=None, ge=0, le=MAX_CHAT_CHARS)
    tokens: int | None = Field(default=None, ge=0, le=MAX_CHAT_CHARS)
    bits: int | None = Field(default=None, ge=0, le=8 * 4 * MAX_CHAT_CHARS)
    per: Literal["message", "match"] = "message"

    @model_validator(mode="after")
    def _one_unit(self) -> Budget:
        given = [u for u in ("chars", "tokens", "bits") if getattr(self, u) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of chars, tokens or bits, not {given or 'none'}")
        return self


class Delay(BaseModel):
    """Delivered ``turns`` turns of the match later, or at its end (``turns: end``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["delay"] = "delay"
    turns: int | Literal["end"] = 1

    @field_validator("turns", mode="before")
    @classmethod
    def _turns(cls, turns: object) -> object:
        if turns == "end" or (type(turns) is int and 1 <= turns <= 100_000):
            return turns
        raise ValueError(f"write a number of turns from 1 to 100000, or end; not {turns!r}")


class Drop(BaseModel):
    """Lost with probability ``p``, drawn from the match seed: the same run loses the same ones."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["drop"] = "drop"
    p: float = Field(ge=0.0, le=1.0)


class ShuffleRoles(BaseModel):
    """The reader is not told which member sent it (``sender`` empty, ``sender_seat`` -1)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["shuffle_roles"] = "shuffle_roles"


#: What a paraphrasing model is asked, ``{text}`` standing for the message.
PARAPHRASE_PROMPT = (
    "Rewrite the following message in your own words, keeping its meaning. "
    "Answer with the rewritten message only.\n\nMessage: {text}"
)


class Paraphrase(BaseModel):
    """Rewritten by a model: ``model`` names one the referee's operator registered (on the
    referee's command line, or the run config's ``paraphrasers``), never an address or a key."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["paraphrase"] = "paraphrase"
    model: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    prompt: str = Field(default=PARAPHRASE_PROMPT, max_length=MAX_CHAT_CHARS)
    max_tokens: int = Field(default=64, ge=1, le=512)

    @field_validator("prompt")
    @classmethod
    def _has_text(cls, prompt: str) -> str:
        if "{text}" not in prompt:
            raise ValueError("the prompt must hold {text}, where the message goes")
        return prompt


#: What the referee may do to a message between its sender and a reader (docs/collusion.md).
Intervention = Annotated[
    Redact | Budget | Delay | Drop | ShuffleRoles | Paraphrase, Field(discriminator="kind")
]


class ChannelSpec(BaseModel):
    """A talk channel: who may speak and hear, who overhears, when it is open.

    ``opens``:
      * ``before_act`` — before each of a member's act turns the member gets a
        talk turn on this channel (Loki's message-then-act protocol);
      * ``start`` — every member gets a talk turn on this channel after the
        deal, before the first move: a team can share its private information
        before anyone acts, as the team solve assumes;
      * ``always`` — members may send chat at any time during the match;
      * ``game`` — the game's own talk phases (Trust-and-Split, beauty contest
        discussion) are routed to this channel.
    ``max_messages`` bounds messages per member per opening (``before_act``,
    ``start``, ``game``) or per match (``always``).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    members: list[int] = Field(description="seat indices that may speak and hear")
    eavesdroppers: list[int] = Field(
        default_factory=list, description="seats that hear, marked overheard"
    )
    opens: Literal["before_act", "start", "always", "game"] = "before_act"
    max_messages: int = Field(default=1, ge=0, le=1000)
    max_chars: int = Field(default=500, ge=1, le=MAX_CHAT_CHARS)
    interventions: list[Intervention] = Field(
        default_factory=list,
        max_length=16,
        description="applied in order to every message, between its sender and the members",
    )
    eavesdropper_interventions: list[Intervention] | None = Field(
        default=None,
        max_length=16,
        description="what eavesdroppers' copies get instead (None: the members' list)",
    )

    def intervened(self) -> bool:
        """Whether any message of this channel may reach a reader other than as sent."""
        return bool(self.interventions or self.eavesdropper_interventions)


class RewardTransform(BaseModel):
    """Post-game reward shaping. ``coalition``: members each get the mean of their returns
    (Loki eq. 1). ``penalty_if_flagged``: each seat an overseer's flag accused with at least
    ``flag_threshold`` suspicion loses that much, once a match, after any sharing."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "coalition"] = "none"
    members: list[int] = Field(default_factory=list)
    penalty_if_flagged: float = Field(default=0.0, ge=0.0, le=1e6)
    flag_threshold: float = Field(default=0.5, ge=0.0, le=1.0)


class AdapterRef(BaseModel):
    """A LoRA adapter version: where to get it and how to check it (sha256 over ``adapter_digest``).

    A match names one per seat (``MatchSpec.adapters``) so a buffer opponent
    plays its whole match with one version; a checkpoint message carries the
    same fields.
    """

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    uri: str = Field(min_length=1, max_length=2048, description="a local folder or an http(s) URL")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class MatchSpec(BaseModel):
    """Everything a referee needs to run one match."""

    model_config = ConfigDict(extra="forbid")

    game: str
    params: dict[str, JSON] = Field(default_factory=dict)
    seats: list[AgentId] = Field(min_length=1, description="agent id per seat")
    channels: list[ChannelSpec] = Field(default_factory=list)
    transform: RewardTransform = Field(default_factory=RewardTransform)
    turn_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    on_timeout: Literal["default", "random", "forfeit"] = "default"
    seed: int = 0
    crn_group: str | None = None
    crn_index: int = Field(
        default=0,
        ge=0,
        description="this match's place in its CRN group: the group shares chance (the seed), "
        "each member gets its own agent sampling (MatchStart.seed)",
    )
    run: str = Field(default="default", pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")  # not ".."
    run_stamp: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$",  # a directory name, never "." or ".."
        description="this run's own directory under runs/<run>/ (the runner's UTC start "
        "time): each run gets a fresh one; None: runs/<run>/ itself",
    )
    adapters: list[AdapterRef | None] = Field(
        default_factory=list,
        description="per seat, the adapter version a trainable agent must play with (empty: its latest)",
    )
    observers: list[AgentId] = Field(
        default_factory=list,
        max_length=16,
        description="agents at the table that do not play (overseers): seat len(seats) + i; "
        "they hear the channels that name them as eavesdroppers and may send flags",
    )
