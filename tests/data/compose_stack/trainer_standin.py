"""Stands in for the `trainer` service in tests/test_compose_stack.py (the real one needs torch).

It serves the trainer's metrics as `backroom train` does: each "step" goes
through the trainer loop's own export (`backroom.trainer.loop._export`), and an
evaluation result is set as the loop sets it. It also stands in for a `local`
agent (torch too), counting decisions and batch sizes on the metrics the local
agent uses. Only the numbers are made up; names, labels and types are the
package's.
"""

from __future__ import annotations

import time

from backroom import metrics
from backroom.trainer.loop import _export

metrics.serve(9100)  # on $BACKROOM_METRICS_HOST, as the compose file sets it
step = 0
while True:
    step += 1
    row = {
        "loss": 1.0 / step,
        "kl": 0.01 * step,
        "entropy": 1.0,
        "tis_clamped": 0.0,
        "grad_norm": 1.0,
        "step_seconds": 0.5,
        "tokens_per_second": 2000.0,
        "cooperation_rate": 0.5,
        "version_lag": 0.5,
        "reward_seat0": 1.0,
        "reward_seat1": -1.0,
    }
    _export(row, tokens=1000)
    metrics.TRAIN_EVAL.labels(baseline="tft").set(0.25)
    metrics.AGENT_DECISIONS.labels(kind="local", phase="act").inc(8)
    metrics.LOCAL_BATCH_ROWS.observe(8)
    time.sleep(1)
