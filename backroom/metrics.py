"""Prometheus metrics of every backroom process, defined once.

Names follow ``backroom_<thing>_<unit>``; labels are bounded (game, agent
kind, outcome, reason, message type) and never a match or agent id, so a long
run cannot blow up the time-series count.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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
TIMEOUTS = Counter("backroom_turn_timeouts_total", "Turns that timed out", ["game", "phase"])
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
)  # reason in backroom.agents.adapters.REJECT_REASONS

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


def serve(port: int | None) -> None:
    """Serve /metrics on ``port`` (0 or None: do not serve)."""
    if port:
        start_http_server(port)
