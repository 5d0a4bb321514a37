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

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from backroom.bus.wire import ChannelSpec, MatchSpec, Paraphrase, RewardTransform
from backroom.runner.config_blocks import (
    ALWAYS,
    MODEL,
    AgentEntry,
    DealSchedule,
    ModelChoice,
    RunChannel,
    RunParaphraser,
    RunTransform,
)
from backroom.runner.config_blocks import EXTERNAL as EXTERNAL
from backroom.runner.config_blocks import agent_kind_names as agent_kind_names
from backroom.runner.config_errors import ConfigError, read_yaml, validate
from backroom.runner.config_errors import error_message as _message
from backroom.runner.config_errors import field_errors as _field_errors
from backroom.runner.game_checks import EXPLORED_STATES as EXPLORED_STATES
from backroom.runner.game_checks import act_states as act_states
from backroom.runner.game_checks import always_refusal, build_game
from backroom.runner.game_checks import engine_params as engine_params
from backroom.seeds import match_seed

if TYPE_CHECKING:
    from backroom.games.base import Game


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(default="run", pattern=r"^[A-Za-z0-9_.-]+$")
    #: PettingZoo environments beyond the built-in ones, by name: ``{name: "pkg.mod:factory"}``.
    #: Registered for this process and the ones it starts (``backroom.envs.seated``); the
    #: wire and the records carry only the name. Before ``game``, so ``params`` may use them.
    pettingzoo_envs: dict[str, str] = Field(default_factory=dict, max_length=64)
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
    #: Agents at the table that do not play (overseers: the ``monitor`` kind); channels may
    #: name them as eavesdroppers, and they may flag (docs/collusion.md).
    observers: list[str] = Field(default_factory=list, max_length=16)
    #: The models channels' ``paraphrase`` interventions may name (docs/collusion.md).
    paraphrasers: list[RunParaphraser] = Field(default_factory=list)
    transform: RunTransform = Field(default_factory=RunTransform)
    agent_processes: Literal["separate", "single"] = "separate"
    referees: int = Field(default=1, ge=1)
    model: ModelChoice = Field(
        default_factory=ModelChoice, description="what the agents of kind `model` play with"
    )
    deals: DealSchedule | None = Field(
        default=None, description="Kuhn only: fixed deals, each hand a set number of times"
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

    @field_validator("pettingzoo_envs")
    @classmethod
    def _register_envs(cls, envs: dict[str, str]) -> dict[str, str]:
        """The config's author names code here, and only here: register it by name."""
        from backroom.envs.seated import register_env

        for name, path in envs.items():
            register_env(name, path)
        return envs

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
        self._check_observers(ids)
        self._schedule_deals()
        game = build_game(self.game, self.params)
        self._check_seating(game.num_players)
        self._check_always(game)
        self._check_paraphrasers()
        return self

    def _check_observers(self, ids: list[str]) -> None:
        """Observers are agents of the config that never take a player's seat."""
        seated = set(self.seats or []) if not self.round_robin else set(ids)
        for i, o in enumerate(self.observers):
            if o not in ids:
                raise ValueError(f"observers.{i}: {o!r} names no agent in `agents` ({ids})")
            if o in seated:
                raise ValueError(f"observers.{i}: {o!r} plays a seat; an observer only watches")

    def _check_paraphrasers(self) -> None:
        """Every ``paraphrase`` names one of ``paraphrasers`` (the referee would refuse it)."""
        names = {p.name for p in self.paraphrasers}
        for i, c in enumerate(self.channels):
            steps = [*c.interventions, *(c.eavesdropper_interventions or [])]
            for step in steps:
                if isinstance(step, Paraphrase) and step.model not in names:
                    raise ValueError(
                        f"channels.{i}: paraphrase model {step.model!r} is none of paraphrasers "
                        f"({sorted(names) or 'none given'}): add it under paraphrasers: with its "
                        "base_url"
                    )

    def _check_always(self, game: Game) -> None:
        """An ``always`` agent must name an action of the game: else it would play the
        first legal one, every move, and nothing would say so."""
        errors: list[tuple[tuple[str | int, ...], str]] = []
        for i, agent in enumerate(self.agents):
            if agent.kind == ALWAYS:
                why = always_refusal(game, agent.options.get("action"), self.seed)
                if why:
                    errors.append((("agents", i, "options", "action"), why))
        if errors:
            raise _field_errors(errors)

    def _schedule_deals(self) -> None:
        """Check ``deals`` against the game and set ``matches`` from it.

        The match count follows from the schedule: ``matches`` may be left out,
        and when given must be what the schedule plays. With ``crn`` above 1 a
        CRN group shares its seed and so its deal: ``each`` must fill whole groups.
        """
        if self.deals is None:
            return
        if self.game != "kuhn":
            raise _field_errors(
                [(("deals",), f"only kuhn has a deal to fix; this run plays {self.game}")]
            )
        if "deal" in self.params:
            raise _field_errors(
                [
                    (
                        ("params", "deal"),
                        "fixes one deal for every match, and `deals` schedules several: "
                        "keep one of them",
                    )
                ]
            )
        hands = self.scheduled_hands()
        total = len(hands) * self.deals.each
        if self.deals.each % self.crn:
            raise _field_errors(
                [
                    (
                        ("deals", "each"),
                        f"{self.deals.each} is not a multiple of crn ({self.crn}): the matches "
                        "of a CRN group share their seed, so they play one hand",
                    )
                ]
            )
        if "matches" in self.model_fields_set and self.matches != total:
            raise _field_errors(
                [
                    (
                        ("matches",),
                        f"{self.matches}, but deals plays {len(hands)} hands x {self.deals.each} "
                        f"= {total} matches; leave matches out (it follows from deals) or make "
                        f"it {total}",
                    )
                ]
            )
        self.matches = total

    def scheduled_hands(self) -> list[tuple[int, ...]]:
        """The hands ``deals`` plays, checked against the game: [] without a schedule."""
        from backroom.games.kuhn import KuhnPoker

        if self.deals is None:
            return []
        game = build_game(self.game, self.params)
        assert isinstance(game, KuhnPoker)  # `deals` is refused for any other game
        if self.deals.hands == "all":
            return game.deals()
        if not self.deals.hands:
            raise _field_errors(
                [(("deals", "hands"), "lists no hand; leave it out (or write all) for every deal")]
            )
        errors: list[tuple[tuple[str | int, ...], str]] = []
        seen: dict[tuple[int, ...], int] = {}
        for i, hand in enumerate(self.deals.hands):
            try:
                checked = build_game(self.game, {**self.params, "deal": hand})
            except ValidationError as exc:
                errors += [(("deals", "hands", i), _message(e)) for e in exc.errors()]
                continue
            assert isinstance(checked, KuhnPoker) and checked.deal is not None
            if checked.deal in seen:
                errors.append(
                    (
                        ("deals", "hands", i),
                        f"{hand} is listed already (hands.{seen[checked.deal]}); "
                        "`each` sets how often every hand is played",
                    )
                )
            seen.setdefault(checked.deal, i)
        if errors:
            raise _field_errors(errors)
        return list(seen)

    def _deal_order(self) -> list[tuple[int, ...]] | None:
        """The hand of every CRN group, in play order; None without a schedule.

        Rounds of every hand once, each round shuffled by a generator seeded
        from the run's seed alone: the same config plays the same hands in the
        same order, and stopping early leaves the hands balanced.
        """
        if self.deals is None:
            return None
        hands = self.scheduled_hands()
        rng = random.Random(f"deals-{self.seed}")
        order: list[tuple[int, ...]] = []
        for _ in range(self.deals.each // self.crn):
            rounds = list(hands)
            rng.shuffle(rounds)
            order += rounds
        return order

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
                # Observers sit after the players: only eavesdroppers may name them.
                table = [*seats, *self.observers] if loc[-1] == "eavesdroppers" else seats
                try:
                    bad = [s for s in _seats_of(members, table) if not 0 <= s < len(table)]
                except ConfigError as exc:
                    errors.setdefault(loc, str(exc))
                    continue
                if bad:
                    errors.setdefault(loc, f"seats {bad} are outside 0..{len(table) - 1}")
        if errors:
            raise _field_errors(list(errors.items()))

    def match_specs(self) -> Iterator[tuple[str, MatchSpec]]:
        """(match id suffix, spec) for every match of the run, in order.

        With ``deals``, each CRN group's spec adds its hand as ``params.deal``.
        """
        order = self._deal_order()
        for i, seats in zip(range(self.matches), self._seatings(), strict=False):
            group = i // self.crn
            params = self.params if order is None else {**self.params, "deal": list(order[group])}
            yield (
                f"{i:06d}",
                MatchSpec(
                    game=self.game,
                    params=params,
                    seats=seats,
                    channels=[self._channel(c, seats) for c in self.channels],
                    transform=RewardTransform(
                        kind=self.transform.kind,
                        members=_seats_of(self.transform.members, seats),
                        penalty_if_flagged=self.transform.penalty_if_flagged,
                        flag_threshold=self.transform.flag_threshold,
                    ),
                    observers=list(self.observers),
                    turn_timeout_s=self.turn_timeout_s,
                    on_timeout=self.on_timeout,
                    seed=match_seed(self.seed, group),
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
            eavesdroppers=_seats_of(c.eavesdroppers, [*seats, *self.observers]),
            opens=c.opens,
            max_messages=c.max_messages,
            max_chars=c.max_chars,
            interventions=c.interventions,
            eavesdropper_interventions=c.eavesdropper_interventions,
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
    return parse_config(files_beside(read_yaml(path), Path(path)), source=str(path))


def files_beside(data: Any, path: Path) -> Any:
    """OpenSpiel file parameters of a config read from ``path``: beside it only, allowed for
    this process and those it starts (``openspiel_bounds.files_beside``). A config parsed
    from anywhere else (``parse_config``, a request) gets no file."""
    from backroom.games.openspiel_bounds import files_beside as beside

    params = data.get("params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or data.get("game") != "openspiel":
        return data
    try:
        return {**data, "params": beside(params, path.resolve().parent)}
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_config(data: Any, source: str = "config") -> RunConfig:
    return validate(RunConfig, data, source)
