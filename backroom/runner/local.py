"""``backroom run``: start what is missing, run the matches, collect the episodes.

On one machine the runner starts a broker (when no URL is given), the
referee(s) and every agent as separate OS processes — the same processes a
user would start by hand on many machines — then submits match requests with
at most ``concurrency`` in flight and gathers one episode per match.

Faults (docs/operations.md, "Faults"): a match accepted by a referee that
then goes away (its process dead, or its status offline past
``REFEREE_GRACE_S``) is requested again, and so is one voided because its
referee stopped; the first episode of a match is kept and later ones counted
(``Faults.duplicates``). When no referee is left the run fails with the dead
referee's log, rather than wait. An agent that goes offline is reported at
once, and at the end with the number of matches its seats were defaulted in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt

from backroom import metrics
from backroom.agents.model.loading import THREADS_ENV, torch_threads_for
from backroom.bus import topics
from backroom.bus.auth import CredentialStore, Role
from backroom.bus.broker import Broker, die_with_parent, read_pid, reload_broker
from backroom.bus.client import Bus, BusConfig
from backroom.bus.connection import broker_reachable
from backroom.bus.errors import BusError
from backroom.bus.wire import (
    IDENTITY_WINDOW_S,
    MAX_TRACE_BYTES,
    SHUTTING_DOWN,
    EpisodeRecord,
    Event,
    MatchRequest,
    Status,
    Trace,
    WireError,
    parse,
    parse_all,
    parse_status,
)
from backroom.referee.fallbacks import count_fallbacks, fallback_of, warning_lines
from backroom.runner.config import EXTERNAL, RunConfig
from backroom.runs import bind_run_dir, new_run_dir

#: Seconds into the wait for processes to come online before the runner says who is missing.
SLOW_START_S = 10.0
#: Seconds a referee whose status says offline has to come back before the runner asks
#: again for the matches it accepted. Not at once: a broker shutting down sends every
#: client's will, and a referee that reconnects voids those matches itself (their
#: episodes say so); its reconnect backoff reaches 2 s (times 0.5 to 1.5), so it may
#: take 3 s once the broker is back. The time counts from the runner's own reconnect
#: at the latest. A referee process of the run's own that died is not waited for.
REFEREE_GRACE_S = 5.0
#: Times a match voided because its referee stopped is asked for again; then the void stands.
RERUNS = 3
#: Bytes of traces one run records in its traces.jsonl; past it, traces are counted, not written.
TRACES_MAX_BYTES = 1024**3
#: Seconds an acknowledged match may go without its episode, or word from its referee,
#: before the runner asks again (``MatchRequest.again``): an episode published while the
#: runner's session was lost (a broker killed) reaches nobody. Its referee publishes the
#: episode again, or says it is still running the match.
EPISODE_WAIT_S = 10.0
#: Times such a match is asked again with no answer before it is asked for under a new
#: id (its referee no longer keeps the episode, or the asks reached other referees).
AGAIN_TRIES = 3


class RunError(RuntimeError):
    pass


@dataclass
class Departure:
    """An agent of the run whose status said offline while the run played."""

    agent: str
    at: float  # time.time() of the status
    back_at: float | None = None  # when its status said online again
    defaulted: int = 0  # matches since ``at`` in which a seat of it got the timeout default

    def line(self) -> str:
        """What the run says of it: ``agent X went offline at ... (its seats got defaults in N matches)``."""
        text = f"agent {self.agent} went offline at {_clock(self.at)}"
        if self.back_at is not None:
            text += f", back at {_clock(self.back_at)}"
        n = self.defaulted
        return f"{text} (its seats got defaults in {n} match{'' if n == 1 else 'es'})"


@dataclass
class Faults:
    """What went wrong during a run, and what the runner did about it."""

    #: Referees that went away while the run played (identities).
    referees_lost: list[str] = field(default_factory=list)
    #: Referees given up that then took a match requested after that: alive after all.
    referees_revived: list[str] = field(default_factory=list)
    #: Matches requested again, by why: ``referee lost`` (it had accepted them),
    #: ``accepted by a lost referee`` (its acknowledgement came after the runner gave
    #: it up), ``voided`` (its referee stopped mid-match).
    rerequest_reasons: Counter[str] = field(default_factory=Counter)
    #: Requests sent again because no referee acknowledged them in time.
    resubmitted: int = 0
    #: Accepted matches asked again because neither their episode nor their referee was
    #: heard of for ``EPISODE_WAIT_S`` (``MatchRequest.again``).
    asked_again: int = 0
    #: Episodes of a match past its first (dropped; a match asked for again ran twice).
    duplicates: int = 0
    #: Lines of such episodes taken out of the run's ``episodes.jsonl`` (``dedupe_episodes``).
    duplicates_on_disk: int = 0
    #: Ids a match was asked for again under -> the run's id of that match. A match
    #: played again gets a new id (``<id>.r<n>``): agents drop a turn they answered
    #: before, by match, turn and seat, so a rerun under the old id would time out.
    reruns: dict[str, str] = field(default_factory=dict)
    departures: list[Departure] = field(default_factory=list)
    #: Stopped by Ctrl-C (SIGINT) while playing: the episodes are the matches finished by then.
    interrupted: bool = False

    @property
    def rerequested(self) -> int:
        """Matches requested again, all told."""
        return sum(self.rerequest_reasons.values())


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


@dataclass(repr=False)
class RunResult:
    config: RunConfig
    episodes: list[EpisodeRecord]
    seconds: float  # wall clock of the whole run, processes starting up included
    run_dir: Path
    broker_url: str
    play_seconds: float  # first request out to last episode in
    faults: Faults = field(default_factory=Faults)

    @property
    def matches_per_second(self) -> float:
        """Rate of play: from the first request to the last episode, so the
        seconds that processes take to import and connect do not dilute it."""
        return len(self.episodes) / self.play_seconds if self.play_seconds > 0 else 0.0

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run on Python 3.11 builds the repr of its main
        # task's result twice on the way out (CPython issue #112559), and the
        # dataclass repr of every episode took about a second per 10,000 matches.
        return (
            f"RunResult(run={self.config.run!r}, episodes={len(self.episodes)}, "
            f"seconds={self.seconds:.1f}, run_dir={str(self.run_dir)!r})"
        )


@dataclass
class PlayClock:
    """When a run's first request went out and its last episode came in (``perf_counter``)."""

    started: float = 0.0
    ended: float = 0.0


