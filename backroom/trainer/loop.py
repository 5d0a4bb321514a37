"""The training loop: request rollouts, wait for their episodes and traces, credit, step, announce.

``train`` is the loop; each phase is a method of ``Training``, in the order it runs:

* ``resume``: the learner, adapter and buffer the run directory holds (fresh: v0),
  then ``rejoin``: announce what the agents play and wait for them;
* ``roll_out``: plan the step's matches (``rollouts.plan_step``), store the
  requests, then send them; wait until the store holds every episode and the
  traces of its trained seats; join them (``Store.join``; what is missing is
  dropped and counted, never guessed);
* ``learn``: credit every decision with its round's advantage
  (``advantages.assign_credit``, the algorithm's own credit from
  ``algorithms.py``); one LoRA step (``Learner.step``); save the adapter as the
  next version;
* ``record``: log the step and mark its episodes used in ONE transaction, then
  train_log.csv, the metrics and the tracker;
* ``publish``: announce the checkpoint (and hand it to a league when due);
* ``evaluate``: every ``evaluation.every`` steps, play the baselines.

A run directory holds ``store.sqlite``, ``adapters/v{n}/``, ``optimizer/v{n}.pt``,
``train_log.csv`` and ``evaluations.jsonl``. ``resume=True`` continues after
the last logged step: its adapter and optimizer state are loaded, and the
step's requests, if they were already sent, are reused (episodes that arrived
while the trainer was down wait in its MQTT session and the store).
"""

from __future__ import annotations

import asyncio
import csv
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backroom import metrics
from backroom.bus.client import BusConfig
from backroom.bus.wire import AdapterRef
from backroom.model.adapters import AdapterRejected, adapter_digest
from backroom.trainer.advantages import Hyper, assign_credit
from backroom.trainer.batch import BatchError, Played, planned_only
from backroom.trainer.bus import TrainerBus
from backroom.trainer.config import OpponentError, TrainConfig
from backroom.trainer.entrants import entrant_due, send_entrant
from backroom.trainer.evaluation import (
    cooperation,
    evaluate_and_log,
    evaluated_steps,
    evaluation_due,
    play,
)
from backroom.trainer.learner import (
    Learner,
    LoraSettings,
    Sample,
    StepSettings,
    StepStats,
    sample_of,
)
from backroom.trainer.opponents import (
    Opponent,
    Records,
    live_policies,
    resolve_pool,
    with_current,
)
from backroom.trainer.parallel import finish, follow, lead_step, sync_parameters
from backroom.trainer.rollouts import AgentBuffer, plan_step
from backroom.trainer.serving import AdapterServer, announce_to_servers
from backroom.trainer.store import Joined, Store
from backroom.trainer.tracking import Tracking, TrackingError, open_tracking

log = logging.getLogger("backroom.trainer")


class TrainError(RuntimeError):
    pass


class ProcessExited(TrainError):
    """A process ``backroom train`` started (agent host, referee) exited while the run needed
    it; the steps logged before are kept (``--resume``)."""


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    version: str
    evaluations: list[dict[str, Any]] = field(default_factory=list)


def version_number(version: str | None) -> int | None:
    if version and version.startswith("v") and version[1:].isdigit():
        return int(version[1:])
    return None


def adapter_ref(
    config: TrainConfig, folder: Path, version: str, base_url: str | None = None
) -> AdapterRef:
    """The announcement of an adapter folder: a local path, or its URL on the trainer's adapter server."""
    sha, size = adapter_digest(folder)
    uri = f"{base_url}/adapters/{version}" if base_url else str(folder.resolve())
    return AdapterRef(policy=config.policy, version=version, uri=uri, sha256=sha, size=size)


def cooperation_rate(game: str, episodes: Sequence[Joined]) -> float | None:
    """IPD: the share of A (cooperate) among the trained seats' moves; None for other games."""
    return cooperation(
        game,
        (
            a.action
            for ep in episodes
            for a in ep.record.actions
            if a.phase == "act" and a.seat in ep.request.trainable
        ),
    )


