"""The ``tracking:`` block of a config (``backroom train``'s, ``backroom league``'s): which tool,
where, and what its client needs (checked before anything is written)."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class MlflowSpec(BaseModel):
    """``tracking: {kind: mlflow}`` (backroom/tracking/; docs/training.md says what goes where)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["mlflow"]
    uri: str | None = Field(
        default=None,
        description="tracking URI (http://host:5000, sqlite:///path.db, databricks); "
        "default: a SQLite store in RUN_DIR/mlflow/",
    )
    experiment: str | None = Field(
        default=None, description="default: the config's run (league: its league)"
    )
    name: str | None = Field(default=None, description="the run's name; default RUN_DIR's name")
    adapters: Literal["reference", "files"] = Field(
        default="reference",
        description="each adapter version as a reference (path, sha256) or its files",
    )


class WandbSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["wandb"]
    project: str = "backroom"
    entity: str | None = None
    mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="default: WANDB_MODE, else online with WANDB_API_KEY set, else offline",
    )
    dir: str | None = Field(default=None, description="where wandb/ goes; default RUN_DIR")
    name: str | None = Field(default=None, description="the run's name; default RUN_DIR's name")
    adapters: Literal["reference", "files"] = "reference"


class TensorboardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["tensorboard"]
    dir: str | None = Field(
        default=None, description="event files' folder; default RUN_DIR/tensorboard"
    )


TrackingSpec = Annotated[MlflowSpec | WandbSpec | TensorboardSpec, Field(discriminator="kind")]


class TrackingError(RuntimeError):
    """The tracker could not be opened (the work has not started)."""


def required_modules(spec: TrackingSpec) -> tuple[str, ...]:
    """What the tool's client needs, for ``require_extra`` (the extra is named after the kind)."""
    if isinstance(spec, MlflowSpec):
        # mlflow-skinny has no SQL store of its own; the default store is SQLite
        local = spec.uri is None or spec.uri.startswith(("sqlite", "postgresql", "mysql", "mssql"))
        return ("mlflow", "sqlalchemy", "alembic") if local else ("mlflow",)
    if isinstance(spec, WandbSpec):
        return ("wandb",)
    return ("tensorboard", "torch")


def require_client(spec: TrackingSpec | None) -> None:
    """Refuse before anything is written when the tool's client is not installed (find_spec,
    not import: the clients take seconds to import)."""
    if spec is None:
        return
    missing = [m for m in required_modules(spec) if importlib.util.find_spec(m) is None]
    if missing:
        raise TrackingError(
            f'tracking: {{kind: {spec.kind}}} needs the "{spec.kind}" extra '
            f"({', '.join(missing)} not installed): pip install 'backroom[{spec.kind}]' "
            "(or backroom[tracking] for all three)"
        )