@dataclass(frozen=True)
class RunNames:
    """The identities of a run's own processes: the runner and the referees it starts."""

    runner: str
    referees: tuple[str, ...]
    #: Made up for this run (removed from a broker it did not start when it ends).
    own: bool = False


def run_names(config: RunConfig, nonce: str | None = None) -> RunNames:
    """``runner-<run>-<nonce>`` and ``referee-<run>-<nonce>[-<i>]``, or the fixed names.

    The MQTT client id is the username, so two processes under one identity
    throw each other off the broker, round and round: two ``backroom run`` on
    one broker, both as ``runner`` and both starting a ``referee``, both hung.
    A name with a fresh nonce is no other process's. ``nonce=None`` gives the
    fixed ``runner``, ``referee``, ``referee-1``, ...: for a broker whose
    identities the run cannot add (compose's read-only credentials), and for
    scripts that start a stack by hand.
    """
    if nonce is None:
        referees = tuple("referee" if i == 0 else f"referee-{i}" for i in range(config.referees))
        return RunNames("runner", referees)
    base = f"{config.run[:40]}-{nonce}"  # 64 characters at most, with "referee-" and "-99"
    referees = tuple(
        f"referee-{base}" if i == 0 else f"referee-{base}-{i}" for i in range(config.referees)
    )
    return RunNames(f"runner-{base}", referees, own=True)


@dataclass
class Stack:
    """The processes a run started; ``stop`` ends them all (a crash cannot leave orphans behind)."""

    run_dir: Path
    broker: Broker | None = None
    url: str = ""
    credentials: CredentialStore | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: Identities this run added to a broker it did not start: they outlive the run.
    created: list[str] = field(default_factory=list)
    #: Identities made up for this run on a broker it did not start: ``stop`` removes them.
    ephemeral: list[str] = field(default_factory=list)
    #: Names of the run's own processes (None: the fixed ``runner``, ``referee``, ...).
    names: RunNames | None = None
    #: The run's referee processes: process name -> identity.
    referees: dict[str, str] = field(default_factory=dict)
    nonce: str = field(default_factory=lambda: secrets.token_hex(3))

    def start_broker(
        self,
        url: str | None,
        credentials_dir: str | Path | None,
        identities: list[tuple[str, Role]] | None = None,
    ) -> None:
        """Start a broker when no URL is given, with ``identities`` created before it starts."""
        if url is None:
            broker = Broker(self.run_dir / "broker")
            for name, role in identities or []:
                broker.credentials.add(name, role=role)
            self.broker = broker.start()
            self.url = self.broker.url
            self.credentials = self.broker.credentials
        else:
            if credentials_dir is None:
                raise RunError(
                    "with --broker, pass --credentials DIR: the credentials.json of that broker "
                    "(written by `backroom broker` or `backroom credentials add`)"
                )
            self.url = url
            self.credentials = CredentialStore(credentials_dir)

    def can_add_identities(self) -> bool:
        """Whether an identity added now can log in: its broker is ours, or rereads the store.

        Not so for compose's runner (its credentials are mounted read-only) nor
        for credentials copied from a broker on another host (no pid file to
        send SIGHUP to).
        """
        if self.broker is not None:
            return True
        if self.credentials is None or not os.access(self.credentials.dir, os.W_OK):
            return False
        store = self.credentials.path
        if store.exists() and not os.access(store, os.W_OK):
            return False
        pid = read_pid(self.credentials.dir)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True

    def identity(self, username: str, role: Role = "agent", ephemeral: bool = False) -> BusConfig:
        """Connection settings for ``username``, added to the store (and the broker) when new.

        ``ephemeral``: made up for this run, so ``stop`` removes it again from a
        broker the run did not start.
        """
        assert self.credentials is not None
        known = username in self.credentials.load()
        cred = self.credentials.add(username, role=role)
        if not known and self.broker is None:
            (self.ephemeral if ephemeral else self.created).append(username)
        if not known:
            # A broker we started, or one whose pid file sits beside the
            # credentials (`backroom broker --dir`), rereads them now.
            reload_broker(self.credentials.dir)
        return BusConfig.from_url(self.url, username=cred.username, password=cred.password)

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = (logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "backroom", *args],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def exit_code(self, name: str) -> int | None:
        return self.procs[name].poll()

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.ephemeral and self.credentials is not None:
            # Their processes are gone: on someone else's broker, leave nothing behind.
            for name in self.ephemeral:
                self.credentials.remove(name)
            self.ephemeral.clear()
            reload_broker(self.credentials.dir)
        if self.broker is not None:
            self.broker.stop()


def identities(config: RunConfig, names: RunNames | None = None) -> list[tuple[str, Role]]:
    """Every identity a run needs, so a broker we start knows them all from its first second."""
    names = names or run_names(config)
    refs: list[tuple[str, Role]] = [(r, "referee") for r in names.referees]
    return [*refs, (names.runner, "runner"), *((a.id, "agent") for a in config.agents)]


def _env(cfg: BusConfig) -> dict[str, str]:
    return {
        "BACKROOM_BROKER": f"mqtt://{cfg.host}:{cfg.port}",
        "BACKROOM_USERNAME": cfg.username or "",
        "BACKROOM_PASSWORD": cfg.password or "",
    }


#: Agent kinds that run a torch model in their own process.
MODEL_KINDS = ("local",)


def torch_threads_env(config: RunConfig) -> dict[str, str]:
    """``BACKROOM_TORCH_THREADS`` for the agent processes: the cores shared by those that run a
    model at once (torch's default, every core in each, oversubscribes the machine). Empty when
    the caller set it, or no agent runs a model here."""
    models = [a for a in config.agents if a.kind in MODEL_KINDS]
    if THREADS_ENV in os.environ or not models:
        return {}
    processes = 1 if config.agent_processes == "single" else len(models)
    return {THREADS_ENV: str(torch_threads_for(processes))}


