"""The processes of a run: its broker, its credentials, its referees and agents.

``backroom run`` and ``backroom train`` start the same processes a user would
start by hand on many machines; ``Stack`` holds them so one ``stop`` ends them
all (a crash cannot leave orphans behind), and ``env_for`` is how a process
learns which broker and identity to use. What to start is a ``StackProcesses``
(agents, referees, how the agents share processes), built from a run config or
a league config: neither has to pose as the other.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from backroom.bus.auth import CredentialStore, Role
from backroom.bus.broker import Broker, die_with_parent, read_pid, reload_broker
from backroom.bus.client import BusConfig
from backroom.model.loading import THREADS_ENV, torch_threads_for
from backroom.runner.config import EXTERNAL, AgentEntry, RunConfig
from backroom.runner.results import RunError


@dataclass(frozen=True)
class StackProcesses:
    """What a stack starts, and nothing of what it plays: ``backroom run`` builds it from a
    run config (``of_run``), the league from its own config, so neither poses as the other.

    ``name`` is the base of the made-up process names (``run_names``); ``paraphrasers``
    the referees' ``--paraphraser`` values (``RunParaphraser.option``).
    """

    name: str
    agents: tuple[AgentEntry, ...]
    referees: int = 1
    agent_processes: Literal["separate", "single"] = "separate"
    paraphrasers: tuple[str, ...] = ()

    @classmethod
    def of_run(cls, config: RunConfig) -> StackProcesses:
        return cls(
            name=config.run,
            agents=tuple(config.agents),
            referees=config.referees,
            agent_processes=config.agent_processes,
            paraphrasers=tuple(p.option() for p in config.paraphrasers),
        )

    @classmethod
    def of(cls, source: StackProcesses | RunConfig) -> StackProcesses:
        """``source`` itself, or a run config's processes (scripts and tests that start a
        stack by hand pass the run config they play)."""
        return source if isinstance(source, StackProcesses) else cls.of_run(source)

    def local(self) -> list[AgentEntry]:
        """The agents this stack starts: all but the ``external`` ones, someone else's."""
        return [a for a in self.agents if a.kind != EXTERNAL]


#: What the stack's functions take: its own input, or a run config (``StackProcesses.of``).
StackSource = StackProcesses | RunConfig


@dataclass(frozen=True)
class RunNames:
    """The identities of a run's own processes: the runner and the referees it starts."""

    runner: str
    referees: tuple[str, ...]
    #: Made up for this run (removed from a broker it did not start when it ends).
    own: bool = False


def run_names(config: StackSource, nonce: str | None = None) -> RunNames:
    """``runner-<run>-<nonce>`` and ``referee-<run>-<nonce>[-<i>]``, or the fixed names.

    The MQTT client id is the username, so two processes under one identity
    throw each other off the broker, round and round: two ``backroom run`` on
    one broker, both as ``runner`` and both starting a ``referee``, both hung.
    A name with a fresh nonce is no other process's. ``nonce=None`` gives the
    fixed ``runner``, ``referee``, ``referee-1``, ...: for a broker whose
    identities the run cannot add (compose's read-only credentials), and for
    scripts that start a stack by hand.
    """
    procs = StackProcesses.of(config)
    if nonce is None:
        referees = tuple("referee" if i == 0 else f"referee-{i}" for i in range(procs.referees))
        return RunNames("runner", referees)
    base = f"{procs.name[:40]}-{nonce}"  # 64 characters at most, with "referee-" and "-99"
    referees = tuple(
        f"referee-{base}" if i == 0 else f"referee-{base}-{i}" for i in range(procs.referees)
    )
    return RunNames(f"runner-{base}", referees, own=True)


#: Where a process the stack starts finds its bus password: a file only its user can read
#: (``Stack.private_file``), named by path; the password itself is in no environment.
PASSWORD_FILE_ENV = "BACKROOM_PASSWORD_FILE"
#: The caller's secrets a spawned process does not inherit: each gets only its own, in a file.
#: (An agent's options cannot name them either: ``agents.llm.key_env_refusal``.)
UNINHERITED_ENV = frozenset(
    {"BACKROOM_PASSWORD", "BACKROOM_PASSWORDS", PASSWORD_FILE_ENV, "BACKROOM_WEB_TOKEN"}
)
#: The folder of a run's password files (mode 0700; removed when the stack stops).
PRIVATE_DIR = "private"


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

    def private_file(self, name: str, text: str) -> Path:
        """``text`` in ``<run dir>/private/<name>``, readable by this user only (0600 in 0700)."""
        folder = self.run_dir / PRIVATE_DIR
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # a file left by an earlier run keeps no wider mode
            f.write(text)
        return path

    def spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        passwords: dict[str, str] | None = None,
    ) -> None:
        """Start ``backroom ARGS`` as process ``name``, its output in ``logs/<name>.log``.

        ``env``'s ``BACKROOM_PASSWORD`` (``env_for``) reaches the process as a file it
        alone is meant to read (``BACKROOM_PASSWORD_FILE``), and ``passwords`` (an agent
        host's, by agent id) as ``--passwords-file``: a password in the environment would
        be every child's and any option's that names a variable (an ``llm`` agent's
        ``api_key_env``) to read.
        """
        env = dict(env)
        if (password := env.pop("BACKROOM_PASSWORD", None)) is not None:
            env[PASSWORD_FILE_ENV] = str(self.private_file(f"{name}.password", password))
        if passwords is not None:
            path = self.private_file(f"{name}.passwords.json", json.dumps(passwords))
            args = [*args, "--passwords-file", str(path)]
        inherited = {k: v for k, v in os.environ.items() if k not in UNINHERITED_ENV}
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = (logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "backroom", *args],
            env={**inherited, **env},
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
        shutil.rmtree(self.run_dir / PRIVATE_DIR, ignore_errors=True)  # their readers are gone