def build_samples(
    episodes: Sequence[Joined], config: TrainConfig
) -> tuple[list[Sample], list[int]]:
    """Samples of every joined decision, and each one's adapter-version lag behind the learner.

    In match order, not the order the episodes arrived in: the baselines' sums and
    the update's micro-batches then add the same numbers in the same order in every
    run of a seed, so an interrupted and resumed run ends with the adapter of one
    that ran through (to the agents' scoring precision: tests/test_trainer.py).
    """
    assert config.hp is not None and config.method.rollouts  # dpo: trainer.dpo, no rollouts
    hp = config.hp
    episodes = sorted(episodes, key=lambda ep: ep.record.match)
    credit = assign_credit(
        episodes,
        config.algorithm,
        Hyper(
            discount=hp.discount,
            reward_norm=hp.reward_norm,
            beta=hp.beta,
            aa_gamma=hp.aa_gamma,
            baseline=hp.baseline,
        ),
    )
    samples, versions = [], []
    for ep in episodes:
        for d in ep.decisions:
            per_round = credit[(ep.record.match, d.seat)]
            s = sample_of(d.trace, float(per_round[min(d.round, len(per_round)) - 1]))
            if s is not None:
                samples.append(s)
                versions.append(version_number(d.trace.adapter_version) or 0)
    return samples, versions


class TrainLog:
    """``train_log.csv``: one row per step, the columns fixed by the first row.

    The store, not this file, is the record of which steps happened: a trainer
    killed between logging a step in the store and appending its row here gets
    the row back from the store on resume (``catch_up``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _header(self) -> list[str] | None:
        if not self.path.exists():
            return None
        with self.path.open(newline="") as f:
            return next(csv.reader(f), None)

    def logged_steps(self) -> set[int]:
        if not self.path.exists():
            return set()
        with self.path.open(newline="") as f:
            return {int(r["step"]) for r in csv.DictReader(f) if (r.get("step") or "").isdigit()}

    def append(self, row: dict[str, Any]) -> None:
        header = self._header()
        with self.path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header or list(row), restval="", extrasaction="ignore")
            if header is None:
                w.writeheader()
            w.writerow(row)

    def catch_up(self, steps: Sequence[tuple[int, str, dict[str, float]]]) -> int:
        """Append the rows of steps the store logged and this file lacks; how many."""
        have = self.logged_steps()
        missing = [(step, version, m) for step, version, m in steps if step not in have]
        for step, version, m in missing:
            self.append({**m, "step": step, "version": version})
        return len(missing)


@dataclass
class Run:
    """What training starts from: the learner, the adapter it plays, the buffer, the next step;
    the opponent pool and the learner's record against its opponents (PFSP)."""

    learner: Learner
    current: AdapterRef
    buffer: AgentBuffer
    first_step: int
    pool: list[Opponent] = field(default_factory=list)
    records: Records = field(default_factory=Records)


#: transformers' loading is not thread-safe (it swaps process-wide defaults while it
#: builds a model): two trainers in one process (co-training in a test, a notebook)
#: load their learners one at a time.
_LOADING = threading.Lock()


def build_learner(config: TrainConfig, adapter: Path | None) -> Learner:
    """The base model with the run's LoRA (fresh, or ``adapter`` to continue); blocking."""
    assert config.hp is not None
    with _LOADING:
        return _learner(config, adapter)


def _learner(config: TrainConfig, adapter: Path | None) -> Learner:
    assert config.hp is not None
    hp = config.hp
    return Learner(
        config.model,
        LoraSettings(
            config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.target_modules
        ),
        StepSettings(
            lr=hp.lr,
            tis_cap=hp.tis_cap,
            kl_coef=hp.kl_coef,
            entropy_coef=hp.entropy_coef,
            grad_clip=hp.grad_clip,
            micro_batch_tokens=config.micro_batch_tokens,
        ),
        adapter,
        config.seed,
    )


def optimizer_path(run_dir: Path, version: str) -> Path:
    """Adam's state after the step that made ``version``.

    One file per version, not one ``optimizer.pt`` overwritten each step: a
    trainer killed between saving a step and logging it resumes from the last
    *logged* version, and must find the moments of that version, not of the
    step it never logged.
    """
    return run_dir / "optimizer" / f"{version}.pt"


