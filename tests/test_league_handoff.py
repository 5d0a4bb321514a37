"""The trainer's hand-off to a league and back: entrant files in, the ratings' progress out.

``backroom train`` with ``league:`` writes ``<dir>/entrants.d/<name>.vN.yaml``
(``trainer.entrants``); a league played into ``<dir>`` adds them
(``league.handoff``); each later evaluation of the run reports the ratings
the league's ``standings.json`` gives its entrants (``league_progress``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.agents import make_agent
from backroom.agents.base import Agent
from backroom.bus.auth import CredentialStore
from backroom.bus.broker import Broker
from backroom.bus.wire import AdapterRef
from backroom.league.config import parse_league
from backroom.league.handoff import handed_entrants, with_handed_entrants
from backroom.league.play import run_league
from backroom.model.adapters import adapter_digest
from backroom.runner.config import ConfigError
from backroom.trainer.config import parse_train_config
from backroom.trainer.entrants import league_progress, send_entrant
from backroom.trainer.loop import train

from .conftest import identity, load_factor, stack
from .test_trainer_cotrain import cotrain_data, learners
from .test_trainer_opponents import data, fake_adapter


def league_data(**extra: Any) -> dict[str, Any]:
    return {
        "league": "ipd",
        "games": [{"game": "ipd", "params": {"rounds": 3}, "seeds": 2}],
        "entrants": [
            {"id": "tft", "kind": "tit-for-tat"},
            {"id": "always-b", "kind": "always", "options": {"action": "B"}},
        ],
        **extra,
    }


def checkpoint_ref(run_dir: Path, version: str) -> AdapterRef:
    """A fake adapter folder of ``run_dir`` and its reference, digest and all (as a trainer's)."""
    fake_adapter(run_dir / "adapters" / version, version)
    sha, size = adapter_digest(run_dir / "adapters" / version)
    return AdapterRef(policy="p", version=version, uri="/x", sha256=sha, size=size)


def hand_over(tmp_path: Path, league: Path, versions: list[str]) -> None:
    config = parse_train_config(data(league={"dir": str(league), "every": 1, "name": "grpo"}))
    run_dir = tmp_path / "run"
    for v in versions:
        send_entrant(config, run_dir, int(v[1:]) - 1, checkpoint_ref(run_dir, v))


def test_a_league_adds_the_checkpoints_training_runs_handed_over_once(tmp_path: Path) -> None:
    league = tmp_path / "league"
    model = {"kind": "local", "options": {"model": "/models/base", "policy": "follow"}}
    config = parse_league(league_data(trainers=[str(tmp_path / "run")], model=model))
    assert with_handed_entrants(config, league) == (config, [])  # nothing handed over yet
    hand_over(tmp_path, league, ["v1", "v2"])
    merged, added = with_handed_entrants(config, league)
    assert added == ["grpo.v1", "grpo.v2"]
    assert [e.id for e in merged.entrants] == ["tft", "always-b", "grpo.v1", "grpo.v2"]
    v2 = merged.entrants[-1]
    # seated as the league's own `model:` plays, with that adapter, frozen (no policy)
    assert v2.kind == "local" and v2.options == {
        "model": "/models/base",
        "adapter": str((tmp_path / "run" / "adapters" / "v2").resolve()),
    }
    # a league that has them (a resumed one, or a config naming them) adds nothing twice
    assert with_handed_entrants(merged, league) == (merged, [])
    hand_over(tmp_path, league, ["v3"])
    assert with_handed_entrants(merged, league)[1] == ["grpo.v3"]


def test_a_checkpoint_of_a_run_the_league_does_not_name_is_refused(tmp_path: Path) -> None:
    league = tmp_path / "league"
    hand_over(tmp_path, league, ["v1"])
    said: list[str] = []
    config = parse_league(league_data())
    assert with_handed_entrants(config, league, said.append) == (config, [])
    assert "lies outside the league directory" in said[0] and "trainers:" in said[0]
    assert (league / "entrants.d" / "rejected" / "grpo.v1.yaml").exists()
    # an adapter inside the league directory needs no naming
    inside = league / "adapters" / "v4"
    fake_adapter(inside, "v4")
    sha, _ = adapter_digest(inside)
    good = {"format": 2, "name": "own.v4", "policy": "p", "version": "v4", "sha256": sha}
    (league / "entrants.d" / "own.v4.yaml").write_text(
        yaml.safe_dump({**good, "adapter": "adapters/v4"})
    )
    assert with_handed_entrants(config, league)[1] == ["own.v4"]


def escapes(tmp_path: Path, league: Path) -> Iterator[tuple[str, dict[str, Any] | str, str]]:
    """Hostile ``entrants.d`` files: (file name, record or raw text, words of the refusal)."""
    run = tmp_path / "run"
    ref = checkpoint_ref(run, "v1")
    good = {
        "format": 2,
        "name": "x.v1",
        "policy": "p",
        "version": "v1",
        "adapter": str(run / "adapters" / "v1"),
        "sha256": ref.sha256,
    }
    listener = {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "BACKROOM_PASSWORDS"}
    yield (
        "agent.yaml",
        {"format": 1, "agent": {"id": "x", "kind": "llm", "options": listener}},
        ("format 1 is not 2"),
    )
    yield "newer.yaml", {**good, "format": 3}, "format 3 is newer than 2"
    yield (
        "kind.yaml",
        {**good, "kind": "llm", "options": listener},
        "field.s. kind, options refused",
    )
    yield "base.yaml", {**good, **listener}, "field.s. api_key_env, base_url refused"
    yield "torn.yaml", ": : :\n", "not YAML"
    yield "list.yaml", "[1, 2]\n", "not a mapping"
    yield "name.yaml", {**good, "name": "../x"}, "name: String should match"
    yield (
        "digest.yaml",
        {**good, "sha256": "0" * 64},
        f"its sha256 is {ref.sha256} .*, not the 0000",
    )
    yield "dots.yaml", {**good, "adapter": f"{run}/adapters/../adapters/v1"}, "no `..`"
    yield "etc.yaml", {**good, "adapter": "/etc"}, "lies outside the league directory"
    # a link inside a named run, to a folder outside every one of them
    outside = tmp_path / "elsewhere" / "v1"
    fake_adapter(outside, "v1")
    (run / "adapters" / "link").mkdir()
    (run / "adapters" / "link" / "v1").symlink_to(outside)
    sha, _ = adapter_digest(outside)
    linked = {**good, "adapter": str(run / "adapters" / "link" / "v1"), "sha256": sha}
    yield "link.yaml", linked, "lies outside the league directory"
    # a real folder inside whose weights are a link out of the run
    (run / "adapters" / "half" / "v1").mkdir(parents=True)
    (run / "adapters" / "half" / "v1" / "adapter_config.json").write_text("{}")
    (run / "adapters" / "half" / "v1" / "adapter_model.safetensors").symlink_to(
        outside / "adapter_model.safetensors"
    )
    half = {**good, "adapter": str(run / "adapters" / "half" / "v1"), "sha256": sha}
    yield "half.yaml", half, "adapter_model.safetensors leads out of"
    yield "version.yaml", {**good, "version": "v2"}, "the folder of version v2 is named so"


def test_every_hostile_handed_over_file_is_refused_and_set_aside(tmp_path: Path) -> None:
    league = tmp_path / "league"
    folder = league / "entrants.d"
    folder.mkdir(parents=True)
    config = parse_league(league_data(trainers=[str(tmp_path / "run")]))
    cases = list(escapes(tmp_path, league))
    for name, record, _ in cases:
        text = record if isinstance(record, str) else yaml.safe_dump(record)
        (folder / name).write_text(text)
    (folder / "passwd.yaml").symlink_to("/etc/passwd")  # a link is no record: never read
    said: list[str] = []
    assert handed_entrants(league, config, said.append) == []
    assert len(said) == len(cases) + 1
    for (name, _, words), line in zip(
        sorted([*cases, ("passwd.yaml", "", "cannot be read as a plain file")]), said, strict=True
    ):
        assert re.search(rf"{name}: .*{words}", line), (name, line)
        assert line.endswith(f"(moved to {folder / 'rejected'})")
        reason = (folder / "rejected" / f"{name}.reason").read_text()
        assert re.search(words, reason), (name, reason)
    assert sorted(p.name for p in folder.glob("*.yaml")) == []  # nothing read twice
    assert "root:" not in "\n".join(said)  # the linked file's content is nowhere


def test_a_refusal_writes_through_no_planted_link_and_quotes_no_terminal_escape(
    tmp_path: Path,
) -> None:
    league = tmp_path / "league"
    rejected = league / "entrants.d" / "rejected"
    rejected.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (rejected / "x.yaml.reason").symlink_to(victim)  # planted by whoever writes entrants.d
    (league / "entrants.d" / "x.yaml").write_text("format: 2\nkind: llm\n")
    sneaky = league / "entrants.d" / "\x1b]0;owned\x07.yaml"
    sneaky.write_text(yaml.safe_dump({"format": 2, "\x1b[2J": 1}))
    said: list[str] = []
    assert handed_entrants(league, parse_league(league_data()), said.append) == []
    assert victim.read_text() == "mine\n"
    assert "kind refused" in (rejected / "x.yaml.reason").read_text()
    assert len(said) == 2 and all(line.isprintable() for line in said)
    assert "\\x1b[2J" in said[0] and not sneaky.exists()


def test_an_agent_option_naming_a_secret_of_backroom_is_refused_at_load() -> None:
    bad = {"base_url": "http://127.0.0.1:8000/v1", "api_key_env": "BACKROOM_PASSWORDS"}
    entrants = [{"id": "x", "kind": "llm", "options": bad}, {"id": "tft", "kind": "tit-for-tat"}]
    with pytest.raises(ConfigError, match=r"entrants\.0\.options: api_key_env BACKROOM_PASSWORDS"):
        parse_league({**league_data(), "entrants": entrants})
    model = {"kind": "llm", "options": {**bad, "api_key_env": "BACKROOM_PASSWORD_FILE"}}
    with pytest.raises(ConfigError, match=r"model\.options: api_key_env BACKROOM_PASSWORD_FILE"):
        parse_league({**league_data(), "model": model})
    with pytest.raises(ValueError, match="a variable backroom sets"):
        make_agent("llm", "x", base_url="http://127.0.0.1:8000/v1", api_key_env="BACKROOM_PASSWORD")
    # the key of backroom serve-model is meant for a model server (compose hands it so)
    served = {"id": "x", "kind": "llm", "options": {**bad, "api_key_env": "BACKROOM_SERVE_KEY"}}
    parse_league({**league_data(), "entrants": [served, entrants[1]]})


def children_with(word: bytes) -> dict[int, bytes]:
    """The environment of each child of this process whose command line holds ``word``."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != os.getpid():
                continue
            if word in (proc / "cmdline").read_bytes():
                found[int(proc.name)] = (proc / "environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return found


async def test_a_dropped_llm_entrant_sends_no_password_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finding: an ``llm`` entrant dropped into entrants.d, its base_url a listener of the
    attacker's and its api_key_env the agent host's passwords, made the league's agent process
    send every local entrant's bus password as its bearer token. Now the file is refused and
    set aside, the listener hears nothing, and no child's environment holds a password (the
    agent host reads them from a file of its own)."""
    heard: list[bytes] = []

    async def listen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heard.append(await reader.read(4096))
        writer.close()

    server = await asyncio.start_server(listen, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    league = tmp_path / "league"
    (league / "entrants.d").mkdir(parents=True)
    hostile = {
        "format": 1,
        "agent": {
            "id": "spy",
            "kind": "llm",
            "options": {
                "base_url": f"http://127.0.0.1:{port}/v1",
                "api_key_env": "BACKROOM_PASSWORDS",
            },
        },
    }
    (league / "entrants.d" / "spy.yaml").write_text(yaml.safe_dump(hostile))
    monkeypatch.setenv("BACKROOM_PASSWORD", "the-callers-own")  # inherited by no child
    said: list[str] = []
    config, added = with_handed_entrants(
        parse_league(league_data(agent_processes="single")), league, said.append
    )
    assert added == [] and "spy.yaml: format 1 is not 2" in said[0]
    assert (league / "entrants.d" / "rejected" / "spy.yaml").exists()
    assert not (league / "entrants.d" / "spy.yaml").exists()

    environs: dict[int, bytes] = {}

    async def watch() -> None:  # the referee's and the agent host's, while they run
        while not children_with(b"agent-host") or len(environs) < 2:
            environs.update(children_with(b"backroom\0"))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        summary = await run_league(config, league, ready_timeout_s=60 * load_factor())
        await asyncio.wait_for(watcher, 1)  # the host was seen while it ran
    finally:
        watcher.cancel()
        server.close()
    assert summary.played > 0 and summary.pending == 0
    assert heard == []
    (stores,) = [p for p in league.glob("runs/ipd/*/broker") if not p.parent.is_symlink()]
    passwords = [c.password for c in CredentialStore(stores).load().values()]
    assert passwords and all(p for p in passwords)
    for env in environs.values():
        names = {line.split(b"=", 1)[0] for line in env.split(b"\0") if line}
        assert b"BACKROOM_PASSWORDS" not in names and b"BACKROOM_PASSWORD" not in names
        assert b"the-callers-own" not in env
        assert not [p for p in passwords if p.encode() in env]
    assert not (stores.parent / "private").exists()  # the password files go with the run


def test_evaluation_reports_the_ratings_the_league_gave_this_runs_entrants(
    tmp_path: Path,
) -> None:
    league = tmp_path / "league"
    config = parse_train_config(data(league={"dir": str(league), "name": "grpo"}))
    assert league_progress(config) is None  # no standings yet
    assert league_progress(parse_train_config(data())) is None  # no league at all
    league.mkdir()
    (league / "standings.json").write_text('{"games": {')  # torn: as none
    assert league_progress(config) is None

    def rating(agent: str, mu: float) -> dict[str, Any]:
        return {"agent": agent, "mu": mu, "sigma": 2.0, "ordinal": mu - 6, "matches": 8}

    standings = {
        "league": "ipd",
        "updated": 1.0,
        "running": True,
        "games": {
            "ipd": {
                "ratings": [rating("tft", 27.0), rating("grpo.v2", 25.0), rating("grpo.v1", 20.0)]
            },
            "kuhn": {"ratings": [rating("cfr", 30.0)]},
        },
    }
    (league / "standings.json").write_text(json.dumps(standings))
    progress = league_progress(config)
    assert progress == {
        "league": "ipd",
        "updated": 1.0,
        "running": True,
        "entrants": {"ipd": [rating("grpo.v2", 25.0), rating("grpo.v1", 20.0)]},
    }


@pytest.mark.slow  # two short training runs and a league session, about two minutes
async def test_checkpoints_go_to_a_league_and_come_back_as_ratings(
    broker: Broker, tmp_path: Path, tiny_qwen_model: Path
) -> None:
    """The whole loop with the tiny random Qwen2: a run hands v1 and v2 over, a league rates
    them against tit-for-tat, and the run's next evaluation (after --resume) reports those
    ratings from the league's standings."""
    league = tmp_path / "league"
    train_data = cotrain_data(tiny_qwen_model, "hand", "x", "grpo")
    train_data.update(opponents=[], league={"dir": str(league), "every": 1})
    run_dir = tmp_path / "hand"
    players: list[Agent] = [*learners(tiny_qwen_model, "hand")]
    async with stack(broker, tmp_path / "runs", players):
        await train(
            parse_train_config(train_data), run_dir, identity(broker, "trainer-hand", "trainer")
        )
    # the league names the run its checkpoints may come from, and the model they play on
    base = parse_train_config(train_data).model.agent_options()
    model = {"kind": "local", "options": {k: v for k, v in base.items() if v is not None}}
    league_config = league_data(
        agent_processes="single", turn_timeout_s=60, model=model, trainers=[str(run_dir)]
    )
    config, added = with_handed_entrants(parse_league(league_config), league)
    assert added == ["hand.v1", "hand.v2"]
    summary = await run_league(config, league, ready_timeout_s=300)
    assert summary.pending == 0 and summary.played > 0
    rated = {r["agent"] for r in summary.standings["games"]["ipd"]["ratings"]}
    assert {"hand.v1", "hand.v2"} <= rated
    # one more step: its evaluation reads the standings the league wrote
    more = parse_train_config({**train_data, "steps": 3, "evaluation": {"every": 1, "matches": 1}})
    async with stack(broker, tmp_path / "runs", [*learners(tiny_qwen_model, "hand")]):
        result = await train(
            more, run_dir, identity(broker, "trainer-hand", "trainer"), resume=True
        )
    progress = result.evaluations[-1]["league"]
    assert progress["league"] == "ipd" and progress["running"] is False
    assert {r["agent"] for r in progress["entrants"]["ipd"]} == {"hand.v1", "hand.v2"}
    for r in progress["entrants"]["ipd"]:
        assert r["matches"] > 0 and r["sigma"] > 0
    assert (league / "entrants.d" / "hand.v3.yaml").exists()  # and v3 is handed over in turn


SWAPPER = """
import ctypes, os, sys
rejected, link = (p.encode() for p in sys.argv[1:3])
renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
while True:  # RENAME_EXCHANGE: the real folder and a link to elsewhere swap places atomically
    renameat2(-100, rejected, -100, link, 2)
"""


def test_a_folder_swapped_for_a_link_while_refusing_takes_nothing_out(tmp_path: Path) -> None:
    """Whoever writes ``entrants.d`` may swap ``rejected/`` for a link between the check and
    the move, in a loop of its own process: a refused file, and its reason, land in the
    league's own folder or stay where they are, never where the link points."""
    import subprocess
    import sys

    from backroom.league.handoff import REJECTED_DIR, set_aside

    handed = tmp_path / "league" / "entrants.d"
    rejected, link, elsewhere = handed / REJECTED_DIR, handed / "link", tmp_path / "elsewhere"
    rejected.mkdir(parents=True)
    elsewhere.mkdir()
    link.symlink_to(elsewhere)
    files = [handed / f"x{i}.yaml" for i in range(2000)]
    for f in files:
        f.write_text("format: 1\n")
    args = [sys.executable, "-c", SWAPPER, str(rejected), str(link)]
    attacker = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        for f in files:
            set_aside(f, "refused")
    finally:
        attacker.kill()
        attacker.wait()
    assert sorted(p.name for p in elsewhere.iterdir())[:5] == []
