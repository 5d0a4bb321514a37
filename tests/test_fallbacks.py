"""Every move that was not the agent's own choice is marked, counted and can be left out.

A real run (`backroom run`, its broker, referee and agent processes) whose
`llm` seat talks to an OpenAI-compatible stub server of this test: some
requests hang past the agent's deadline, some replies are unreadable (then
repaired or not); the record marks each fallback with its reason, the run's
table, `backroom analyze` and `analysis.json` count them, and
`--exclude-fallbacks` measures what this test computes by hand from
episodes.jsonl. The referee's own timeout default is marked `timeout`; an
`always` agent whose action the game lacks is refused; old records still load.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from backroom import metrics
from backroom.agents.local_model import LocalAgent
from backroom.agents.parsing import fallback_action
from backroom.analysis import analyze_episodes, notes
from backroom.bus.broker import Broker
from backroom.bus.wire import EpisodeRecord, MatchSpec, MatchStart, Turn
from backroom.games import make_game
from backroom.model.backend import Backend
from backroom.model.serve import running_server
from backroom.records import count_fallbacks, describe, has_fallback, record_moves
from backroom.runner.config import ConfigError, parse_config
from backroom.runs import read_episodes, resolve_run_dir

from .conftest import RawAgent, Runner, agents, identity, stack
from .gameplay import episode

#: A request hangs this long: far past the agent's deadline (turn_timeout_s - deadline_margin_s).
HANG_S = 5.0


def stub_server() -> FastAPI:
    """A chat-completions endpoint whose reply follows from the request's ``seed``.

    The ``llm`` agent derives the seed from the match's seed, the seat, the
    turn and the call (``act``, ``repair``, ``talk``), so the same config gets
    the same replies: 1 in 8 requests hangs (a deadline fallback), 1 in 8 first
    replies is unreadable; a repair request is answered readably half of the
    time (``repaired``) and unreadably otherwise (``unparseable``).
    """
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        seed = int(body["seed"])
        repair = "was not valid" in body["messages"][-1]["content"]
        if seed % 8 == 0:  # until the agent gives up on it (or HANG_S)
            for _ in range(int(HANG_S / 0.05)):
                if await request.is_disconnected():
                    break
                await asyncio.sleep(0.05)
        if repair:
            text = "<B>" if seed % 2 == 0 else "I would rather not say."
        else:
            text = "Let me think about it." if seed % 8 == 1 else ("<A>", "<B>")[seed % 2]
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "stub",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            }
        )

    return app


async def backroom(*args: str, cwd: Path) -> tuple[int, str]:
    """The CLI in a subprocess, while this event loop keeps serving the stub."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "backroom",
        *args,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "400"},  # rich must not wrap a line we look for
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode is not None  # set by communicate(): for the type checker
    return proc.returncode, out.decode()


def config_text(url: str) -> str:
    return f"""
run: fb
game: ipd
params: {{rounds: 3}}
matches: 8
seed: 3
concurrency: 8
turn_timeout_s: 3.0  # a normal reply has 2.5 s: a busy machine keeps it its own
agents:
  - id: llm
    kind: llm
    options: {{base_url: "{url}/v1", model: stub, api_key_env: "", deadline_margin_s: 0.5,
               backoff_base_s: 0.01}}
  - {{id: tft, kind: tit-for-tat}}
channels:
  - {{name: table2, members: [llm, tft], opens: before_act}}
"""


