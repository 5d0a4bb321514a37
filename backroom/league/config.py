"""League configs: the entrants, the games and the schedule, checked before anything starts.

Errors name the field, as run configs do (``entrants.2.versions: ...``):
the config goes through the runner's ``validate``, and the checks that need
the games (the game's parameters, an ``always`` agent's action) are made here
against every game of the league.

An entrant is an agent spec the runner can seat (``AgentEntry``: scripted
kinds, ``cfr``/``table``, ``llm``, ``local``, ``external``), plus:

* ``from_run`` and ``versions`` (``local`` only): one entrant per adapter
  version of a training run directory (``RUN_DIR/adapters/vN``), named
  ``<id>.vN``, each a ``local`` agent with ``adapter`` set to that folder;
* ``optional`` (for people and other ``external`` agents): the league plays
  its pairings only while it is online when a league session starts; until
  then they stay pending and ``show`` says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from backroom.runner.config import (
    ALWAYS,
    EXTERNAL,
    MODEL,
    AgentEntry,
    ModelChoice,
    RunChannel,
    always_refusal,
    build_game,
    read_yaml,
    validate,
)
from backroom.runner.config_errors import error_message, field_errors
from backroom.tracking import TrackingSpec

#: Seat orders are every permutation of a pairing up to this many; past it, the rotations.
MAX_PERMUTATIONS = 24

_EVERY = re.compile(r"^every\s+(\d+)$")


class Entrant(AgentEntry):
    """An agent spec (``AgentEntry``) with the league's own fields."""

    from_run: str | None = Field(
        default=None, description="a training run directory whose adapter versions play (local)"
    )
    versions: str | list[str] | None = Field(
        default=None, description="all (the default), last, every N, or a list (v0, v10, ...)"
    )
    optional: bool = Field(
        default=False, description="played only while online when a session starts (people)"
    )

    @model_validator(mode="after")
    def _run_fields(self) -> Entrant:
        if self.kind == "human":  # its terminal would be a spawned process's, which has none
            raise ValueError(
                "a person plays an `external` entrant (with optional: true, the league waits "
                "for nobody) and joins as its id through `backroom web` or `backroom agent human`"
            )
        if self.from_run is None:
            if self.versions is not None:
                raise ValueError("`versions` picks adapters of `from_run`; give from_run too")
            return self
        if self.kind != "local":
            raise ValueError(
                f"`from_run` gives adapters to a `local` model, not kind {self.kind!r}"
            )
        if isinstance(self.versions, str) and not (
            self.versions in ("all", "last") or _EVERY.match(self.versions)
        ):
            raise ValueError(
                f"versions {self.versions!r}: write all, last, every N, or a list (v0, v10)"
            )
        return self

    def run_versions(self) -> list[str]:
        """The adapter versions of ``from_run`` this entrant stands for, oldest first."""
        assert self.from_run is not None
        folder = Path(self.from_run) / "adapters"
        found = _adapter_versions(folder, self.from_run)
        if isinstance(self.versions, list):
            missing = [v for v in self.versions if v not in found]
            if missing:
                raise ValueError(f"{folder} has no {', '.join(missing)}; it has {', '.join(found)}")
            return list(self.versions)
        if self.versions == "last":
            return found[-1:]
        if self.versions in (None, "all"):
            return found
        every = int(_EVERY.match(self.versions).group(1))  # type: ignore[union-attr]
        if every < 1:
            raise ValueError("versions: every N needs N >= 1")
        picked = [v for v in found if int(v[1:]) % every == 0]
        return picked if found[-1] in picked else [*picked, found[-1]]

    def agents(self) -> list[AgentEntry]:
        """The agents this entrant seats: itself, or one ``local`` agent per version."""
        plain = AgentEntry(id=self.id, kind=self.kind, options=self.options)
        if self.from_run is None:
            return [plain]
        folder = Path(self.from_run).resolve() / "adapters"
        return [
            AgentEntry(
                id=f"{self.id}.{v}",
                kind=self.kind,
                options={**self.options, "adapter": str(folder / v)},
            )
            for v in self.run_versions()
        ]


