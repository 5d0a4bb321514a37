"""The bus against a real Mosquitto: identity, ACL, reconnects."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from backroom.bus import topics
from backroom.bus.auth import hash_password
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, BusConfig, BusError, NotAuthorizedError
from backroom.bus.wire import (
    MAX_PAYLOAD_BYTES,
    Action,
    ActionRecord,
    Episode,
    EpisodeRecord,
    MatchSpec,
    WireError,
    dump,
    dump_episode,
    parse,
    parse_all,
)

from .conftest import identity


def test_password_hash_is_what_mosquitto_passwd_writes(tmp_path) -> None:
    path = tmp_path / "pw"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(path), "alice", "s3cret"], check=True)
    theirs = path.read_text().strip().split(":", 1)[1]
    _, _, iterations, salt_b64, _ = theirs.split("$")
    import base64

    ours = hash_password("s3cret", iterations=int(iterations), salt=base64.b64decode(salt_b64))
    assert ours == theirs


async def test_agent_cannot_write_another_outbox_or_read_another_inbox(broker: Broker) -> None:
    alice, bob, ref = (
        identity(broker, "alice"),
        identity(broker, "bob"),
        identity(broker, "referee", "referee"),
    )
    snooped: list[str] = []
    got_own: list[str] = []
    async with Bus(alice) as a, Bus(bob) as b, Bus(ref) as r:
        # bob subscribes to everything; Mosquitto accepts the SUBSCRIBE but filters delivery by ACL.
        await b.subscribe("backroom/v1/#", lambda t, p: snooped.append(t))
        await a.subscribe(topics.inbox("alice"), lambda t, p: got_own.append(t))
        with pytest.raises(NotAuthorizedError, match="refused publish"):
            await a.publish(topics.outbox("bob"), b"{}")
        with pytest.raises(NotAuthorizedError):
            await a.publish(topics.inbox("bob"), b"{}")
        with pytest.raises(NotAuthorizedError):
            await a.publish(topics.CONTROL_MATCHES, b"{}")
        await a.publish(topics.outbox("alice"), b"{}")
        await r.publish(topics.inbox("alice"), b"secret")
        await r.publish(topics.public("m1"), b"public")
        await asyncio.sleep(0.2)
    assert got_own == [topics.inbox("alice")]
    # bob saw the public event and alice's status-less traffic never
    assert topics.inbox("alice") not in snooped
    assert topics.outbox("alice") not in snooped
    assert topics.public("m1") in snooped


async def test_wrong_password_is_refused_with_a_clear_error(broker: Broker) -> None:
    good = identity(broker, "carol")
    bad = BusConfig(
        host=good.host, port=good.port, username="carol", password="nope", connect_timeout_s=3
    )
    with pytest.raises(BusError, match=r"refused login|could not connect"):
        async with Bus(bad):
            pass


async def test_identity_added_while_broker_runs_can_connect(broker: Broker) -> None:
    late = identity(broker, "latecomer")  # writes files and SIGHUPs the broker
    await asyncio.sleep(0.1)
    async with Bus(late) as bus:
        await bus.publish(topics.outbox("latecomer"), b"{}")


async def test_client_reconnects_and_resubscribes_after_broker_restart(broker: Broker) -> None:
    alice, ref = identity(broker, "alice"), identity(broker, "referee", "referee")
    received: list[bytes] = []
    async with Bus(alice) as a, Bus(ref) as r:
        await a.subscribe(topics.inbox("alice"), lambda t, p: received.append(p))
        await r.publish(topics.inbox("alice"), b"before")
        await asyncio.sleep(0.1)
        await asyncio.to_thread(broker.restart, 0.3)
        # publish blocks until the connection is back, then goes through
        await asyncio.wait_for(r.publish(topics.inbox("alice"), b"after"), 15)
        for _ in range(100):
            if b"after" in received:
                break
            await asyncio.sleep(0.05)
        assert a.reconnects >= 1 and r.reconnects >= 1
    assert received[0] == b"before" and b"after" in received


def test_wire_rejects_bad_payloads_with_reasons() -> None:
    with pytest.raises(WireError) as e:
        parse(b"{not json")
    assert e.value.reason == "malformed"
    with pytest.raises(WireError) as e:
        parse(b'{"type": "teleport", "v": 1}')
    assert e.value.reason == "unknown_type"
    with pytest.raises(WireError) as e:
        parse(b'{"type": "action", "v": 1, "turn": -3, "action": 1}')
    assert e.value.reason == "invalid" and "turn" in e.value.detail
    with pytest.raises(WireError) as e:
        parse(b"x" * (MAX_PAYLOAD_BYTES + 1), MAX_PAYLOAD_BYTES)
    assert e.value.reason == "oversized"
    ok = parse(Action(match="m", turn=2, action="raise").model_dump_json())
    assert isinstance(ok, Action) and ok.action == "raise"


def test_a_batch_is_parsed_message_by_message() -> None:
    good = Action(match="m", turn=1, action="call").model_dump_json()
    out = parse_all(f'[{good}, {{"type": "teleport", "v": 1}}, {good}]'.encode())
    assert [type(m).__name__ for m in out] == ["Action", "WireError", "Action"]
    assert isinstance(out[1], WireError) and out[1].reason == "unknown_type"
    assert [type(m).__name__ for m in parse_all(good.encode())] == ["Action"]
    (bad,) = parse_all(b"[{nope")
    assert isinstance(bad, WireError) and bad.reason == "malformed"
    (big,) = parse_all(b"[" + b" " * MAX_PAYLOAD_BYTES + b"]", MAX_PAYLOAD_BYTES)
    assert isinstance(big, WireError) and big.reason == "oversized"


def test_an_episode_around_a_serialised_record_is_the_episode_message() -> None:
    spec = MatchSpec(game="kuhn", params={"variant": "loki"}, seats=["a", "b", "c"], seed=3)
    record = EpisodeRecord(
        match="m:1",
        run="r",
        referee="ref",
        spec=spec,
        game="kuhn",
        params=spec.params,
        seed=3,
        crn_group=None,
        seats=spec.seats,
        actions=[ActionRecord(turn=1, t=1.5, seat=0, agent="a", phase="act", action="call")],
        deliveries=[],
        round_rewards=[[1.0, -1.0, 0.0]],
        raw_returns=[1.0, -1.0, 0.0],
        returns=[1.0, -1.0, 0.0],
        reason="normal",
        started_at=1.0,
        ended_at=2.0,
        final_observations=[{"card": 4, "text": 'quote " é'}],
    )
    payload = dump_episode("m:1", record.model_dump_json().encode())
    msg = parse(payload)
    assert isinstance(msg, Episode) and msg.match == "m:1" and msg.record == record
    reference = Episode(match="m:1", record=record, ts=msg.ts)
    assert payload == dump(reference)  # byte for byte what serialising the whole message gives


async def test_batched_publishes_share_packets_when_busy_keep_order_and_go_at_once_when_not(
    broker: Broker,
) -> None:
    ref, alice = identity(broker, "referee", "referee"), identity(broker, "alice")
    packets: list[bytes] = []
    async with Bus(ref) as r, Bus(alice) as a:
        await a.subscribe(topics.inbox("alice"), lambda t, p: packets.append(p))
        # not busy: each message is on the socket when the call returns, its own packet, a plain JSON object
        r.publish_batched(topics.inbox("alice"), Action(match="m", turn=0, action=0))
        # neither our batch buffer nor paho's send queue holds it: it is in the socket
        assert not r._batches and not r._client._client._out_packet  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
        assert len(packets) == 1 and packets[0].startswith(b"{")
        # a busy process: 300 messages in a few loop iterations leave in far fewer packets, in order
        r.set_busy(True)
        for i in range(300):
            r.publish_batched(topics.inbox("alice"), Action(match="m", turn=i + 1, action=i))
            if i % 100 == 99:
                await asyncio.sleep(0)
        await r.publish(topics.inbox("alice"), Action(match="m", turn=301, action="last"))
        await asyncio.sleep(0.3)
    messages = [m for p in packets for m in parse_all(p)]
    assert [m.turn for m in messages] == list(range(302))  # type: ignore[union-attr]
    assert len(packets) < 20
    assert all(len(p) <= 32 * 1024 for p in packets)