def load_optimizer(learner: Learner, run_dir: Path, version: str) -> None:
    path = optimizer_path(run_dir, version)
    if path.exists():
        import torch

        learner.load_optimizer_state(torch.load(path, weights_only=True))


def follower(config: TrainConfig, run_dir: Path) -> int:
    """A rank > 0 of a data-parallel run: the same learner as rank 0, stepping when it leads."""
    store = Store(run_dir / "store.sqlite")
    try:
        logged = [(step, version) for step, version, _ in store.steps()]
    finally:
        store.close()
    last = logged[-1] if logged else None
    learner = build_learner(config, run_dir / "adapters" / last[1] if last else None)
    if last is not None:
        load_optimizer(learner, run_dir, last[1])
    sync_parameters(learner)
    return follow(learner)


def open_run(
    config: TrainConfig,
    run_dir: Path,
    logged: list[tuple[int, str]],
    resume: bool,
    base_url: str | None,
) -> Run:
    """Load the learner for a run directory; on resume, its last adapter and optimizer state.

    ``logged`` is the store's (step, version) list. Blocking (model loading,
    files): called in a worker thread.
    """
    adapters = run_dir / "adapters"
    last = logged[-1] if logged else None
    if last is not None and not resume:
        raise TrainError(
            f"{run_dir} already holds a run (step {last[0]}); pass --resume, or another run dir"
        )
    learner = build_learner(config, adapters / last[1] if last else None)
    if last is not None:
        load_optimizer(learner, run_dir, last[1])
    buffer = AgentBuffer(config.buffer.every, config.buffer.size)
    if last is None:
        return Run(
            learner, adapter_ref(config, learner.save(adapters / "v0"), "v0", base_url), buffer, 0
        )
    # the buffer as it stood: the adapter each step played (v0, v1, ...), offered as the loop does
    for step, version in [(0, "v0"), *((s + 1, v) for s, v in logged[:-1])]:
        if (adapters / version).exists():
            buffer.offer(step, adapter_ref(config, adapters / version, version, base_url))
    return Run(
        learner, adapter_ref(config, adapters / last[1], last[1], base_url), buffer, last[0] + 1
    )


def save_step(
    run: Run, config: TrainConfig, run_dir: Path, step: int, base_url: str | None
) -> AdapterRef:
    """The step's adapter (atomically) and the optimizer state; blocking, in a worker thread."""
    import torch

    version = f"v{step + 1}"
    folder = run.learner.save(run_dir / "adapters" / version)
    target = optimizer_path(run_dir, version)
    target.parent.mkdir(exist_ok=True)
    tmp = target.with_suffix(".tmp")
    torch.save(run.learner.optimizer_state(), tmp)
    tmp.replace(target)
    # keep the last two: the logged version's and the one this step may not log
    for old in sorted(target.parent.glob("v*.pt"), key=lambda p: int(p.stem[1:]))[:-2]:
        old.unlink()
    return adapter_ref(config, folder, version, base_url)


async def train(
    config: TrainConfig,
    run_dir: Path,
    bus_config: BusConfig,
    resume: bool = False,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    online_timeout_s: float = 120.0,
) -> TrainResult:
    """Run ``config.steps`` steps (minus those already logged when resuming), phase by phase."""
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    t = Training(config, run_dir, online_timeout_s, on_step)
    try:
        run = await t.resume(resume)  # the learner and adapter the directory holds (or v0)
        async with TrainerBus(
            bus_config, t.store, config.game, live_policies(run.pool), watch=t.players
        ) as tb:
            await t.rejoin(tb)  # announce the adapters, wait for the agents, catch up
            for step in range(run.first_step, config.steps):
                batch = await t.roll_out(tb, step)  # plan, play, join episodes with traces
                update = await t.learn(step, batch)  # credit A_t, one LoRA step, v{step + 1}
                row = await t.record(step, batch, update)  # the store first, then the logs
                await t.publish(tb, step, update.ref)  # the agents play the new version
                t.tell(step, row)
                if evaluation_due(config, step):
                    await t.evaluate(tb, step)
        return TrainResult(run_dir, len(t.store.steps()), run.current.version, t.evaluations)
    finally:
        await t.close(sys.exc_info()[1])


