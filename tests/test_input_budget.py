"""What one identity may send the referee is budgeted: a flood is dropped unread, others play on.

(Issue finding: a 20,000-message burst from one agent cut everyone's
throughput by ~60% for seconds.) Each payload is charged the loop time it
took (``WorkBudget``, issue 22: bytes were the wrong price); past
``input_burst_s`` (then ``input_share`` of each second) a payload is dropped
before it is parsed, counted in ``backroom_inputs_dropped_total``, and
answered by one ``rate_limited`` error out of the sender's error budget,
and the sender is not read until its budget is full again; another
identity's budget is its own.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

from backroom.bus.broker import Broker
from backroom.bus.wire import Error
from backroom.referee.service import Referee

from .conftest import RawAgent, drained, identity


def dropped() -> float:
    return REGISTRY.get_sample_value("backroom_inputs_dropped_total") or 0.0


async def test_a_flood_is_dropped_unread_and_counted_and_others_are_served(
    broker: Broker, tmp_path: Path
) -> None:
    before = dropped()
    config = identity(broker, "referee", "referee")
    async with (
        Referee(config, runs_dir=tmp_path / "runs", input_burst_s=1.0, input_share=1e-9) as ref,
        RawAgent(identity(broker, "mallory")) as mal,
        RawAgent(identity(broker, "trent")) as trent,
    ):
        await ref.outboxes.seat(["mallory", "trent"])  # as if seated: only those are read
        await drained(ref)  # their statuses are in
        ref.budgets.input(
            "mallory"
        ).tokens = 1e-9  # a flood's end: one more payload, whatever it costs
        junk = b"{nope" + b" " * 995  # 1,000 bytes, malformed
        for _ in range(10):
            await mal.send(junk)
        await trent.send(b"{nope")
        await mal.barrier(ref)
        await trent.barrier(ref)
        assert "mallory" in ref.outboxes.muted  # and not read until its budget is full again
    reasons = [e.reason for e in mal.of(Error)]
    # One payload was judged and charged what it took; the next was dropped unread and
    # mallory unsubscribed, and those the broker had sent before that were dropped too.
    assert reasons.count("malformed") == 1
    assert 1 <= reasons.count("rate_limited") <= 9
    assert dropped() - before == reasons.count("rate_limited")
    assert [e.reason for e in trent.of(Error)] == ["malformed"]  # its own budget
