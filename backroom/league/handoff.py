"""Entrants handed over by training runs: ``<league dir>/entrants.d/*.yaml``.

``backroom train`` with ``league: {dir: D, every: N}`` writes one file per
N-th checkpoint into ``D/entrants.d/`` (``backroom.trainer.entrants``; the
format is in docs/training.md). A league played into ``D`` adds those it
does not have yet to its entrants, so ``backroom league CONFIG --dir D --resume``
after more training plays only the new checkpoints' pairings (the store
counts every match once). A record's ``agent`` is seated as it is: a ``local``
agent on the run's base model with that adapter folder, named ``<name>.vN``
as a ``from_run`` entrant's versions are.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from backroom.league.config import Entrant, LeagueConfig
from backroom.runner.config import ConfigError

#: The folder a league directory receives training runs' checkpoints in.
HANDED_DIR = "entrants.d"
#: The newest record format this league reads; a newer one is refused, not guessed at.
HANDED_FORMAT = 1


def handed_entrants(directory: str | Path) -> list[Entrant]:
    """The entrants in ``directory/entrants.d``, by file name; a bad file is refused naming it."""
    folder = Path(directory) / HANDED_DIR
    entrants: list[Entrant] = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        try:
            record = yaml.safe_load(path.read_text())
            if int(record["format"]) > HANDED_FORMAT:
                raise ValueError(f"format {record['format']} is newer than {HANDED_FORMAT}")
            entrants.append(Entrant.model_validate(record["agent"]))
        except ValidationError as exc:
            problems = "; ".join(
                f"agent.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"{path}: {problems}") from None
        except (OSError, yaml.YAMLError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path}: not an entrant a training run handed over ({exc!r}); "
                "remove it or write it again with backroom train"
            ) from None
    return entrants


def with_handed_entrants(
    config: LeagueConfig, directory: str | Path
) -> tuple[LeagueConfig, list[str]]:
    """``config`` with the handed-over entrants it lacks (checked like its own), and their ids."""
    have = {a.id for e in config.entrants for a in e.agents()}
    new = [e for e in handed_entrants(directory) if e.id not in have]
    if not new:
        return config, []
    try:
        merged = LeagueConfig.model_validate({**dict(config), "entrants": [*config.entrants, *new]})
    except ValueError as exc:
        raise ConfigError(f"{Path(directory) / HANDED_DIR}: {exc}") from None
    return merged, [e.id for e in new]
