"""What the referee costs on top of the broker, measured side by side in one run.

1. Raw round trip: two plain aiomqtt clients (QoS 1, TCP_NODELAY) through the
   same Mosquitto: A (this process) publishes, B (an echo in its own process)
   answers, A receives. This is the floor. (On topics the broker's ACL
   allows them, see ``pair_topics``.)
2. Referee-mediated move: the referee's own clock from sending a Kuhn ``Turn``
   (observation out) to accepting the ``Action`` (action back), read from the
   ``backroom_turn_latency_seconds`` histogram. The referee runs in this
   process and each agent in its own, as deployed — the same process
   boundary as the raw pair. (``--in-process`` puts the agents on the
   referee's event loop too; then all their packets share one core.)
   Both run side by side: ten blocks of raw round trips alternate with ten
   blocks of matches, so the machine's drift touches both alike.
3. Throughput: matches per second with N = 1, 10, 100 concurrent matches, every
   part a separate OS process as ``backroom run`` starts them, counted from the
   first request to the last episode (process start-up is not play). Beside
   it, the in-process loop: the same matches played on the game engine alone
   (no bus, no referee), the floor of what a match costs. For each N it prints
   the CPU time every process spent per match (``/proc``, Linux), which says
   what bounds the rate: one referee process can use one core, and all
   processes together can use every core.
4. The rate at scale, 100 in flight: refereed Kuhn moves per second with 100
   matches in flight (the referee here, each agent in its own process, a
   feeder here that starts a match whenever one ends) against raw aiomqtt
   request/response round trips per second with 100 requests outstanding
   through the same broker (the echo answers each as it comes). Blocks of
   each alternate. Target: moves / round trips >= 1.2 (issue 37; it was 0.5). (Printed between
   parts 2 and 3; ``--only rate`` runs it alone.)
5. Referee scaling (``--only scaling --referees 1 2 4 8``): the same run
   through ``backroom run``'s code with K referee processes sharing one
   broker, 12 random agents in their own processes playing classic Kuhn
   round robin (so no single agent process carries every match), the same
   matches in flight for every K, and matches per K proportional to K.
   Printed: matches per second, the ratio to one referee against the goal
   0.7·K, and the CPU each kind of process spent per second of play (1.00
   = one core busy): a broker near 1.00 is Mosquitto's single thread
   bounding the run, a referee near 1.00 a referee bounding it. Beside them,
   the CPU milliseconds per match of all referees together and of the
   runner, and last each one's ratio at the largest K to the smallest (the
   target for the referees: <= 1.2 at K = 4 against K = 1, on 2 cores too:
   each referee reads only the moves addressed to it). Not in the default
   run (it wants many cores; on 2 its matches per second measure the
   machine, its CPU per match still the referees' work).

Run: ``python bench/bus_overhead.py`` (add ``--quick`` for a short run). The
machine is shared and noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiomqtt
from prometheus_client import REGISTRY

from backroom import metrics
from backroom.agents import make_agent
from backroom.agents.runtime import AgentRunner
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, BusConfig, install_uvloop
from backroom.bus.wire import MatchRequest, MatchSpec
from backroom.games import make_game
from backroom.referee.service import Referee
from backroom.runner import local
from backroom.runner.config import AgentEntry, RunConfig
from backroom.runner.local import run_local

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def identity(broker: Broker, name: str, role: str = "agent") -> BusConfig:
    cred = broker.credentials.add(name, role=role)  # type: ignore[arg-type]
    broker.reload()
    return BusConfig(host=broker.host, port=broker.port, username=name, password=cred.password)


#: aiomqtt warns on every publish while more than 10 await their PUBACK: 100 in flight is the point here.
QUIET = logging.getLogger("bench.aiomqtt")
QUIET.setLevel(logging.ERROR)


def client(cfg: BusConfig) -> aiomqtt.Client:
    return aiomqtt.Client(
        cfg.host,
        cfg.port,
        username=cfg.username,
        password=cfg.password,
        identifier=cfg.username,
        protocol=aiomqtt.ProtocolVersion.V5,
        socket_options=NODELAY,
        max_inflight_messages=0,  # as the Bus: no cap (paho's default of 20 would throttle 100 in flight)
        logger=QUIET,
    )


def pair_topics(name: str) -> tuple[str, str]:
    """The raw pair's ping and pong topics, as the broker's ACL allows them.

    A (role trainer, ``{name}-a``) writes pings where a trainer announces
    checkpoints; B (role agent, ``{name}-b``) reads them there and answers on
    its traces, which a trainer reads. No other process of the bench reads
    either topic.
    """
    return topics.checkpoint(name), topics.traces(f"{name}-b")


async def echo(cfg: BusConfig, name: str, concurrent: bool) -> None:
    """The B side of the raw pair: answer every ping (run in its own process).

    ``concurrent``: answer each ping as it comes, without waiting for the
    previous answer's PUBACK (for 100 in flight); else one after another.
    """
    answering: set[asyncio.Task[None]] = set()
    ping, pong = pair_topics(name)
    async with client(cfg) as cb:
        await cb.subscribe(ping, qos=1)
        async for msg in cb.messages:
            answer = cb.publish(pong, msg.payload, qos=1)
            if concurrent:
                task = asyncio.create_task(answer)
                answering.add(task)
                task.add_done_callback(answering.discard)
            else:
                await answer


#: A ping: the size of an agent's answer, with the request's number first.
PING = b'{"turn":%d,"type":"action","v":1,"action":1}'


@contextlib.asynccontextmanager
async def echo_client(
    broker: Broker, name: str, concurrent: bool
) -> AsyncIterator[tuple[Callable[[bytes], Awaitable[None]], AsyncIterator[aiomqtt.Message]]]:
    """Yields ``send(ping)`` and the answers of an echo process that has answered once."""
    a, b = identity(broker, f"{name}-a", "trainer"), identity(broker, f"{name}-b", "agent")
    ping, pong = pair_topics(name)
    await asyncio.sleep(0.1)
    proc = await asyncio.create_subprocess_exec(
        # The password goes by environment: a token may start with "-", which argparse takes for an option.
        sys.executable,
        __file__,
        "--echo",
        str(b.port),
        name,
        *(["--echo-concurrent"] if concurrent else []),
        env={**os.environ, "BENCH_ECHO_PASSWORD": b.password or ""},
    )
    try:
        async with client(a) as ca:
            await ca.subscribe(pong, qos=1)

            async def send(payload: bytes) -> None:
                await ca.publish(ping, payload, qos=1)

            it = ca.messages.__aiter__()
            while True:  # until the echo process is up
                if proc.returncode is not None:
                    raise RuntimeError(f"the echo process exited with {proc.returncode}")
                await send(PING % 0)
                try:
                    await asyncio.wait_for(it.__anext__(), 0.2)
                    break
                except TimeoutError:
                    continue
            yield send, it
    finally:
        proc.terminate()
        await proc.wait()


@contextlib.asynccontextmanager
async def raw_pair(broker: Broker) -> AsyncIterator[Callable[[int], Awaitable[list[float]]]]:
    """The reference: yields ``ping(n)``, n timed aiomqtt round trips through the echo process."""
    async with echo_client(broker, "bench", concurrent=False) as (send, it):
        payload = PING % 1

        async def ping(n: int) -> list[float]:
            samples = []
            for _ in range(n):
                t = time.perf_counter()
                await send(payload)
                await it.__anext__()
                samples.append(time.perf_counter() - t)
            return samples

        yield ping


@contextlib.asynccontextmanager
async def raw_in_flight(broker: Broker) -> AsyncIterator[Callable[[int, float], Awaitable[float]]]:
    """Yields ``rate(k, seconds)``: aiomqtt round trips per second with k requests always out."""
    async with echo_client(broker, "bench-rate", concurrent=True) as (send, it):
        waiting: dict[int, asyncio.Future[None]] = {}

        async def answers() -> None:
            async for msg in it:
                payload = msg.payload
                assert isinstance(payload, bytes)
                fut = waiting.pop(int(payload[8 : payload.index(b",")]), None)
                if fut is not None:
                    fut.set_result(None)

        reader = asyncio.create_task(answers())
        ids = itertools.count(1)

        async def rate(k: int, seconds: float) -> float:
            done = 0
            stop = False

            async def requester() -> None:
                nonlocal done
                loop = asyncio.get_running_loop()
                while not stop:
                    i = next(ids)
                    fut = waiting[i] = loop.create_future()
                    await send(PING % i)
                    await fut
                    done += 1

            tasks = [asyncio.create_task(requester()) for _ in range(k)]
            await asyncio.sleep(seconds / 4)  # until all k are in flight
            t0, n0 = time.perf_counter(), done
            await asyncio.sleep(seconds)
            t1, n1 = time.perf_counter(), done
            stop = True
            await asyncio.gather(*tasks)
            return (n1 - n0) / (t1 - t0)

        try:
            yield rate
        finally:
            reader.cancel()


def spec(seats: list[str], seed: int) -> MatchSpec:
    return MatchSpec(
        game="kuhn",
        params={"variant": "loki"},
        seats=seats,
        seed=seed,
        run="bench",
        turn_timeout_s=10,
    )


class Refereed:
    """The measured side, set up by ``refereed``: a referee here, three agents, a runner's bus here."""

    def __init__(self, bus: Bus, names: list[str]) -> None:
        self.bus = bus
        self.names = names
        self.started = 0
        self.finished = 0
        self.feeding = False  # start a match whenever one ends
        self.episode = asyncio.Event()

    def on_episode(self, _topic: str, payload: bytes) -> None:
        # Episodes come batched: count them without parsing the records.
        n = payload.count(b'"type":"episode"')
        self.finished += n
        self.episode.set()
        if self.feeding:
            for _ in range(n):
                self.request()

    def request(self) -> None:
        self.started += 1
        request = MatchRequest(match=f"rm{self.started}", spec=spec(self.names, self.started))
        self.bus.publish(topics.CONTROL_MATCHES, request, batch=True)

    async def play(self, n: int) -> list[float]:
        """The mean referee turn latency of each of n matches, played one at a time."""
        per_match = []
        for _ in range(n):
            before_sum, before_n = _hist_totals()
            self.episode.clear()
            self.request()
            await self.episode.wait()
            after_sum, after_n = _hist_totals()
            if after_n > before_n:
                per_match.append((after_sum - before_sum) / (after_n - before_n))
        return per_match

    async def moves_in_flight(self, k: int, seconds: float) -> float:
        """Refereed moves per second with k matches always in flight."""
        self.feeding = True
        target = self.finished + k
        for _ in range(k):
            self.request()
        while self.finished < target:  # one round played: all k in flight, at their own pace
            self.episode.clear()
            await self.episode.wait()
        t0, (_, n0) = time.perf_counter(), _hist_totals()
        await asyncio.sleep(seconds)
        t1, (_, n1) = time.perf_counter(), _hist_totals()
        self.feeding = False
        while self.finished < self.started:
            self.episode.clear()
            await self.episode.wait()
        return (n1 - n0) / (t1 - t0)


