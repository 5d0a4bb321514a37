"""``backroom train`` on one machine: the broker, a referee and the agents as processes.

The same processes a user would start by hand on many machines (the runner's
``Stack``); the trainer itself runs in the calling process. The learning
players share one ``agent-host`` process, so they share one model copy and
one batching queue; the evaluation baselines run there too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backroom.bus.auth import Role
from backroom.bus.client import BusConfig
from backroom.runner.stack import Stack, env_for
from backroom.trainer.config import TrainConfig


def trainer_identity(config: TrainConfig) -> str:
    """One per run, stable across restarts: ``--resume`` finds its MQTT session again."""
    return f"trainer-{config.run}"[:64]


def referee_identity(config: TrainConfig) -> str:
    """The referee a run starts: ``referee-train-<run>``, so that on a shared broker it is no
    other process's (two under one name throw each other off; ``backroom referee`` refuses to
    start under a name in use), nor one of compose's pool (``referee-<n>``)."""
    return f"referee-train-{config.run}"[:64]


def player_options(config: TrainConfig) -> dict[str, Any]:
    assert config.hp is not None
    return {
        **config.model.agent_options(),
        "policy": config.policy,
        "temperature": config.hp.temperature,
        "deadline_margin_s": 0.5,
        **config.agent_options,
    }


def agent_entries(config: TrainConfig) -> list[dict[str, Any]]:
    players = [
        {"id": p, "kind": "local", "options": player_options(config)} for p in config.players
    ]
    pool = [o.agent.model_dump() for o in config.opponents if o.agent is not None]
    return players + [b.model_dump() for b in config.evaluation.baselines] + pool


def start_stack(
    config: TrainConfig, run_dir: Path, broker_url: str | None, credentials: Path | None
) -> tuple[Stack, BusConfig]:
    """Start what the run needs (a broker only when no URL is given); return the trainer's connection."""
    stack = Stack(run_dir)
    entries = agent_entries(config)
    referee = referee_identity(config)
    ids: list[tuple[str, Role]] = [(referee, "referee"), (trainer_identity(config), "trainer")]
    ids += [(e["id"], "agent") for e in entries]
    stack.start_broker(broker_url, credentials, ids)
    try:
        ref = stack.identity(referee, role="referee")
        stack.spawn("referee", ["referee", "--runs-dir", str(run_dir / "runs")], env_for(ref))
        passwords = {e["id"]: stack.identity(e["id"]).password or "" for e in entries}
        env = {
            "BACKROOM_BROKER": env_for(stack.identity(entries[0]["id"]))["BACKROOM_BROKER"],
            # its output is a log file: no carriage-return progress bars of model loading
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        args = ["agent-host", "--spec-json", json.dumps(entries)]
        stack.spawn("agents", args, env, passwords=passwords)  # in a file only it reads
        return stack, stack.identity(trainer_identity(config), role="trainer")
    except BaseException:
        stack.stop()
        raise