@dataclass
class Rollouts:
    """A step's matches as played, and joined with their traces: what the update learns from."""

    played: Played
    joined: list[Joined]
    dropped: dict[str, int]  # what the join left out, by reason
    seconds: float


@dataclass
class Update:
    """What one optimiser step made: the next adapter version, its statistics, and each
    decision's adapter version (the lag of the data behind the learner)."""

    ref: AdapterRef
    stats: StepStats
    versions: list[int]


class Training:
    """One run directory in training: its store, logs, tracker and adapter server, and the
    phases of a step, which ``train`` calls in order."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: Path,
        online_timeout_s: float,
        on_step: Callable[[int, dict[str, Any]], None] | None,
    ) -> None:
        self.config, self.run_dir = config, run_dir
        self.online_timeout_s, self.on_step = online_timeout_s, on_step
        self.store = Store(run_dir / "store.sqlite", int(config.trace_budget_mb * 1024**2))
        self.tracking = open_tracking(None, run_dir, {})  # off until the run directory is taken
        self.train_log = TrainLog(run_dir / "train_log.csv")
        self.evaluations: list[dict[str, Any]] = []
        self.players = list(config.players) + [b.id for b in config.evaluation.baselines]
        self.server: AdapterServer | None = None
        self._run: Run | None = None

    @property
    def run(self) -> Run:
        assert self._run is not None, "resume() first"
        return self._run

    @property
    def base_url(self) -> str | None:
        return self.server.public_url if self.server else None

    # --- resume: what the run directory holds, and the agents back on the bus -------------

    async def resume(self, resume: bool) -> Run:
        """The learner, adapter and buffer the directory holds (fresh: v0), the pool, the tracker."""
        config = self.config
        if config.serve_adapters:
            host, port = config.serve_adapters.rsplit(":", 1)
            self.server = AdapterServer(
                self.run_dir / "adapters", host, int(port), config.adapter_url
            ).__enter__()
        logged = [(step, version) for step, version, _ in self.store.steps()]
        run = await asyncio.to_thread(open_run, config, self.run_dir, logged, resume, self.base_url)
        self._run = run
        try:
            run.pool = await asyncio.to_thread(resolve_pool, config)
        except (OpponentError, AdapterRejected) as exc:  # its files went since the config was read
            raise TrainError(str(exc)) from None
        run.records = Records.from_store(self.store, run.first_step)
        self.players += [o.agent for o in run.pool if o.agent is not None]
        self.tracking = await _open_tracking(config, self.run_dir)
        sync_parameters(run.learner)  # data-parallel ranks start from rank 0's adapter
        return run

    async def rejoin(self, tb: TrainerBus) -> None:
        """Announce what the agents play, wait for them, and redo what a kill after the last
        logged step may have cost (its CSV row, tracker rows, league entrant, evaluation)."""
        config, run = self.config, self.run
        for old in run.buffer.refs:  # resumed: their location may be new (the server's port)
            await tb.announce(old, current=False)
        for frozen in (o.ref for o in run.pool if o.live is None and o.ref is not None):
            await tb.announce(frozen, current=False)  # local agents load only what is announced
        await _announce(tb, config, run.current)
        if missing := await tb.wait_online(self.players, self.online_timeout_s):
            raise TrainError(f"agents not online after {self.online_timeout_s:.0f}s: {missing}")
        self.train_log.catch_up(self.store.steps())
        await asyncio.to_thread(self.tracking.catch_up, self.run_dir)
        last = run.first_step - 1
        if last >= 0 and entrant_due(config, last):  # a kill may have come before its file
            await asyncio.to_thread(send_entrant, config, self.run_dir, last, run.current)
        if last >= 0 and evaluation_due(config, last) and last not in evaluated_steps(self.run_dir):
            await self.evaluate(tb, last)

    # --- one step -------------------------------------------------------------------------

    async def roll_out(self, tb: TrainerBus, step: int) -> Rollouts:
        """Plan the step's matches (or take those a stopped run already asked for), play them,
        and join each episode with its trained seats' traces (what is missing is counted)."""
        config, run = self.config, self.run
        planned = planned_only(self.store.requests(step=step, kind="train")) or plan_step(
            config,
            step,
            run.current,
            run.buffer.refs,
            await self._pool_now(tb),
            run.records if config.buffer.sample == "pfsp" else None,
        )
        t0 = time.perf_counter()
        try:
            played = await play(
                tb, self.store, planned, config.episode_timeout_s, config.concurrency
            )
        except BatchError as exc:
            raise TrainError(f"step {step}: {exc}") from None
        seconds = time.perf_counter() - t0
        joined, dropped = self.store.join(played.matches)
        for reason, n in dropped.items():
            metrics.TRAIN_DROPPED.labels(reason=reason).inc(n)
        if played.played < played.planned:
            log.warning("step %d: %s", step, played.summary())
        return Rollouts(played, joined, dropped, seconds)

    async def learn(self, step: int, batch: Rollouts) -> Update:
        """Credit every decision, one LoRA step on them, the adapter saved as the next version."""
        # A_t = G_t - baseline (multi-agent GRPO), or equation 1's shaping of it (adalign)
        samples, versions = build_samples(batch.joined, self.config)
        if not samples:
            raise TrainError(
                f"step {step}: no decision to learn from: {batch.played.summary()} "
                f"({batch.dropped}; missing episodes: {batch.played.missing[:3]})"
            )
        log.info("step %d: updating on %d decisions", step, len(samples))
        learner = self.run.learner
        try:  # loss = -sum min(pi/mu, cap) * A * log pi (+ KL, - entropy) / action tokens
            stats = await asyncio.to_thread(lead_step, learner, samples)
        except asyncio.CancelledError:
            # Ctrl-C: the thread cannot be cancelled, and asyncio waits for it
            # on the way out; it stops at its next micro-batch instead.
            learner.stop.set()
            raise
        ref = await asyncio.to_thread(
            save_step, self.run, self.config, self.run_dir, step, self.base_url
        )
        return Update(ref, stats, versions)

    async def record(self, step: int, batch: Rollouts, update: Update) -> dict[str, Any]:
        """The step in the store (logged with its episodes marked used, one transaction), then
        its row in train_log.csv, the metrics and the tracker; the row."""
        row = _row(self.config.game, step, batch, update) | _batch_columns(batch.played)
        # who went past its trace budget for this step, by name (the column and log line)
        row["traces_over_budget"] = self.store.over_budget_text(step)
        self.store.log_step(
            step,
            update.ref.version,
            {k: v for k, v in row.items() if isinstance(v, float | int)},
            [ep.record.match for ep in batch.joined],
        )
        self.run.records.add_joined(batch.joined)
        _export(row, update.stats.tokens)
        self.train_log.append(row)
        await asyncio.to_thread(self.tracking.rows, [row])
        return row

    async def publish(self, tb: TrainerBus, step: int, ref: AdapterRef) -> None:
        """The new checkpoint: the buffer keeps the adapter this step played, the agents are
        told the new one, and every ``league.every`` steps it goes to the league."""
        run = self.run
        for gone in run.buffer.offer(step, run.current):
            if gone.version != ref.version:
                await tb.retract(gone)  # no match will name it again
        run.current = ref
        await _announce(tb, self.config, ref)
        if entrant_due(self.config, step):
            await asyncio.to_thread(send_entrant, self.config, self.run_dir, step, ref)

    def tell(self, step: int, row: dict[str, Any]) -> None:
        """The step's line: the caller's hook (the progress line) and the log."""
        if self.on_step:
            self.on_step(step, row)
        log.info(
            "step %d: %s",
            step,
            {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
        )

    async def evaluate(self, tb: TrainerBus, step: int) -> None:
        """The current adapter against the baselines (and the pool), in evaluations.jsonl."""
        # The co-trained policies' first checkpoints are waited for as long as agents are.
        pool = await self._pool_now(tb)
        try:
            result = await evaluate_and_log(
                tb, self.store, self.config, step, self.run.current, pool, self.run_dir
            )
        except BatchError as exc:
            raise TrainError(f"evaluation after step {step}: {exc}") from None
        await asyncio.to_thread(self.tracking.evaluations, [result])
        self.evaluations.append(result)

    async def _pool_now(self, tb: TrainerBus) -> list[Opponent]:
        """The pool with the co-trained policies' current adapters (waiting for their first)."""
        pool = self.run.pool
        live = live_policies(pool)
        if not live:
            return pool
        try:
            return with_current(pool, await tb.current_of(live, self.online_timeout_s))
        except TimeoutError as exc:
            raise TrainError(
                f"opponents: {exc}; is the other trainer running on this bus?"
            ) from None

    async def close(self, error: BaseException | None) -> None:
        """Whatever ended the run: the ranks, the store, the tracker (told how), the server."""
        finish()  # data-parallel ranks stop with the leader
        self.store.close()
        await asyncio.to_thread(self.tracking.close, error)
        if self.server is not None:
            self.server.__exit__(None, None, None)


async def _open_tracking(config: TrainConfig, run_dir: Path) -> Tracking:
    """After ``open_run`` (which refuses a directory holding another run: that run's
    tracker stays as it was), before the bus: a tracker that cannot open stops the run."""
    try:
        return await asyncio.to_thread(
            open_tracking,
            config.tracking,
            run_dir,
            config.model_dump(mode="json"),
            None,
            run_dir / "adapters",
        )
    except TrackingError as exc:
        raise TrainError(str(exc)) from None


async def _announce(tb: TrainerBus, config: TrainConfig, ref: AdapterRef) -> None:
    """The retained checkpoint for ``local`` agents; a runtime-LoRA load on each configured server."""
    await tb.announce(ref)
    if config.lora_servers:
        await announce_to_servers(config.lora_servers, ref)


def _row(game: str, step: int, batch: Rollouts, update: Update) -> dict[str, Any]:
    """One line of train_log.csv (and the Prometheus gauges)."""
    joined, stats, versions = batch.joined, update.stats, update.versions
    returns = np.array([ep.record.returns for ep in joined], dtype=float)
    coop = cooperation_rate(game, joined)
    return {
        "step": step,
        "version": update.ref.version,
        "matches": len(joined),
        "decisions": len(versions),
        "loss": stats.loss,
        "kl": stats.kl,
        "entropy": stats.entropy,
        "tis_clamped": stats.tis_clamped,
        "grad_norm": stats.grad_norm,
        "step_seconds": stats.seconds,
        "rollout_seconds": batch.seconds,
        "tokens_per_second": stats.tokens / stats.seconds if stats.seconds else 0.0,
        "version_lag": (step - float(np.mean(versions))) if versions else 0.0,
        "cooperation_rate": coop if coop is not None else float("nan"),
        **{f"reward_seat{s}": float(returns[:, s].mean()) for s in range(returns.shape[1])},
        "dropped": sum(batch.dropped.values()),
    }


def _batch_columns(played: Played) -> dict[str, Any]:
    """How many of the step's matches were played, and why the others were not: the step's
    line and ``backroom analyze`` say ``3 of 4 matches (1 voided: reason)`` from these."""
    return {
        "planned": played.planned,
        "voided": len(played.voided),
        "unplayed": played.summary() if played.played < played.planned else "",
    }


def _export(row: dict[str, Any], tokens: int) -> None:
    metrics.TRAIN_STEPS.inc()
    metrics.TRAIN_TOKENS.inc(tokens)
    metrics.TRAIN_STEP_SECONDS.observe(row["step_seconds"])
    for stat in (
        "loss",
        "kl",
        "entropy",
        "tis_clamped",
        "grad_norm",
        "tokens_per_second",
        "cooperation_rate",
    ):
        metrics.TRAIN_VALUE.labels(stat=stat).set(row[stat])
    for key, value in row.items():
        if key.startswith("reward_seat"):
            metrics.TRAIN_REWARD.labels(seat=key.removeprefix("reward_seat")).set(value)
    metrics.TRAIN_VERSION_LAG.set(row["version_lag"])
