"""``backroom train CONFIG``: LoRA adapters from play, or a memory-one policy in seconds.

The path of a run: the config and its ``--set`` overrides are validated
(``trainer.config``); a ``memory_one:`` block trains the five-logit policy in
this process (``_train_memory_one``); ``algorithm: dpo`` runs TRL's trainer;
anything else starts the stack (broker, referee, agent host) and the loop,
on ``--nproc`` ranks through torchrun. Each ends with where its log, adapters
and plots are, and the tracking tool's line when one is configured.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from backroom.cli.common import (
    BrokerOpt,
    CredsOpt,
    MetricsOpt,
    bus_config,
    console,
    require_extra,
    require_model,
    setup_logging,
)

if TYPE_CHECKING:
    from backroom.runner.stack import Stack
    from backroom.trainer.config import TrainConfig
    from backroom.trainer.loop import TrainResult

#: How often ``backroom train`` looks whether a process it started has exited.
PROCESS_CHECK_S = 0.5


def train_cmd(
    config_path: Annotated[
        Path, typer.Argument(help="training config (YAML), e.g. examples/ipd_quick.yaml")
    ],
    run_dir: Annotated[
        Path | None, typer.Option(help="where the store, adapters and logs go (default runs/<run>)")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="continue a stopped run from its last checkpoint and store")
    ] = False,
    steps: Annotated[int | None, typer.Option(help="training steps (the config's steps)")] = None,
    batch: Annotated[
        int | None, typer.Option(help="matches per step (the config's hyper.batch_size)")
    ] = None,
    rounds: Annotated[
        int | None, typer.Option(help="rounds per match (the config's params.rounds)")
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="override any config field, validated as the file is: hyper.lr=3e-5, "
            "lr=3e-5 (a bare hyperparameter), evaluation.every=5, memory_one.tied_features=256; "
            "repeatable",
        ),
    ] = None,
    broker_url: BrokerOpt = None,
    credentials: CredsOpt = None,
    spawn: Annotated[
        bool, typer.Option(help="start broker (if no --broker), referee and agents")
    ] = True,
    metrics_port: MetricsOpt = 0,
    nproc: Annotated[
        int, typer.Option(help="data-parallel training processes on this machine (torchrun)")
    ] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch threads of each process it starts (default: the config's `threads`, "
            "else the cores shared between the trainer ranks and the agent host)",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Train LoRA adapters from play (multi-agent GRPO, Advantage Alignment, or DPO on table talk)."""
    setup_logging(verbose)
    edits = [f"steps={steps}"] if steps is not None else []
    edits += [f"hyper.batch_size={batch}"] if batch is not None else []
    edits += [f"params.rounds={rounds}"] if rounds is not None else []
    config = _load_config(config_path, [*edits, *(overrides or [])])
    target = run_dir or Path("runs") / config.run
    if config.tracking is not None:
        from backroom.trainer.tracking import required_modules

        kind = config.tracking.kind
        require_extra(f"tracking: {{kind: {kind}}}", kind, required_modules(config.tracking))
    if config.memory_one is not None:
        _train_memory_one(config, target, resume)
        return
    require_extra("backroom train", "train", ("torch", "transformers", "peft", "trl"))
    require_model("backroom train", config.model.path)
    from backroom.cli.progress import train_logging

    # transformers' download and "Loading weights" bars: carriage returns in a file, and drawn
    # through rich's bar on a terminal; set before transformers is imported, which reads it then
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _set_torch_threads(config, threads, nproc, spawn)
    rank_name = os.environ.get("RANK", "0")
    log_file = target / "logs" / ("trainer.log" if rank_name == "0" else f"trainer-{rank_name}.log")
    with train_logging(log_file) as noise:
        _train(config, target, resume, broker_url, credentials, spawn, metrics_port, nproc)
    if noise.held:
        console.print(
            f"{noise.held} library warning(s) (deprecations and the like) are in {log_file}",
            soft_wrap=True,
            markup=False,
        )


