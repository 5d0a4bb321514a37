"""Nothing a message, a record or a store names is run or read (issue 35, items 1 and 2).

A ``game: pettingzoo`` spec names its environment; before, it named an import
path with keyword arguments (``{env: "os:system", kwargs: {command: ...}}``) and
every reader of a spec ran it: the referee for a runner-role request, ``backroom
web`` and the ``kuhn-team`` agents for a start message, ``analyze`` and ``replay``
for an ``episodes.jsonl``, ``league show --refresh`` for a league store. Each is
tried here with a command that would leave a marker file: none may, and each
says why in one line. OpenSpiel parameters were unbounded: a hang, a wedged
referee, a file read into the record, a decode error; each is refused here with
a message naming its bound, and the referee keeps playing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from backroom.bus.broker import Broker
from backroom.bus.wire import MatchSpec, MatchStart
from backroom.games import make_game
from backroom.games import openspiel_bounds as bounds
from backroom.runner.config import ConfigError, load_config, parse_config

from .conftest import Runner, agents, load_factor, stack

pytest.importorskip("pyspiel")
pytest.importorskip("pettingzoo")

UNKNOWN = "unknown pettingzoo env 'os:system': register it under the entry point group"


def hostile(marker: Path) -> dict[str, Any]:
    """``game: pettingzoo`` params that would run ``touch marker`` in the old readers."""
    return {"env": "os:system", "kwargs": {"command": f"touch {marker}"}}


def spec(game: str, params: dict[str, Any], **kw: Any) -> MatchSpec:
    base: dict[str, Any] = {"seats": ["a", "b"], "turn_timeout_s": 5, "run": "t"}
    return MatchSpec(game=game, params=params, **{**base, **kw})


async def played(broker: Broker, tmp_path: Path, rps: bool = False) -> dict[str, Any]:
    """One real rock-paper-scissors episode over the broker, as its JSON (for tampering)."""
    async with stack(broker, tmp_path / "runs", agents(("a", "random"), ("b", "random"))):
        async with Runner(broker) as runner:
            await runner.submit("m-rps", spec("pettingzoo", {"env": "rps"}))
            (ep,) = await runner.wait(["m-rps"], timeout=30 * load_factor())
    assert ep.reason == "normal", ep.detail
    data: dict[str, Any] = json.loads(ep.model_dump_json())
    return data


# --- item 1: pettingzoo environments by registered name only ---------------------------


async def test_a_match_request_naming_code_runs_nothing(broker: Broker, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    async with stack(broker, tmp_path / "runs", agents(("a", "random"), ("b", "random"))):
        async with Runner(broker) as runner:
            await runner.submit("m-bad", spec("pettingzoo", hostile(marker)))
            await runner.submit("m-ok", spec("pettingzoo", {"env": "tictactoe"}))
            bad, ok = await runner.wait(["m-bad", "m-ok"], timeout=30 * load_factor())
    assert bad.reason == "error" and UNKNOWN in bad.detail and "\n" not in bad.detail
    assert ok.reason == "normal", ok.detail  # a registered name plays
    assert not marker.exists()


async def test_a_start_message_naming_code_runs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``backroom web`` (the seat's rules) and the demo's ``kuhn-team`` build the game from
    the start message a referee-role identity sent."""
    from backroom.agents import make_agent
    from backroom.human.render import rules_for

    marker = tmp_path / "ran"
    start = MatchStart(
        match="m",
        seat=0,
        seats=["a", "b"],
        game="pettingzoo",
        params=hostile(marker),
        turn_timeout_s=5,
    )
    assert UNKNOWN in rules_for(start)
    team = make_agent("kuhn-team", "alice")
    with caplog.at_level(logging.WARNING):
        await team.on_match_start(start)  # said in one log line, no traceback
    assert any(UNKNOWN in r.getMessage() and r.exc_info is None for r in caplog.records)
    assert not marker.exists()


