"""A config's errors in the words and at the paths a person fixes: every config of backroom's.

The run, league and trainer configs are YAML files checked by pydantic; these
helpers read such a file and turn pydantic's errors into one ``ConfigError``
that names each field (``agents.1.kind: ...``), and let a check that runs on
the whole config (a game built, its seats counted) report at the field to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    pass


def read_yaml(path: str | Path) -> Any:
    """A config file's data; a missing file or bad YAML is a ``ConfigError`` naming the file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    if data is None:  # pydantic's words for it were "Input should be a valid dictionary"
        raise ConfigError(f"{p} is empty: a config is a YAML mapping (game:, agents:, ...)")
    return data


def validate(model: type[M], data: Any, source: str) -> M:
    """``model.model_validate(data)``, its errors as one ``ConfigError`` naming each field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top level)'}: {error_message(e)}"
            for e in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None


def field_errors(errors: list[tuple[tuple[str | int, ...], str]]) -> ValidationError:
    """Errors at given fields: raised from a validator, pydantic reports them at these paths."""
    return ValidationError.from_exception_data(
        "RunConfig",
        [
            InitErrorDetails(
                type=PydanticCustomError("config", "{reason}", {"reason": reason}),
                loc=loc,
                input=None,
            )
            for loc, reason in errors
        ],
    )


def error_message(error: Any) -> str:
    """Our validators' words without pydantic's ``Value error, `` in front of them."""
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return str(error["msg"])