@contextlib.asynccontextmanager
async def refereed(broker: Broker, runs: Path, in_process: bool) -> AsyncIterator[Refereed]:
    """The referee in this process, each agent in its own (or here, ``in_process``)."""
    names = ["p0", "p1", "p2"]
    configs = [identity(broker, n) for n in names]
    runner_cfg = identity(broker, "runner", "runner")
    await asyncio.sleep(0.1)
    procs: list[asyncio.subprocess.Process] = []
    runners: list[AgentRunner] = []
    async with Referee(identity(broker, "referee", "referee"), runs_dir=runs) as ref:
        if in_process:
            runners = [
                AgentRunner(make_agent("random", n, seed=i), c)
                for i, (n, c) in enumerate(zip(names, configs, strict=True))
            ]
            for r in runners:
                await r.open()
        else:
            for n, c in zip(names, configs, strict=True):
                env = {
                    **os.environ,
                    "BACKROOM_BROKER": f"mqtt://{c.host}:{c.port}",
                    "BACKROOM_USERNAME": n,
                    "BACKROOM_PASSWORD": c.password or "",
                }
                argv = [sys.executable, "-m", "backroom", "agent", "random", "--id", n]
                procs.append(await asyncio.create_subprocess_exec(*argv, env=env))
        # Read as if seated for the whole bench (they are, in every match): a referee reads
        # only its seated agents' statuses. Online, so latency is labelled by kind.
        await ref.outboxes.seat(names)
        while any(ref.kind_of(n) != "random" for n in names):
            await asyncio.sleep(0.05)
        async with Bus(runner_cfg) as bus:
            side = Refereed(bus, names)
            await bus.subscribe(topics.ALL_EPISODES, side.on_episode)
            yield side
        for r in runners:
            await r.__aexit__(None, None, None)
        for p in procs:
            p.terminate()
            await p.wait()


