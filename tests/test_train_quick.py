"""``backroom train`` for someone trying it: overrides, the quick examples, what a pipe shows.

The quick LoRA example (SmolLM2) runs in the slow set; the memory-one example,
the overrides, the piped progress and the log file's filter run in the default
suite.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from backroom.runner.config import ConfigError
from backroom.trainer.config import load_train_config, parse_train_config
from backroom.trainer.store import Store

from .conftest import TEST_DEVICE, load_factor

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def backroom(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "backroom", *map(str, args)]


# --- overrides ---


def test_overrides_set_what_the_file_would() -> None:
    """``--steps/--batch/--rounds/--set`` give the config that the same values in the file give."""
    path = EXAMPLES / "ipd_quick.yaml"
    edits = [
        "steps=7",
        "hyper.batch_size=6",
        "params.rounds=5",
        "lr=3e-5",  # a bare hyperparameter is hyper.<name>; 3e-5 is a number, not YAML 1.1's string
        "evaluation.every=2",
        "agent_options={max_new_tokens: 4}",
    ]
    got = load_train_config(path, edits)
    data = yaml.safe_load(path.read_text())
    data["steps"] = 7
    data["hyper"] = {**data["hyper"], "batch_size": 6, "lr": 3e-5}
    data["params"]["rounds"] = 5
    data["evaluation"]["every"] = 2
    data["agent_options"] = {"max_new_tokens": 4}
    assert got.model_dump() == parse_train_config(data).model_dump()
    assert got.hp is not None and got.hp.lr == 3e-5 and got.hp.batch_size == 6
    assert load_train_config(path).steps == 3  # the file itself is untouched
    m1 = load_train_config(EXAMPLES / "ipd_memory_one.yaml", ["memory_one.tied_features=256"])
    assert m1.memory_one is not None and m1.memory_one.tied_features == 256


@pytest.mark.parametrize(
    ("args", "file_edit"),
    [
        (["--set", "hyper.lrr=1"], {"hyper": {"lr": 1e-4, "batch_size": 4, "lrr": 1}}),
        (["--set", "lr=-1"], {"hyper": {"lr": -1, "batch_size": 4}}),
        (["--set", "stepz=3"], {"stepz": 3}),
        (["--steps", "0"], {"steps": 0}),
        (["--batch", "0"], {"hyper": {"lr": 1e-4, "batch_size": 0}}),
        (["--rounds", "0"], {"params": {"rounds": 0}}),
        (["--set", "concurrency=many"], {"concurrency": "many"}),
        (["--set", "memory_one.init_coop=1.5"], {"memory_one": {"init_coop": 1.5}}),
    ],
    ids=["bad-key", "bad-value", "bad-top-key", "steps", "batch", "rounds", "type", "nested"],
)
def test_a_bad_override_is_refused_with_the_configs_error_and_nothing_is_written(
    tmp_path: Path, args: list[str], file_edit: dict[str, Any]
) -> None:
    from backroom.cli import app

    path = EXAMPLES / "ipd_quick.yaml"
    with pytest.raises(ConfigError) as in_file:
        parse_train_config({**yaml.safe_load(path.read_text()), **file_edit})
    problem = str(in_file.value).split(": ", 1)[1]  # without the source ("config: ")
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(path), "--run-dir", str(run_dir), *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("bad config: ") and problem in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("lr", "expected KEY=VALUE"),
        ("hyper.lr=[1", "not valid YAML"),
        ("steps.x=1", "steps is 3, not a mapping"),
    ],
)
def test_a_malformed_set_is_refused_in_one_line(tmp_path: Path, override: str, words: str) -> None:
    from backroom.cli import app

    run_dir = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        ["train", str(EXAMPLES / "ipd_quick.yaml"), "--run-dir", str(run_dir), "--set", override],
    )
    assert res.exit_code == 2 and words in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not run_dir.exists()


# --- memory-one through backroom train ---


def test_memory_one_through_backroom_train_reaches_tit_for_tat(tmp_path: Path) -> None:
    """The example gives tit-for-tat in seconds, the run the memory-one tests check
    (tests/test_trainer_memory_one.py), through the config and the CLI."""
    from backroom.trainer.memory_one import Result, Settings, train

    run_dir = tmp_path / "m1"
    done = subprocess.run(
        backroom("train", EXAMPLES / "ipd_memory_one.yaml", "--run-dir", run_dir),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120 * load_factor(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((run_dir / "memory_one.json").read_text())
    r = Result(p_a=summary["p_a"], returns=summary["returns"])
    assert r.is_tit_for_tat and summary["policy"] == "tit-for-tat", summary["p_a"]
    assert r.returns["self"] > 25 and r.returns["tft"] > 25  # cooperates with both
    assert r.returns["always-b"] > 8  # and loses only the first round to always-B
    assert "400 steps: tit-for-tat" in done.stdout
    # the same settings as the memory-one tests' run: the same play, the same policy
    direct = train(Settings(algorithm="adalign", beta=0.5, steps=400), 0)
    assert summary["p_a"] == direct.p_a
    rows = list(csv.DictReader((run_dir / "train_log.csv").open()))
    assert [float(x["cooperation_rate"]) for x in rows] == direct.coop_by_step
    (evaluation,) = [
        json.loads(x) for x in (run_dir / "evaluations.jsonl").read_text().splitlines()
    ]
    assert evaluation["against"]["tft"]["learner"] == summary["returns"]["tft"]
    # a piped run prints a line every 5% of its steps, not 400
    assert sum(line.startswith("step ") for line in done.stdout.splitlines()) == 20


def test_memory_one_grpo_through_backroom_train_ends_at_always_b(tmp_path: Path) -> None:
    done = subprocess.run(
        backroom(
            "train",
            EXAMPLES / "ipd_memory_one.yaml",
            "--run-dir",
            tmp_path / "g",
            "--set",
            "algorithm=grpo",
            "--steps",
            "150",
        ),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120 * load_factor(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "g" / "memory_one.json").read_text())
    assert summary["policy"] == "always-B", summary["p_a"]
    assert summary["settings"]["rho"] == 0.0  # GRPO plays no agent buffer unless hyper.rho says
    assert summary["returns"]["always-a"] > 45  # it exploits a cooperator


def test_memory_one_refuses_what_it_would_not_do() -> None:
    path = EXAMPLES / "ipd_memory_one.yaml"
    for edit, words in (
        ("hyper.kl_coef=0.1", "memory_one: hyper.kl_coef must be 0"),
        ("hyper.group_size=2", "memory_one: hyper.group_size must be 1"),
        ("params.temptation=6", "memory_one: plays the paper's payoffs"),
        ("game=kuhn", "game/params"),  # ipd's rounds are no parameter of Kuhn poker
    ):
        with pytest.raises(ConfigError, match=words):
            load_train_config(path, [edit])


# --- what a pipe and the log file get ---


def tiny_run(model: Path) -> dict[str, Any]:
    """GRPO self-play of 2-round matches on the tiny random Qwen2: a step in seconds."""
    return {
        "run": "piped",
        "game": "ipd",
        "params": {"rounds": 2},
        "algorithm": "grpo",
        "preset": "ipd",
        "hyper": {"lr": 1e-3, "batch_size": 2},
        "steps": 1000,  # never reached: the run is stopped
        "policy": "pol",
        "model": {"path": str(model), "device": TEST_DEVICE},
        "lora": {"rank": 4, "alpha": 8},
        "players": ["p0", "p1"],
        "evaluation": {"every": 1000, "matches": 1, "baselines": []},
        "turn_timeout_s": 60,
        "episode_timeout_s": 120,
    }


def test_piped_progress_comes_a_line_per_step_while_it_runs(
    tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """Not a terminal: each step's line arrives as the step ends (rich's live display
    printed everything at the end); no control characters, no library warnings. Ctrl-C
    between steps then stops it with the resume command."""
    cfg = tmp_path / "piped.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run(tiny_qwen_model)))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        backroom("train", cfg, "--run-dir", run_dir),
        env={k: v for k, v in ENV.items() if k != "BACKROOM_LOG_LEVEL"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[tuple[str, bool] | None] = queue.Queue()
    errors: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # each with whether the trainer was still running then
            lines.put((line, proc.poll() is None))
        lines.put(None)

    def read_stderr() -> None:
        assert proc.stderr is not None
        errors.extend(proc.stderr)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
    for t in readers:
        t.start()
    seen: list[tuple[str, bool]] = []
    deadline = time.monotonic() + 180 * load_factor()
    try:
        while not any(line.startswith("step 2/1000 ") for line, _ in seen):
            item = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert item is not None, f"ended early: {seen} {errors[-20:]}"
            seen.append(item)
    except queue.Empty:
        raise AssertionError(f"no second step line in time: {seen}") from None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120 * load_factor())
    for t in readers:
        t.join(timeout=10)
    while (item := lines.get(timeout=10)) is not None:
        seen.append(item)
    out = "".join(line for line, _ in seen)
    steps = [(line, running) for line, running in seen if line.startswith("step ")]
    assert [line.split()[1] for line, _ in steps][:2] == ["1/1000", "2/1000"], out
    assert all(running for _, running in steps[:2]), steps  # read while the run was running
    assert "\r" not in out and "\x1b[" not in out, repr(out[-500:])
    assert proc.returncode == 130, out + "".join(errors[-20:])
    assert "--resume" in out and str(run_dir) in out
    stderr = "".join(errors)
    assert "Warning:" not in stderr and "deprecated" not in stderr, stderr[-2000:]
    assert (run_dir / "logs" / "trainer.log").exists()
    with Store(run_dir / "store.sqlite") as store:
        assert len(store.steps()) >= 2


def test_a_process_of_the_run_that_exits_stops_it_at_once_with_its_reason(
    tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """An agent host that cannot build a pool agent (a frozen memory-one policy whose run is
    not there) exits; the trainer says so, with the host's own error, instead of waiting
    120 s for agents that will never come online."""
    config = tiny_run(tiny_qwen_model)
    missing = tmp_path / "no-such-run"
    config["opponents"] = [
        {"agent": {"id": "frozen", "kind": "memory-one", "options": {"run": str(missing)}}}
    ]
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        backroom("train", cfg, "--run-dir", tmp_path / "run"),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=110 * load_factor(),  # under the 120 s the trainer waits for agents
    )
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "process agents exited with code" in out, out[-3000:]
    assert "cannot read a final policy" in out and "agents not online" not in out, out[-3000:]


def test_library_warnings_go_to_the_log_file_not_the_terminal(tmp_path: Path) -> None:
    from backroom.cli import progress

    terminal = io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(terminal)
    saved = root.level, list(root.handlers)
    root.handlers = [handler]
    root.setLevel(logging.WARNING)
    ours = str(Path(progress.__file__))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with progress.train_logging(tmp_path / "logs" / "trainer.log") as noise:
                warnings.warn_explicit(
                    "`past_key_values` is deprecated", FutureWarning, "/x/transformers/m.py", 1
                )
                warnings.warn_explicit("vocabulary assumed", UserWarning, "/x/peft/s.py", 2)
                logging.getLogger("transformers.utils").warning("`cache_params` are deprecated")
                warnings.warn_explicit("a backroom warning", UserWarning, ours, 3)
                logging.getLogger("backroom.trainer").warning("the run's own warning")
                logging.getLogger("backroom.trainer").info("step 0: updating")
                logging.getLogger("transformers.utils").error("a library's error")
            after = warnings.showwarning
    finally:
        root.handlers = saved[1]
        root.setLevel(saved[0])
    shown = terminal.getvalue()
    kept = (tmp_path / "logs" / "trainer.log").read_text()
    assert noise.held == 3
    for text in ("past_key_values", "vocabulary assumed", "cache_params"):
        assert text not in shown and text in kept, text
    for text in ("a backroom warning", "the run's own warning", "a library's error"):
        assert text in shown and text in kept, text
    assert "step 0: updating" in kept and "step 0: updating" not in shown  # INFO: the file only
    assert after is not progress._log_warning  # restored on the way out
    assert root.level == saved[0] and handler.filters == []


# --- plots ---


def test_a_two_step_run_plots_whole_steps() -> None:
    from backroom.analysis.plotting import figure
    from backroom.analysis.training import step_ticks

    fig = figure()
    ax = fig.add_subplot()
    ax.plot([0, 1], [0.5, 0.7])
    fig.canvas.draw()
    assert any(t != int(t) for t in ax.get_xticks())  # matplotlib's own: 0.0, 0.2, ...
    step_ticks(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(t == int(t) for t in ticks), ticks
    assert {0, 1} <= set(ticks)


# --- the quick LoRA example ---


@pytest.mark.slow  # SmolLM2, 3 steps: 1.5 min idle, about 3 at load 3 per core
def test_the_quick_example_trains_a_few_steps_in_minutes(tmp_path: Path) -> None:
    run_dir = tmp_path / "quick"
    t0 = time.monotonic()
    done = subprocess.run(
        backroom("train", EXAMPLES / "ipd_quick.yaml", "--run-dir", run_dir),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600 * load_factor(),
    )
    seconds = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    config = load_train_config(EXAMPLES / "ipd_quick.yaml")
    with Store(run_dir / "store.sqlite") as store:
        assert [(s, v) for s, v, _ in store.steps()] == [(i, f"v{i + 1}") for i in range(3)]
    for version in ("v0", "v1", "v2", "v3"):
        assert (run_dir / "adapters" / version / "adapter_model.safetensors").stat().st_size > 0
    rows = list(csv.DictReader((run_dir / "train_log.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(int(r["matches"]) == config.hp.batch_size for r in rows)  # type: ignore[union-attr]
    (evaluation,) = [
        json.loads(x) for x in (run_dir / "evaluations.jsonl").read_text().splitlines()
    ]
    assert set(evaluation["against"]) == {"always-a", "always-b", "tft", "self"}
    assert "3 steps; adapter v3" in done.stdout
    print(f"ipd_quick.yaml: {seconds:.0f} s at load {os.getloadavg()[0]:.1f}")
