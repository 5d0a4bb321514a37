"""Policy files have one reader and one writer (``backroom.solvers.policy_file``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backroom.solvers.policy_file import read_policy, write_policy


def test_written_policy_reads_back_and_shipped_names_resolve(tmp_path: Path) -> None:
    doc = {"game": "kuhn", "params": {}, "policy": {"0": {"0": 0.25, "1": 0.75}}, "meta": {}}
    path = write_policy(tmp_path / "sub" / "p.json", doc)
    assert read_policy(path) == doc
    assert not list(path.parent.glob(".*.tmp"))  # the temp file was renamed, not left
    assert read_policy("kuhn_loki_cfr")["game"] == "kuhn"


def test_bad_policy_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read policy file"):
        read_policy(tmp_path / "missing.json")
    bad = tmp_path / "bad.yaml"
    bad.write_text("game: kuhn\n")
    with pytest.raises(ValueError, match="needs a 'policy' mapping"):
        read_policy(bad)
    with pytest.raises(ValueError, match="needs a 'policy' mapping"):
        write_policy(tmp_path / "x.json", {"game": "kuhn"})
