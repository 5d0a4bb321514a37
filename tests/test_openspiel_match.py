"""Whole matches of OpenSpiel games over a real broker: the runner, the referee, agents, the record.

A config's ``game: openspiel`` is submitted by the runner (``run_matches``)
to a referee over Mosquitto, as ``backroom run`` does; the agents live in
this process. Table talk before each act, a private channel and an
eavesdropper attach as to a native game, and each match ends in an episode
record like any other. The Leduc match with an LLM seat (SmolLM2, offline)
is slow, as the other offline-model runs are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backroom.agents import make_agent
from backroom.bus.broker import Broker
from backroom.bus.wire import EpisodeRecord
from backroom.games import make_game
from backroom.runner.config import RunConfig, parse_config
from backroom.runner.local import run_matches
from backroom.runs import read_episodes

from .conftest import identity, stack

pytest.importorskip("pyspiel")


def config(params: dict[str, Any], third: dict[str, Any], matches: int) -> RunConfig:
    """alice and bob collude (card-telling poker colluders); carol plays CFR and overhears them."""
    return parse_config(
        {
            "run": "openspiel-match",
            "game": "openspiel",
            "params": params,
            "matches": matches,
            "seed": 11,
            "turn_timeout_s": 60,
            "agents": [
                {
                    "id": "carol",
                    "kind": "cfr",
                    "options": {"game": "openspiel", "params": params, "iterations": 10},
                },
                {"id": "alice", "kind": "poker-colluder"},
                third,
            ],
            "channels": [
                {"name": "table", "members": [0, 1, 2], "opens": "before_act"},
                {
                    "name": "colluders",
                    "members": [1, 2],
                    "eavesdroppers": [0],
                    "opens": "before_act",
                },
            ],
            "transform": {"kind": "coalition", "members": [1, 2]},
        }
    )


async def play(cfg: RunConfig, broker: Broker, runs_dir: Path) -> list[EpisodeRecord]:
    agents = [make_agent(a.kind, a.id, **a.options) for a in cfg.agents]
    async with stack(broker, runs_dir, agents):
        runner = identity(broker, "runner", "runner")
        waiting = ["referee", *(a.id for a in cfg.agents)]
        return await run_matches(cfg, runner, waiting, ready_timeout_s=300)


def check_record(cfg: RunConfig, eps: list[EpisodeRecord], runs_dir: Path) -> None:
    """Normal episodes whose moves replay on the engine to the recorded returns."""
    assert len(eps) == cfg.matches
    assert all(e.reason == "normal" and not e.timeouts for e in eps), [e.detail for e in eps]
    game = make_game(cfg.game, **cfg.params)
    for e in eps:
        assert e.game == "openspiel" and e.params == cfg.params
        assert sum(e.raw_returns) == pytest.approx(0.0)  # poker is zero-sum before the transform
        assert e.returns[1] == e.returns[2]  # the colluders share their winnings
        # replay: the match seed deals again, and the recorded moves end where the match did
        state = game.new_initial_state(seed=e.seed)
        for a in (a for a in e.actions if a.phase == "act"):
            assert isinstance(a.action, int)
            # only a model may fall back (an answer it could not parse), and the record says so
            assert not a.fallback or a.agent == "smol"
            state.apply({a.seat: a.action})
        assert state.is_terminal() and state.returns() == e.raw_returns
        assert [o["info_state"] for o in e.final_observations] == [
            state.information_state(s) for s in range(3)
        ]
        # the colluders' messages reach carol, marked overheard; table talk reaches everyone
        private = [d for d in e.deliveries if d.channel == "colluders"]
        assert private and all(d.overheard == (d.to_seat == 0) for d in private)
        assert len([d for d in private if d.overheard]) == len(
            [d for d in private if not d.overheard]
        )
        assert any(a.phase == "talk" for a in e.actions)
    assert len(list(read_episodes(runs_dir / cfg.run))) == cfg.matches


async def test_three_player_kuhn_from_openspiel_over_the_broker(
    broker: Broker, tmp_path: Path
) -> None:
    """CFR (solved on start on the OpenSpiel tree), a colluder pair, talk and an eavesdropper."""
    cfg = config({"name": "kuhn_poker", "players": 3}, {"id": "bob", "kind": "poker-colluder"}, 6)
    eps = await play(cfg, broker, tmp_path)
    check_record(cfg, eps, tmp_path)
    told = [d.text for e in eps for d in e.deliveries if d.channel == "colluders"]
    assert all(t.startswith("my card is ") for t in told)


@pytest.mark.slow
async def test_leduc_with_a_cfr_seat_a_scripted_seat_and_an_llm_seat(
    broker: Broker, tmp_path: Path
) -> None:
    """The issue's match: three-player Leduc, CFR + scripted colluder + SmolLM2, talk, eavesdropper."""
    params = {"name": "leduc_poker", "players": 3, "suit_isomorphism": True}
    llm = {"id": "smol", "kind": "local", "options": {"max_new_tokens": 8}}
    cfg = config(params, llm, 2)
    eps = await play(cfg, broker, tmp_path)
    check_record(cfg, eps, tmp_path)
    assert all(e.invalid_inputs == 0 for e in eps)
    moved = {a.agent for e in eps for a in e.actions if a.phase == "act"}
    assert moved == {"carol", "alice", "smol"}