def start_processes(
    stack: Stack, config: RunConfig, runs_dir: Path, metrics_port: int = 0, referees: bool = True
) -> list[str]:
    """Spawn the referee(s) and agents; return the identities to wait for.

    Agents of kind ``external`` are not started: they are someone else's
    process (a notebook, another machine) and the run waits for them to come
    online (``run_matches`` says so at once). With ``metrics_port`` P, the
    referees and agents serve metrics on P+1, P+2, ... in the order they are
    started.
    """
    waiting = []
    ports = iter(range(metrics_port + 1, metrics_port + 10_000)) if metrics_port else None

    def metrics_args() -> list[str]:
        return ["--metrics-port", str(next(ports))] if ports else []

    names = stack.names or run_names(config)
    if referees:
        for i, identity in enumerate(names.referees):
            name = "referee" if i == 0 else f"referee-{i}"  # the process, and its log file
            cfg = stack.identity(identity, role="referee", ephemeral=names.own)
            stack.spawn(name, ["referee", "--runs-dir", str(runs_dir), *metrics_args()], _env(cfg))
            stack.referees[name] = identity
            waiting.append(identity)
    local = [a for a in config.agents if a.kind != EXTERNAL]
    for a in config.agents:
        stack.identity(a.id)  # external agents get their identity too, to be handed out
    threads = torch_threads_env(config)
    if config.agent_processes == "single" and local:
        passwords = {a.id: stack.identity(a.id).password or "" for a in local}
        spec = json.dumps([a.model_dump() for a in local])
        env = {
            **_env(stack.identity(local[0].id)),
            "BACKROOM_PASSWORDS": json.dumps(passwords),
            **threads,
        }
        stack.spawn("agents", ["agent-host", "--spec-json", spec, *metrics_args()], env)
    else:
        for a in local:
            args = [
                "agent",
                a.kind,
                "--id",
                a.id,
                "--options-json",
                json.dumps(a.options),
                *metrics_args(),
            ]
            stack.spawn(a.id, args, {**_env(stack.identity(a.id)), **threads})
    waiting += [a.id for a in config.agents]
    return waiting