def _hist_totals() -> tuple[float, float]:
    """Running sum and count of the referee's act-turn latency for random agents."""
    total = count = 0.0
    for family in metrics.TURN_LATENCY.collect():
        for s in family.samples:
            if s.labels.get("kind") == "random" and s.labels.get("phase") == "act":
                if s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = s.value
    return total, count


TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(proc: Path, stat_fields: list[str]) -> float:
    """CPU seconds of one process: the nanoseconds its threads ran (``schedstat``), or else
    user + system in clock ticks (``stat``), too coarse for a quick run's 0.2 s of play."""
    try:
        return (
            sum(
                int((task / "schedstat").read_text().split()[0])
                for task in (proc / "task").iterdir()
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        return (int(stat_fields[11]) + int(stat_fields[12])) / TICKS


def children_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of this process and the processes it started, by pid (Linux)."""
    out: dict[int, tuple[str, float]] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        pid, ppid = int(entry.name), int(fields[1])
        if pid == me or ppid == me:
            out[pid] = (_role(argv), _cpu_s(entry, fields))
    return out


def _role(argv: list[bytes]) -> str:
    words = [a.decode(errors="replace") for a in argv if a]
    if words and words[0].endswith("mosquitto"):
        return "broker"
    if "referee" in words:
        return "referee"
    if "agent" in words and "--id" in words:
        return f"agent {words[words.index('--id') + 1]}"
    return "runner"


def timed_run(config: RunConfig, runs: Path) -> tuple[float, float, list[tuple[str, float]]]:
    """Matches per second, the wall seconds of play (the first request out to the last
    episode in, as ``RunResult.matches_per_second`` counts them), and each process's
    (role, CPU seconds) over that span.

    The play starts when the runner stamps its clock (``PlayClock.started``), so the
    processes' start-up is left out and every match is in. (From the first episode on,
    a run with as many matches in flight as it has matches saw only its last moves.)"""
    snaps: list[tuple[float, dict[int, tuple[str, float]]]] = []

    class Clock(local.PlayClock):
        def __setattr__(self, name: str, value: object) -> None:
            if name == "started" and value and not snaps:  # the first request is going out
                snaps.append((time.perf_counter(), children_cpu()))
            super().__setattr__(name, value)

    def on_episode(_record: object, n: int) -> None:
        if n == config.matches and len(snaps) == 1:
            snaps.append((time.perf_counter(), children_cpu()))

    saved = local.run_options

    def clocked(*args: Any, **kwargs: Any) -> Any:
        """The run's play options with this clock: it stamps the first request going out."""
        options = saved(*args, **kwargs)
        options.clock = Clock()
        return options

    local.run_options = clocked
    try:
        result = asyncio.run(run_local(config, runs_dir=runs, on_episode=on_episode))
    finally:
        local.run_options = saved
    assert all(e.reason == "normal" for e in result.episodes), {
        (e.reason, e.detail) for e in result.episodes if e.reason != "normal"
    }
    if len(snaps) != 2:
        return result.matches_per_second, 0.0, []
    (t0, first), (t1, last) = snaps
    used = [(role, s - first[pid][1]) for pid, (role, s) in last.items() if pid in first]
    return result.matches_per_second, t1 - t0, used


def throughput(concurrency: int, matches: int, runs: Path) -> tuple[float, dict[str, float]]:
    """Matches per second, and each process's CPU milliseconds per match over the play."""
    config = RunConfig(
        run=f"bench-n{concurrency}",
        game="kuhn",
        params={"variant": "loki"},
        matches=matches,
        concurrency=concurrency,
        agents=[AgentEntry(id=f"t{i}", kind="random") for i in range(3)],
        turn_timeout_s=30,
    )
    rate, _, used = timed_run(config, runs)
    return rate, {role: s / matches * 1e3 for role, s in used}


SCALING_AGENTS = 12


def runner_messages_in() -> float:
    """MQTT messages the runner (this process) has read so far: what it pays per message.

    Read around a whole run, so the start's statuses and rosters count too: one per agent
    and referee, against 300 matches or more a run."""
    labels = {"direction": "in", "role": "runner"}
    return REGISTRY.get_sample_value("backroom_bus_messages_total", labels) or 0.0


def scaling_part(runs: Path, referees: list[int], quick: bool, in_flight: int) -> None:
    """Matches per second with K referees against one, and what each kind of process used."""
    per_referee = 300 if quick else 4000
    rates: dict[int, float] = {}
    per_match: dict[int, tuple[float, float]] = {}  # K -> (referees', runner's) CPU ms per match
    print(
        f"referee scaling: classic Kuhn, {SCALING_AGENTS} random agents round robin, "
        f"{in_flight} matches in flight, {per_referee}·K matches, {os.cpu_count()} cores"
    )
    print(
        f"  {'K':>2}  {'matches/s':>9}  {'vs K=1':>6}  {'goal':>5}   CPU per second of play "
        "(1.00 = one core): broker, busiest referee, referees, agents, runner   "
        "CPU ms per match: referees, runner   runner's MQTT messages in per match"
    )
    for k in referees:
        config = RunConfig(
            run=f"bench-k{k}",
            game="kuhn",
            matches=per_referee * k,
            concurrency=in_flight,
            agents=[AgentEntry(id=f"s{i}", kind="random") for i in range(SCALING_AGENTS)],
            round_robin=True,
            referees=k,
            turn_timeout_s=30,
        )
        heard_before = runner_messages_in()
        rates[k], wall, used = timed_run(config, runs)
        heard_per_match = (runner_messages_in() - heard_before) / config.matches
        load = {
            kind: sum(s for r, s in used if r.startswith(kind)) / wall if wall else 0.0
            for kind in ("broker", "referee", "agent", "runner")
        }
        busiest = max((s for r, s in used if r == "referee"), default=0.0) / wall if wall else 0.0
        base = rates[min(rates)]
        ref_ms, run_ms = (
            sum(s for r, s in used if r == kind) / config.matches * 1e3
            for kind in ("referee", "runner")
        )
        per_match[k] = (ref_ms, run_ms)
        print(
            f"  {k:>2}  {rates[k]:9.1f}  {rates[k] / base:5.2f}x  {0.7 * k:4.1f}x   "
            f"{load['broker']:5.2f}  {busiest:5.2f}  {load['referee']:5.2f}  "
            f"{load['agent']:5.2f}  {load['runner']:5.2f}   {ref_ms:8.3f}  {run_ms:6.3f}   "
            f"{heard_per_match:5.2f}",
            flush=True,
        )
    low, high = min(per_match), max(per_match)
    if high != low and all(per_match[low]):
        of_referees, of_runner = (per_match[high][i] / per_match[low][i] for i in (0, 1))
        print(
            f"  CPU per match, K={high} vs K={low}: referees {of_referees:.2f}x "
            f"(target <= 1.2x), runner {of_runner:.2f}x"
        )


def in_process_loop(matches: int) -> float:
    """The floor: matches per second of the game engine alone, random legal moves, one core."""
    game = make_game("kuhn", variant="loki")
    rng = random.Random(0)
    t = time.perf_counter()
    for seed in range(matches):
        state = game.new_initial_state(seed)
        while not state.is_terminal():
            state.apply({p: state.action_spec(p).sample(rng) for p in state.current_players()})
        state.returns()
    return matches / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--in-process", action="store_true", help="agents on the referee's event loop")
    ap.add_argument(
        "--only",
        choices=["latency", "rate", "throughput", "scaling"],
        help="run one part of the benchmark (scaling runs only when named)",
    )
    ap.add_argument(
        "--referees",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        metavar="K",
        help="referee counts of the scaling part",
    )
    ap.add_argument(
        "--in-flight", type=int, default=400, help="matches in flight in the scaling part"
    )
    ap.add_argument("--echo", nargs=2, metavar=("PORT", "NAME"), help=argparse.SUPPRESS)
    ap.add_argument("--echo-concurrent", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    install_uvloop()
    if args.echo:
        port, name = args.echo
        password = os.environ["BENCH_ECHO_PASSWORD"]
        cfg = BusConfig(port=int(port), username=f"{name}-b", password=password)
        asyncio.run(echo(cfg, name, args.echo_concurrent))
        return
    n_rtt, n_matches = (600, 60) if args.quick else (4000, 300)
    with tempfile.TemporaryDirectory() as d:
        runs = Path(d)
        if args.only in (None, "latency"):
            latency_part(runs, n_rtt, n_matches, args.in_process)
        if args.only in (None, "rate"):
            rate_part(runs, args.in_process, blocks=3 if args.quick else 5)
        if args.only in (None, "throughput"):
            throughput_part(runs, args.quick)
        if args.only == "scaling":
            scaling_part(runs, sorted(args.referees), args.quick, args.in_flight)


def latency_part(
    runs: Path, n_rtt: int, n_matches: int, in_process: bool, blocks: int = 10
) -> None:
    """Raw round trips and refereed moves alternate in blocks, so the machine's drift hits both alike."""
    with Broker(runs / "broker") as broker:

        async def latency() -> tuple[list[float], list[float]]:
            raw: list[float] = []
            moves: list[float] = []
            async with raw_pair(broker) as ping, refereed(broker, runs, in_process) as side:
                for _ in range(blocks):
                    raw += await ping(n_rtt // blocks)
                    moves += await side.play(n_matches // blocks)
            return raw, moves

        raw, moves = asyncio.run(latency())
    raw_ms, move_ms = statistics.median(raw) * 1e3, statistics.median(moves) * 1e3
    print(f"raw aiomqtt round trip (QoS 1)    median {raw_ms:.3f} ms  (n={len(raw)})")
    where = "agents in the referee's process" if in_process else "agents in their own processes"
    print(
        f"referee-mediated Kuhn move        median {move_ms:.3f} ms  (n={len(moves)} matches; {where})"
    )
    print(f"ratio move / raw                  {move_ms / raw_ms:.2f}x   (target <= 1.25x)")
    print()


def rate_part(
    runs: Path, in_process: bool, blocks: int, in_flight: int = 100, seconds: float = 2.0
) -> None:
    """Refereed moves and raw round trips per second, ``in_flight`` of each outstanding, alternating."""
    with Broker(runs / "broker-rate") as broker:

        async def rates() -> tuple[list[float], list[float]]:
            raw: list[float] = []
            moves: list[float] = []
            async with raw_in_flight(broker) as rate, refereed(broker, runs, in_process) as side:
                for _ in range(blocks):
                    raw.append(await rate(in_flight, seconds))
                    moves.append(await side.moves_in_flight(in_flight, seconds))
            return raw, moves

        raw, moves = asyncio.run(rates())
    raw_r, move_r = statistics.median(raw), statistics.median(moves)
    each = f"{blocks} blocks of {seconds:.0f} s"
    print(f"raw aiomqtt round trips, {in_flight} in flight    {raw_r:8.0f} /s  (median of {each})")
    print(
        f"refereed Kuhn moves, {in_flight} matches in flight {move_r:8.0f} /s  (median of {each})"
    )
    print(
        f"ratio moves / raw round trips at {in_flight} in flight  {move_r / raw_r:.2f}x"
        "   (target >= 1.2x)"
    )
    print()


def throughput_part(runs: Path, quick: bool) -> None:
    rates = {}
    cpus = {}
    for n, m in (
        (1, 100 if quick else 300),
        (10, 300 if quick else 1000),
        (100, 1000 if quick else 3000),
    ):
        rates[n], cpus[n] = throughput(n, m, runs)
        print(
            f"{n:>3} concurrent matches: {rates[n]:8.1f} matches/s  ({m} matches, separate processes)"
        )
    loop = in_process_loop(3000 if quick else 20000)
    print(f"in-process loop (engine alone): {loop:8.1f} matches/s  (one core, no bus, no referee)")
    print(f"throughput ratio N=100 / N=1      {rates[100] / rates[1]:.1f}x   (target >= 20x)")
    print(f"ratio in-process loop / N=100     {loop / rates[100]:.1f}x")
    if all(cpus.values()):
        print()
        print("CPU per match (ms), from the first request to the last episode:")
        roles = sorted(cpus[100], key=lambda r: (not r.startswith("referee"), r))
        print(
            f"  {'N':>3}  " + "  ".join(f"{r[:10]:>10}" for r in roles) + "       all  wall/match"
        )
        for n, cpu in cpus.items():
            wall = 1e3 / rates[n]
            print(
                f"  {n:>3}  "
                + "  ".join(f"{cpu.get(r, 0.0):10.3f}" for r in roles)
                + f"  {sum(cpu.values()):8.3f}  {wall:10.3f}"
            )
        cpu, cores = cpus[100], os.cpu_count() or 1
        referee = max(v for r, v in cpu.items() if r.startswith("referee"))
        total = sum(cpu.values())
        bound = 1e3 / max(referee, total / cores)
        print(
            f"  N=100 bound: one referee core ({referee:.3f} ms/match) and {cores} cores for all "
            f"({total:.3f} ms/match) allow at most {bound:.0f} matches/s = "
            f"{bound / rates[1]:.1f}x N=1"
        )
        # The target read backwards: the CPU a match may cost at N=100 for 20x N=1 on these cores.
        per_core = 1e3 / (20 * rates[1])  # wall ms per match at 20x: one process's CPU budget
        agents = sum(v for r, v in cpu.items() if r.startswith("agent"))
        print(
            f"  20x N=1 needs {20 * rates[1]:.0f} matches/s: at most {cores * per_core:.3f} ms/match for all "
            f"processes (they spend {total:.3f}; the agents alone {agents:.3f}) and "
            f"{per_core:.3f} for the referee (it spends {referee:.3f})"
        )


if __name__ == "__main__":
    main()
