"""Prometheus metrics of every backroom process, defined once.

Names follow ``backroom_<thing>_<unit>``; labels are bounded (game, agent
kind, outcome, reason, message type) and never a match or agent id, so a long
run cannot blow up the time-series count. (One exception: a league's rating
gauges name the agent, one series per entrant of the league's own config.)
"""

from __future__ import annotations

import os
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from backroom.agent_kinds import BUILTIN_KINDS

#: Where /metrics listens unless ``BACKROOM_METRICS_HOST`` says otherwise: the
#: endpoint has no authentication, so only this machine may read it by default
#: (docker compose sets 0.0.0.0, so Prometheus reaches it on the service network).
DEFAULT_METRICS_HOST = "127.0.0.1"
METRICS_HOST_ENV = "BACKROOM_METRICS_HOST"

#: Agent kinds a ``kind`` label may name: backroom's own (``agent_kinds.BUILTIN_KINDS``,
#: the one list, which the agents' registry is held to). Metrics cannot import the
#: agents, and a label must never take a value an agent made up: a status with
#: a new ``kind`` before every move would otherwise add a series per move.
KNOWN_AGENT_KINDS = frozenset(BUILTIN_KINDS)
#: What an agent that has not said its kind (no status seen) is labelled.
UNKNOWN_KIND = "unknown"
#: What any kind outside ``KNOWN_AGENT_KINDS`` is labelled.
OTHER = "other"


def kind_label(kind: str) -> str:
    """``kind`` as a metric label, from a closed set: a known agent kind, ``unknown`` or ``other``."""
    if kind in KNOWN_AGENT_KINDS or kind == UNKNOWN_KIND:
        return kind
    return OTHER