async def run_matches(
    config: RunConfig,
    bus_config: BusConfig,
    wait_for: list[str],
    stack: Stack | None = None,
    on_episode: Callable[[EpisodeRecord, int], None] | None = None,
    ready_timeout_s: float = 60.0,
    ack_timeout_s: float = 2.0,
    traces_path: Path | None = None,
    clock: PlayClock | None = None,
    on_notice: Callable[[str], None] | None = None,
    external: list[str] | None = None,
    run_stamp: str | None = None,
    faults: Faults | None = None,
    referee_grace_s: float = REFEREE_GRACE_S,
    stop: asyncio.Event | None = None,
    traces_max_bytes: int = TRACES_MAX_BYTES,
    episode_wait_s: float = EPISODE_WAIT_S,
    claim_window_s: float = 0.0,
    run_key: str | None = None,
) -> list[EpisodeRecord]:
    """Submit the run's matches (``concurrency`` in flight) and return one episode per match.

    With ``traces_path``, every trace a trainable agent publishes for one of
    these matches (prompt and completion tokens, log-probs, the raw request and
    reply of an API model) is appended there as JSON lines, each decision once, up to
    ``traces_max_bytes`` for the run (``on_notice`` hears when it is reached). With ``run_stamp``,
    every request names it, so referees write ``runs/<run>/<run_stamp>/``: this
    run's own directory, never an earlier run's file.

    ``on_notice`` hears, while the run waits, whom it waits for: at once for
    ``external`` (identities whose process someone else starts; default: the
    config's ``external`` agents), and after ``SLOW_START_S`` for any process
    still missing, so a wait for a process nobody starts is never silent.
    Besides ``wait_for``, the run waits for one referee (any status of kind
    ``referee``) to be online.

    While the run plays, a submitting task fills the window and this one
    watches the referees, so a submit waiting on a full window never keeps a
    dead referee from being noticed. Matches a referee accepted and did not
    finish are requested again when it goes away: at once when its process
    (one of ``stack``'s) died, after ``referee_grace_s`` when its status says
    offline; each time under a new id (``Faults.reruns``), and the first
    episode of a match, under any of its ids, is the one kept. With no referee
    left, the run fails: at once when the run's own referees all died, after
    ``ready_timeout_s`` when others may come back. ``on_notice`` hears of each
    referee lost and each agent gone offline; ``faults`` gets the counts. Once
    ``stop`` is set (Ctrl-C), the run returns the matches finished by then and
    ``faults.interrupted`` says that it stopped short. An accepted match with
    no episode and no word of its referee for ``episode_wait_s`` is asked
    again (``Faults.asked_again``); after ``AGAIN_TRIES`` unanswered asks,
    under a new id.

    ``claim_window_s`` > 0: the runner's identity may be another process's (a
    fixed ``runner``, shared by two runs on one broker). The runner stays
    ready that long after connecting to be thrown off by a process still
    logged in under it (which reconnects at once), and then fails with a
    ``RunError`` saying so, rather than throw it off again and again (both
    runs hung). As the agents do (``AgentRunner._claim``).
    """
    faults = faults if faults is not None else Faults()
    notice = on_notice or (lambda _msg: None)
    online: set[str] = set()
    ready = asyncio.Event()
    episodes: dict[str, EpisodeRecord] = {}
    window = asyncio.Semaphore(config.concurrency)
    all_done = asyncio.Event()
    nonce = f"{int(time.time() * 1000) % 10**10:010d}"
    specs = [spec for _, spec in config.match_specs()]
    match_ids = [f"{config.run}.{nonce}.{suffix}" for suffix, _ in config.match_specs()]
    wanted = set(match_ids)
    # Requests go out under attempt ids: a match's own id, then ``<id>.r<n>``.
    slot_of: dict[str, str] = {m: m for m in match_ids}  # attempt id -> the match's id
    current: dict[str, str] = {}  # match id -> the attempt id asked for last
    requests: dict[str, MatchRequest] = {}  # by attempt id
    sent: dict[str, float] = {}  # attempt id -> when submitted (or again), not acknowledged
    owner: dict[str, str] = {}  # attempt id -> the referee that accepted it (no episode yet)
    heard: dict[str, float] = {}  # accepted attempt -> monotonic time of its referee's last word
    unanswered: Counter[str] = Counter()  # accepted attempt -> asks again with no answer
    tries: Counter[str] = Counter()  # match id -> attempts asked for after the first
    voids: Counter[str] = Counter()  # match id -> times voided because its referee stopped
    referees_up: set[str] = set()  # referees whose status says online
    rostered: set[str] = set()  # identities a referee-only record names referees
    unproven: dict[str, bytes] = {}  # "online, kind referee" from names not (yet) rostered
    referees_down: dict[str, float] = {}  # referee -> monotonic time its status said offline
    lost: dict[str, float] = {}  # referee given up on -> time.monotonic() it was
    first_asked: dict[str, float] = {}  # attempt id -> time.monotonic() first requested
    agent_ids = {a.id for a in config.agents}
    away: dict[str, Departure] = {}  # agents offline now
    playing = False
    me = bus_config.username or "runner"
    unwritten: list[str] = []  # why a referee could not write an episode (fails the run)

    def check_ready() -> None:
        if referees_up and all(w in online for w in wait_for):
            ready.set()

    def no_referee() -> str:
        """What the run waits for when no referee counts: say why one that says so does not."""
        if not unproven:
            return "a referee"
        return (
            f"a referee ({', '.join(sorted(unproven))} says online as a referee, but no roster "
            "record names it: only the referee role can write one, so it is not a referee, or "
            "its broker's ACL predates roster records: add an identity there, which rewrites "
            "it, and reload the broker)"
        )

    def on_roster(topic: str, payload: bytes) -> None:
        """A referee-only record names ``name`` a referee: its "online" counts from now on."""
        name = topics.referee_of(topic)
        if name is None or not payload:
            return
        rostered.add(name)
        if (claim := unproven.pop(name, None)) is not None:
            on_status(topics.status(name), claim)

    def on_status(topic: str, payload: bytes) -> None:
        name = topics.agent_of(topic)
        try:
            msg = parse_status(payload)
        except WireError:
            return
        if name is None or not isinstance(msg, Status):
            return
        up = msg.state == "online"
        if not up:
            unproven.pop(name, None)  # a later roster record must not replay a stale online
        if msg.kind == "referee" and up and name not in rostered:
            # Any identity may say "kind: referee" of itself; counted as one, an agent
            # kept a run waiting for ever after the real referee died. Its roster
            # record (which only referees can write) may still be on its way.
            unproven[name] = payload
            metrics.UNPROVEN_REFEREES.inc()
            return
        (online.add if up else online.discard)(name)
        if msg.kind == "referee":
            if up:
                referees_up.add(name)
                referees_down.pop(name, None)
                lost.pop(name, None)  # back: what it takes from now on is its own again
            elif name in referees_up or name in owner.values():
                # Only a referee this run knew: a shared broker keeps the retained
                # "offline" of every referee that ever ran there, other runs' included.
                referees_up.discard(name)
                referees_down.setdefault(name, time.monotonic())
        elif name in agent_ids and playing:
            departed(name, up)
        check_ready()

    def departed(agent: str, up: bool) -> None:
        """An agent's status changed mid-run: say so now (its seats play the default meanwhile)."""
        if not up and agent not in away:
            away[agent] = departure = Departure(agent, time.time())
            faults.departures.append(departure)
            notice(
                f"agent {agent} went offline at {_clock(departure.at)}: its seats get the "
                f"timeout default ({config.on_timeout}) until it is back"
            )
        elif up and agent in away:
            departure = away.pop(agent)
            departure.back_at = time.time()
            notice(f"agent {agent} is back online at {_clock(departure.back_at)}")

    def on_ack(_topic: str, payload: bytes) -> None:
        # A referee acknowledges each request it takes in the runner's own inbox.
        for msg in parse_all(payload):
            if isinstance(msg, WireError) or not msg.match:
                continue
            sent.pop(msg.match, None)
            match_id = slot_of.get(msg.match, "")
            if isinstance(msg, Event) and msg.kind == "running" and msg.match in owner:
                heard[msg.match] = time.monotonic()  # asked again: its referee still plays it
                unanswered.pop(msg.match, None)
            if (
                isinstance(msg, Event)
                and msg.kind == "forgotten"  # finished, its episode no longer kept: play anew
                and msg.match in owner
                and current.get(match_id) == msg.match
                and match_id not in episodes
            ):
                ask_again(match_id, "no episode")
            if isinstance(msg, Event) and msg.kind == "accepted" and match_id in current:
                if match_id in episodes or current[match_id] != msg.match:
                    continue
                referee = _referee_identity(msg.data)
                if referee in lost and first_asked[msg.match] > lost[referee]:
                    revive(referee, msg.match)
                if referee in lost:  # its acknowledgement trailed the news of its death
                    ask_again(match_id, "accepted by a lost referee")
                else:
                    owner[msg.match] = referee
                    heard[msg.match] = time.monotonic()

    def revive(referee: str, match: str) -> None:
        """``referee``, given up, took a request sent after that: it is alive, count on it.

        A live referee can be given up: after a broker restart a stale ``offline`` of
        it can arrive after its fresh ``online`` (the runner's session hands over what
        it queued), and a referee announces itself only when it connects. Given up for
        good, every match it went on taking was asked for again and ran twice: 2,403
        requests for 1,266 of 20,000 matches in one chaos soak. An acknowledgement of a
        request sent *before* it was given up may trail its death, so that match is
        asked for again.
        """
        lost.pop(referee, None)
        referees_up.add(referee)
        referees_down.pop(referee, None)
        faults.referees_revived.append(referee)
        notice(f"referee {referee} is alive after all (it took {match}): counted on again")

    def on_episode_msg(_topic: str, payload: bytes) -> None:
        for msg in parse_all(payload):
            if not isinstance(msg, WireError):
                on_episode_record(getattr(msg, "record", None))

    def on_episode_record(record: EpisodeRecord | None) -> None:
        if record is None or record.match not in slot_of:
            return  # someone else's run
        match_id = slot_of[record.match]
        owner.pop(record.match, None)
        heard.pop(record.match, None)
        if match_id in episodes:
            faults.duplicates += 1  # a redelivery, or a match asked for again that ran twice
            return
        stopped = record.reason == "voided" and record.detail == SHUTTING_DOWN
        if stopped and voids[match_id] < RERUNS:
            voids[match_id] += 1
            if record.match == current[match_id]:  # not asked for again already
                ask_again(match_id, "voided")  # its referee stopped: not the match's doing
            return
        if record.not_written:
            # The referee cannot write the run's file (a full disk, a broken run
            # directory): every later match would go the same way. Fail now, saying why.
            unwritten.append(f"referee {record.referee} could not write match {match_id}: ")
            unwritten[-1] += record.detail
            all_done.set()
        episodes[match_id] = record
        sent.pop(record.match, None)
        sent.pop(current[match_id], None)
        window.release()
        if on_episode:
            on_episode(record, len(episodes))
        if clock is not None:  # the last one so far: a run stopped early ends here
            clock.ended = time.perf_counter()
        if len(episodes) == len(wanted):
            all_done.set()

    def ask(attempt: str) -> None:
        sent[attempt] = time.monotonic()
        first_asked.setdefault(attempt, sent[attempt])
        # Batched: requests released together (a batch of episodes came back) go out as one message.
        bus.publish(topics.CONTROL_MATCHES, requests[attempt], batch=True)

    def ask_again(match_id: str, why: str) -> None:
        """Ask for ``match_id`` under a new attempt id; the old attempt is forgotten."""
        faults.rerequest_reasons[why] += 1
        tries[match_id] += 1
        old = current[match_id]
        attempt = f"{match_id}.r{tries[match_id]}"
        requests[attempt] = requests[old].model_copy(update={"match": attempt})
        current[match_id] = attempt
        slot_of[attempt] = match_id
        faults.reruns[attempt] = match_id
        sent.pop(old, None)
        owner.pop(old, None)
        heard.pop(old, None)
        ask(attempt)

    async def submit() -> None:
        for match_id, spec in zip(match_ids, specs, strict=True):
            await window.acquire()
            if run_stamp is not None:
                spec = spec.model_copy(update={"run_stamp": run_stamp})
            requests[match_id] = MatchRequest(
                match=match_id, spec=spec, reply_to=me, reply_batches=True, run_key=run_key
            )
            current[match_id] = match_id
            ask(match_id)

    async def resubmit() -> None:
        """Send again what no referee acknowledged: a broker restart can drop a request.

        Safe because referees drop requests for matches they run or ran; with
        several referees, a request lost *after* one referee took it but before
        its "started" event got out could run twice (the runner keeps the first).
        """
        while True:
            await asyncio.sleep(ack_timeout_s / 2)
            now = time.monotonic()
            for attempt, at in list(sent.items()):
                if now - at > ack_timeout_s and slot_of[attempt] not in episodes:
                    faults.resubmitted += 1
                    ask(attempt)
            if bus.connected.is_set():
                ask_accepted_again(now)

    def ask_accepted_again(now: float) -> None:
        """Ask again for accepted matches whose episode and referee have been silent too long.

        Its referee publishes the episode again, says ``running``, or says
        ``forgotten`` (then the match is asked for under a new id at once,
        ``on_ack``). An ask reaches one referee of the shared group, not
        always the owner, which alone answers: so only after ``AGAIN_TRIES``
        silent asks per referee online is the match asked for under a new id
        (its owner silent that long). Counting per referee kept a long match
        under two referees from running twice while it was still playing.
        """
        tries = AGAIN_TRIES * max(1, len(referees_up - lost.keys()))
        for attempt in list(owner):
            if now - heard.get(attempt, now) < episode_wait_s:
                continue
            if unanswered[attempt] >= tries:
                if current[slot_of[attempt]] == attempt:
                    ask_again(slot_of[attempt], "no episode")
                continue
            unanswered[attempt] += 1
            heard[attempt] = now
            faults.asked_again += 1
            again = requests[attempt].model_copy(update={"again": True})
            bus.publish(topics.CONTROL_MATCHES, again, batch=True)

    def lose(referee: str, why: str) -> None:
        """Give ``referee`` up: ask again for every match it accepted and did not finish."""
        if referee in lost:
            return
        lost[referee] = time.monotonic()
        referees_up.discard(referee)
        referees_down.pop(referee, None)
        faults.referees_lost.append(referee)
        mine = [a for a, r in owner.items() if r == referee]
        for attempt in mine:
            del owner[attempt]
            if current[slot_of[attempt]] == attempt:
                ask_again(slot_of[attempt], "referee lost")
        again = (
            f"asked again for its {len(mine)} unfinished match{'' if len(mine) == 1 else 'es'}"
            if mine
            else "it had no unfinished matches"
        )
        notice(f"referee {referee} is gone ({why}); {again}")

    no_referee_since: float | None = None

    async def reconnected() -> None:
        """Restart the grace of every referee seen going offline: the broker was away too.

        A broker that goes down sends the wills of everyone, the referees'
        among them, and they can only say ``online`` again once it is back. The
        grace runs only while the runner itself is connected (``watch_referees``):
        a broker restarting again and again (the chaos soak) kept the runner
        away longer than the grace, and it gave up referees that were fine.
        """
        now = time.monotonic()
        for referee in referees_down:
            referees_down[referee] = now

    def watch_referees() -> None:
        """Lose referees that went away; fail when none is left (``RunError``)."""
        nonlocal no_referee_since
        now = time.monotonic()
        dead: list[str] = []
        if stack is not None:
            dead = [n for n in stack.dead() if n in stack.referees]
            for name in dead:
                code = stack.exit_code(name)
                lose(stack.referees[name], f"its process {name} exited with {code}")
        if bus.connected.is_set():  # disconnected, the runner sees no status: no one's grace runs
            for referee, since in list(referees_down.items()):
                if now - since >= referee_grace_s:
                    lose(referee, f"offline for {referee_grace_s:.0f}s")
        else:
            for referee in referees_down:
                referees_down[referee] = now
        if referees_up - lost.keys():
            no_referee_since = None
            return
        left = len(wanted) - len(episodes)
        if stack is not None and stack.referees and len(dead) == len(stack.referees):
            name = dead[0]
            tail = stack.log_tail(name)
            raise RunError(
                f"referee {name} ({stack.referees[name]}) died (exit code "
                f"{stack.exit_code(name)}) and no referee is left to run the {left} unfinished "
                "matches; the run stops here. "
                + (f"Its log ends:\n{tail}" if tail else "Its log is empty.")
            )
        if no_referee_since is None:
            no_referee_since = now
            notice(f"no referee is online: waiting up to {ready_timeout_s:.0f}s for one")
        elif now - no_referee_since > ready_timeout_s:
            raise RunError(
                f"no referee online for {ready_timeout_s:.0f}s with {left} matches unfinished"
            )

    trace_file = traces_path.open("ab") if traces_path is not None else None

    seated = {m: spec.seats for m, spec in zip(match_ids, specs, strict=True)}
    last_turn: dict[tuple[str, str, int | None], int] = {}  # (attempt, agent, seat) -> turn
    trace_bytes: Counter[str] = Counter()  # agent -> bytes of its traces written
    bound_told = False

    def on_trace(topic: str, payload: bytes) -> None:
        """Record a trace of this run, only as the agent its topic names and only from its seat.

        Any identity may publish on its own ``traces/{agent}`` topic (the ACL
        proves that much), and what it writes inside is its own word: an
        unseated agent could sign its traces "alice". So the sender is the
        topic's agent, the trace must say the same, and the match must seat
        that agent (at ``trace.seat``, when given); anything else is dropped
        and counted in ``backroom_traces_rejected_total``.

        A seated agent's word is bounded too (it could write gigabytes of
        valid traces): a trace over ``MAX_TRACE_BYTES`` is dropped unread;
        each decision is written once: a seat decides its turns in order and
        its traces come in order on one connection, so a turn not after the
        last one written for that seat is a repeat (a redelivery, a replay);
        and the run writes at most ``traces_max_bytes``, then says so once.
        """
        nonlocal bound_told
        if trace_file is None:
            return
        if len(payload) > MAX_TRACE_BYTES:
            metrics.TRACES_REJECTED.labels(reason="oversized").inc()
            return
        try:
            msg = parse(payload, MAX_TRACE_BYTES)
        except WireError:
            return
        if not isinstance(msg, Trace) or msg.match not in slot_of:
            return  # not a trace of this run
        sender = topic.rsplit("/", 1)[-1]
        seats = seated[slot_of[msg.match]]
        key = (msg.match, sender, msg.seat)
        if msg.agent != sender:
            metrics.TRACES_REJECTED.labels(reason="forged").inc()
        elif sender not in seats or (
            msg.seat is not None and not (0 <= msg.seat < len(seats) and seats[msg.seat] == sender)
        ):
            metrics.TRACES_REJECTED.labels(reason="not_seated").inc()
        elif key in last_turn and msg.turn <= last_turn[key]:
            metrics.TRACES_REJECTED.labels(reason="duplicate").inc()
        elif trace_bytes.total() + len(payload) + 1 > traces_max_bytes:
            metrics.TRACES_REJECTED.labels(reason="run_bound").inc()
            if not bound_told:
                bound_told = True
                most = [f"{a} wrote the most ({n:,} bytes)" for a, n in trace_bytes.most_common(1)]
                notice(
                    f"traces.jsonl reached this run's bound of {traces_max_bytes:,} bytes: "
                    f"later traces are not recorded (backroom_traces_rejected_total"
                    f'{{reason="run_bound"}})' + "".join(f"; {m}" for m in most)
                )
        else:
            last_turn[key] = msg.turn
            trace_bytes[sender] += len(payload) + 1
            trace_file.write(payload.rstrip(b"\n") + b"\n")

    taken = asyncio.Event()  # thrown off while claiming the identity: another process has it
    claiming = True

    async def thrown_off() -> None:
        if claiming and claim_window_s > 0 and await broker_reachable(bus_config):
            taken.set()
            await bus.close()  # stay off: the process holding the name keeps it

    try:
        async with Bus(
            bus_config, role="runner", on_connect=[reconnected], on_disconnect=[thrown_off]
        ) as bus:
            try:
                await bus.subscribe(topics.REFEREE_ROSTERS, on_roster)  # retained: before statuses
                await bus.subscribe(topics.ALL_STATUS, on_status)
                if trace_file is not None:
                    await bus.subscribe(topics.ALL_TRACES, on_trace)
                await bus.subscribe(topics.episodes(config.game), on_episode_msg)
                await bus.subscribe(topics.inbox(me), on_ack)
                if claim_window_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(taken.wait(), claim_window_s)
            except (BusError, aiomqtt.MqttError):
                # Cut off mid-subscribe: a raw MqttError traceback was all a clash said.
                if not (claim_window_s > 0 and await broker_reachable(bus_config)):
                    raise
                taken.set()
            claiming = False
            if taken.is_set():
                raise RunError(
                    f"runner identity {me!r} is in use: another process logged in as {me!r} "
                    f"took the connection back while this run was starting (another `backroom "
                    "run` on this broker?). Stop that run, or give this one a runner identity of "
                    f"its own (`backroom credentials add NAME --role runner`)"
                )
            check_ready()
            deadline = time.monotonic() + ready_timeout_s
            slow_at = time.monotonic() + SLOW_START_S
            others = (
                [a.id for a in config.agents if a.kind == EXTERNAL]
                if external is None
                else external
            )
            if [w for w in wait_for if w in others] or not referees_up:
                with contextlib.suppress(TimeoutError):  # the retained "online" of one already up
                    await asyncio.wait_for(ready.wait(), 0.2)
            if awaited := [w for w in wait_for if w in others and w not in online]:
                notice(_waiting_notice(awaited, bus_config, stack, ready_timeout_s))
            while not ready.is_set():
                missing = sorted(set(wait_for) - online) + ([] if referees_up else [no_referee()])
                if slow_at and time.monotonic() > slow_at:
                    slow_at = 0.0
                    left = round(deadline - time.monotonic())
                    notice(f"still waiting for {', '.join(missing)} ({left}s left)")
                if stack is not None and (dead := stack.dead()):
                    raise RunError(
                        f"process {dead[0]} exited before the run started:\n{stack.log_tail(dead[0])}"
                    )
                if stop is not None and stop.is_set():
                    all_done.set()  # Ctrl-C before any match: nothing is asked for
                    break
                if time.monotonic() > deadline:
                    raise RunError(f"not online after {ready_timeout_s}s: {missing}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), 0.1)
            playing = True
            if clock is not None:
                clock.started = time.perf_counter()
            submitter = asyncio.create_task(submit())
            resubmitter = asyncio.create_task(resubmit())

            async def stop_early() -> None:
                if stop is not None:
                    await stop.wait()
                    all_done.set()  # the matches finished so far are the run's result

            relay = asyncio.create_task(stop_early())
            try:
                while not all_done.is_set():
                    if submitter.done() and (error := submitter.exception()) is not None:
                        raise error
                    watch_referees()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(all_done.wait(), 0.2)
            finally:
                submitter.cancel()
                resubmitter.cancel()
                relay.cancel()
            if unwritten:
                raise RunError(f"{unwritten[0]}; the run stops here")
            faults.interrupted = stop is not None and stop.is_set() and len(episodes) < len(wanted)
            await asyncio.sleep(0.2)  # traces of the last decisions are still on their way
    finally:
        if trace_file is not None:  # a failed or stopped run's traces too
            trace_file.close()
    result = [episodes[m] for m in match_ids if m in episodes]
    for departure in faults.departures:
        departure.defaulted = _defaulted(result, departure)
        notice(departure.line())
    return result


def _referee_identity(data: dict[str, Any]) -> str:
    """The identity of the referee that sent an ``accepted`` event: its status topic's name."""
    identity = data.get("identity")
    if isinstance(identity, str):
        return identity
    referee = str(data.get("referee", ""))  # a referee before "identity": "<name>@<host>:<pid>"
    return referee.split("@", 1)[0]


def _defaulted(episodes: Iterable[EpisodeRecord], departure: Departure) -> int:
    """Matches that ended after ``departure.at`` (and began before its return) with a seat of
    its agent defaulted."""
    count = 0
    for ep in episodes:
        if ep.ended_at < departure.at:
            continue
        if departure.back_at is not None and ep.started_at > departure.back_at:
            continue
        if any(ep.seats[seat] == departure.agent for seat in ep.timeouts):
            count += 1
    return count


async def already_online(bus_config: BusConfig, names: Iterable[str]) -> list[str]:
    """Which of ``names`` a retained status says online, read as ``bus_config``.

    ``bus_config`` must be an identity no other process uses (this run's own
    runner): no process can look at a status without logging in, and logging
    in under a name that is online throws its process off (the client id is
    the username). The SUBACK of a second subscription comes after the
    retained statuses of the first.
    """
    wanted = set(names)
    state: dict[str, str] = {}

    def on_status(topic: str, payload: bytes) -> None:
        name = topics.agent_of(topic)
        try:
            msg = parse_status(payload)
        except WireError:
            return
        if name in wanted and isinstance(msg, Status):
            state[name] = msg.state

    async with Bus(bus_config, role="runner") as bus:
        await bus.subscribe(topics.ALL_STATUS, on_status)
        await bus.subscribe(topics.inbox(bus_config.username or "runner"), lambda *_: None)
    return sorted(n for n, s in state.items() if s == "online")


def dedupe_episodes(
    path: Path, kept: Iterable[EpisodeRecord], reruns: dict[str, str] | None = None
) -> int:
    """Keep in ``path`` only the lines of the episodes the runner kept; return how many went.

    A match asked for again (its referee went away, or stopped) may have run
    twice, or left a voided record: the first referee can write its record and
    die before its episode gets out. The runner keeps the first episode it
    received of each match, and the file keeps the same one, in its order.
    ``reruns`` maps the ids a match was asked for again under to its own.
    """
    if not path.exists():
        return 0
    reruns = reruns or {}
    chosen = {reruns.get(ep.match, ep.match): (ep.match, ep.referee) for ep in kept}
    lines = path.read_bytes().splitlines(keepends=True)
    out: list[bytes] = []
    dropped = 0
    for line in lines:
        try:
            record = json.loads(line)
            attempt, referee = record["match"], record["referee"]
        except (ValueError, KeyError, TypeError):
            out.append(line)  # not ours to judge
            continue
        match = reruns.get(attempt, attempt)
        if match in chosen and chosen[match] != (attempt, referee):
            dropped += 1
            continue
        out.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(out))
        os.replace(tmp, path)
    return dropped


