"""Each run writes a fresh ``runs/<run>/<UTC time>/``; ``runs/<run>/latest`` links the newest.

A second run, or a failed one, never appends to an earlier run's files, and
reading ``runs/<run>`` (``backroom analyze``, ``read_episodes``, DPO's source)
reads exactly one run: the latest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pydantic
import pytest

from backroom.bus.wire import MatchSpec
from backroom.referee.episodes import EpisodeLog
from backroom.runs import LATEST, new_run_dir, read_episodes, resolve_run_dir

GOOD = (
    "run: x\ngame: ipd\nparams: {rounds: 2}\nmatches: 3\n"
    "agents:\n  - {id: a, kind: tit-for-tat}\n  - {id: b, kind: random}\n"
)
# The engine cannot format this prompt at the first turn: every match ends in `error`.
FAILING = (
    "run: x\ngame: ipd\nparams: {rounds: 2, prompts: {intro: '{'}}\nmatches: 3\n"
    "agents:\n  - {id: a, kind: tit-for-tat}\n  - {id: b, kind: random}\n"
)


def backroom(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Wide, so rich never wraps a printed path.
    return subprocess.run(
        [sys.executable, "-m", "backroom", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "300"},
    )


def run_config(tmp_path: Path, text: str, expect_rc: int = 0) -> Path:
    """``backroom run`` as a user runs it; returns the run's own directory (``latest``)."""
    config = tmp_path / "x.yaml"
    config.write_text(text)
    out = backroom("run", str(config), "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert out.returncode == expect_rc, out.stdout + out.stderr
    run_dir = resolve_run_dir(tmp_path / "runs" / "x")
    assert run_dir.parent == tmp_path / "runs" / "x" and (run_dir / "episodes.jsonl").is_file()
    assert f"{run_dir}/" in out.stdout  # the path it prints is the real one, not runs/x/...
    return run_dir


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``directory``: its bytes and modification time."""
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_runs_in_the_same_second_get_their_own_directories(tmp_path: Path) -> None:
    now = datetime(2020, 1, 2, 13, 45, 1, tzinfo=UTC)
    made = [new_run_dir(tmp_path, "demo", now) for _ in range(3)]
    assert [d.name for d in made] == ["20200102-134501", "20200102-134501-1", "20200102-134501-2"]
    parent = tmp_path / "demo"
    assert os.readlink(parent / LATEST) == "20200102-134501-2"  # relative: the tree can move
    assert sorted(p.name for p in parent.iterdir()) == sorted([LATEST, *(d.name for d in made)])
    assert resolve_run_dir(parent) == made[-1]
    assert resolve_run_dir(made[0]) == made[0]  # a run directory is itself
    later = new_run_dir(tmp_path, "demo")  # the clock's own time: a later stamp
    assert later.name > made[-1].name and resolve_run_dir(parent) == later


def test_reading_a_parent_reads_only_its_latest_run(tmp_path: Path) -> None:
    first, second = new_run_dir(tmp_path, "r"), new_run_dir(tmp_path, "r")
    (first / "episodes.jsonl").write_text('{"match": "old"}\n')
    (second / "episodes.jsonl").write_text('{"match": "new"}\n')
    assert [e["match"] for e in read_episodes(tmp_path / "r")] == ["new"]
    flat = tmp_path / "flat"  # the layout without stamps: read as it is
    flat.mkdir()
    (flat / "episodes.jsonl").write_text('{"match": "flat"}\n')
    assert resolve_run_dir(flat) == flat
    assert [e["match"] for e in read_episodes(flat)] == ["flat"]
    second.joinpath("episodes.jsonl").unlink()
    second.rmdir()
    with pytest.raises(FileNotFoundError, match=r"latest points to .*, which does not exist"):
        resolve_run_dir(tmp_path / "r")


async def test_the_referee_writes_a_stamped_run_into_its_own_directory(tmp_path: Path) -> None:
    log = EpisodeLog(tmp_path)
    await log.append("r", b'{"match": "a"}', "20261123-134501")
    await log.append("r", b'{"match": "b"}')  # no stamp: the flat layout, as before
    stamped = tmp_path / "r" / "20261123-134501" / "episodes.jsonl"
    assert stamped.read_bytes() == b'{"match": "a"}\n'
    assert (tmp_path / "r" / "episodes.jsonl").read_bytes() == b'{"match": "b"}\n'
    # A referee whose runs directory the runner never saw (another machine) links `latest` too.
    assert resolve_run_dir(tmp_path / "r") == stamped.parent


def test_a_long_lived_referee_finds_every_runs_file(tmp_path: Path) -> None:
    """The referee remembers run directories (each match asks for its own twice) and
    forgets them past a bound: past the bound, old and new runs still get their own files."""
    log = EpisodeLog(tmp_path)
    names = [(f"run{i}", f"2026120{i % 3}-0000{i % 10}") for i in range(1_100)]
    for _ in range(2):
        for run, stamp in names:
            assert log.path(run, stamp) == tmp_path / run / stamp / "episodes.jsonl"
            assert log.path(run) == tmp_path / run / "episodes.jsonl"
    assert log.may_write("run0", "20261200-00000", None)  # keyless, never bound


@pytest.mark.parametrize("stamp", ["..", ".", "a/b", ""])
def test_a_run_stamp_is_one_directory_name(stamp: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="run_stamp"):
        MatchSpec(game="ipd", seats=["a", "b"], run_stamp=stamp)


def test_a_second_run_leaves_the_first_alone_and_analyze_reads_one_run(tmp_path: Path) -> None:
    first = run_config(tmp_path, GOOD)
    before = snapshot(first)
    assert "episodes.jsonl" in before and "traces.jsonl" in before
    second = run_config(tmp_path, GOOD)
    assert second != first and second.parent == first.parent == tmp_path / "runs" / "x"
    assert snapshot(first) == before  # not a byte, not a timestamp
    assert len(list(read_episodes(first))) == len(list(read_episodes(second))) == 3
    assert resolve_run_dir(tmp_path / "runs" / "x") == second

    out = backroom("analyze", "runs/x", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    relative = Path("runs/x") / second.name
    assert f"run: {relative} (the latest run of runs/x)" in out.stdout
    numbers = json.loads((second / "analysis.json").read_text())
    assert numbers["episodes"] == 3 and numbers["run_dir"] == str(relative)
    assert not (first / "analysis.json").exists() and not (first.parent / "analysis.json").exists()
    assert snapshot(first) == before

    out = backroom("analyze", str(first), cwd=tmp_path)  # a run directory named: that one
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"run: {first}\n" in out.stdout
    assert json.loads((first / "analysis.json").read_text())["episodes"] == 3


def test_a_failed_run_does_not_touch_a_good_run(tmp_path: Path) -> None:
    good = run_config(tmp_path, GOOD)
    before = snapshot(good)
    failed = run_config(tmp_path, FAILING, expect_rc=1)
    assert failed != good and failed.parent == good.parent
    assert snapshot(good) == before
    assert [e["reason"] for e in read_episodes(good)] == ["normal"] * 3
    assert [e["reason"] for e in read_episodes(failed)] == ["error"] * 3
    assert resolve_run_dir(good.parent) == failed  # `latest` is the newest run, failed or not