async def test_fallbacks_are_marked_counted_and_can_be_left_out(tmp_path: Path) -> None:
    async with running_server(stub_server()) as url:
        (tmp_path / "fb.yaml").write_text(config_text(url))
        rc, run_out = await backroom(
            "run", "fb.yaml", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path
        )
    assert rc == 0, run_out
    run_dir = resolve_run_dir(tmp_path / "runs" / "fb")
    episodes: list[dict[str, Any]] = list(read_episodes(run_dir))
    assert len(episodes) == 8 and all(e["reason"] == "normal" for e in episodes)

    # The record: each llm move that was not the model's first reply carries its reason,
    # the same one the agent's trace gives; the scripted seat never has one.
    traces = {
        (t["match"], t["turn"], t["seat"]): t
        for t in map(json.loads, (run_dir / "traces.jsonl").read_text().splitlines())
    }
    moves = [(e["match"], a) for e in episodes for a in e["actions"]]
    assert all(a["fallback"] is None for _, a in moves if a["agent"] == "tft")
    mine = [(m, a) for m, a in moves if a["agent"] == "llm"]
    assert len(mine) == 8 * 3 * 2  # a talk turn and an act turn in each of 3 rounds
    for match, a in mine:
        reply = traces[(match, a["turn"], a["seat"])]["reply"]
        assert (a["fallback"] or "") == reply["reason"], (a, reply)
        assert not a["timed_out"] and a["fallback"] != "timeout"
        if a["fallback"] == "deadline" and a["phase"] == "act":
            assert a["action"] == "A"  # the documented fallback: the first legal choice
        if a["fallback"] == "deadline" and a["phase"] == "talk":
            assert a["action"] == ""  # silence
        if a["fallback"] == "unparseable":
            assert reply["outcome"] == "fallback" and reply["detail"]
        if a["fallback"] == "deadline":  # what ran out, in words (docs/agents.md)
            assert reply["detail"].startswith("no answer within"), reply
    seen = {a["fallback"] for _, a in mine}
    # The stub's replies follow from the seeds: with this config's seed all cases occur.
    assert {"deadline", "unparseable", "repaired", None} <= seen, seen
    counts = count_fallbacks(m for e in episodes for m in record_moves(e))
    llm = counts["llm"]
    by_hand = sum(1 for _, a in mine if a["fallback"])
    assert llm["fallbacks"] == by_hand and llm["moves"] == len(mine)
    assert llm["share"] > 0.05 and counts["tft"]["fallbacks"] == 0
    clean = [e for e in episodes if not has_fallback(e)]
    assert 0 < len(clean) < len(episodes), "the seed must give matches with and without"

    # The run's table says it, and warns.
    assert describe(llm) in run_out
    assert f"warning: llm: {by_hand} of its {len(mine)} moves" in run_out
    assert "--exclude-fallbacks" in run_out

    # `backroom analyze`: the same counts, the warning, all 8 matches measured.
    rc, out = await backroom("analyze", str(run_dir), cwd=tmp_path)
    assert rc == 0, out
    assert f"warning: llm: {by_hand} of its {len(mine)} moves" in out
    assert re.search(rf"llm\s+│\s+{len(mine)}\s+│\s+{by_hand}\s+│", out), out
    result = json.loads((run_dir / "analysis.json").read_text())
    assert result["fallbacks"] == counts and result["fallback_warnings"]
    assert result["games"]["ipd"]["episodes"] == 8 and result["excluded_fallback_matches"] == 0

    # --exclude-fallbacks: the measures of the clean matches alone, as computed here.
    rc, out = await backroom("analyze", str(run_dir), "--exclude-fallbacks", cwd=tmp_path)
    assert rc == 0, out
    excluded = len(episodes) - len(clean)
    assert f"left out {excluded} matches with a fallback" in out
    result = json.loads((run_dir / "analysis.json").read_text())
    ipd = result["games"]["ipd"]
    assert result["excluded_fallback_matches"] == excluded and ipd["episodes"] == len(clean)
    rewards = [rr[e["seats"].index("llm")] for e in clean for rr in e["round_rewards"]]
    assert ipd["mean_reward_per_round"]["llm"] == pytest.approx(sum(rewards) / len(rewards))
    acts = [a["action"] for e in clean for a in e["actions"] if a["agent"] == "llm"]
    acts = [x for x in acts if x in ("A", "B")]
    assert ipd["cooperation_rate_by_agent"]["llm"] == pytest.approx(acts.count("A") / len(acts))


async def test_the_referees_timeout_default_is_marked_timeout(
    broker: Broker, tmp_path: Path
) -> None:
    counter = metrics.FALLBACKS.labels(kind="other", reason="timeout")
    before = counter._value.get()
    spec = MatchSpec(
        game="ipd", params={"rounds": 2}, seats=["mute", "tft"], turn_timeout_s=0.3, run="t"
    )
    async with (
        stack(broker, tmp_path / "runs", agents(("tft", "tit-for-tat"))),
        RawAgent(identity(broker, "mute")) as mute,  # online, and never answers
        Runner(broker) as run,
    ):
        await mute.echo()
        await run.submit("m", spec)
        (ep,) = await run.wait(["m"], timeout=30)
    silent = [a for a in ep.actions if a.agent == "mute"]
    assert len(silent) == 2 and ep.reason == "timeout" and ep.timeouts == [0, 0]
    default = make_game("ipd").new_initial_state(0).default_action(0)
    assert all(a.fallback == "timeout" and a.timed_out and a.action == default for a in silent)
    assert all(a.fallback is None for a in ep.actions if a.agent == "tft")
    assert counter._value.get() == before + 2  # a raw client's kind is labelled "other"


