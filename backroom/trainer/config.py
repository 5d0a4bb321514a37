"""Training configs: a YAML file like a run config, plus the algorithm and its hyperparameters.

``preset`` names a column of the paper's hyperparameter table (section 11 of
"Learning Robust Social Strategies with LLMs"); any field of ``hyper`` given
in the file overrides it. Validated by pydantic, so an error names the field
(``hyper.lr: Input should be greater than 0``).

``backroom train --steps/--batch/--rounds/--set KEY=VALUE`` edits the file's
data before that one validation (``apply_overrides``), so an override is
refused with the same words as the same value in the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backroom.model.adapters import ADAPTER_FILES
from backroom.model.spec import ModelSpec
from backroom.runner.config import AgentEntry, ConfigError, read_yaml, validate
from backroom.runner.overrides import apply_overrides
from backroom.runner.overrides import parse_override as _parse_override
from backroom.tracking import TrackingSpec
from backroom.trainer.algorithms import ALGORITHMS, Algorithm, AlgorithmName


class Hyperparameters(BaseModel):
    """One column of the paper's table 1 (``batch_size`` counts matches per step)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(gt=0)
    batch_size: int = Field(ge=1, description="matches per training step")
    group_size: int = Field(ge=1, description="k: matches per CRN group (same seed)")
    reward_norm: float = Field(gt=0, description="c: rewards are divided by it")
    entropy_coef: float = Field(ge=0)
    kl_coef: float = Field(ge=0)
    discount: float = Field(ge=0, le=1)
    beta: float = Field(ge=0, description="Advantage Alignment's beta")
    aa_gamma: float = Field(ge=0, le=1, description="Advantage Alignment's gamma")
    tis_cap: float = Field(default=2.0, gt=0)
    rho: float = Field(
        default=0.5, ge=0, le=1, description="chance that a group's opponent comes from the buffer"
    )
    temperature: float = Field(default=1.0, gt=0)
    grad_clip: float = Field(default=1.0, gt=0)
    baseline: Literal["per_seat", "pooled_other_matches"] = Field(
        default="per_seat",
        description="who a return is compared with in its CRN group (k = 1: the batch), in other "
        "matches: the same seat (the paper's) or both seats (trainer/advantages.py)",
    )


#: The paper's table 1. The paper uses k = 1 for IPD (the baseline runs over the other
#: matches of the batch, in the same seat).
PRESETS: dict[str, dict[str, Any]] = {
    "ipd": dict(
        lr=3e-6,
        batch_size=128,
        group_size=1,
        reward_norm=5.0,
        entropy_coef=0.01,
        kl_coef=0.0,
        discount=0.9,
        beta=0.5,
        aa_gamma=0.9,
    ),
    "split_nocomm": dict(
        lr=3e-6,
        batch_size=64,
        group_size=8,
        reward_norm=100.0,
        entropy_coef=0.0,
        kl_coef=0.001,
        discount=0.9,
        beta=1.0,
        aa_gamma=0.9,
    ),
    "trust_and_split": dict(
        lr=3e-6,
        batch_size=64,
        group_size=8,
        reward_norm=100.0,
        entropy_coef=0.0,
        kl_coef=0.001,
        discount=0.96,
        beta=2.0,
        aa_gamma=0.96,
    ),
}


class LoraSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=32, ge=1)
    alpha: int = Field(default=64, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: str | list[str] = "all-linear"


class Evaluation(BaseModel):
    """Matches of the current adapter against fixed baselines, every ``every`` steps."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(default=5, ge=1)
    matches: int = Field(default=4, ge=1, description="per baseline")
    baselines: list[AgentEntry] = Field(default_factory=list)


class PfspSpec(BaseModel):
    """Prioritized fictitious self-play weights (AlphaStar): ``f(p)`` of the learner's win rate ``p``."""

    model_config = ConfigDict(extra="forbid")

    weighting: Literal["hard", "variance"] = Field(
        default="hard", description="hard: (1 - p)^exponent; variance: p (1 - p)"
    )
    exponent: float = Field(default=2.0, gt=0)


class BufferSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(default=1, ge=1, description="keep every Nth adapter as a future opponent")
    size: int = Field(default=16, ge=1, description="adapters kept; the oldest leaves first")
    sample: Literal["uniform", "pfsp"] = Field(
        default="uniform",
        description="how a group's opponent is drawn from the buffer (or the opponents pool): "
        "uniform (the paper's) or pfsp (by the learner's recorded win rate against each)",
    )
    pfsp: PfspSpec = Field(default_factory=PfspSpec)


class OpponentEntry(BaseModel):
    """One member of a fixed opponent pool: exactly one of ``agent``, ``run`` or ``policy``.

    * ``agent``: an agent the run starts (a scripted kind, an ``llm`` on a server, ...);
    * ``run`` (+ ``versions``): frozen adapters of another training run directory,
      announced under ``policy`` (default ``frozen-<directory name>``) and played by
      this run's own players;
    * ``policy`` alone: co-training, the *current* adapter of a policy another
      ``backroom train`` process trains on the same bus.
    """

    model_config = ConfigDict(extra="forbid")

    agent: AgentEntry | None = None
    run: str | None = Field(default=None, description="a training run directory (frozen adapters)")
    versions: list[str] | Literal["last"] = Field(
        default="last", description="versions of that run (v3, ...) or last"
    )
    policy: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")

    @model_validator(mode="after")
    def _one_kind(self) -> OpponentEntry:
        kinds = [k for k, v in (("agent", self.agent), ("run", self.run)) if v is not None]
        if self.policy is not None and self.run is None:
            kinds.append("policy")
        if len(kinds) != 1:
            raise ValueError(
                "give exactly one of agent (an agent to start), run (frozen adapters of a run "
                f"directory) or policy (a policy co-trained on the bus); got {kinds or 'none'}"
            )
        if self.versions != "last" and self.run is None:
            raise ValueError("versions: only with run (the versions of that run's adapters)")
        return self

    def frozen_policy(self) -> str:
        """The policy name a frozen run's versions are announced under (its own, not the
        learner's: the two runs' ``v3`` are different adapters)."""
        assert self.run is not None
        if self.policy:
            return self.policy
        name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in Path(self.run).name)
        return f"frozen-{name}"[:64]

    @property
    def kind(self) -> Literal["agent", "frozen", "live"]:
        if self.agent is not None:
            return "agent"
        return "frozen" if self.run is not None else "live"


class OpponentError(ValueError):
    """A pool member that cannot be had; the message names the field."""


def frozen_versions(run: Path, wanted: list[str] | str, where: str) -> list[str]:
    """The adapter versions of a frozen run an opponent entry names, oldest first."""
    folder = run / "adapters"
    have = sorted(
        (p.name for p in folder.glob("v*") if p.name[1:].isdigit() and p.is_dir()),
        key=lambda v: int(v[1:]),
    )
    if not have:
        raise OpponentError(f"{where}.run: {run} holds no adapters/v<N> (is it a training run?)")
    if wanted == "last":
        return [have[-1]]
    if missing := [v for v in wanted if v not in have]:
        raise OpponentError(f"{where}.versions: {missing} not in {folder} (it has {have})")
    return list(wanted)


def check_frozen(config: TrainConfig) -> None:
    """Refuse, when the config is read, frozen runs and versions that are not there."""
    for i, entry in enumerate(config.opponents):
        if entry.run is None:
            continue
        run = Path(entry.run)
        for version in frozen_versions(run, entry.versions, f"opponents[{i}]"):
            if missing := [
                n for n in ADAPTER_FILES if not (run / "adapters" / version / n).is_file()
            ]:
                raise OpponentError(
                    f"opponents[{i}].run: {run / 'adapters' / version} lacks {', '.join(missing)}"
                )


class LeagueHandoff(BaseModel):
    """Every ``every``-th checkpoint becomes an entrant of a league (docs/training.md)."""

    model_config = ConfigDict(extra="forbid")

    dir: str = Field(description="the league directory; entrants go to <dir>/entrants.d/")
    every: int = Field(default=10, ge=1, description="every Nth step's adapter")
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="entrant name prefix (default: the run's name)",
    )


class MemoryOneSpec(BaseModel):
    """Train the five-logit memory-one IPD policy (``memory_one.py``) instead of a LoRA.

    The rest of the config (algorithm, preset, ``hyper``, ``buffer``, ``steps``,
    ``seed``, ``params.rounds``) means what it means for a LoRA run; the model,
    LoRA, players and evaluation fields are not used.
    """

    model_config = ConfigDict(extra="forbid")

    init_coop: float = Field(
        default=0.97, gt=0, lt=1, description="P(A) in every state at the start (SmolLM2's)"
    )
    tied_features: int = Field(
        default=0, ge=0, description="0: a free logit per state; M: M weights shared by the states"
    )
    tied_spread: float = Field(
        default=0.3, ge=0, description="how far apart the tied states' features are"
    )


