"""The trainer's hand-off to a league: every Nth checkpoint becomes an entrant file.

A file, not a bus message: a league may be down while the trainer runs, or
started later, and still finds every checkpoint the run sent. One YAML file
per entrant, ``<league dir>/entrants.d/<name>.yaml``, written atomically
(a temporary file renamed), so a league reading the folder never sees half a
record; a resumed trainer writes the same file again with the same content.
The record names a checkpoint and nothing else: its name, the policy and
version, the adapter folder (inside this run's directory) and that folder's
sha256. The league seats it as its own config's ``model:`` block plays, with
that adapter, frozen (it never follows the trainer's later checkpoints), once
it has checked that the folder lies inside a run directory its config names
(``trainers:``) and hashes to the sha256 given (``backroom.league.handoff``).
The format is documented in docs/training.md ("Sending checkpoints to a league").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from backroom.bus.wire import AdapterRef
from backroom.trainer.config import TrainConfig

#: The record's version; a league refuses any other (1 carried a whole agent entry).
ENTRANT_FORMAT = 2


def entrant_due(config: TrainConfig, step: int) -> bool:
    """Whether step ``step``'s checkpoint (version ``v{step + 1}``) goes to the league."""
    return config.league is not None and (step + 1) % config.league.every == 0


def entrant_record(
    config: TrainConfig, run_dir: Path, step: int, ref: AdapterRef
) -> dict[str, Any]:
    """The checkpoint a league may seat: which version, and where its adapter is."""
    assert config.league is not None
    prefix = config.league.name or config.run
    return {
        "format": ENTRANT_FORMAT,
        "name": f"{prefix}.{ref.version}",  # as a league names the versions of a ``from_run``
        "policy": ref.policy,
        "version": ref.version,
        "adapter": str((run_dir / "adapters" / ref.version).resolve()),
        "sha256": ref.sha256,
        "size": ref.size,
        "step": step,
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