def identities(config: StackSource, names: RunNames | None = None) -> list[tuple[str, Role]]:
    """Every identity a run needs, so a broker we start knows them all from its first second."""
    procs = StackProcesses.of(config)
    names = names or run_names(procs)
    refs: list[tuple[str, Role]] = [(r, "referee") for r in names.referees]
    return [*refs, (names.runner, "runner"), *((a.id, "agent") for a in procs.agents)]


def env_for(cfg: BusConfig) -> dict[str, str]:
    """The environment that points a ``backroom`` process at ``cfg``'s broker, as ``cfg``'s identity.

    Passed in the environment, not on the command line: ``ps`` shows every
    user the arguments of every process, passwords included. ``Stack.spawn``
    moves the password into a file of the run's only that user reads and passes
    its path (``BACKROOM_PASSWORD_FILE``).
    """
    return {
        "BACKROOM_BROKER": f"mqtt://{cfg.host}:{cfg.port}",
        "BACKROOM_USERNAME": cfg.username or "",
        "BACKROOM_PASSWORD": cfg.password or "",
    }


#: Agent kinds that run a torch model in their own process.
MODEL_KINDS = ("local",)


def torch_threads_env(config: StackSource) -> dict[str, str]:
    """``BACKROOM_TORCH_THREADS`` for the agent processes: the cores shared by those that run a
    model at once (torch's default, every core in each, oversubscribes the machine). Empty when
    the caller set it, or no agent runs a model here."""
    procs = StackProcesses.of(config)
    models = [a for a in procs.agents if a.kind in MODEL_KINDS]
    if THREADS_ENV in os.environ or not models:
        return {}
    processes = 1 if procs.agent_processes == "single" else len(models)
    return {THREADS_ENV: str(torch_threads_for(processes))}


class _MetricsPorts:
    """``--metrics-port`` P+1, P+2, ... for each process in the order started (none with P=0)."""

    def __init__(self, first: int) -> None:
        self.ports = iter(range(first + 1, first + 10_000)) if first else None

    def args(self) -> list[str]:
        return ["--metrics-port", str(next(self.ports))] if self.ports else []


def start_processes(
    stack: Stack,
    config: StackSource,
    runs_dir: Path,
    metrics_port: int = 0,
    referees: bool = True,
) -> list[str]:
    """Spawn the referee(s) and agents; return the identities to wait for.

    Agents of kind ``external`` are not started: they are someone else's
    process (a notebook, another machine) and the run waits for them to come
    online (``run_matches`` says so at once). With ``metrics_port`` P, the
    referees and agents serve metrics on P+1, P+2, ... in the order they are
    started.
    """
    procs = StackProcesses.of(config)
    ports = _MetricsPorts(metrics_port)
    waiting = start_referees(stack, procs, runs_dir, ports) if referees else []
    start_agents(stack, procs, ports)
    return [*waiting, *(a.id for a in procs.agents)]


def start_referees(
    stack: Stack, procs: StackProcesses, runs_dir: Path, ports: _MetricsPorts
) -> list[str]:
    """One process per referee name (``referee``, ``referee-1``, ...); their identities."""
    names = stack.names or run_names(procs)
    models = [a for p in procs.paraphrasers for a in ("--paraphraser", p)]
    for i, identity in enumerate(names.referees):
        name = "referee" if i == 0 else f"referee-{i}"  # the process, and its log file
        cfg = stack.identity(identity, role="referee", ephemeral=names.own)
        stack.spawn(
            name, ["referee", "--runs-dir", str(runs_dir), *models, *ports.args()], env_for(cfg)
        )
        stack.referees[name] = identity
    return list(names.referees)


def start_agents(stack: Stack, procs: StackProcesses, ports: _MetricsPorts) -> None:
    """The local agents: one ``agent-host`` for all (``single``), or a process each."""
    local = procs.local()
    for a in procs.agents:
        stack.identity(a.id)  # external agents get their identity too, to be handed out
    threads = torch_threads_env(procs)
    if procs.agent_processes == "single" and local:
        passwords = {a.id: stack.identity(a.id).password or "" for a in local}
        spec = json.dumps([a.model_dump() for a in local])
        env = {"BACKROOM_BROKER": env_for(stack.identity(local[0].id))["BACKROOM_BROKER"]}
        args = ["agent-host", "--spec-json", spec, *ports.args()]
        stack.spawn("agents", args, {**env, **threads}, passwords=passwords)
        return
    for a in local:
        args = ["agent", a.kind, "--id", a.id, "--options-json", json.dumps(a.options)]
        stack.spawn(a.id, [*args, *ports.args()], {**env_for(stack.identity(a.id)), **threads})
