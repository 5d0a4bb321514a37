"""The paper configs with LLM players (``examples/llm_*.yaml``).

Their model players are ``kind: model``: they play what the config's ``model:``
field names, SmolLM2 in the agent process (``local``) as written, an
OpenAI-compatible server once that one field says so.

* Every config loads, and each ``model:`` line that docs/agents.md shows for
  vLLM, Ollama and a hosted API switches every model player, and nothing
  else, to the ``llm`` kind; both kinds build from the options that result.
* (slow) Each config plays a short run offline on SmolLM2 (fewer matches,
  rounds and sampled tokens), every match ending normally: the runner's
  ``run_matches`` submits the config's matches to a real referee over a real
  broker. The agents live in the test process, built from the config's
  entries as ``agent_processes: single`` builds them, so every config shares
  one loaded model. One config is played again through ``run_local`` (the
  processes ``backroom run`` starts) with its ``model:`` field pointing at
  ``backroom serve-model``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.agents import make_agent
from backroom.bus.broker import Broker
from backroom.bus.wire import EpisodeRecord
from backroom.model.backend import Backend, shared_backend
from backroom.runner.config import RunConfig, parse_config, read_yaml
from backroom.runner.local import run_local, run_matches

from .conftest import identity, stack

ROOT = Path(__file__).resolve().parent.parent
#: Configs whose players include ``kind: model`` agents (tests/test_examples.py leaves them to us).
LLM_EXAMPLES = sorted(
    p
    for p in (ROOT / "examples").glob("*.yaml")
    if "kind: model" in p.read_text() and "\nleague:" not in p.read_text()  # test_league.py
)
#: One config per paper setup.
SETUPS = {
    "llm_kuhn_baseline",
    "llm_kuhn_explicit",
    "llm_beauty_exclusive",
    "llm_beauty_independent",
    "llm_beauty_amplified",
    "llm_bertrand_talk",
    "llm_bertrand_notalk",
    "llm_ipd",
    "llm_split_nocomm",
    "llm_trust_and_split",
    "llm_liars_dice",  # not a paper's: OpenSpiel's game through `game: openspiel`
}
IDS = [p.stem for p in LLM_EXAMPLES]


def server_lines() -> list[str]:
    """The ``model:`` lines of docs/agents.md's "Pointing the paper configs at a server"."""
    text = (ROOT / "docs" / "agents.md").read_text()
    section = text.split("## Pointing the paper configs at a server", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^model: \{kind: llm.*\}$", section, flags=re.M)


def model_agents(data: dict[str, Any]) -> list[str]:
    return [a["id"] for a in data["agents"] if a["kind"] == "model"]


def test_one_config_per_paper_setup() -> None:
    assert set(IDS) == SETUPS


@pytest.mark.parametrize("path", LLM_EXAMPLES, ids=IDS)
def test_a_paper_config_switches_to_a_server_by_its_model_field(path: Path) -> None:
    data = read_yaml(path)
    players = model_agents(data)
    assert players and data["model"]["kind"] == "local"
    offline = parse_config(data, str(path))
    lines = server_lines()
    assert len(lines) == 3  # vLLM, Ollama, a hosted API
    for line in lines:
        switched = parse_config({**data, "model": yaml.safe_load(line)["model"]}, line)
        # the same run, field by field, but for the model players' kind and backend options
        assert switched.model_dump(exclude={"agents", "model"}) == offline.model_dump(
            exclude={"agents", "model"}
        )
        for before, after, raw in zip(offline.agents, switched.agents, data["agents"], strict=True):
            if before.id not in players:
                assert after == before
                continue
            assert (before.kind, after.kind) == ("local", "llm")
            assert after.options == {**switched.model.options, **raw.get("options", {})}
            make_agent(after.kind, after.id, **after.options)  # builds; connects to nothing yet
    for a in offline.agents:
        make_agent(a.kind, a.id, **a.options)  # the local model loads only at setup


# --- slow: short runs on SmolLM2 -------------------------------------------------------

#: What a short run changes (dotted keys; ``players.X``: option X of every model player).
#: Everything else is the file's.
SHORT: dict[str, dict[str, Any]] = {
    # two of Table 1's hands once each: the match count follows from `deals`
    "llm_kuhn": {
        "deals": {"each": 1, "hands": [[0, 1, 4], [3, 4, 0]]},
        "model.options.max_new_tokens": 8,
    },
    "llm_beauty": {"matches": 1, "model.options.max_new_tokens": 6},
    # planning before round 3: the statistics, the strategy, then the price
    "llm_bertrand": {
        "matches": 1,
        "params.rounds": 3,
        "players.plan_every": 2,
        "model.options.max_new_tokens": 6,
    },
    # round robin: the first pairs are llm_a against llm_b, then against the baselines
    "llm_ipd": {"matches": 3, "params.rounds": 3},
    "llm_split_nocomm": {"matches": 2, "params.rounds": 2, "model.options.max_new_tokens": 20},
    "llm_trust_and_split": {"matches": 2, "params.rounds": 2, "model.options.max_new_tokens": 8},
    "llm_liars_dice": {"matches": 1, "model.options.max_new_tokens": 8},
}


def short(path: Path, **extra: Any) -> dict[str, Any]:
    """The config's data with its short-run overrides applied."""
    data = read_yaml(path)
    (overrides,) = [v for k, v in SHORT.items() if path.stem.startswith(k)]
    for key, value in {**overrides, **extra}.items():
        *head, last = key.split(".")
        if head == ["players"]:
            for a in data["agents"]:
                if a["kind"] == "model":
                    a.setdefault("options", {})[last] = value
            continue
        node = data
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return data


@pytest.fixture(scope="module")
def smol() -> Backend:
    """SmolLM2, loaded once: every ``local`` agent of this module's runs shares it."""
    return shared_backend()


async def play(
    config: RunConfig, broker: Broker, runs_dir: Path
) -> tuple[list[EpisodeRecord], list[dict[str, Any]]]:
    """The config's matches, submitted by the runner to a referee and the config's agents."""
    agents = [make_agent(a.kind, a.id, **a.options) for a in config.agents]
    traces_path = runs_dir / "traces.jsonl"
    async with stack(broker, runs_dir, agents):
        runner = identity(broker, "runner", "runner")
        waiting = ["referee", *(a.id for a in config.agents)]
        episodes = await run_matches(config, runner, waiting, traces_path=traces_path)
    return episodes, read_traces(traces_path)


def read_traces(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_episodes(
    config: RunConfig, eps: list[EpisodeRecord], traces: list[dict[str, Any]], players: list[str]
) -> None:
    assert len(eps) == config.matches
    assert all(e.reason == "normal" for e in eps), [(e.reason, e.detail) for e in eps]
    assert all(not e.timeouts and e.invalid_inputs == 0 for e in eps)
    # every decision of a model player is in a trace: the model played it
    decided = {(t["match"], t["turn"]) for t in traces if t["agent"] in players}
    played = {(e.match, a.turn) for e in eps for a in e.actions if a.agent in players}
    assert played and played <= decided


def check_game(
    stem: str, eps: list[EpisodeRecord], traces: list[dict[str, Any]], players: list[str]
) -> None:
    if stem.startswith("llm_kuhn"):
        # Table 1's protocol, shortened: each scheduled hand once, dealt as scheduled
        assert sorted(tuple(e.params["deal"]) for e in eps) == [(0, 1, 4), (3, 4, 0)]
        assert all([o["card"] for o in e.final_observations] == e.params["deal"] for e in eps)
        for e in eps:  # carol overhears every message the colluders send each other
            sent = [d for d in e.deliveries if not d.overheard]
            heard = [d for d in e.deliveries if d.overheard]
            assert {d.to_seat for d in heard} <= {2} and len(heard) == len(sent)
            assert any(a.phase == "talk" for a in e.actions)
    elif stem.startswith("llm_beauty"):
        (e,) = eps
        talks = [a for a in e.actions if a.phase == "talk"]
        choices = [a for a in e.actions if a.phase == "act"]
        assert (
            len(talks) == 48 and {a.agent for a in choices} == set(players) and len(players) == 24
        )
    elif stem.startswith("llm_bertrand"):
        (e,) = eps
        assert len(e.round_rewards) == 3
        assert any(a.phase == "talk" for a in e.actions) == stem.endswith("_talk")
        planned = {t["agent"] for t in traces if "planning" in (t["request"] or {})}
        assert planned == set(players)  # memory and planning: each firm planned
    elif stem.startswith("llm_liars_dice"):
        for e in eps:  # both models bid (OpenSpiel's action numbers), talk first, one wins
            assert {a.agent for a in e.actions if a.phase == "act"} == set(players)
            assert all(isinstance(a.action, int) for a in e.actions if a.phase == "act")
            assert any(a.phase == "talk" for a in e.actions)
            assert sorted(e.raw_returns) == [-1.0, 1.0]
    else:  # round robin: the model players meet each other and a baseline
        seated = [set(e.seats) for e in eps]
        assert any(s <= set(players) for s in seated) and any(s - set(players) for s in seated)


@pytest.mark.slow
@pytest.mark.parametrize("path", LLM_EXAMPLES, ids=IDS)
async def test_a_paper_config_plays_a_short_run_offline(
    path: Path, broker: Broker, smol: Backend, tmp_path: Path
) -> None:
    data = short(path)
    config = parse_config(data, str(path))
    players = model_agents(data)
    assert {a.kind for a in config.agents if a.id in players} == {"local"}
    eps, traces = await play(config, broker, tmp_path)
    check_episodes(config, eps, traces, players)
    check_game(path.stem, eps, traces, players)


@pytest.mark.slow
async def test_a_paper_config_plays_on_a_server_switched_by_its_model_field(
    smol: Backend, tmp_path: Path
) -> None:
    """``backroom run`` of the IPD config, its ``model:`` field pointing at ``backroom serve-model``."""
    from backroom.model.serve import running_server, serve_model_app

    path = ROOT / "examples" / "llm_ipd.yaml"
    async with running_server(serve_model_app(smol, "smol")) as url:
        server = {"base_url": f"{url}/v1", "model": "smol", "api_key_env": "", "max_tokens": 8}
        config = parse_config(short(path, model={"kind": "llm", "options": server}), str(path))
        # a shared CPU: the agent process may take a while to start
        result = await run_local(config, runs_dir=tmp_path, ready_timeout_s=300)
    players = model_agents(read_yaml(path))
    assert {a.kind for a in config.agents if a.id in players} == {"llm"}
    traces = read_traces(result.run_dir / "traces.jsonl")
    check_episodes(config, result.episodes, traces, players)
    check_game(path.stem, result.episodes, traces, players)
    calls = [t for t in traces if t["agent"] in players]
    assert all(r["model"] == "smol" for t in calls for r in t["request"])
