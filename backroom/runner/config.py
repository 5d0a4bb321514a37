"""Run configs: a YAML file that names the game, the agents, the seats and the channels.

Validated by pydantic, so a typo fails fast with the path of the bad field
(``agents.1.kind: Field required``) instead of half-way through a run. The
game, its parameters, the agent kinds and the seats are checked against the
engines and agents themselves at load: a config that could only produce
``error`` episodes is refused before a broker or process starts.
Channel and coalition members may be given as seat indices or agent ids; the
runner turns them into seats per match (seats can rotate between matches).

Agents of kind ``model`` play with the run's ``model:`` block (``ModelChoice``:
a model-backed kind and its options, default ``local``, SmolLM2 in the agent's
process). One field thus moves every model player of a config between the
local model and an OpenAI-compatible server (``{kind: llm, options:
{base_url: ...}}``); the agents keep their own options (prompts, memory).
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from backroom.bus.auth import check_identity
from backroom.bus.wire import ChannelSpec, MatchSpec, RewardTransform

if TYPE_CHECKING:
    from backroom.games.base import Game

#: The kind of an agent the run does not start: someone else's process (a
#: notebook, another machine) that joins with its own identity.
EXTERNAL = "external"

#: The kind of an agent that plays with the run's ``model:`` block (``ModelChoice``).
MODEL = "model"


M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    pass


def agent_kind_names() -> list[str]:
    """Every kind a config may name: the registered built-ins, then ``external``."""
    from backroom.agents.base import agent_kinds

    return [*sorted(agent_kinds()), EXTERNAL]


def engine_params(game: str) -> list[str] | None:
    """The keyword parameters a registered engine takes; None when it takes any.

    Read from the engine's constructor, so the list cannot drift from what the
    referee will accept.
    """
    from backroom.games.base import _REGISTRY

    signature = inspect.signature(_REGISTRY[game])
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return [
        name
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


class AgentEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: str
    options: dict[str, Any] = Field(default_factory=dict)

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


class RunTransform(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "coalition"] = "none"
    members: list[int | str] = Field(default_factory=list)


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(default="run", pattern=r"^[A-Za-z0-9_.-]+$")
    game: str
    params: dict[str, Any] = Field(default_factory=dict)
    matches: int = Field(default=1, ge=1)
    seed: int = 0
    crn: int = Field(
        default=1, ge=1, description="matches per common-random-numbers group (same seed)"
    )
    concurrency: int = Field(default=10, ge=1)
    turn_timeout_s: float = Field(default=10.0, gt=0)
    on_timeout: Literal["default", "random", "forfeit"] = "default"
    agents: list[AgentEntry] = Field(min_length=1)
    seats: list[str] | None = None
    rotate_seats: bool = False
    round_robin: bool = False
    channels: list[RunChannel] = Field(default_factory=list)
    transform: RunTransform = Field(default_factory=RunTransform)
    agent_processes: Literal["separate", "single"] = "separate"
    referees: int = Field(default=1, ge=1)
    model: ModelChoice = Field(
        default_factory=ModelChoice, description="what the agents of kind `model` play with"
    )

    @model_validator(mode="before")
    @classmethod
    def _model_agents(cls, data: Any) -> Any:
        """Agents of kind ``model`` become agents of the ``model:`` block's kind, with its options."""
        if not isinstance(data, dict) or not isinstance(data.get("agents"), list):
            return data
        if not any(isinstance(a, dict) and a.get("kind") == MODEL for a in data["agents"]):
            return data
        try:
            choice = ModelChoice.model_validate(data.get("model") or {})
        except ValidationError as exc:  # reported at `model.…`, not as every agent's bad kind
            raise _field_errors(
                [(("model", *e["loc"]), _message(e)) for e in exc.errors()]
            ) from None
        agents = [
            choice.resolve(a) if isinstance(a, dict) and a.get("kind") == MODEL else a
            for a in data["agents"]
        ]
        return {**data, "agents": agents}

    @field_validator("game")
    @classmethod
    def _known_game(cls, game: str) -> str:
        from backroom.games import registered_games

        known = registered_games()
        if game not in known:
            raise ValueError(f"unknown game {game!r}; known: {', '.join(known)}")
        return game

    @field_validator("params")
    @classmethod
    def _engine_accepts(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # A field validator, not the model's: a bad parameter is reported beside a bad agent kind.
        if "game" in info.data:  # absent: the game itself was refused
            build_game(info.data["game"], params)
        return params

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        ids = [a.id for a in self.agents]
        if len(set(ids)) != len(ids):
            raise ValueError(f"agent ids must be unique: {ids}")
        if self.seats is None and not self.round_robin:
            self.seats = ids
        for s in self.seats or []:
            if s not in ids:
                raise ValueError(f"seat {s!r} names no agent in `agents` ({ids})")
        if self.round_robin and len(ids) < 2:
            raise ValueError("round_robin needs at least two agents")
        self._check_seating(build_game(self.game, self.params).num_players)
        return self

    def _check_seating(self, players: int) -> None:
        """Seat every match on paper: a mismatch would end each one in ``error`` at the referee."""
        wanted = f"{self.game} with these params seats {players} players"
        if self.round_robin and players != 2:
            raise _field_errors([(("round_robin",), f"round_robin plays pairs, but {wanted}")])
        if not self.round_robin and len(self.seats or []) != players:
            raise _field_errors(
                [(("seats",), f"{len(self.seats or [])} seats are filled, but {wanted}")]
            )
        self._check_members(players)

    def _check_members(self, players: int) -> None:
        """Channel and coalition members must name a seat in every seating the run uses."""
        n = 1
        if self.round_robin:
            n = len(self.agents) * (len(self.agents) - 1)
        elif self.rotate_seats:
            n = len(self.seats or [])
        groups: list[tuple[tuple[str | int, ...], list[int | str]]] = [
            (("transform", "members"), self.transform.members)
        ]
        for i, c in enumerate(self.channels):
            groups += [(("channels", i, "members"), c.members)]
            groups += [(("channels", i, "eavesdroppers"), c.eavesdroppers)]
        errors: dict[tuple[str | int, ...], str] = {}
        for seats in itertools.islice(self._seatings(), min(n, self.matches)):
            for loc, members in groups:
                try:
                    bad = [s for s in _seats_of(members, seats) if not 0 <= s < players]
                except ConfigError as exc:
                    errors.setdefault(loc, str(exc))
                    continue
                if bad:
                    errors.setdefault(loc, f"seats {bad} are outside 0..{players - 1}")
        if errors:
            raise _field_errors(list(errors.items()))

    def match_specs(self) -> Iterator[tuple[str, MatchSpec]]:
        """(match id suffix, spec) for every match of the run, in order."""
        for i, seats in zip(range(self.matches), self._seatings(), strict=False):
            group = i // self.crn
            yield (
                f"{i:06d}",
                MatchSpec(
                    game=self.game,
                    params=self.params,
                    seats=seats,
                    channels=[self._channel(c, seats) for c in self.channels],
                    transform=RewardTransform(
                        kind=self.transform.kind, members=_seats_of(self.transform.members, seats)
                    ),
                    turn_timeout_s=self.turn_timeout_s,
                    on_timeout=self.on_timeout,
                    seed=self.seed + group,
                    crn_group=f"{self.run}-g{group}" if self.crn > 1 else None,
                    crn_index=i % self.crn,
                    run=self.run,
                ),
            )

    def _seatings(self) -> Iterator[list[str]]:
        if self.round_robin:
            pairs = list(itertools.permutations([a.id for a in self.agents], 2))
            yield from itertools.cycle([list(p) for p in pairs])
            return
        seats = list(self.seats or [])
        for i in itertools.count():
            if self.rotate_seats:
                k = i % len(seats)
                yield seats[k:] + seats[:k]
            else:
                yield seats

    def _channel(self, c: RunChannel, seats: list[str]) -> ChannelSpec:
        return ChannelSpec(
            name=c.name,
            members=_seats_of(c.members, seats),
            eavesdroppers=_seats_of(c.eavesdroppers, seats),
            opens=c.opens,
            max_messages=c.max_messages,
            max_chars=c.max_chars,
        )


def build_game(game: str, params: dict[str, Any]) -> Game:
    """The game as the referee will build it, or errors at the parameter to fix.

    Every match of a run shares the game and its parameters, so parameters the
    engine refuses would end every match in ``error``. Error paths are relative
    to ``params`` (``roundz``), and each says what the engine accepts.
    """
    from backroom.games import make_game

    allowed = engine_params(game)
    listed = ", ".join(allowed) if allowed is not None else "any"
    if allowed is not None and (unknown := [k for k in params if k not in allowed]):
        raise _field_errors(
            [((k,), f"{game} has no parameter {k!r}; its parameters: {listed}") for k in unknown]
        )
    try:
        return make_game(game, **params)
    except Exception as exc:  # the engine's own check, in its words
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        named = [k for k in params if re.search(rf"\b{re.escape(k)}\b", reason)]
        loc: tuple[str | int, ...] = (named[0],) if len(named) == 1 else ()
        raise _field_errors([(loc, f"{reason} (parameters of {game}: {listed})")]) from None


def _field_errors(errors: list[tuple[tuple[str | int, ...], str]]) -> ValidationError:
    """Errors at given fields: raised from a validator, pydantic reports them at these paths."""
    return ValidationError.from_exception_data(
        "RunConfig",
        [
            InitErrorDetails(
                type=PydanticCustomError("config", "{reason}", {"reason": reason}),
                loc=loc,
                input=None,
            )
            for loc, reason in errors
        ],
    )


def _seats_of(members: list[int | str], seats: list[str]) -> list[int]:
    out = []
    for m in members:
        if isinstance(m, int):
            out.append(m)
        elif m in seats:
            out.extend(i for i, s in enumerate(seats) if s == m)
        else:
            raise ConfigError(f"{m!r} is neither a seat index nor a seated agent ({seats})")
    return out


def read_yaml(path: str | Path) -> Any:
    """A config file's data; a missing file or bad YAML is a ``ConfigError`` naming the file."""
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None


def validate(model: type[M], data: Any, source: str) -> M:
    """``model.model_validate(data)``, its errors as one ``ConfigError`` naming each field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {_message(e)}"
            for e in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None


def load_config(path: str | Path) -> RunConfig:
    return parse_config(read_yaml(path), source=str(path))


def parse_config(data: Any, source: str = "config") -> RunConfig:
    return validate(RunConfig, data, source)


def _message(error: Any) -> str:
    """Our validators' words without pydantic's ``Value error, `` in front of them."""
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return str(error["msg"])
