"""Policy files: the one format the solvers write and the ``table`` / ``cfr`` agents play.

``{"game", "params", "policy": {info_state: {action: probability}}, "meta"}``,
JSON (or YAML for hand-written ones). Reading and writing live here, beside
the solvers that make them, so the format has one owner: the agents and the
CLI import this module instead of parsing the file themselves.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def read_policy(path: str | Path) -> dict[str, Any]:
    """Read a policy file; a bare name such as ``kuhn_loki_cfr`` names one shipped in
    ``backroom/policies/``."""
    p = Path(path)
    if not p.exists() and p.suffix == "" and p.name == str(path):
        shipped = resources.files("backroom").joinpath("policies", f"{path}.json")
        if shipped.is_file():
            return dict(json.loads(shipped.read_text()))
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read policy file {path}: {exc.strerror}") from None
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("policy"), dict):
        raise ValueError(
            f"{path}: a policy file needs a 'policy' mapping of info state -> action probabilities"
        )
    return data


def write_policy(path: str | Path, document: dict[str, Any]) -> Path:
    """Write a policy document atomically (a temp file, then a rename): an agent
    loading the file while a solve rewrites it never reads half of it."""
    if not isinstance(document.get("policy"), dict):
        raise ValueError("a policy document needs a 'policy' mapping")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, target)
    return target