class DpoSettings(BaseModel):
    """``dpo:`` of a training config, validated with the rest of it at load (an unknown key
    is an error: a typo would silently use a default)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="run directory with episodes.jsonl and traces.jsonl (runs/<run>: its latest run)"
    )
    beta: float = Field(default=0.1, gt=0)
    lr: float = Field(default=5e-5, gt=0)
    epochs: float = Field(default=1.0, gt=0)
    max_steps: int | None = Field(default=None, ge=1, description="overrides epochs")
    batch_size: int = Field(default=4, ge=1)
    max_pairs: int = Field(default=10_000, ge=1)
    activation_checkpointing: bool | None = None


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(default="train", pattern=r"^[A-Za-z0-9_.-]+$")
    game: str
    params: dict[str, Any] = Field(default_factory=dict)
    algorithm: AlgorithmName = Field(
        description="; ".join(f"{a.name}: {a.doc}" for a in ALGORITHMS.values())
    )
    preset: Literal["ipd", "split_nocomm", "trust_and_split"] | None = None
    hyper: dict[str, Any] = Field(default_factory=dict, description="overrides of the preset")
    steps: int = Field(default=10, ge=1)
    seed: int = 0
    policy: str = Field(default="learner", pattern=r"^[A-Za-z0-9_.-]+$")
    model: ModelSpec = Field(default_factory=ModelSpec)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    players: list[str] = Field(
        default_factory=lambda: ["learner-0", "learner-1"],
        description="ids of the local agents that play the seats (one per seat)",
    )
    agent_options: dict[str, Any] = Field(
        default_factory=dict, description="options of every player"
    )
    evaluation: Evaluation = Field(default_factory=Evaluation)
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    opponents: list[OpponentEntry] = Field(
        default_factory=list,
        description="a fixed pool every training match plays against (no self-play, no buffer)",
    )
    league: LeagueHandoff | None = None
    turn_timeout_s: float = Field(default=120.0, gt=0)
    episode_timeout_s: float = Field(
        default=600.0, gt=0, description="how long a step waits for its episodes"
    )
    concurrency: int = Field(default=32, ge=1, description="matches in flight")
    trace_budget_mb: float = Field(
        default=256.0,
        gt=0,
        description="MiB of traces the trainer stores from one agent for one step's matches; "
        "past it, that agent's traces are refused, counted and named in train_log.csv",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="torch intra-op threads of the trainer and of the agent host it starts; "
        "default: the cores shared between them",
    )
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=64,
        description="padded tokens per forward pass (memory); default 1024 on a CPU, 8192 on a GPU",
    )
    dpo: DpoSettings | None = Field(default=None, description="DPO settings (algorithm: dpo)")
    serve_adapters: str | None = Field(
        default=None,
        pattern=r"^[^:]+:[0-9]+$",
        description="HOST:PORT: serve adapters over HTTP and announce http:// URIs (agents on other machines)",
    )
    adapter_url: str | None = Field(
        default=None, description="base URL agents reach the adapter server at"
    )
    lora_servers: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible servers told to load each version (/v1/load_lora_adapter)",
    )

    memory_one: MemoryOneSpec | None = Field(
        default=None,
        description="train the memory-one IPD policy through the same credit, in seconds",
    )

    tracking: TrackingSpec | None = Field(
        default=None,
        description="log train_log.csv, the evaluations, the config and the adapters to "
        "MLflow, W&B or TensorBoard (backroom/tracking/, trainer/tracking.py)",
    )

    hp: Hyperparameters | None = None  # filled from preset + hyper

    @property
    def method(self) -> Algorithm:
        """The algorithm's registry entry (``algorithms.ALGORITHMS``)."""
        return ALGORITHMS[self.algorithm]

    @model_validator(mode="after")
    def _resolve(self) -> TrainConfig:
        self.method.check(self)
        if not self.method.rollouts:  # DPO: no steps, no hyperparameters
            return self
        base = {**(PRESETS[self.preset] if self.preset else {}), **self.method.hyper}
        try:
            self.hp = Hyperparameters.model_validate({**base, **self.hyper})
        except ValidationError as exc:
            problems = "; ".join(
                f"hyper.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            hint = (
                ""
                if self.preset
                else f" (no preset: name one of {sorted(PRESETS)} or give them all)"
            )
            raise ValueError(problems + hint) from None
        if self.hp.batch_size % self.hp.group_size:
            raise ValueError(
                f"hyper.batch_size ({self.hp.batch_size}) must be a multiple of hyper.group_size ({self.hp.group_size})"
            )
        if len(set(self.players)) != len(self.players):
            raise ValueError(f"players must be distinct agent ids: {self.players}")
        if self.memory_one is not None:
            self._check_memory_one(self.hp)
        if self.opponents:
            self._check_opponents()
        return self

    def _check_opponents(self) -> None:
        """Refuse pools that would collide with this run's own names on the bus."""
        self._check_pool_agents()
        self._check_pool_policies()
        if any(o.kind == "live" for o in self.opponents) and "run" not in self.model_fields_set:
            raise ValueError(
                "run: co-training processes share one bus, and match ids start with the run's "
                "name; give each process its own run name"
            )
        if len(self.players) != 2:
            raise ValueError("opponents: a pool plays two-seat games (one seat the learner's)")
        if self.memory_one is not None:
            raise ValueError("opponents: not with memory_one (it plays self-play and its buffer)")

    def _check_pool_agents(self) -> None:
        """The pool's agents are agents of the run too: their ids are the run's to give once."""
        ids = [o.agent.id for o in self.opponents if o.agent is not None]
        taken = set(self.players) | {b.id for b in self.evaluation.baselines}
        if clash := sorted(set(ids) & taken) or sorted({i for i in ids if ids.count(i) > 1}):
            raise ValueError(
                f"opponents: agent ids {clash} are used twice (players and evaluation "
                "baselines are agents of the run too); give the pool's agents their own ids"
            )

    def _check_pool_policies(self) -> None:
        """Each frozen run is announced under a policy of its own, never this run's."""
        frozen = {(o.frozen_policy(), str(Path(o.run))) for o in self.opponents if o.run}
        names = [name for name, _ in frozen]
        if clash := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(
                f"opponents: two frozen runs are announced as {clash}; give each its own policy:"
            )
        if any(o.policy == self.policy for o in self.opponents) or self.policy in names:
            raise ValueError(
                f"opponents: policy {self.policy!r} is this run's own policy; name the opponent's "
                "policy (frozen adapters: policy: another name)"
            )

    def _check_memory_one(self, hp: Hyperparameters) -> None:
        """Refuse what the memory-one policy would silently not do (it has no KL, no
        sampling temperature, a fixed clip, and a baseline over the whole batch)."""
        if hp.group_size != 1:
            raise ValueError(
                f"memory_one: hyper.group_size must be 1 (the baseline runs over the batch), got {hp.group_size}"
            )
        for name, value, default in (
            ("kl_coef", hp.kl_coef, 0.0),
            ("temperature", hp.temperature, 1.0),
            ("grad_clip", hp.grad_clip, 1.0),
        ):
            if value != default:
                raise ValueError(
                    f"memory_one: hyper.{name} must be {default:g} (the memory-one policy has no other), got {value:g}"
                )


