"""Same config, same seed, same play: a rerun replays every action.

Agents sample from a generator per match and seat, seeded from the match's
seed (``MatchStart.seed``), so concurrency, process layout and timing must not
change what is played. The runs here go through the real runner (broker,
referee and agents as processes, each run in its own directory) and compare
every match's actions between two runs that differ in concurrency and
process layout; a run with another seed must play differently, or the
comparison would prove nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from backroom.agents.base import Agent
from backroom.agents.llm import LLMAgent
from backroom.bus.wire import AdapterRef, EpisodeRecord, MatchSpec, MatchStart, Turn
from backroom.games import make_game
from backroom.model.backend import shared_backend
from backroom.model.serve import running_server
from backroom.runner.config import RunConfig, load_config
from backroom.runner.local import run_local
from backroom.runs import read_episodes
from backroom.seeds import derive_seed, play_seed
from backroom.trainer.config import parse_train_config
from backroom.trainer.rollouts import plan_step

ROOT = Path(__file__).resolve().parent.parent

#: What one match played: every decision, in order (timestamps left out).
Play = list[tuple[Any, ...]]


def variant(config: RunConfig, **changes: Any) -> RunConfig:
    """``config`` with fields replaced, validated again."""
    return RunConfig.model_validate({**config.model_dump(), **changes})


def play(config: RunConfig, runs_dir: Path) -> dict[tuple[int, int], Play]:
    """Run ``config`` in its own directory; each match's actions, read back from episodes.jsonl.

    Keyed by the match's place in the run (its seed's offset, its CRN index), not
    by its id, which carries a per-run nonce.
    """
    result = asyncio.run(run_local(config, runs_dir=runs_dir))
    episodes = [EpisodeRecord.model_validate(e) for e in read_episodes(result.run_dir)]
    assert len(episodes) == config.matches
    assert all(e.reason == "normal" and not e.timeouts for e in episodes), [
        (e.reason, e.detail) for e in episodes
    ]
    # A simultaneous turn's answers are recorded as they arrive; the referee hands them
    # on in seat order, and so they are compared.
    plays = {
        (e.spec.seed - config.seed, e.spec.crn_index): sorted(
            ((a.turn, a.seat, a.agent, a.phase, a.action) for a in e.actions),
            key=lambda a: (a[0], a[1]),
        )
        for e in episodes
    }
    assert len(plays) == config.matches
    return plays


def elsewise(config: RunConfig) -> RunConfig:
    """The same run laid out otherwise: one match at a time, all agents in one process."""
    layout = "single" if config.agent_processes == "separate" else "separate"
    return variant(config, concurrency=1, agent_processes=layout)


# --- the demo and one example per game, twice through the runner ----------------------------


def test_demo_replays_whatever_the_concurrency_and_process_layout(tmp_path: Path) -> None:
    demo = variant(load_config(ROOT / "backroom" / "demo.yaml"), matches=60)
    assert demo.concurrency > 1 and demo.agent_processes == "separate"
    first = play(demo, tmp_path / "a")
    assert play(elsewise(demo), tmp_path / "b") == first
    # Another seed deals and samples otherwise: the comparison above can fail.
    other = play(variant(demo, seed=1000), tmp_path / "c")
    assert sum(other[k] != first[k] for k in first) > len(first) // 2


def test_a_crn_group_deals_alike_and_samples_apart(tmp_path: Path) -> None:
    """Members of a CRN group share the seed (the cards) but not the agents' draws."""
    demo = load_config(ROOT / "backroom" / "demo.yaml")
    agents = [a.model_dump() for a in demo.agents]
    agents[2] = {"id": "carol", "kind": "random"}  # a draw at every decision
    config = variant(demo, matches=24, crn=3, concurrency=8, agents=agents)
    plays = play(config, tmp_path / "a")
    groups = {k[0] for k in plays}
    assert len(groups) == 8
    assert all(len({str(plays[(g, i)]) for i in range(3)}) > 1 for g in groups)
    assert play(elsewise(config), tmp_path / "b") == plays


#: One example config per game (Kuhn is the demo's), scaled down.
EXAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    "ipd": ("ipd.yaml", {"rounds": 5}),
    "split_nocomm": ("split_nocomm.yaml", {"rounds": 5}),
    "trust_and_split": ("trust_and_split.yaml", {"rounds": 5}),
    "beauty_contest": ("beauty_contest.yaml", {}),
    "bertrand": ("bertrand_linear.yaml", {"rounds": 20}),
}


@pytest.mark.parametrize("game", list(EXAMPLES))
def test_example_replays_with_a_sampling_seat(game: str, tmp_path: Path) -> None:
    """The example's first agent turns ``random``: the baselines alone would never draw."""
    name, params = EXAMPLES[game]
    example = load_config(ROOT / "examples" / name)
    assert example.game == game
    agents = [a.model_dump() for a in example.agents]
    agents[0] = {"id": agents[0]["id"], "kind": "random"}
    config = variant(
        example,
        matches=min(example.matches, 4),
        params={**example.params, **params},
        concurrency=max(2, min(example.concurrency, 4)),
        agents=agents,
    )
    first = play(config, tmp_path / "a")
    assert play(elsewise(config), tmp_path / "b") == first


# --- the generators themselves -----------------------------------------------------------


def start(match: str, seat: int, seed: int) -> MatchStart:
    return MatchStart(
        match=match, seat=seat, seats=["x", "y"], game="ipd", turn_timeout_s=5, seed=seed
    )