def _adapter_versions(folder: Path, run: str) -> list[str]:
    """The adapter versions (``v0``, ``v1``, ...) in a training run's ``adapters`` folder,
    oldest first; none, or no folder, is an error that says how to get them."""
    if not folder.is_dir():
        raise ValueError(
            f"{folder} is no directory: `from_run` names a `backroom train` run; "
            f"train it first (backroom train CONFIG --run-dir {run}; the "
            "league config's header names the CONFIG)"
        )
    found = sorted(
        (p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"v\d+", p.name)),
        key=lambda v: int(v[1:]),
    )
    if not found:
        raise ValueError(f"{folder} holds no adapter version (v0, v1, ...)")
    return found


class LeagueGame(BaseModel):
    """One game of the league; every pairing of ``group`` entrants plays it."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    game: str
    params: dict[str, Any] = Field(default_factory=dict)
    seeds: int = Field(default=1, ge=1, description="round robin: seeds each pairing plays")
    group: int | None = Field(
        default=None, ge=2, description="entrants per match (default: the game's players)"
    )
    seat_orders: Literal["auto", "all", "rotations"] = "auto"
    entrants: list[str] | None = Field(
        default=None, description="the entrants (their ids) that play this game; default: all"
    )
    channels: list[RunChannel] = Field(
        default_factory=list,
        description="private channels by agent id, open in the matches that seat two members",
    )

    @field_validator("game")
    @classmethod
    def _known_game(cls, game: str) -> str:
        from backroom.games import registered_games

        if game not in (known := registered_games()):
            raise ValueError(f"unknown game {game!r}; known: {', '.join(known)}")
        return game

    @property
    def key(self) -> str:
        return self.id or self.game


class Schedule(BaseModel):
    """``round_robin``: every pairing, every seat order, ``seeds`` each. ``adaptive``: CRN groups
    (a pairing, a seed, every seat order) where ratings are least certain, up to ``budget``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["round_robin", "adaptive"] = "round_robin"
    budget: int | None = Field(default=None, ge=1, description="adaptive: matches in all")
    batch: int | None = Field(default=None, ge=1, description="adaptive: CRN groups per round")

    @model_validator(mode="after")
    def _budget(self) -> Schedule:
        if self.kind == "adaptive" and self.budget is None:
            raise ValueError("an adaptive schedule needs `budget` (matches in all)")
        if self.kind == "round_robin" and self.budget is not None:
            raise ValueError("`budget` is for kind: adaptive; a round robin plays every pairing")
        return self


class LeagueConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    league: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = 0
    games: list[LeagueGame] = Field(min_length=1)
    entrants: list[Entrant] = Field(min_length=2)
    schedule: Schedule = Field(default_factory=Schedule)
    concurrency: int = Field(default=10, ge=1)
    referees: int = Field(default=1, ge=1)
    turn_timeout_s: float = Field(default=10.0, gt=0)
    on_timeout: Literal["default", "random", "forfeit"] = "default"
    agent_processes: Literal["separate", "single"] = "separate"
    model: ModelChoice = Field(default_factory=ModelChoice)
    exact_models: bool = Field(
        default=True,
        description="at the league's end, load each `local` model entrant once in the league's "
        "process and ask its policy at every information state of a game small enough to "
        "traverse: an exact exploitability (false: the empirical one, no model loaded)",
    )
    trainers: list[str] = Field(
        default_factory=list,
        description="training run directories whose checkpoints entrants.d may name (their "
        "adapters play on `model:`); besides these and from_run, only the league directory",
    )
    tracking: TrackingSpec | None = Field(
        default=None,
        description="log the config, the ratings as they change and the final standings to "
        "MLflow, W&B or TensorBoard (league/tracking.py; the block of backroom train's configs)",
    )

    @model_validator(mode="before")
    @classmethod
    def _model_entrants(cls, data: Any) -> Any:
        """Entrants of kind ``model`` play with the ``model:`` block, as in run configs."""
        if not isinstance(data, dict) or not isinstance(data.get("entrants"), list):
            return data
        if not any(isinstance(a, dict) and a.get("kind") == MODEL for a in data["entrants"]):
            return data
        try:
            choice = ModelChoice.model_validate(data.get("model") or {})
        except ValidationError as exc:
            raise field_errors(
                [(("model", *e["loc"]), error_message(e)) for e in exc.errors()]
            ) from None
        entrants = [
            choice.resolve(a) if isinstance(a, dict) and a.get("kind") == MODEL else a
            for a in data["entrants"]
        ]
        return {**data, "entrants": entrants}

    @model_validator(mode="after")
    def _check(self) -> LeagueConfig:
        errors: list[tuple[tuple[str | int, ...], str]] = []
        keys = [g.key for g in self.games]
        if len(set(keys)) != len(keys):
            errors.append((("games",), f"two games share an id ({keys}); give each an `id`"))
        agents: list[str] = []
        for i, e in enumerate(self.entrants):
            try:
                agents += [a.id for a in e.agents()]
            except ValueError as exc:
                errors.append((("entrants", i, "from_run"), str(exc)))
        if dup := sorted({a for a in agents if agents.count(a) > 1}):
            errors.append((("entrants",), f"agent ids must be unique; repeated: {dup}"))
        for g, game in enumerate(self.games):
            errors += self._check_game(g, game)
        if errors:
            raise field_errors(errors)
        return self

    def _check_game(self, g: int, game: LeagueGame) -> list[tuple[tuple[str | int, ...], str]]:
        try:
            engine = build_game(game.game, game.params)
        except ValidationError as exc:
            return [(("games", g, "params", *e["loc"]), error_message(e)) for e in exc.errors()]
        players = engine.num_players
        group = game.group or players
        errors: list[tuple[tuple[str | int, ...], str]] = []
        if players % group:
            errors.append(
                (("games", g, "group"), f"{game.game} seats {players}; {group} does not divide it")
            )
        known = [e.id for e in self.entrants]
        for name in game.entrants or []:
            if name not in known:
                errors.append((("games", g, "entrants"), f"{name!r} is no entrant ({known})"))
        playing = self.game_agents(game)
        if len(playing) < group:
            errors.append(
                (("games", g), f"a match seats {group} entrants, and {len(playing)} play it")
            )
        errors += _channel_errors(g, game, playing)
        return errors + self._always_errors(g, game, engine)

    def _always_errors(
        self, g: int, game: LeagueGame, engine: Any
    ) -> list[tuple[tuple[str | int, ...], str]]:
        """An ``always`` entrant's action that ``game`` does not have."""
        errors: list[tuple[tuple[str | int, ...], str]] = []
        for i, e in enumerate(self.entrants):
            if game.entrants is not None and e.id not in game.entrants:
                continue
            if e.kind == ALWAYS and (why := always_refusal(engine, e.options.get("action"))):
                errors.append((("entrants", i, "options", "action"), f"{game.key}: {why}"))
        return errors

    def game_agents(self, game: LeagueGame) -> list[str]:
        """The agents that play ``game`` (its ``entrants``, versions expanded), in config order."""
        out = []
        for e in self.entrants:
            if game.entrants is None or e.id in game.entrants:
                try:
                    out += [a.id for a in e.agents()]
                except ValueError:
                    continue  # reported at entrants.N.from_run
        return out

    def agents(self) -> list[AgentEntry]:
        """Every agent the league seats, ``from_run`` versions expanded, in config order."""
        return [a for e in self.entrants for a in e.agents()]

    def optional(self) -> set[str]:
        return {a.id for e in self.entrants if e.optional for a in e.agents()}

    def external(self) -> list[str]:
        return [a.id for a in self.agents() if a.kind == EXTERNAL]


def _channel_errors(
    g: int, game: LeagueGame, playing: list[str]
) -> list[tuple[tuple[str | int, ...], str]]:
    """A channel's members and eavesdroppers are agents that play ``game`` (seats rotate)."""
    errors: list[tuple[tuple[str | int, ...], str]] = []
    for c, channel in enumerate(game.channels):
        for field in ("members", "eavesdroppers"):
            bad = [m for m in getattr(channel, field) if m not in playing]
            if bad:
                errors.append(
                    (
                        ("games", g, "channels", c, field),
                        f"{bad}: name agents that play {game.key} (by id; seats rotate)",
                    )
                )
    return errors


def parse_league(data: Any, source: str = "league config") -> LeagueConfig:
    return validate(LeagueConfig, data, source)


def load_league(path: str | Path) -> LeagueConfig:
    return parse_league(read_yaml(path), source=str(path))
