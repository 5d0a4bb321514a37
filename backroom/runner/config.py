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
import random
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
from backroom.bus.wire import ChannelSpec, Intervention, MatchSpec, Paraphrase, RewardTransform
from backroom.seeds import match_seed

if TYPE_CHECKING:
    from backroom.games.base import Game, State

#: The kind of an agent the run does not start: someone else's process (a
#: notebook, another machine) that joins with its own identity.
EXTERNAL = "external"

#: The kind of an agent that plays with the run's ``model:`` block (``ModelChoice``).
MODEL = "model"

#: The scripted kind whose ``action`` option is checked against the game's actions.
ALWAYS = "always"
#: States of a game visited for the actions it has (``act_states``).
EXPLORED_STATES = 200


M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    pass


def agent_kind_names() -> list[str]:
    """Every kind a config may name: the registered built-ins, then ``external``."""
    from backroom.agents.kinds import agent_kinds

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


def act_states(game: Game, seed: int, limit: int = EXPLORED_STATES) -> Iterator[tuple[State, int]]:
    """(state, seat) of the act turns in the first ``limit`` states of ``game``, breadth first.

    A game declares its actions per state (``State.action_spec``), not once, so
    the states are visited: every choice is followed (at most 16 combinations
    of a simultaneous move), a described answer (a price, a proposal) and a
    message by the engine's default.
    """
    from collections import deque

    queue = deque([game.new_initial_state(seed)])
    visited = 0
    while queue and visited < limit:
        state = queue.popleft()
        visited += 1
        if state.is_terminal():
            continue
        players = sorted(state.current_players())
        options: list[list[Any]] = []
        for p in players:
            if state.phase == "act":
                yield state, p
            spec = state.action_spec(p)
            choices = list(spec.choices) if state.phase == "act" else []
            options.append(choices or [state.default_action(p)])
        for combo in itertools.islice(itertools.product(*options), 16):
            child = state.clone()
            try:
                child.apply(dict(zip(players, combo, strict=True)))
            except ValueError:  # IllegalActionError: a combination the rules refuse
                continue
            queue.append(child)


def always_refusal(game: Game, action: Any, seed: int = 0) -> str | None:
    """Why an ``always`` agent's ``action`` is no action of ``game`` (None when it is one).

    As the agent plays it: a listed choice, or its name, exactly (``A``, not
    ``a``); where the game describes its answers instead (a price, a number),
    what the engine accepts (``State.check_action``) in some act turn.
    """
    from backroom.games.base import IllegalActionError

    names: list[Any] = []
    schemas: list[dict[str, Any]] = []
    for state, seat in act_states(game, seed):
        spec = state.action_spec(seat)
        if spec.choices:
            if action is not None and (action in spec.choices or action in spec.names):
                return None
            for x in spec.names or spec.choices:
                if x not in names:
                    names.append(x)
            continue
        try:
            state.check_action(seat, action)
            return None
        except IllegalActionError:
            if spec.schema not in schemas:
                schemas.append(spec.schema)
    legal = [", ".join(str(x) for x in names)] if names else []
    legal += [_describe_schema(s) for s in schemas]
    what = " or ".join(legal) or "no act turn in its first states"
    if action is None:
        return f"`always` needs `action`; {game.name} takes {what}"
    return f"{game.name} has no action {action!r}; it takes {what}"


def _describe_schema(schema: dict[str, Any]) -> str:
    """``a number from 0 to 10``, ``an integer from 0 to 100``, ``an object (hats, books)``."""
    kind = schema.get("type")
    if kind in ("integer", "number"):
        word = "an integer" if kind == "integer" else "a number"
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and hi is not None:
            return f"{word} from {lo} to {hi}"
        return word
    if kind == "object":
        return f"an object ({', '.join(schema.get('properties', {}))})"
    return f"a {kind or 'value'}"


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
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    if data is None:  # pydantic's words for it were "Input should be a valid dictionary"
        raise ConfigError(f"{p} is empty: a config is a YAML mapping (game:, agents:, ...)")
    return data


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


def _message(error: Any) -> str:
    """Our validators' words without pydantic's ``Value error, `` in front of them."""
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return str(error["msg"])
