"""A config file edited from the command line: ``--set KEY=VALUE`` and ``backroom run --matches``.

One implementation for ``backroom run`` and ``backroom train``: the edits are
applied to the file's data before its one validation, so an override is
checked (and refused, naming the field) exactly as the same value in the file.

``--matches N`` on a config with a ``deals:`` schedule cannot set ``matches``
(it follows from the schedule): it plays fewer (or more) matches per hand
instead, ``deals.each`` as near N / hands as whole CRN groups allow, and
says so in one line (``with_matches``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from backroom.runner.config import ConfigError, files_beside, parse_config, read_yaml

if TYPE_CHECKING:
    from backroom.runner.config import RunConfig

#: A number as people type it; YAML 1.1 (PyYAML) reads ``1e-4`` as a string.
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def parse_override(
    text: str, bare: Collection[str] = (), bare_under: str = "", example: str = "concurrency=4"
) -> tuple[list[str], Any]:
    """``KEY=VALUE`` as a path into the config's data and a YAML value.

    KEY is dotted (``deals.each``, ``params.rounds``); a bare name in ``bare``
    means ``<bare_under>.<name>`` (the trainer's ``lr`` is ``hyper.lr``).
    VALUE is read as YAML (``true``, ``[a, b]``, ``{k: 1}``), a number in any
    spelling as a number.
    """
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. {example}")
    if len(path) == 1 and path[0] in bare:
        path = [bare_under, path[0]]
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({problem})") from None
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)
    return path, value


def apply_overrides(data: Any, overrides: Sequence[tuple[list[str], Any]]) -> Any:
    """A copy of the config's data with each value set at its path (mappings made as needed)."""
    if not overrides or not isinstance(data, dict):
        return data  # not a mapping: validation says so, naming the file
    out = copy.deepcopy(data)
    for path, value in overrides:
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"--set {'.'.join(path)}: {where} is {child!r}, not a mapping")
            node = child
        node[path[-1]] = value
    return out


def _integral(data: Any) -> Any:
    """``--set concurrency=4`` reads 4 as 4.0 (any spelling of a number is one): a whole
    float becomes an int again, so a field typed ``int`` takes it."""
    if isinstance(data, dict):
        return {k: _integral(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_integral(v) for v in data]
    if isinstance(data, float) and data.is_integer():
        return int(data)
    return data


def load_run_config(
    path: str | Path, overrides: Sequence[str] = (), matches: int | None = None
) -> tuple[RunConfig, str | None]:
    """The run config with ``--set`` edits and ``--matches``, validated; and the line that says
    how ``--matches`` was read when the config schedules ``deals`` (None otherwise)."""
    edits = [parse_override(o) for o in overrides]
    source = str(path) + (f" with {', '.join(overrides)}" if overrides else "")
    data = apply_overrides(read_yaml(path), [(p, _integral(v)) for p, v in edits])
    data = files_beside(data, Path(path))  # an OpenSpiel file parameter: beside the config only
    config = parse_config(data, source=source)
    if matches is None:
        return config, None
    return with_matches(config, data, matches, source)


def with_matches(
    config: RunConfig, data: Any, matches: int, source: str
) -> tuple[RunConfig, str | None]:
    """``config`` playing ``matches`` matches: the count itself, or with ``deals:`` as many per hand
    as come nearest (at least one CRN group each), said in one line."""
    if matches < 1:
        raise ConfigError(f"--matches {matches}: must be at least 1")
    if config.deals is None:  # validated again: more matches may reach seatings not yet checked
        return parse_config({**data, "matches": matches}, source=source), None
    hands = len(config.scheduled_hands())
    crn = config.crn
    each = max(crn, matches // hands // crn * crn)
    deals = {**data["deals"], "each": each}
    edited = parse_config({**data, "deals": deals}, source=source)
    why = "" if edited.matches == matches else f" (the nearest to {matches} that plays "
    if why:
        why += "every hand alike" + (f" in whole CRN groups of {crn})" if crn > 1 else ")")
    note = (
        f"--matches {matches} with deals: {hands} hands x {each} each = {edited.matches} matches"
        f"{why}, instead of x {config.deals.each} = {config.matches}"
    )
    return edited, note