async def draws(agent: Agent, match: str, seat: int, seed: int, n: int = 8) -> list[float]:
    await agent.on_match_start(start(match, seat, seed))
    rng = agent.rng_for(match, seat)
    return [rng.random() for _ in range(n)]


async def test_per_match_generator_follows_seed_and_seat_only() -> None:
    one, two = Agent("one"), Agent("two")
    same = await draws(one, "m1", 0, 5)
    assert await draws(two, "elsewhere", 0, 5) == same  # another agent, another match id
    assert await draws(Agent("three"), "m1", 1, 5) != same  # another seat
    assert await draws(Agent("four"), "m1", 0, 6) != same  # another seed
    assert await draws(Agent("five", seed=1), "m1", 0, 5) != same  # the agent's own seed option
    # Draws elsewhere in between do not move a match's sequence.
    a, b = Agent("a"), Agent("b")
    await a.on_match_start(start("p", 0, 9))
    await a.on_match_start(start("q", 0, 10))
    ra, rq = a.rng_for("p"), a.rng_for("q")
    interleaved = []
    for _ in range(4):
        interleaved.append(ra.random())
        rq.random()
    assert interleaved == (await draws(b, "p", 0, 9, 4))
    assert a.rng_for("p") is ra  # kept for the match, not remade per turn


def test_seeds_are_the_same_in_every_process() -> None:
    # A digest, not hash(): this value may never change, or old runs stop replaying.
    assert derive_seed("backroom", 0, None, 1) == derive_seed("backroom", 0, None, 1)
    assert derive_seed("backroom", 0, None, 1) == 214469094250559749
    assert derive_seed(1, 2) != derive_seed(2, 1) and derive_seed(12) != derive_seed(1, 2)
    assert 0 <= derive_seed("x", bits=31) < 2**31


def test_crn_members_get_their_own_play_seed() -> None:
    spec = MatchSpec(game="ipd", seats=["x", "y"], seed=7, crn_group="g")
    seeds = [play_seed(spec.seed, i) for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4


def test_training_groups_number_their_members() -> None:
    """A GRPO group of k matches shares a seed; without its own play seed per member the k
    matches of a sampling policy would be one match k times, with no spread to learn from."""
    config = parse_train_config(
        {
            "game": "ipd",
            "params": {"rounds": 3},
            "algorithm": "grpo",
            "preset": "ipd",
            "hyper": {"batch_size": 8, "group_size": 4},
            "players": ["alice", "bob"],
        }
    )
    current = AdapterRef(policy="p", version="v1", uri="/a/v1", sha256="0" * 64, size=1)
    plan = plan_step(config, 3, current, [])
    for group in {r.group for r in plan}:
        specs = [r.spec for r in plan if r.group == group]
        assert len({s.seed for s in specs}) == 1
        assert sorted(s.crn_index for s in specs) == [0, 1, 2, 3]
        assert len({play_seed(s.seed, s.crn_index) for s in specs}) == 4


# --- model-backed kinds ---------------------------------------------------------------------


def ipd_turn(match: str, turn: int = 1) -> Turn:
    state = make_game("ipd", rounds=3).new_initial_state(0)
    return Turn(
        match=match,
        turn=turn,
        seat=0,
        phase="act",
        observation=state.observation(0),
        prompt=state.prompt(0),
        legal=state.action_spec(0).to_json(),
        deadline_s=5,
    )


async def test_llm_requests_carry_a_replayable_seed() -> None:
    bodies: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        bodies.append(await request.json())
        return JSONResponse(
            {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "<A>"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            }
        )

    async with running_server(app) as url:
        seeds: list[int | None] = []
        for seed, turn, send in (
            (3, 1, True),
            (3, 1, True),
            (4, 1, True),
            (3, 2, True),
            (3, 1, False),
        ):
            llm = LLMAgent("l", base_url=f"{url}/v1", model="m", api_key_env="", send_seed=send)
            await llm.setup()
            try:
                await llm.on_match_start(start(f"m{len(seeds)}", 0, seed))
                assert await llm.act(ipd_turn(f"m{len(seeds)}", turn)) == "A"
            finally:
                await llm.close()
            seeds.append(bodies[-1].get("seed"))
    same, again, other_seed, other_turn, unsent = seeds
    assert isinstance(same, int) and 0 <= same < 2**31
    assert again == same and other_seed != same and other_turn != same and unsent is None


def test_local_text_sampling_replays_from_its_seed_whatever_shares_the_batch() -> None:
    """Each row samples from its own generator: the same seed gives the same tokens alone or
    beside other rows; another seed gives other tokens."""
    backend = shared_backend()

    def prompt(text: str) -> list[int]:
        return backend.encode_chat([{"role": "user", "content": text}])

    mine = prompt("You hold the king in Kuhn poker. Tell your partner what you will do.")
    alone = backend.generate_batch([(mine, None)], 8, 1.0, 0.95, seeds=[7])[0]
    beside = backend.generate_batch(
        [(prompt("Say hi."), None), (mine, None), (prompt("Name a card."), None)],
        8,
        1.0,
        0.95,
        seeds=[12345, 7, None],
    )[1]
    assert beside.token_ids == alone.token_ids and beside.text == alone.text
    other = backend.generate_batch([(mine, None)], 8, 1.0, 0.95, seeds=[8])[0]
    assert other.token_ids != alone.token_ids
