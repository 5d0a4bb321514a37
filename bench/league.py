"""League speed: matches per second against ``backroom run``, and rating 100,000 results.

1. **Play**, side by side in one run: the same matches (classic Kuhn, N random
   agents in one agent process, every ordered pair, the same window) played
   as a league (``run_league``: its schedule, its store, its standings file)
   and as a run config through ``backroom run``'s code (``run_local`` with
   ``round_robin: true``). Blocks alternate (league, run, league, run, ...),
   each starting its own broker, referee and agent process; the rate of each
   is counted from the first request out to the last episode in (process
   start-up is not play), and the medians are compared. Target: league / run
   >= 0.9.
2. **Rating**: openskill over 100,000 two-player results of 20 entrants, from
   the store (SQLite read included) and from memory. Target: under 10 s. Beside
   it the head-to-head table, built from every result against from the samples
   a running league keeps (``ratings.Cells``), the same numbers (asserted).
3. **Adaptive rounds**: the ratings an adaptive schedule picks by, between
   rounds of 16 results: rated again from every result, as the schedule did,
   against brought up to date with the new ones (``play.Tally``), on one store,
   with the same numbers (asserted); printed as a ratio.

Run: ``python bench/league.py`` (``--quick``: fewer matches and blocks). The
machine is shared and noisy: read the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from backroom.bus.wire import EpisodeRecord, MatchSpec
from backroom.league.config import parse_league
from backroom.league.play import Tally, run_league
from backroom.league.ratings import Cells, head_to_head, rate
from backroom.league.store import LeagueStore
from backroom.runner.config import parse_config
from backroom.runner.local import run_local

GAME = {"game": "kuhn", "params": {"variant": "classic", "players": 2}}


async def league_rate(work: Path, agents: int, seeds: int, concurrency: int) -> tuple[float, int]:
    config = parse_league(
        {
            "league": "bench",
            "games": [{**GAME, "seeds": seeds}],
            "entrants": [{"id": f"r{i}", "kind": "random"} for i in range(agents)],
            "agent_processes": "single",
            "concurrency": concurrency,
        }
    )
    summary = await run_league(config, work / f"league-{time.monotonic_ns()}")
    return summary.matches_per_second, summary.played


async def run_rate(work: Path, agents: int, matches: int, concurrency: int) -> tuple[float, int]:
    config = parse_config(
        {
            "run": "bench",
            **GAME,
            "matches": matches,
            "round_robin": True,
            "agents": [{"id": f"r{i}", "kind": "random"} for i in range(agents)],
            "agent_processes": "single",
            "concurrency": concurrency,
        }
    )
    result = await run_local(config, runs_dir=work / "runs")
    return result.matches_per_second, len(result.episodes)


async def play(args: argparse.Namespace) -> None:
    pairs = args.agents * (args.agents - 1)  # ordered: a league pairing in both seat orders
    matches = pairs * args.seeds
    print(
        f"play: {matches} matches of classic Kuhn, {args.agents} random agents, window {args.window}"
    )
    league: list[float] = []
    run: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(args.blocks):
            lr, ln = await league_rate(Path(tmp), args.agents, args.seeds, args.window)
            rr, rn = await run_rate(Path(tmp), args.agents, matches, args.window)
            assert ln == rn == matches, (ln, rn, matches)
            league.append(lr)
            run.append(rr)
            print(f"  block {block + 1}: league {lr:7.1f}/s   backroom run {rr:7.1f}/s")
    ratio = statistics.median(league) / statistics.median(run)
    print(
        f"median: league {statistics.median(league):.1f}/s, backroom run "
        f"{statistics.median(run):.1f}/s; league / run = {ratio:.2f} (target >= 0.9)"
    )


AGENTS = [f"a{i}" for i in range(20)]


def results(n: int) -> Iterator[tuple[str, str, EpisodeRecord]]:
    """``n`` two-player Kuhn results of 20 entrants: (key, CRN group, record)."""
    rng = random.Random(0)
    template = EpisodeRecord(
        match="m",
        run="bench",
        referee="r",
        spec=MatchSpec(game="kuhn", seats=["a0", "a1"]),
        game="kuhn",
        params={},
        seed=0,
        crn_group=None,
        seats=["a0", "a1"],
        actions=[],
        deliveries=[],
        round_rewards=[],
        raw_returns=[0.0, 0.0],
        returns=[0.0, 0.0],
        reason="normal",
        started_at=0.0,
        ended_at=0.0,
    )
    for i in range(n):
        a, b = rng.sample(AGENTS, 2)
        r = float(rng.choice([-2, -1, 1, 2]))
        group = f"kuhn|{','.join(sorted((a, b)))}|{i}"
        record = template.model_copy(
            update={"seats": [a, b], "returns": [r, -r], "crn_group": group}
        )
        yield f"{group}|{a},{b}", group, record


def rating(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, LeagueStore(Path(tmp) / "l.sqlite") as store:
        t0 = time.perf_counter()
        for key, _group, record in results(n):
            store.add(key, record)
        store.flush()
        filled = time.perf_counter() - t0
        t0 = time.perf_counter()
        counted = store.results()
        read = time.perf_counter() - t0
        table = rate(counted)
        from_store = time.perf_counter() - t0
    t0 = time.perf_counter()
    rate(counted)
    in_memory = time.perf_counter() - t0
    t0 = time.perf_counter()
    from_all = head_to_head(counted, AGENTS).to_json()
    h2h_all = time.perf_counter() - t0
    cells = Cells()
    for r in counted:  # what a running league has added result by result
        cells.add(r)
    t0 = time.perf_counter()
    from_cells = cells.table(AGENTS).to_json()
    h2h_cells = time.perf_counter() - t0
    assert from_cells == from_all
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    print(
        f"rating: {n:,} results (store filled in {filled:.1f} s, not counted); load {load:.1f}/core"
    )
    print(
        f"  from the store: {from_store:.2f} s (read {read:.2f} s); rate again: {in_memory:.2f} s "
        f"(target < 10 s); {len(table)} entrants"
    )
    print(
        f"  head to head: from every result {h2h_all:.2f} s, from the cells kept as results "
        f"come {h2h_cells:.3f} s (a running league's every second); "
        f"ratio {h2h_all / h2h_cells:.0f}x"
    )


def adaptive(n: int, size: int) -> None:
    """Between an adaptive league's rounds, its ratings: rated again from every result
    (as before) against brought up to date with the round's results (``play.Tally``),
    side by side on one store filling round by round."""
    again = tally_s = 0.0
    tally = Tally(list(AGENTS))
    with tempfile.TemporaryDirectory() as tmp, LeagueStore(Path(tmp) / "l.sqlite") as store:
        rows = list(results(n))
        spec = rows[0][2].spec
        for start in range(0, n, size):
            round_ = rows[start : start + size]
            store.schedule([(key, "kuhn", group, spec) for key, group, _ in round_])
            for key, _group, record in round_:
                store.add(key, record)
            store.flush()
            t0 = time.perf_counter()
            full = Tally(list(AGENTS))
            full.update(store.results(as_scheduled=True))
            sigma_again = full.sigma()
            again += time.perf_counter() - t0
            t0 = time.perf_counter()
            tally.update(store.results(after=tally.seq, as_scheduled=True))
            sigma = tally.sigma()
            tally_s += time.perf_counter() - t0
            assert sigma == sigma_again  # the same numbers, for less
    print(
        f"adaptive: {n:,} results in rounds of {size}: rated again each round {again:.2f} s, "
        f"brought up to date {tally_s:.2f} s; again / up to date = {again / tally_s:.0f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--results", type=int, default=100_000)
    parser.add_argument("--adaptive", type=int, default=2_000, help="results of part 3")
    args = parser.parse_args()
    args.seeds = 25 if args.quick else 100
    args.blocks = 2 if args.quick else 3
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(play(args))
    rating(args.results)
    adaptive(500 if args.quick else args.adaptive, 16)


if __name__ == "__main__":
    main()