MATCHES_STARTED = Counter("backroom_matches_started_total", "Matches a referee started", ["game"])
MATCHES_FINISHED = Counter(
    "backroom_matches_finished_total", "Matches a referee finished, by outcome", ["game", "outcome"]
)
TURN_LATENCY = Histogram(
    "backroom_turn_latency_seconds",
    "Time from a turn sent to the answer received, by agent kind",
    ["kind", "phase"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
MESSAGES = Counter(
    "backroom_messages_total", "Wire messages handled, by direction and type", ["direction", "type"]
)
INVALID_INPUTS = Counter(
    "backroom_invalid_inputs_total", "Agent messages rejected by the referee, by reason", ["reason"]
)
ERRORS_DROPPED = Counter(
    "backroom_errors_dropped_total",
    "Error replies the referee did not send: the agent's error budget was spent",
)
INPUTS_DROPPED = Counter(
    "backroom_inputs_dropped_total",
    "Outbox payloads the referee dropped unread: the sender's input budget was spent",
)
INPUTS_MUTED = Counter(
    "backroom_inputs_muted_total",
    "Times the referee stopped reading an identity (outbox and status) until its input "
    "budget refilled",
)
UNPROVEN_REFEREES = Counter(
    "backroom_unproven_referee_statuses_total",
    "Statuses saying online as a referee from identities no referee roster record names",
)
STATUSES_DROPPED = Counter(
    "backroom_statuses_dropped_total",
    "Statuses the referee dropped: over the sender's input budget, oversized, or not a status",
    ["reason"],
)
EPISODES_NOT_WRITTEN = Counter(
    "backroom_episodes_not_written_total",
    "Episodes the referee could not write to its run's file (published as error episodes)",
)
EPISODES_REPUBLISHED = Counter(
    "backroom_episodes_republished_total",
    "Episodes a referee published again: a runner asked again for a match it had finished",
)
RUN_DIRS_REFUSED = Counter(
    "backroom_run_dirs_refused_total",
    "Match requests refused: they named a run directory bound to another run's key",
)
TRACES_REJECTED = Counter(
    "backroom_traces_rejected_total",
    "Traces the runner did not record, by reason (forged, not_seated, oversized, duplicate, agent_bound, run_bound, write_failed)",
    ["reason"],
)
TIMEOUTS = Counter("backroom_turn_timeouts_total", "Turns that timed out", ["game", "phase"])
FLAGS = Counter(
    "backroom_flags_total", "Overseers' flags a referee recorded, by suspicion", ["game", "level"]
)
FALLBACKS = Counter(
    "backroom_fallbacks_total",
    "Recorded moves that were not the agent's own choice, by agent kind and reason "
    "(backroom.bus.wire.Fallback; the referee counts them as each match's record is written)",
    ["kind", "reason"],
)
RECONNECTS = Counter("backroom_reconnects_total", "Reconnections to the broker", ["role"])
BUS_MESSAGES = Counter(
    "backroom_bus_messages_total", "MQTT messages in and out of this process", ["direction", "role"]
)
AGENT_DECISIONS = Counter(
    "backroom_agent_decisions_total", "Decisions made by an agent process", ["kind", "phase"]
)
AGENT_ERRORS = Counter(
    "backroom_agent_errors_total",
    "Errors the referee sent back to an agent, by reason",
    ["kind", "reason"],
)
ADAPTER_REJECTED = Counter(
    "backroom_adapter_rejected_total", "Adapters an agent refused to load, by reason", ["reason"]
)  # reason in backroom.model.adapters.REJECT_REASONS
WEB_REFUSED = Counter(
    "backroom_web_refused_total",
    "Requests backroom web refused, by reason",
    ["reason"],
)  # reason: host (not a served name), origin, locked_out, seat_held
LOCAL_BATCH_ROWS = Histogram(
    "backroom_local_batch_rows",
    "Prompts in one batch of the local model (the local agent and serve-model)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)  # observed by Backend.score_batch and Backend.generate_batch

# The trainer (``backroom train``): one series per metric, or per bounded label.
TRAIN_STEP_SECONDS = Histogram(
    "backroom_train_step_seconds",
    "Wall time of one optimiser step",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
TRAIN_TOKENS = Counter("backroom_train_tokens_total", "Tokens through the model in training steps")
TRAIN_STEPS = Counter("backroom_train_steps_total", "Training steps taken")
TRAIN_VALUE = Gauge(
    "backroom_train_value", "Last step's value of a training statistic", ["stat"]
)  # stat in {loss, kl, entropy, tis_clamped, grad_norm, tokens_per_second, cooperation_rate}
TRAIN_REWARD = Gauge(
    "backroom_train_reward", "Mean return per seat in the last step's rollouts", ["seat"]
)
TRAIN_EVAL = Gauge(
    "backroom_train_eval_reward", "Mean return of the learner against a baseline", ["baseline"]
)
TRAIN_VERSION_LAG = Gauge(
    "backroom_train_version_lag",
    "Mean adapter versions between a rollout decision and the trained adapter",
)
TRAIN_DROPPED = Counter(
    "backroom_train_dropped_total",
    "Data the trainer dropped instead of guessing, by reason",
    ["reason"],
)


# Leagues (``backroom league``): an agent label, bounded by the league's own entrant list.
RATING = Gauge(
    "backroom_rating", "An entrant's openskill rating (mu) in a league", ["league", "agent"]
)
RATING_SIGMA = Gauge(
    "backroom_rating_sigma",
    "The uncertainty (sigma) of an entrant's league rating",
    ["league", "agent"],
)


def serve(port: int | None, host: str | None = None) -> WSGIServer | None:
    """Serve /metrics on ``host:port`` (port 0 or None: do not serve); return the server.

    ``host`` defaults to ``$BACKROOM_METRICS_HOST``, else 127.0.0.1: the
    endpoint answers anyone who can reach it, so it is not put on every
    interface unless asked.
    """
    if not port:
        return None
    host = host or os.environ.get(METRICS_HOST_ENV) or DEFAULT_METRICS_HOST
    server, _thread = start_http_server(port, addr=host)
    return server
