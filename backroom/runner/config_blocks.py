"""The blocks a run config is made of besides the run itself: agents, the model, channels, ...

``AgentEntry`` (an agent and its kind), ``ModelChoice`` (what ``kind: model``
agents play with), ``RunChannel``, ``RunParaphraser``, ``RunTransform`` and
``DealSchedule``: each checked alone here; what needs the whole config (seats
against agents, members against seatings) is ``RunConfig``'s
(``runner/config.py``, which re-exports these names). The league's config
reuses the agent, model and channel blocks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backroom.bus.auth import check_identity
from backroom.bus.wire import Intervention

#: The kind of an agent the run does not start: someone else's process (a
#: notebook, another machine) that joins with its own identity.
EXTERNAL = "external"

#: The kind of an agent that plays with the run's ``model:`` block (``ModelChoice``).
MODEL = "model"

#: The scripted kind whose ``action`` option is checked against the game's actions.
ALWAYS = "always"


def agent_kind_names() -> list[str]:
    """Every kind a config may name: the registered built-ins, then ``external``."""
    from backroom.agents.kinds import agent_kinds

    return [*sorted(agent_kinds()), EXTERNAL]


def _no_secret_of_ours(options: dict[str, Any]) -> dict[str, Any]:
    """Refuse an ``api_key_env`` naming a variable backroom sets (a password, a token): the
    agent would send it to its ``base_url`` (``backroom.agents.llm.key_env_refusal``)."""
    from backroom.agents.llm import key_env_refusal

    if why := key_env_refusal(str(options.get("api_key_env") or "")):
        raise ValueError(why)
    return options


class AgentEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: str
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("options")
    @classmethod
    def _options_name_no_secret(cls, options: dict[str, Any]) -> dict[str, Any]:
        return _no_secret_of_ours(options)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        # Here, not when the spawned `backroom agent` dies with a usage text.
        known = agent_kind_names()
        if kind not in known:
            raise ValueError(
                f"unknown agent kind {kind!r}; known: {', '.join(known)} "
                f"({EXTERNAL}: a process of your own that the run waits for)"
            )
        return kind

    @model_validator(mode="after")
    def _valid_id(self) -> AgentEntry:
        check_identity(self.id)
        return self


class ModelChoice(BaseModel):
    """What every ``kind: model`` agent of a run plays with: a model-backed kind and its options.

    Each such agent becomes an agent of ``kind`` whose options are these
    options updated by its own (key by key: the agent's win). Keep what only
    one backend understands here (``local``: ``max_new_tokens``, ``device``;
    ``llm``: ``base_url``, ``model``, ``api_key_env``, ``max_tokens``) and what
    both take (prompts, memory, ``collusion``) on the agents, so replacing this
    one field switches backends.
    """

    model_config = ConfigDict(extra="forbid")

    kind: str = "local"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("options")
    @classmethod
    def _options_name_no_secret(cls, options: dict[str, Any]) -> dict[str, Any]:
        return _no_secret_of_ours(options)

    @field_validator("kind")
    @classmethod
    def _a_startable_kind(cls, kind: str) -> str:
        known = [k for k in agent_kind_names() if k != EXTERNAL]
        if kind not in known:
            raise ValueError(f"unknown agent kind {kind!r} for `model`; known: {', '.join(known)}")
        return kind

    def resolve(self, agent: dict[str, Any]) -> dict[str, Any]:
        """A raw ``kind: model`` agent entry as the agent it stands for."""
        own = agent.get("options") or {}
        if not isinstance(own, dict):
            return {**agent, "kind": self.kind}  # AgentEntry reports the bad options
        return {**agent, "kind": self.kind, "options": {**self.options, **own}}


class RunChannel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    members: list[int | str]
    eavesdroppers: list[int | str] = Field(default_factory=list)
    opens: Literal["before_act", "start", "always", "game"] = "before_act"
    max_messages: int = 1
    max_chars: int = 500
    #: What the referee does to each message on its way (docs/collusion.md), in order.
    interventions: list[Intervention] = Field(default_factory=list, max_length=16)
    #: The eavesdroppers' own list (the overseer sees the raw text); None: the members'.
    eavesdropper_interventions: list[Intervention] | None = Field(default=None, max_length=16)


class RunParaphraser(BaseModel):
    """A model a channel's ``paraphrase`` may name: an OpenAI-compatible endpoint the config's
    author chose (``backroom serve-model`` for the local one), handed to the referees on their
    command line (``--paraphraser``), never inside a match request."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    base_url: str = Field(pattern=r"^https?://")
    model: str = Field(default="", description="the model to ask (empty: the server's own)")
    key_env: str | None = Field(default=None, description="the variable holding its API key")

    @field_validator("key_env")
    @classmethod
    def _not_ours(cls, key_env: str | None) -> str | None:
        if key_env is not None and key_env.startswith("BACKROOM_"):
            raise ValueError(f"{key_env} is a variable backroom sets (a bus password or token)")
        return key_env

    def option(self) -> str:
        """The referee's ``--paraphraser`` value."""
        extra = f",model={self.model}" if self.model else ""
        extra += f",key_env={self.key_env}" if self.key_env else ""
        return f"{self.name}={self.base_url}{extra}"


class RunTransform(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "coalition"] = "none"
    members: list[int | str] = Field(default_factory=list)
    #: Taken off each seat an overseer's flag accused (docs/collusion.md, "Overseers").
    penalty_if_flagged: float = Field(default=0.0, ge=0.0)
    flag_threshold: float = Field(default=0.5, ge=0.0, le=1.0)


class DealSchedule(BaseModel):
    """Fixed Kuhn deals: every hand ``each`` times, as the Loki paper's Table 1 ran them.

    The paper plays "100 games for each hand"; dealt by chance, a run of 100
    matches gives each of Loki's 60 deals 1.7 on average, and a given hand
    none in about one run of five ((59/60)^100). A hand is the card of every seat, seat 0's first; ``hands``
    names the hands to play, or ``all`` (the default) for every deal of the
    deck. The run plays ``len(hands) * each`` matches, in rounds that play every
    hand once, in an order shuffled from the run's seed, so any prefix of the
    run is balanced to within one match per hand.
    """

    model_config = ConfigDict(extra="forbid")

    each: int = Field(ge=1, description="matches per hand")
    hands: list[list[int]] | Literal["all"] = Field(
        default="all", description="the cards of every seat, seat 0's first; all: every deal"
    )