def parse_train_config(data: Any, source: str = "config") -> TrainConfig:
    config = validate(TrainConfig, data, source)
    from backroom.games import make_game

    try:
        game = make_game(config.game, **config.params)
    except Exception as exc:
        raise ConfigError(f"{source}: game/params: {exc}") from None
    if config.method.rollouts and game.new_initial_state(0).num_players != len(config.players):
        raise ConfigError(
            f"{source}: players: the game has {game.new_initial_state(0).num_players} seats"
        )
    if config.opponents:
        try:
            check_frozen(config)
        except OpponentError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if config.memory_one is not None:
        paper = {"reward": 3.0, "temptation": 5.0, "sucker": 0.0, "punishment": 1.0}
        if config.game != "ipd":
            raise ConfigError(f"{source}: memory_one: plays the ipd, not {config.game}")
        got = {k: getattr(game, k) for k in paper}
        if got != paper or getattr(game, "continuation", None) is not None:
            raise ConfigError(
                f"{source}: memory_one: plays the paper's payoffs (R 3, T 5, S 0, P 1) over a "
                "fixed number of rounds; leave params.reward/temptation/sucker/punishment/"
                "continuation out"
            )
    return config


def load_train_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config file with ``--set``-style ``KEY=VALUE`` overrides applied, validated once."""
    source = str(path) + (f" with {', '.join(overrides)}" if overrides else "")
    data = apply_overrides(read_yaml(path), [parse_override(o) for o in overrides])
    return parse_train_config(data, source=source)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``KEY=VALUE`` (``runner.overrides.parse_override``); a bare hyperparameter name
    (``lr``) means ``hyper.<name>``."""
    return _parse_override(
        text, bare=Hyperparameters.model_fields, bare_under="hyper", example="hyper.lr=1e-4"
    )