async def test_records_naming_code_run_nothing_in_analyze_or_replay(
    broker: Broker, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from backroom.cli import app
    from backroom.replay.view import match_view

    record = await played(broker, tmp_path)
    marker = tmp_path / "ran"
    record["params"] = record["spec"]["params"] = hostile(marker)
    run = tmp_path / "sent" / "20260101-000000"
    run.mkdir(parents=True)
    (run / "episodes.jsonl").write_text(json.dumps(record) + "\n")

    analyzed = CliRunner().invoke(app, ["analyze", str(run), "--out-dir", str(tmp_path / "out")])
    assert not marker.exists(), analyzed.output
    view = match_view(record, {}, set())  # what `backroom replay` shows of the match
    assert any(UNKNOWN in gap for gap in view["gaps"]), view["gaps"]
    assert not marker.exists()


def test_a_league_store_naming_code_runs_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from backroom.cli import app
    from backroom.league.store import LeagueStore

    marker = tmp_path / "ran"
    league = tmp_path / "league"
    league.mkdir()
    config = {
        "league": "l",
        "games": [{"game": "pettingzoo", "params": hostile(marker)}],
        "entrants": [{"id": "a", "kind": "random"}, {"id": "b", "kind": "random"}],
    }
    with LeagueStore(league / "league.sqlite") as store:
        store.set_meta("config", json.dumps(config))
    shown = CliRunner().invoke(app, ["league", "show", str(league), "--refresh"])
    assert not marker.exists()
    assert shown.exit_code != 0 and UNKNOWN in " ".join(shown.output.split()), shown.output
    assert "Traceback" not in shown.output


def test_a_config_names_its_own_environment_and_the_wire_only_its_name() -> None:
    """A run config registers ``pettingzoo_envs`` for its processes (inherited through
    ``BACKROOM_PETTINGZOO_ENVS``); specs and records then carry the name alone."""
    import os

    from backroom.envs.seated import ENVS_ENV, register_env

    cfg = parse_config(
        {
            "run": "t",
            "pettingzoo_envs": {"my_rps": "pettingzoo.classic.rps_v2:env"},
            "game": "pettingzoo",
            "params": {"env": "my_rps"},
            "agents": [{"id": "a", "kind": "random"}, {"id": "b", "kind": "random"}],
        }
    )
    assert cfg.params == {"env": "my_rps"}
    assert json.loads(os.environ[ENVS_ENV])["my_rps"] == "pettingzoo.classic.rps_v2:env"
    assert make_game("pettingzoo", env="my_rps").num_players == 2
    with pytest.raises(ValueError, match="not a free name"):
        register_env("rps", "os:system")  # a built-in name is never taken over


# --- item 2: OpenSpiel by declared parameters, bounded ----------------------------------


def openspiel_config(params: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": "t",
        "game": "openspiel",
        "params": params,
        "agents": [{"id": "a", "kind": "random"}, {"id": "b", "kind": "random"}],
    }


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (
            {"name": "blotto", "coins": 1000, "fields": 10},
            "over the bound of 100,000 (MAX_ACTIONS)",
        ),
        ({"name": "hex", "board_size": 3000}, "over the bound of 100,000 (MAX_ACTIONS)"),
        ({"name": "efg_game", "filename": "/etc/passwd"}, "parameter 'filename' names a file"),
        ({"name": "nfg_game"}, "parameter 'filename' names a file"),
        ({"name": "bargaining", "instances_file": "/etc/passwd"}, "names a file"),
    ],
    ids=["blotto-hang", "hex-decode", "efg-file", "nfg-bare", "bargaining-file"],
)
def test_openspiel_past_a_bound_is_refused_in_one_line(params: dict[str, Any], says: str) -> None:
    """What ``backroom run`` says of the config: at once, one line, naming the bound."""
    began = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        parse_config(openspiel_config(params), source="bad.yaml")
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert time.monotonic() - began < 5 * load_factor()


def test_a_game_that_builds_too_long_is_killed_at_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No estimate for Blotto, a one-second bound: its 7 s construction is cut off."""
    monkeypatch.setattr(bounds, "ESTIMATES", {})
    monkeypatch.setattr(bounds, "MAX_BUILD_S", 1.0)
    monkeypatch.setattr(bounds, "PROBE_START_S", 1.0)
    began = time.monotonic()
    with pytest.raises(ValueError, match=r"did not build within 1 s \(MAX_BUILD_S\)"):
        make_game("openspiel", name="blotto", coins=61, fields=6)
    assert time.monotonic() - began < 2.0 + 2 * load_factor()
    with pytest.raises(ValueError, match="MAX_BUILD_S"):  # the verdict is kept: no second probe
        make_game("openspiel", name="blotto", coins=61, fields=6)


async def test_the_referee_answers_a_bad_game_at_once_and_keeps_playing(
    broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hang that wedged a referee, the file read into a record, and a game that builds
    too long (bound lowered), each an ``error`` episode; a good game asked for meanwhile
    plays, before the slow one's probe ends."""
    async with stack(broker, tmp_path / "runs", agents(("a", "random"), ("b", "random"))):
        async with Runner(broker) as runner:
            began = time.monotonic()
            await runner.submit(
                "m-hang", spec("openspiel", {"name": "blotto", "coins": 1000, "fields": 10})
            )
            (hang,) = await runner.wait(["m-hang"], timeout=30 * load_factor())
            answered = time.monotonic() - began
            await runner.submit(
                "m-file", spec("openspiel", {"name": "efg_game", "filename": "/etc/passwd"})
            )
            (read,) = await runner.wait(["m-file"], timeout=30 * load_factor())

            monkeypatch.setattr(bounds, "ESTIMATES", {})
            # Killed at 2 s: on an idle machine the build takes 3-7 s (at 3 + 5 s it could end)
            monkeypatch.setattr(bounds, "MAX_BUILD_S", 1.0)
            monkeypatch.setattr(bounds, "PROBE_START_S", 1.0)
            await runner.submit(
                "m-slow", spec("openspiel", {"name": "blotto", "coins": 62, "fields": 6})
            )
            await runner.submit("m-good", spec("openspiel", {"name": "kuhn_poker", "players": 2}))
            (good,) = await runner.wait(["m-good"], timeout=30 * load_factor())
            assert "m-slow" not in runner.episodes  # still probing: the referee played on
            (slow,) = await runner.wait(["m-slow"], timeout=30 * load_factor())
    assert hang.reason == "error" and "MAX_ACTIONS" in hang.detail
    assert answered < 2.0 * load_factor()
    assert read.reason == "error" and "names a file" in read.detail
    passwd = Path("/etc/passwd").read_text().splitlines()[0]
    assert passwd not in read.model_dump_json()
    assert good.reason == "normal", good.detail
    assert slow.reason == "error" and "did not build within 1 s (MAX_BUILD_S)" in slow.detail


