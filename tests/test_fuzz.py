"""Fuzz the referee's input over the real broker: it never crashes and every match ends."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.referee.budgets import ERROR_BURST

from .conftest import RawAgent, Runner, agents, identity, loki_spec, play_raw, stack

MATCHES = [f"f{i}" for i in range(8)]
TYPES = [
    "action",
    "chat",
    "turn",
    "episode",
    "status",
    "match_request",
    "error",
    "message",
    "nope",
    "",
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
messages = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES)},
    optional={
        "v": st.sampled_from([1, 2, "1", None]),
        "match": st.sampled_from(MATCHES) | st.text(max_size=12) | st.integers(),
        "seq": st.integers(-3, 10**12),
        "turn": st.integers(-2, 40) | st.text(max_size=3) | st.none(),
        "seat": st.integers(-1, 4) | st.none(),
        "action": json_values | st.sampled_from(["fold", "call", "raise", 0, 1, 2, 3]),
        "channel": st.sampled_from(["colluders", "table", "x"]) | st.text(max_size=6),
        "text": st.text(max_size=600),
        "ts": st.floats() | st.text(max_size=3),
        "extra": json_values,
    },
)
payloads = (
    st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v).encode())
    | messages.map(lambda m: json.dumps(m).encode())
)


class LoopThread:
    """An event loop in a thread, so hypothesis (synchronous) can drive async clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_fuzzed_outbox_never_breaks_the_referee(broker: Broker, tmp_path: Path) -> None:
    lt = LoopThread()
    ctx: dict[str, Any] = {}

    async def setup() -> None:
        ctx["stack"] = stack(
            broker, tmp_path / "runs", agents(("a", "kuhn-colluder"), ("b", "random"))
        )
        ctx["ref"], _ = await ctx["stack"].__aenter__()
        ctx["run"] = await Runner(broker).__aenter__()
        # she reads only her inbox: a payload sent while nobody reads her outbox is unheard
        mallory = RawAgent(identity(broker, "mallory"), reads=topics.inbox("mallory"))
        ctx["mal"] = await mallory.__aenter__()
        # read for the whole storm, as if seated in a match that lasts it: her matches
        # below end before it does, and a referee reads only seated agents' outboxes
        await ctx["ref"].outboxes.seat(["mallory"])
        ctx["stop"] = asyncio.Event()
        ctx["driver"] = asyncio.create_task(play_raw(ctx["mal"], "raise", ctx["stop"]))
        for i, m in enumerate(MATCHES):
            # mallory sits in seat 1 of a colluding match: she is asked to talk and to act
            await ctx["run"].submit(m, loki_spec(["a", "mallory", "b"], seed=i, turn_timeout_s=2))

    lt.run(setup())
    sent = 0
    dropped_before = REGISTRY.get_sample_value("backroom_errors_dropped_total") or 0.0
    # On a loaded machine the referee's CPU share per sender runs out too: payloads then go
    # unread, counted in their own metric (``Budgets``), and the unread are no silent loss.
    unread_before = REGISTRY.get_sample_value("backroom_inputs_dropped_total") or 0.0

    @settings(
        max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(payload=payloads)
    def fuzz(payload: bytes) -> None:
        nonlocal sent
        lt.run(ctx["mal"].send(payload))
        sent += 1

    try:
        fuzz()

        async def finish() -> list[Any]:
            eps = await ctx["run"].wait(MATCHES, timeout=60)
            # the referee still takes new matches after the storm
            await ctx["run"].submit("after", loki_spec(["a", "mallory", "b"], seed=99))
            eps += await ctx["run"].wait(["after"], timeout=30)
            return eps

        eps = lt.run(finish(), timeout=120)
    finally:

        async def teardown() -> None:
            ctx["stop"].set()
            await ctx["driver"]
            await ctx["mal"].__aexit__(None, None, None)
            await ctx["run"].__aexit__(None, None, None)
            await ctx["stack"].__aexit__(None, None, None)

        lt.run(teardown())
        lt.close()
    assert sent == 2500
    assert all(ep.reason in ("normal", "timeout") for ep in eps)
    assert all(sum(ep.raw_returns) == 0 for ep in eps)
    errors = ctx["mal"].of(__import__("backroom.bus.wire", fromlist=["Error"]).Error)
    reasons = {e.reason for e in errors}
    # the storm was answered, with reasons, up to mallory's error budget; past it
    # the errors were dropped and counted, not silently
    dropped = (REGISTRY.get_sample_value("backroom_errors_dropped_total") or 0.0) - dropped_before
    unread = (REGISTRY.get_sample_value("backroom_inputs_dropped_total") or 0.0) - unread_before
    assert len(errors) >= ERROR_BURST
    # and what she sent while the referee had stopped reading her (muted past her input
    # budget, a line in its log) the broker took with nobody subscribed, and said so
    unheard = ctx["mal"].unheard
    # all but the few payloads that were valid messages (9 to 14 of 2,500 in three runs)
    accounted = len(errors) + dropped + unread + unheard
    assert accounted > 0.8 * sent, (len(errors), dropped, unread, unheard)
    assert {"malformed", "unknown_type", "invalid"} <= reasons