async def test_the_local_kind_marks_its_deadline_fallback(smol: Backend) -> None:
    """The same field for the model in this process: a Bertrand price cannot be sampled
    in a 0.1 ms budget (on any device: its prompt alone takes longer), so the documented
    fallback goes out, marked ``deadline``."""
    game = make_game("bertrand", rounds=2)
    state = game.new_initial_state(0)
    local = LocalAgent("loc", max_new_tokens=2, deadline_margin_s=0.0)
    traces: list[Any] = []

    async def keep(trace: Any) -> None:
        traces.append(trace)

    local._trace_sink = keep
    await local.setup()
    try:
        await local.on_match_start(
            MatchStart(match="m", seat=0, seats=["loc", "x"], game="bertrand", turn_timeout_s=1e-4)
        )
        turn = Turn(
            match="m",
            turn=1,
            seat=0,
            phase="act",
            observation=state.observation(0),
            prompt=state.prompt(0),
            legal=state.action_spec(0).to_json(),
            deadline_s=1e-4,
        )
        action = await local.act(turn)
    finally:
        await local.close()
    assert action == fallback_action(turn.legal)
    assert local.take_fallback(turn) == "deadline" and local.take_fallback(turn) is None
    assert traces[-1].reply["detail"].startswith("no answer within")  # what ran out, in words


def test_always_with_an_action_the_game_lacks_is_refused() -> None:
    def refusal(options: dict[str, Any], game: str = "ipd") -> str:
        with pytest.raises(ConfigError) as err:
            parse_config(
                {
                    "game": game,
                    "agents": [
                        {"id": "a", "kind": "always", "options": options},
                        {"id": "b", "kind": "random"},
                    ],
                }
            )
        return str(err.value)

    assert "agents.0.options.action: ipd has no action 'C'; it takes A, B" in refusal(
        {"action": "C"}
    )
    assert "it takes A, B" in refusal({"action": "b"})  # the agent plays names exactly
    assert "`always` needs `action`" in refusal({})
    assert "it takes a number from 0.0 to" in refusal({"action": 99.0}, "bertrand")
    for game, action in (("ipd", "B"), ("kuhn", "bet"), ("bertrand", 1.5)):
        config = parse_config(
            {
                "game": game,
                "agents": [
                    {"id": "a", "kind": "always", "options": {"action": action}},
                    {"id": "b", "kind": "random"},
                ],
            }
        )
        assert config.agents[0].options["action"] == action


def test_an_episode_written_before_the_field_still_loads() -> None:
    game = make_game("ipd", rounds=2)
    old = episode(game, agents(("t", "tit-for-tat"), ("d", "random")))
    for a in old["actions"]:
        del a["fallback"]  # as a referee before the field wrote it
    old["actions"][0]["timed_out"] = True  # its timeout default, then marked this way only
    record = EpisodeRecord.model_validate(old)
    assert all(a.fallback is None for a in record.actions)
    assert has_fallback(old)
    counts = count_fallbacks(record_moves(old))
    assert counts["t"]["by_reason"] == {"timeout": 1} and counts["d"]["fallbacks"] == 0


def test_the_replay_counts_fallbacks_as_every_reader_does() -> None:
    """The replay's list (``with fallbacks``) counts the moves ``backroom.records`` counts, an
    old record's ``timed_out`` default included: it used to see only the ``fallback`` field."""
    from backroom.replay.index import summary_row

    game = make_game("ipd", rounds=2)
    old = episode(game, agents(("t", "tit-for-tat"), ("d", "random")))
    for a in old["actions"]:
        del a["fallback"]
    old["actions"][0]["timed_out"] = True
    new = episode(game, agents(("t", "tit-for-tat"), ("d", "random")))
    new["actions"][1]["fallback"] = "deadline"
    for record in (old, new):
        row, _ = summary_row(record)
        counted = sum(1 for _, reason in record_moves(record) if reason is not None)
        assert counted == 1 and row[12] == counted, row  # row[12]: the list's fallbacks column


def test_analyze_says_how_many_matches_were_voided_and_left_out() -> None:
    game = make_game("ipd", rounds=2)
    ok = episode(game, agents(("t", "tit-for-tat"), ("d", "random")))
    voided = dict(ok, match="v", reason="voided", detail="referee stopped", final_observations=[])
    result = analyze_episodes([ok, voided, dict(voided, match="v2")])
    assert result["voided"] == 2 and result["outcomes"] == {"normal": 1, "voided": 2}
    assert result["games"]["ipd"]["episodes"] == 1
    (line,) = notes(result)
    assert line.startswith("left out: 2 of 3 matches did not finish (2 voided)")
