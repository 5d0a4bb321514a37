"""Play agents against an engine in-process, without the bus.

Each decision gets the ``Turn`` a referee would send (observation, prompt,
legal answers, phase, seat, turn counter) so agents see exactly their wire
input; answers go through ``state.apply``, which validates them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from backroom.agents.base import Agent
from backroom.bus.wire import MatchEnd, MatchStart, Turn
from backroom.games.base import Game, State


async def play_async(
    game: Game, agents: Sequence[Agent], seed: int | None = 0, match: str = "m0"
) -> tuple[State, list[dict[str, Any]]]:
    """Play one match; returns the final state and the action log (referee-style records)."""
    state = game.new_initial_state(seed)
    for seat, agent in enumerate(agents):
        await agent.on_match_start(
            MatchStart(
                match=match,
                seat=seat,
                seats=[a.id for a in agents],
                game=game.name,
                params=game.public_params(),  # as the referee tells the players
                turn_timeout_s=10,
                **({"seed": seed} if seed is not None else {}),  # agents' draws replay from it
            )
        )
    log: list[dict[str, Any]] = []
    turn = 0
    while not state.is_terminal():
        turn += 1
        phase = state.phase
        actions: dict[int, Any] = {}
        for seat in sorted(state.current_players()):
            obs = state.observation(seat)
            json.dumps(obs)  # what travels must be JSON
            msg = Turn(
                match=match,
                turn=turn,
                seat=seat,
                phase=phase,
                observation=obs,
                prompt=state.prompt(seat),
                legal=state.action_spec(seat).to_json(),
                deadline_s=10,
            )
            agent = agents[seat]
            answer = await (agent.talk(msg) if phase == "talk" else agent.act(msg))
            actions[seat] = state.check_action(seat, answer)
            log.append(
                {
                    "turn": turn,
                    "t": float(turn),
                    "seat": seat,
                    "agent": agent.id,
                    "phase": phase,
                    "action": actions[seat],
                    "timed_out": False,
                }
            )
        state.apply(actions)
    returns = state.returns()
    for seat, agent in enumerate(agents):
        await agent.on_match_end(
            MatchEnd(match=match, seat=seat, returns=returns, raw_returns=returns, reason="normal")
        )
    return state, log


def play(game: Game, agents: Sequence[Agent], seed: int | None = 0) -> Any:
    return asyncio.run(play_async(game, agents, seed))[0]


def episode(
    game: Game, agents: Sequence[Agent], seed: int = 0, match: str = "m0", run: str = "test"
) -> dict[str, Any]:
    """Play a match and return it as an EpisodeRecord dict, as a line of episodes.jsonl."""
    from backroom.bus.wire import EpisodeRecord, MatchSpec

    state, log = asyncio.run(play_async(game, agents, seed, match))
    seats = [a.id for a in agents]
    record = EpisodeRecord(
        match=match,
        run=run,
        referee="in-process",
        spec=MatchSpec(game=game.name, params=game.params(), seats=seats, seed=seed, run=run),
        game=game.name,
        params=game.params(),
        seed=seed,
        crn_group=None,
        seats=seats,
        actions=log,  # type: ignore[arg-type]
        deliveries=[],
        round_rewards=list(state.round_rewards),
        raw_returns=state.returns(),
        returns=state.returns(),
        reason="normal",
        started_at=0.0,
        ended_at=1.0,
        final_observations=[state.observation(s) for s in range(game.num_players)],
    )
    return json.loads(record.model_dump_json())
