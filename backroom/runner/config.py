"""Run configs: a YAML file that names the game, the agents, the seats and the channels.

Validated by pydantic, so a typo fails fast with the path of the bad field
(``agents.1.kind: Field required``) instead of half-way through a run.
Channel and coalition members may be given as seat indices or agent ids; the
runner turns them into seats per match (seats can rotate between matches).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backroom.bus.auth import check_identity
from backroom.bus.wire import ChannelSpec, MatchSpec, RewardTransform


class ConfigError(ValueError):
    pass


class AgentEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid_id(self) -> AgentEntry:
        check_identity(self.id)
        return self


class RunChannel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    members: list[int | str]
    eavesdroppers: list[int | str] = Field(default_factory=list)
    opens: Literal["before_act", "always", "game"] = "before_act"
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
    crn: int = Field(default=1, ge=1, description="matches per common-random-numbers group (same seed)")
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
        return self

    def match_specs(self) -> Iterator[tuple[str, MatchSpec]]:
        """(match id suffix, spec) for every match of the run, in order."""
        for i, seats in zip(range(self.matches), self._seatings(), strict=False):
            group = i // self.crn
            yield f"{i:06d}", MatchSpec(
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
                run=self.run,
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


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    return parse_config(data, source=str(p))


def parse_config(data: Any, source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None
