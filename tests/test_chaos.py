"""A short chaos soak (bench/chaos_soak.py): agents, one referee at a time and the broker
killed and restarted at random while two referees play; nothing lost, nothing twice."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _soak_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("chaos_soak", ROOT / "bench" / "chaos_soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_chaos_soak_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    soak = _soak_module()
    report = asyncio.run(
        soak.soak(
            matches=3000,
            duration=45.0,
            seed=7,
            runs_dir=tmp_path,
            interval=2.0,
            limit_s=150.0,
            say=lambda _msg: None,
        )
    )
    text = "\n".join(report.lines())
    assert not report.error, text
    assert report.requested == 3000, text
    assert report.lost == 0 and report.lost_on_disk == 0, text
    assert report.duplicated == 0 and report.duplicated_on_disk == 0, text
    assert sum(report.finished.values()) == 3000, text
    # the chaos happened: something was killed, and a referee's matches were asked for again
    assert sum(report.events.values()) >= 5, text
