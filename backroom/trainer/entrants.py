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

import json
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


#: The league's standings document (``backroom.league.standings``): read as a file, so the
#: trainer needs none of the league's code, as ``backroom web``'s /league page does.
STANDINGS_FILE = "standings.json"


def league_progress(config: TrainConfig) -> dict[str, Any] | None:
    """This run's entrants' ratings in the league's latest standings, per game, by version;
    None without ``league:`` or before the league has written standings.

    What the league has rated so far: the trainer hands entrants over, a league
    run plays them (``backroom league ... --resume``), and each evaluation reports
    where they stand then. A torn or foreign file counts as no standings.
    """
    if config.league is None:
        return None
    path = Path(config.league.dir) / STANDINGS_FILE
    try:
        doc = json.loads(path.read_text())
        games = doc["games"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    prefix = f"{config.league.name or config.run}."
    mine = {
        key: [
            {k: r.get(k) for k in ("agent", "mu", "sigma", "ordinal", "matches")}
            for r in game.get("ratings", [])
            if str(r.get("agent", "")).startswith(prefix)
        ]
        for key, game in games.items()
    }
    return {
        "league": doc.get("league"),
        "updated": doc.get("updated"),
        "running": doc.get("running"),
        "entrants": {key: rows for key, rows in mine.items() if rows},
    }