def _waiting_notice(
    who: list[str], bus_config: BusConfig, stack: Stack | None, timeout_s: float
) -> str:
    """Whom the run waits for and how they join: their process is not the runner's to start."""
    url = f"mqtt://{bus_config.host}:{bus_config.port}"
    text = f"waiting up to {timeout_s:.0f}s for {', '.join(who)} to connect to {url}"
    if stack is not None and stack.credentials is not None:
        name, whose = (who[0], "its") if len(who) == 1 else ("NAME", "each one's")
        text += f"; `backroom credentials add {name} --dir {stack.credentials.dir}` prints {whose} password"
    return text


async def run_local(
    config: RunConfig,
    runs_dir: str | Path = "runs",
    broker_url: str | None = None,
    credentials_dir: str | Path | None = None,
    on_episode: Callable[[EpisodeRecord, int], None] | None = None,
    spawn: bool = True,
    metrics_port: int = 0,
    on_notice: Callable[[str], None] | None = None,
    ready_timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Start broker (if no URL), referee(s) and agents as processes; run the config; stop them.

    ``spawn=False`` starts nothing: the referee and agents are already running
    (docker compose, other machines) and the run waits for them to be online.
    ``on_notice`` hears whom the run waits for and, when a run on someone
    else's broker fails, which identities it added there (they stay: a process
    may be using them, and ``backroom credentials remove`` takes them away).

    The runner and the referees it starts get identities of this run's own
    (``run_names``), removed again from a broker the run did not start; where
    the run cannot add identities, the fixed ``runner`` and ``referee``. On a
    broker the run did not start, it refuses to start a process whose identity
    a retained status says is online: that process would be thrown off.
    """
    runs, run_dir = _prepare_dirs(runs_dir, config.run)
    # Referees write into the run directory only for requests with its key (only
    # referees read requests; no episode carries it): no other runner can name it.
    run_key = secrets.token_hex(16)
    bind_run_dir(run_dir, run_key)
    stack = Stack(run_dir)
    external: list[str] | None = None  # None: the config's `external` agents
    faults = Faults()
    try:
        names = run_names(config, stack.nonce) if broker_url is None else None
        stack.start_broker(broker_url, credentials_dir, identities(config, names))
        if names is None:  # someone else's broker: our own names only where we can add them
            names = run_names(config, stack.nonce if stack.can_add_identities() else None)
        stack.names = names
        bus_config = stack.identity(names.runner, role="runner", ephemeral=names.own)
        if stack.broker is None:
            if names.own:
                await asyncio.sleep(0.3)  # the broker rereads its files (SIGHUP) before we log in
            if spawn:
                mine = [*names.referees, *(a.id for a in config.agents if a.kind != EXTERNAL)]
                if taken := await already_online(bus_config, mine):
                    raise RunError(
                        f"already online on {stack.url}: {', '.join(taken)}. Another process "
                        "logs in under each (another `backroom run` of these agents?), and "
                        "starting a second one would throw it off the broker: stop it, rename "
                        "the agents, or play with --no-spawn against the running ones"
                    )
        if spawn:
            waiting = start_processes(stack, config, runs, metrics_port)
        else:
            waiting = [a.id for a in config.agents]  # and a referee, any (run_matches)
            external = waiting
        t0 = time.perf_counter()
        clock = PlayClock()
        episodes = await run_matches(
            config,
            bus_config,
            waiting,
            stack,
            on_episode,
            ready_timeout_s=ready_timeout_s,
            traces_path=run_dir / "traces.jsonl",
            clock=clock,
            on_notice=on_notice,
            external=external,
            run_stamp=run_dir.name,
            faults=faults,
            stop=stop,
            # A fixed name (compose's `runner`) may be another run's: claim it first.
            claim_window_s=0.0 if names.own else IDENTITY_WINDOW_S,
            run_key=run_key,
        )
        seconds = time.perf_counter() - t0
        stack.stop()  # the referees write what they still have before the file is checked
        faults.duplicates_on_disk = dedupe_episodes(
            run_dir / "episodes.jsonl", episodes, faults.reruns
        )
        return RunResult(
            config, episodes, seconds, run_dir, stack.url, clock.ended - clock.started, faults
        )
    except BaseException as exc:
        if stack.created and stack.credentials is not None:
            added = (
                f"this run added {', '.join(stack.created)} to {stack.credentials.path}; "
                f"`backroom credentials remove NAME --dir {stack.credentials.dir}` removes one"
            )
            if isinstance(exc, RunError):
                raise RunError(f"{exc}\n{added}") from None
            if on_notice is not None:
                on_notice(added)
        raise
    finally:
        stack.stop()


def _prepare_dirs(runs_dir: str | Path, run: str) -> tuple[Path, Path]:
    """The runs directory and this run's fresh ``runs/<run>/<UTC stamp>/`` (``latest`` points to it).

    Fresh on every run so that a second run, or a failed one, never appends to
    an earlier run's episodes, traces or logs.
    """
    runs = Path(runs_dir).resolve()
    return runs, new_run_dir(runs, run)


def summarize(result: RunResult) -> dict[str, Any]:
    """Per agent: matches, seats, mean raw return and return after the transform per seat,
    timeouts; outcomes; faults (``Faults``: referees lost, matches asked for again,
    duplicates, and each agent that went offline, with the matches its seats were
    defaulted in); ``fallbacks`` per agent (``referee.fallbacks.count_fallbacks``:
    moves that were not its own choice, by reason) and a ``warnings`` line for each
    agent over ``WARN_SHARE`` of them.

    An agent may hold several seats of one match (the beauty contest's 24
    seats, four agents): it played the match once, so ``matches`` counts
    matches and ``seats`` the seats held, over which the means are taken.
    """
    per: dict[str, dict[str, float]] = {}
    outcomes: dict[str, int] = {}
    for ep in result.episodes:
        outcomes[ep.reason] = outcomes.get(ep.reason, 0) + 1
        for agent in dict.fromkeys(ep.seats):
            row = per.setdefault(
                agent, {"matches": 0, "seats": 0, "raw": 0.0, "reward": 0.0, "timeouts": 0}
            )
            row["matches"] += 1
        for seat, agent in enumerate(ep.seats):
            row = per[agent]
            row["seats"] += 1
            row["raw"] += ep.raw_returns[seat]
            row["reward"] += ep.returns[seat]
            row["timeouts"] += ep.timeouts.count(seat)
    for row in per.values():
        n = max(1, int(row["seats"]))
        row["raw"] /= n
        row["reward"] /= n
    faults = {**asdict(result.faults), "rerequested": result.faults.rerequested}
    fallbacks = count_fallbacks(
        (a.agent, fallback_of(a.fallback, a.timed_out))
        for ep in result.episodes
        for a in ep.actions
    )
    return {
        "agents": per,
        "outcomes": outcomes,
        "faults": faults,
        "fallbacks": fallbacks,
        "warnings": warning_lines(fallbacks),
    }
