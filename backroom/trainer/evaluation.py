"""The trainer's evaluations, and how any of its requests are played: sent, stored, waited for.

Every ``evaluation.every`` steps (and after the last) the current adapter
plays seat 0 against each fixed baseline, itself and each pool member
(``rollouts.plan_evaluation``); the mean returns per opponent go to
``evaluations.jsonl`` and Prometheus. A line torn by a kill is run again on
resume (``evaluated_steps``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from backroom import metrics
from backroom.bus.wire import AdapterRef
from backroom.games.ipd import COOPERATE
from backroom.trainer.batch import Played, planned_only, play_batch
from backroom.trainer.bus import TrainerBus
from backroom.trainer.config import TrainConfig
from backroom.trainer.entrants import league_progress
from backroom.trainer.opponents import Opponent
from backroom.trainer.rollouts import plan_evaluation
from backroom.trainer.store import Joined, Request, Store
from backroom.trainer.tracking import read_evaluations

log = logging.getLogger("backroom.trainer")

#: How long traces may trail their episode (they travel on another client's connection).
TRACE_GRACE_S = 10.0


def evaluation_due(config: TrainConfig, step: int) -> bool:
    return (step + 1) % config.evaluation.every == 0 or step + 1 == config.steps


def evaluated_steps(run_dir: Path) -> set[int]:
    """Steps with an evaluation on record; one torn by a kill is not, and is run again."""
    return {int(r["step"]) for r in read_evaluations(run_dir / "evaluations.jsonl")}


async def play(
    tb: TrainerBus,
    store: Store,
    planned: list[Request],
    timeout_s: float,
    window: int,
    dead_referees: Callable[[], list[tuple[str, str]]] | None = None,
) -> Played:
    """Send (or, on resume, send again what has no result yet) and wait (``batch.play_batch``),
    then wait a little for the trained seats' traces."""
    played = await play_batch(tb, store, planned, timeout_s, window, dead_referees)
    await tb.wait_traces(played.matches, TRACE_GRACE_S)
    return played


def cooperation(game: str, moves: Iterable[object]) -> float | None:
    """IPD: the share of A (cooperate) among ``moves``; None for other games, or no moves.
    The training rows (``loop.cooperation_rate``) and the evaluations count it alike."""
    if game != "ipd":
        return None
    played = list(moves)
    return sum(1 for m in played if m == COOPERATE) / len(played) if played else None


async def evaluate(
    tb: TrainerBus,
    store: Store,
    config: TrainConfig,
    step: int,
    current: AdapterRef,
    pool: Sequence[Opponent] = (),
) -> dict[str, Any]:
    """Play the current adapter against every baseline and pool member; log mean returns
    (and IPD cooperation)."""
    planned = planned_only(store.requests(step=step, kind="eval")) or plan_evaluation(
        config, step, current, pool
    )
    played = await play(tb, store, planned, config.episode_timeout_s, config.concurrency)
    missing = played.missing
    joined, dropped = store.join(played.matches)
    by_label: dict[str, list[Joined]] = {}
    for ep in joined:
        by_label.setdefault(ep.request.label, []).append(ep)
    result: dict[str, Any] = {
        "step": step,
        "version": current.version,
        "missing": len(missing),
        # played but not evaluated (voided, an adapter refused...): said, never silently gone
        "dropped": dict(dropped),
        "against": {},
    }
    for label, eps in by_label.items():
        mine = float(np.mean([ep.record.returns[0] for ep in eps]))
        theirs = float(np.mean([ep.record.returns[1] for ep in eps]))
        coop = cooperation(
            config.game,
            (a.action for ep in eps for a in ep.record.actions if a.phase == "act" and a.seat == 0),
        )
        result["against"][label] = {
            "learner": mine,
            "opponent": theirs,
            "matches": len(eps),
            "cooperation_rate": coop,
        }
        metrics.TRAIN_EVAL.labels(baseline=label).set(mine)
    log.info("evaluation after step %d: %s", step, result["against"])
    if result["missing"] or dropped:
        log.warning(
            "evaluation after step %d: %d of %d matches without an episode, dropped: %s "
            "(the means above are of the rest)",
            step,
            len(missing),
            len(planned),
            dict(dropped) or "none",
        )
    if (progress := league_progress(config)) is not None:
        result["league"] = progress  # the ratings the league has given this run's entrants
        log.info("league %s after step %d: %s", progress["league"], step, progress["entrants"])
    return result


async def evaluate_and_log(
    tb: TrainerBus,
    store: Store,
    config: TrainConfig,
    step: int,
    current: AdapterRef,
    pool: Sequence[Opponent],
    run_dir: Path,
) -> dict[str, Any]:
    """``evaluate``, its result appended to ``run_dir/evaluations.jsonl``."""
    result = await evaluate(tb, store, config, step, current, pool)
    with (run_dir / "evaluations.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    return result
