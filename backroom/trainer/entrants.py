"""The trainer's hand-off to a league: every Nth checkpoint becomes an entrant file.

A file, not a bus message: a league may be down while the trainer runs, or
started later, and still finds every checkpoint the run sent. One YAML file
per entrant, ``<league dir>/entrants.d/<name>.yaml``, written atomically
(a temporary file renamed), so a league reading the folder never sees half a
record; a resumed trainer writes the same file again with the same content.
The record's ``agent`` is an agent entry a run config or a league seats as
it is: a ``local`` agent on the run's base model with that adapter folder,
frozen (no ``policy``: it never follows the trainer's later checkpoints);
``entrant`` says the same as a league config's ``from_run`` entrant
(``versions: [vN]``), which seats that very agent, named ``<id>.vN``.
The format is documented in docs/training.md ("Sending checkpoints to a league").
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from backroom.bus.wire import AdapterRef
from backroom.trainer.config import TrainConfig

#: The record's version; a league refuses a newer one rather than guessing.
ENTRANT_FORMAT = 1


def entrant_due(config: TrainConfig, step: int) -> bool:
    """Whether step ``step``'s checkpoint (version ``v{step + 1}``) goes to the league."""
    return config.league is not None and (step + 1) % config.league.every == 0


def entrant_record(
    config: TrainConfig, run_dir: Path, step: int, ref: AdapterRef
) -> dict[str, Any]:
    """What a league needs to seat the checkpoint, and where it came from."""
    assert config.league is not None
    from backroom.trainer.launch import player_options

    prefix = config.league.name or config.run
    name = f"{prefix}.{ref.version}"  # as a league names the versions of a ``from_run`` entrant
    folder = run_dir / "adapters" / ref.version
    options = {k: v for k, v in player_options(config).items() if k != "policy" and v is not None}
    return {
        "format": ENTRANT_FORMAT,
        "name": name,
        "agent": {
            "id": name,
            "kind": "local",
            "options": {**options, "adapter": str(folder.resolve())},
        },
        "entrant": {
            "id": prefix,
            "kind": "local",
            "options": options,
            "from_run": str(run_dir.resolve()),
            "versions": [ref.version],
        },
        "from_run": str(run_dir.resolve()),
        "run": config.run,
        "algorithm": config.algorithm,
        "policy": ref.policy,
        "version": ref.version,
        "step": step,
        "sha256": ref.sha256,
        "size": ref.size,
        "created": time.time(),
    }


def send_entrant(config: TrainConfig, run_dir: Path, step: int, ref: AdapterRef) -> Path:
    """Write the checkpoint's entrant record into the league directory; return its path."""
    assert config.league is not None
    record = entrant_record(config, run_dir, step, ref)
    folder = Path(config.league.dir) / "entrants.d"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{record['name']}.yaml"
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(record, sort_keys=False))
    tmp.replace(target)
    return target
