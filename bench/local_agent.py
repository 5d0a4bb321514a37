"""Decisions per second of the ``local`` agent on SmolLM2: batched against unbatched, in one run.

    .venv/bin/python bench/local_agent.py            # 1, 8 and 32 concurrent matches
    .venv/bin/python bench/local_agent.py --quick    # fewer matches per run
    .venv/bin/python bench/local_agent.py --talk     # a colluders' talk turn before each act

Three ``local`` agents (one shared SmolLM2-135M-Instruct backend, CPU) play
Loki Kuhn poker; N matches run concurrently and every act decision scores the
legal actions (fold, call, raise) as completions of the prompt. The same
agents play the same deals with the same sampling draws twice per setting:
once with the backend's batching queue (``max_batch`` 32) and once with
``max_batch`` 1 — the unbatched path, one forward pass per decision. The two
are interleaved (alternating which goes first), repeated, and the fastest
repeat of each is reported with the median beside it, since the machine is
shared and noisy: read the ratios.

The engine drives the agents directly with the ``Turn`` a referee would send
(no broker): the model is the cost being measured, the bus adds well under a
millisecond per decision (bench/bus_overhead.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from backroom.agents.backend import Backend, shared_backend
from backroom.agents.local import LocalAgent
from backroom.bus.wire import ChannelSpec, MatchEnd, MatchStart, Turn
from backroom.games import make_game

COLLUDERS = ChannelSpec(name="colluders", members=[0, 1], eavesdroppers=[2], opens="before_act")


async def play(agents: list[LocalAgent], match: str, seed: int, talk: bool) -> int:
    """One Loki Kuhn match played by ``agents``; returns how many decisions they made."""
    game = make_game("kuhn", variant="loki")
    state = game.new_initial_state(seed)
    channels = [COLLUDERS] if talk else []
    for seat, a in enumerate(agents):
        await a.on_match_start(MatchStart(match=match, seat=seat, seats=[x.id for x in agents], game="kuhn",
                                          params=game.params(), channels=channels, turn_timeout_s=600))
    decisions, turn_no = 0, 0
    while not state.is_terminal():
        (seat,) = state.current_players()
        if talk and seat in COLLUDERS.members:
            turn_no += 1
            text = await agents[seat].talk(Turn(match=match, turn=turn_no, seat=seat, phase="talk",
                                                channel="colluders", observation=state.observation(seat),
                                                prompt=state.prompt(seat),
                                                legal={"schema": {"type": "string", "maxLength": 500}},
                                                deadline_s=600))
            decisions += 1
            # (delivery to the partner is the referee's job; its cost is not the model's)
            _ = text
        turn_no += 1
        turn = Turn(match=match, turn=turn_no, seat=seat, phase="act", observation=state.observation(seat),
                    prompt=state.prompt(seat), legal=state.action_spec(seat).to_json(), deadline_s=600)
        state.apply({seat: await agents[seat].act(turn)})
        decisions += 1
    for seat, a in enumerate(agents):
        await a.on_match_end(MatchEnd(match=match, seat=seat, returns=state.returns(),
                                      raw_returns=state.returns(), reason="normal"))
    return decisions


async def run(agents: list[LocalAgent], concurrent: int, per_worker: int, talk: bool, tag: str) -> tuple[float, int]:
    """``concurrent`` workers each play ``per_worker`` matches back to back; decisions per second."""

    async def worker(w: int) -> int:
        return sum([await play(agents, f"{tag}-{w}-{i}", 1000 * w + i, talk) for i in range(per_worker)])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(worker(w) for w in range(concurrent)))
    elapsed = time.perf_counter() - t0
    return sum(counts) / elapsed, sum(counts)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer matches per setting")
    ap.add_argument("--talk", action="store_true", help="add a talk turn (sampled text) before colluder acts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()

    t0 = time.perf_counter()
    backend: Backend = await asyncio.to_thread(shared_backend)
    print(f"model: {backend.name} on {backend.device} (loaded in {time.perf_counter() - t0:.1f} s)")
    agents = [LocalAgent(f"p{i}", seed=i, max_new_tokens=args.max_new_tokens, collusion="explicit" if i < 2 else "baseline")
              for i in range(3)]
    for a in agents:
        await a.setup()
    await play(agents, "warmup", 0, args.talk)  # first calls pay one-off costs

    print(f"{'matches':>8} {'decisions':>9} | {'unbatched dec/s':>16} {'(median)':>9} | "
          f"{'batched dec/s':>14} {'(median)':>9} | {'ratio':>6} {'rows/batch':>9}")
    for n in args.concurrency:
        per_worker = (2 if args.quick else 4) if n == 1 else 1
        results: dict[str, list[float]] = {"unbatched": [], "batched": []}
        rows_per_pass: list[float] = []
        decisions = 0
        for r in range(args.repeats):
            # the same work for both modes (same seeds, same sampling draws), in alternating order
            for mode in ("unbatched", "batched") if r % 2 == 0 else ("batched", "unbatched"):
                backend.max_batch = 1 if mode == "unbatched" else 32
                for i, a in enumerate(agents):
                    a.rng.seed(1000 * r + i)
                batches, rows = backend.batches, backend.rows
                rate, decisions = await run(agents, n, per_worker, args.talk, f"{mode}{n}r{r}")
                results[mode].append(rate)
                if mode == "batched" and backend.batches > batches:
                    rows_per_pass.append((backend.rows - rows) / (backend.batches - batches))
        ub, b = max(results["unbatched"]), max(results["batched"])
        print(f"{n:>8} {decisions:>9} | {ub:>16.2f} {statistics.median(results['unbatched']):>9.2f} | "
              f"{b:>14.2f} {statistics.median(results['batched']):>9.2f} | {b / ub:>5.2f}x "
              f"{statistics.mean(rows_per_pass) if rows_per_pass else 0:>9.1f}")
    print("ratio = best batched / best unbatched decisions per second at the same concurrency")


if __name__ == "__main__":
    asyncio.run(main())
