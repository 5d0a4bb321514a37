"""The move path's structs (``bus.structs``) against ``wire``'s pydantic models.

Traffic is recorded from real matches over a real broker: what a seat's inbox
gets (turns, deliveries, errors, the match's start and end, statuses), and
what the referee reads from the agents' outboxes (actions, chat, a flag).
Every recorded payload is read both ways and must give the same message, the
struct must write the same JSON object the model writes, and a payload the
structs do not take must be refused with the very ``WireError`` the models
give.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backroom.bus import structs, topics, wire
from backroom.bus.broker import Broker
from backroom.bus.wire import Flag, MatchStart

from .conftest import (
    RawAgent,
    Runner,
    agents,
    identity,
    load_factor,
    loki_spec,
    play_raw,
    stack,
)

Tape = list[tuple[str, bytes]]


async def _record(broker: Broker, runs: Path) -> Tape:
    """Three Loki matches with talk (two scripted colluders in ``AgentRunner``s, a raw
    eavesdropper that also flags one match and sends a move for no match): every payload
    the eavesdropper can read, and every payload the referee reads from an outbox."""
    tape: Tape = []
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    async with stack(broker, runs, players) as (ref, _), Runner(broker) as run:
        assert ref.bus is not None
        await ref.bus.subscribe(topics.outbox("+", ref.name), lambda t, p: tape.append((t, p)))
        async with RawAgent(identity(broker, "carol")) as carol:
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(carol, "call", stop))
            ids = [f"w{i}" for i in range(3)]
            for i, m in enumerate(ids):
                await run.submit(m, loki_spec(["a", "b", "carol"], seed=i))
            start = await carol.next_of(MatchStart, timeout=10 * load_factor())
            assert isinstance(start, MatchStart)
            await carol.send(Flag(match=start.match, suspicion=0.5, accused=[0], reason="hm"))
            await run.wait(ids, timeout=30 * load_factor())
            await carol.barrier()  # a move for no match: an Error comes back
            stop.set()
            await driver
            tape.extend(carol.seen)
    return tape


def _messages(payload: bytes) -> list[Any]:
    data = json.loads(payload)
    return data if isinstance(data, list) else [data]


async def test_recorded_traffic_reads_and_writes_the_same(broker: Broker, tmp_path: Path) -> None:
    tape = await _record(broker, tmp_path / "runs")
    kinds: set[str] = set()
    for topic, payload in tape:
        models = wire.parse_all(payload)
        read = structs.parse_all(payload)
        assert len(read) == len(models) == len(_messages(payload)), topic
        for model, got, sent in zip(models, read, _messages(payload), strict=True):
            assert not isinstance(model, wire.WireError), (topic, payload)
            if type(model).__name__ not in {s.__name__ for s in structs.STRUCTS.values()}:
                assert got == model  # no struct for it: the model, as before
                continue
            kinds.add(model.type)
            assert isinstance(got, structs.STRUCTS[model.type]), (topic, payload)
            assert got.v == model.v == wire.SCHEMA_VERSION
            # The same message, both ways, and the same JSON object written.
            assert msgspec.to_builtins(got) == model.model_dump(mode="json") == sent
            assert json.loads(structs.encode(got)) == json.loads(wire.dump(model))
            assert structs.model_of(got) == model
            assert msgspec.json.decode(wire.dump(model), type=type(got)) == got
    assert kinds >= {
        "turn",
        "action",
        "chat",
        "flag",
        "message",
        "error",
        "match_end",
        "event",
        "status",
    }


@pytest.mark.parametrize("kind", sorted(structs.STRUCTS))
def test_each_struct_has_its_models_fields(kind: str) -> None:
    """A field added to a model and not to its struct (or the other way) fails here first."""
    struct = structs.STRUCTS[kind]
    model = structs.MODELS[struct]
    assert list(struct.__struct_fields__) == [f for f in model.model_fields if f != "type"]
    assert model.model_fields["type"].default == kind == struct(**_required(model)).type


def _required(model: type[Any]) -> dict[str, Any]:
    """Any value for each required field (the struct's __init__ checks nothing)."""
    return {n: None for n, f in model.model_fields.items() if f.is_required()}


def test_a_struct_writes_what_its_model_writes() -> None:
    """The referee's and the agents' own messages, built as structs, against the models'
    bytes: the same object, ``type`` moved first, nothing else."""
    turn = dict(
        match="m1",
        seq=3,
        ts=1.5,
        turn=2,
        seat=0,
        phase="act",
        observation={"card": "K", "history": ["pass"], "é": "ü"},
        prompt="You hold K. Bet?",
        legal={"n": 2, "names": ["pass", "bet"]},
        deadline_s=10.0,
    )
    action = dict(match="m1", seq=4, ts=2.0, turn=2, action=[1, {"x": None}], fallback="deadline")
    delivery = dict(
        match="m1", ts=3.0, channel="c", sender="a", sender_seat=0, text="hi 😀", overheard=True
    )
    for struct, fields in [
        (structs.Turn, turn),
        (structs.Action, action),
        (structs.Delivery, delivery),
        (
            structs.Status,
            dict(ts=4.0, state="online", kind="random", batches=True, heartbeat_s=5.0),
        ),
    ]:
        model = structs.MODELS[struct](**fields)
        mine, theirs = structs.encode(struct(**fields)), wire.dump(model)
        assert json.loads(mine) == json.loads(theirs)
        head = f'{{"type":"{model.type}",'.encode()
        assert mine == head + theirs.replace(f',"type":"{model.type}"'.encode(), b"")[1:]


TOO_DEEP = b'{"type":"action","turn":1,"action":' + b"[" * 250 + b"]" * 250 + b"}"
DEEP_BUT_FINE = b'{"type":"action","turn":1,"action":' + b"[" * 150 + b"]" * 150 + b"}"
ACTION = b'{"type":"action","turn":1,"action":0}'
REFUSED = [
    b"not json",
    b"",
    b"{}",
    b'{"type":"nope"}',
    b'{"type":"action","turn":-1,"action":0}',
    b'{"type":"action","turn":1,"action":0,"extra":1}',
    b'{"type":"action","turn":1}',
    b'{"type":"action","turn":1,"action":0,"v":2}',
    b'{"type":"action","turn":1,"action":0,"fallback":"bored"}',
    b'{"type":"chat","channel":"c","text":"' + b"x" * (wire.MAX_CHAT_CHARS + 1) + b'"}',
    b'{"type":"flag","suspicion":1.5}',
    b'{"type":"status","state":"online","heartbeat_s":0}',
    b'{"type":"error","reason":"no_such_reason"}',
    b'{"type":"match_end","seat":0,"returns":[],"raw_returns":[],"reason":"won"}',
    b'{"type":"turn","turn":0,"seat":0,"phase":"sleep","observation":{},"deadline_s":1}',
    b'{"type":"action","turn":1,"action":0,"match":"' + b"m" * 129 + b'"}',
    TOO_DEEP,
    b"[" + b",".join([ACTION] * (wire.MAX_BATCH_MESSAGES + 1)) + b"]",
    b"[" + ACTION + b',{"type":"action"}]',
    b"[" + ACTION + b",3]",
    b"[" + ACTION + b',{"type":"nope"}]',
    b"[[" + ACTION + b"]]",
    b" " * 70_000,
    rb'{"type":"chat","channel":"c","text":"\udc00x"}',  # a lone surrogate
    b'{"type":"action","turn":1,"action":"\xff"}',  # not UTF-8
    ACTION + b" x",
    b"\xef\xbb\xbf" + ACTION,
]
TAKEN = [
    ACTION,
    b"  " + ACTION,
    b"[]",
    b"[" + ACTION + b"," + ACTION + b"]",
    DEEP_BUT_FINE,
    b'{"type":"action","turn":"3","action":0}',  # the models' lax reading: kept as it was
    b'{"type":"action","turn":3.0,"action":0}',
    b"[" + ACTION + b',{"type":"match_start","seat":0,"seats":["a"],"game":"kuhn",'
    b'"turn_timeout_s":1}]',
]


@pytest.mark.parametrize("payload", REFUSED, ids=range(len(REFUSED)))
def test_what_the_models_refuse_is_refused_alike(payload: bytes) -> None:
    """Same reason, same detail: tests/test_fuzz.py and the abuse tests hold for the structs."""
    want = wire.parse_all(payload, wire.MAX_PAYLOAD_BYTES)
    got = structs.parse_all(payload, wire.MAX_PAYLOAD_BYTES)
    assert [type(e) for e in got] == [type(e) for e in want] == [wire.WireError]
    assert [(e.reason, e.detail) for e in got] == [(e.reason, e.detail) for e in want]  # type: ignore[union-attr]


@pytest.mark.parametrize("payload", TAKEN, ids=range(len(TAKEN)))
def test_what_the_models_take_is_taken_alike(payload: bytes) -> None:
    """The same messages, a struct for each of a struct's type (a ``"turn": "3"`` too,
    read by the models and handed on as the struct)."""
    want = wire.parse_all(payload, wire.MAX_PAYLOAD_BYTES)
    got = structs.parse_all(payload, wire.MAX_PAYLOAD_BYTES)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert not isinstance(w, wire.WireError)
        if w.type in structs.STRUCTS:
            assert isinstance(g, structs.STRUCTS[w.type])
            assert msgspec.to_builtins(g) | {"ts": 0} == w.model_dump(mode="json") | {"ts": 0}
        else:
            assert type(g) is type(w)