def _load_config(config_path: Path, edits: list[str]) -> TrainConfig:
    """The config with the command line's edits, or a one-line refusal (exit 2)."""
    from backroom.runner.config import ConfigError
    from backroom.trainer.config import load_train_config

    try:
        return load_train_config(config_path, edits)
    except ConfigError as exc:
        console.print(f"[red]bad config:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None


def _set_torch_threads(config: TrainConfig, threads: int | None, nproc: int, spawn: bool) -> None:
    """Share the cores: every torch process of the run computes at once (the trainer ranks
    and, when spawned, the agent host). Children inherit the variable; rank 0 says it once."""
    from backroom.model.loading import THREADS_ENV, torch_threads_for, usable_cores

    if threads or config.threads:
        why = "--threads" if threads else "the config's threads"
        os.environ[THREADS_ENV] = str(threads or config.threads)
    elif THREADS_ENV in os.environ:
        why = THREADS_ENV
    else:
        why = f"default: {usable_cores()} cores shared"
        os.environ[THREADS_ENV] = str(torch_threads_for(nproc + (1 if spawn else 0)))
    if os.environ.get("RANK", "0") == "0":  # torchrun's ranks say it once
        console.print(
            f"torch threads: {os.environ[THREADS_ENV]} in each of {nproc} trainer process(es)"
            + (" and the agent host" if spawn else "")
            + f" ({why})",
            soft_wrap=True,
        )


def _train(
    config: TrainConfig,
    target: Path,
    resume: bool,
    broker_url: str | None,
    credentials: Path | None,
    spawn: bool,
    metrics_port: int,
    nproc: int,
) -> None:
    """``backroom train`` past its config and threads: DPO, or the loop with its processes."""
    if not config.method.rollouts:  # DPO: learns from a finished run (trainer/algorithms.py)
        _train_dpo(config, target)
        return
    from rich.text import Text

    from backroom import metrics
    from backroom.bus.broker import BrokerError
    from backroom.bus.client import BusError, run
    from backroom.cli.progress import StepProgress
    from backroom.trainer.launch import start_stack, trainer_identity
    from backroom.trainer.loop import ProcessExited, TrainError, follower, train
    from backroom.trainer.parallel import init_from_env

    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        _start_ranks(nproc)
    rank, _ = init_from_env()
    if rank > 0:  # a follower: steps when rank 0 leads, touches neither the bus nor the run dir
        follower(config, target)
        return

    metrics.serve(metrics_port)
    title = f"{config.run} {config.algorithm} on {config.game}"
    progress = StepProgress(console, title, config.steps)

    def on_step(step: int, row: dict[str, Any]) -> None:
        progress.step(step, _step_line(row))

    stack = None
    try:
        if spawn:
            stack, bus = start_stack(config, target, broker_url, credentials)
        elif broker_url is None:
            raise typer.BadParameter(
                "--no-spawn needs --broker and --credentials of the running stack"
            )
        else:
            bus = bus_config(broker_url, trainer_identity(config), credentials)
        with progress:
            training = train(config, target, bus, resume=resume, on_step=on_step)
            result = run(_stopped_by_a_dead_process(training, stack))
    except (TrainError, BrokerError, BusError) as exc:
        # not markup: a process's log tail may hold brackets
        console.print(Text.assemble(("error:", "red"), f" {exc}"), soft_wrap=True)
        if isinstance(exc, ProcessExited):
            _say_how_to_resume(target)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        _say_how_to_resume(target)
        raise typer.Exit(130) from None
    finally:
        if stack is not None:
            stack.stop()
    _report(config, target, result)


def _train_dpo(config: TrainConfig, target: Path) -> None:
    from backroom.runner.config import ConfigError
    from backroom.trainer.dpo import run_dpo

    try:
        console.print(run_dpo(config, target))
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


async def _stopped_by_a_dead_process(
    training: Coroutine[Any, Any, TrainResult], stack: Stack | None
) -> TrainResult:
    """The run, stopped with the reason as soon as a process it started exits.

    Why: an agent host that failed at start (an option a pool agent refuses,
    a policy file that is not there) showed only as "agents not online after
    120s", its reason left in ``logs/agents.log``; one that died mid-run left
    the referee to default its seats. The steps already logged stay logged:
    ``--resume`` goes on from the last one. However this returns (the run
    done, a process gone, Ctrl-C), the run's task has ended, its cleanup run.
    """
    import asyncio

    from backroom.trainer.loop import ProcessExited

    task = asyncio.ensure_future(training)
    try:
        while stack is not None and not task.done():
            await asyncio.wait({task}, timeout=PROCESS_CHECK_S)
            if not task.done() and (dead := stack.dead()):
                name = dead[0]
                raise ProcessExited(
                    f"process {name} exited with code {stack.exit_code(name)} while the run "
                    f"needed it; the end of {stack.run_dir / 'logs' / name}.log:\n"
                    f"{stack.log_tail(name)}"
                )
        return await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cleanup, without taking its exception as ours
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: what it raised is already on its way, or is moot


def _start_ranks(nproc: int) -> None:
    """Start ``nproc`` ranks under torchrun, each running this command again; exit as they do."""
    import subprocess

    run_args = ["-m", "backroom", *sys.argv[1:]]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    raise typer.Exit(subprocess.call([*torchrun, *run_args]))


def _step_line(row: dict[str, Any]) -> str:
    """A loop step: loss, each seat's reward, cooperation where the game has it, the times,
    and the agents whose traces went past their budget."""
    rewards = " ".join(f"{row[k]:+.2f}" for k in row if k.startswith("reward_seat"))
    coop = row["cooperation_rate"]  # NaN in a game without a cooperative move
    return (
        f"loss {row['loss']:+.4f} reward {rewards}"
        + ("" if math.isnan(coop) else f" coop {coop:.2f}")
        + f" (rollouts {row['rollout_seconds']:.0f} s, update {row['step_seconds']:.0f} s)"
        # agents whose traces went past their budget for the step (``Store.over_budget``)
        + (f"; traces over budget: {over}" if (over := row.get("traces_over_budget")) else "")
        # a step that trained on fewer matches than it asked for: "3 of 4 matches (1 voided: ...)"
        + (f"; {unplayed}" if (unplayed := row.get("unplayed")) else "")
    )


def _say_how_to_resume(target: Path) -> None:
    """Ctrl-C: the finished steps are kept; print the command that continues them."""
    import shlex

    again = [a for a in sys.argv[1:] if a != "--resume"]
    if "--run-dir" not in again:
        again += ["--run-dir", str(target)]
    console.print(f"stopped; the steps finished are kept in {target}. Continue with:")
    console.print(shlex.join([*invoked_as(), *again, "--resume"]), soft_wrap=True, markup=False)


def invoked_as(argv0: str | None = None) -> list[str]:
    """The command the user typed to start this one: ``backroom``, a path to it, or
    ``python -m backroom`` (``sys.argv[0]`` is then ``.../backroom/__main__.py``).

    A resume line printed as ``backroom train ...`` failed for someone who ran
    ``.venv/bin/backroom`` or ``python -m backroom`` without the venv active.
    """
    arg = sys.argv[0] if argv0 is None else argv0
    if Path(arg).name == "__main__.py":
        return [
            Path(sys.executable).name if _on_path(sys.executable) else sys.executable,
            "-m",
            "backroom",
        ]
    return [Path(arg).name if _on_path(arg) else arg]


def _on_path(program: str) -> bool:
    """Whether the bare name of ``program`` finds this very file on PATH."""
    import shutil

    found = shutil.which(Path(program).name)
    return found is not None and Path(found).resolve() == Path(program).resolve()


def _report(config: TrainConfig, target: Path, result: TrainResult) -> None:
    """Where the run's adapter, log and plots are; the last evaluation; the tracking line."""
    console.print(
        f"{result.steps} steps; adapter {result.version}: {target / 'adapters' / result.version}",
        soft_wrap=True,
    )
    if result.evaluations:
        last = result.evaluations[-1]
        returns = ", ".join(f"{k} {v['learner']:.2f}" for k, v in last["against"].items())
        console.print(
            # counted from 1, as the steps line above and the progress lines count them
            f"evaluation after step {last['step'] + 1} (learner's mean return per match): "
            f"{returns}",
            soft_wrap=True,
            markup=False,
        )
    console.print(
        f"log: {target / 'train_log.csv'}; plots: backroom analyze {target}", soft_wrap=True
    )
    _print_tracking(config, target)


def _print_tracking(config: TrainConfig, target: Path) -> None:
    from backroom.trainer.tracking import tracking_summary

    if config.tracking is not None and (line := tracking_summary(target)):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def _train_memory_one(config: TrainConfig, target: Path, resume: bool) -> None:
    """A config with a ``memory_one:`` block: the five-logit policy, in this process, in seconds."""
    from backroom.cli.progress import StepProgress
    from backroom.trainer import memory_one
    from backroom.trainer.tracking import TrackingError

    if resume or memory_one.holds_run(target):
        console.print(
            f"[red]error:[/red] {target} already holds a run; pass another --run-dir"
            if not resume
            else "[red]error:[/red] a memory-one run takes seconds and is not resumed: start "
            "it again (another --run-dir)",
            soft_wrap=True,
        )
        raise typer.Exit(2)
    title = f"{config.run} {config.algorithm}, memory-one"
    # a line every 5% of the run when piped: a few seconds of hundreds of steps
    progress = StepProgress(console, title, config.steps, every=max(1, config.steps // 20))

    def on_step(step: int, row: dict[str, float]) -> None:
        p_a = " ".join(
            f"{k.removeprefix('p_')} {v:.2f}" for k, v in row.items() if k.startswith("p_")
        )
        progress.step(step, f"coop {row['cooperation_rate']:.2f} P(A): {p_a}")

    try:
        with progress:
            result = memory_one.run(config, target, on_step)
    except TrackingError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from None
    states = ", ".join(f"{k} {v:.2f}" for k, v in result.p_a.items())
    returns = ", ".join(f"{k} {v:.1f}" for k, v in result.returns.items())
    lines = [
        f"{config.steps} steps: {result.verdict} (P(A) by state: {states})",
        f"learner's mean return per {memory_one.settings_for(config).rounds}-round match "
        f"against: {returns}",
        f"log: {target / 'train_log.csv'}, {target / 'memory_one.json'}; plots: backroom analyze {target}",
    ]
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    _print_tracking(config, target)