# Gambit's extensive form: one decision of player 1, each leaf paying both players.
EFG = """EFG 2 R "One choice" { "P1" "P2" } ""
p "" 1 1 "" { "L" "R" } 0
t "" 1 "Left" { 1, -1 }
t "" 2 "Right" { -1, 1 }
"""


def test_a_config_may_name_a_game_file_beside_it_and_nowhere_else(tmp_path: Path) -> None:
    (tmp_path / "one.efg").write_text(EFG)
    good = tmp_path / "run.yaml"
    good.write_text(json.dumps(openspiel_config({"name": "efg_game", "filename": "one.efg"})))
    cfg = load_config(good)
    assert cfg.params["filename"] == str((tmp_path / "one.efg").resolve())
    assert make_game("openspiel", **cfg.params).num_players == 2  # allowed in this process

    elsewhere = tmp_path / "sub"
    elsewhere.mkdir()
    bad = elsewhere / "run.yaml"
    bad.write_text(json.dumps(openspiel_config({"name": "efg_game", "filename": "../one.efg"})))
    with pytest.raises(ConfigError, match="is not a file beside the config"):
        load_config(bad)
    with pytest.raises(ConfigError, match="names a file"):  # a config from anywhere else
        parse_config(openspiel_config({"name": "efg_game", "filename": "/etc/hostname"}))


def test_the_probe_builds_and_plays_in_its_own_process() -> None:
    """The probe's verdicts, as the child process gives them."""
    assert bounds.probe("kuhn_poker", {"players": 3}) is None
    assert "MAX_ACTIONS" in (bounds.probe("hex", {"board_size": 400}) or "")


def probes_alive() -> int:
    """Probe processes (``openspiel_bounds.main``) that this process started and that run now."""
    mine, alive = str(os.getpid()), 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            command = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        alive += ppid == mine and b"openspiel_bounds import main" in command
    return alive


async def test_a_flood_of_requests_to_vet_starts_few_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each probe is a Python process with pyspiel: 9 requests for 5 slow games (bound
    lowered) start at most ``MAX_PROBES`` at once, requests for one game share its probe,
    and past ``MAX_VETTING`` games a request is refused at once. Before, each request
    started its own process."""
    from backroom.referee import building

    monkeypatch.setattr(bounds, "ESTIMATES", {})
    monkeypatch.setattr(bounds, "_verdicts", {})
    monkeypatch.setattr(bounds, "MAX_BUILD_S", 1.0)
    monkeypatch.setattr(bounds, "PROBE_START_S", 1.0)
    monkeypatch.setattr(building, "MAX_VETTING", 4)
    games = [{"name": "blotto", "coins": 100 + i, "fields": 6} for i in range(5)]
    asked = [*(games[0] for _ in range(5)), *games[1:]]
    vetting = [asyncio.ensure_future(building.vet(spec("openspiel", p))) for p in asked]
    most = 0
    while not all(t.done() for t in vetting):
        most = max(most, probes_alive())
        await asyncio.wait(vetting, timeout=0.05)
    said = [str(t.exception()) for t in vetting]
    assert most <= building.MAX_PROBES, most
    assert sum("(MAX_VETTING)" in s for s in said) == 1, said  # the fifth game
    assert sum("(MAX_BUILD_S)" in s for s in said) == 8, said  # 5 share the first probe
    assert probes_alive() == 0


def test_a_game_that_builds_in_seconds_is_refused_and_one_that_passes_is_built_once() -> None:
    """A game the probe passes is built in the process that asked, in C++ that holds the GIL:
    one that takes seconds (Blotto with 16,000 coins on two fields: about 3 s here) would
    stall a referee for every match, so it is refused; a passed game is built once."""
    from backroom.games.openspiel import load

    with pytest.raises(ValueError, match=r"MAX_BUILD_S"):
        make_game("openspiel", name="blotto", coins=16_000, fields=2)
    load.cache_clear()
    make_game("openspiel", name="leduc_poker", players=3)
    make_game("openspiel", name="leduc_poker", players=3)
    info = load.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_no_spec_makes_a_reader_draw_even_for_an_environment_the_operator_registered() -> None:
    from backroom.envs.seated import check_kwargs

    with pytest.raises(ValueError, match="takes no 'render_mode' from a spec"):
        check_kwargs("someone.elses_env", {"render_mode": "human"})
    check_kwargs("someone.elses_env", {"size": 3})  # its own arguments: its factory checks them
