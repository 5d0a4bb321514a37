"""DPO on table talk (the Loki paper's Algorithm 4): pairs from a run, TRL steps on a LoRA adapter.

* the pairing rule on hand-built episodes and traces: only seated agents'
  talk counts, equal returns and identical messages are never paired, each
  distinct message is in at most one pair, best against worst first;
* ``train_dpo``: real TRL DPO steps on a tiny random Qwen2, fed our token ids
  as they are (its first-step log-probs are the base model's of those ids);
  the adapter it saves is trained, loads in peft and in the agents' backend;
* a played run (slow): ``backroom run`` plays Loki Kuhn with two ``local``
  colluders (the tiny Qwen2) talking on a private channel against CFR; its
  pairs are checked against the raw traces, then ``run_dpo`` trains on them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from backroom.bus.wire import ActionRecord, EpisodeRecord, MatchSpec, Trace
from backroom.model.spec import ModelSpec
from backroom.runner.config import ConfigError
from backroom.runs import read_records, resolve_run_dir
from backroom.trainer.config import TrainConfig, load_train_config, parse_train_config
from backroom.trainer.dpo import (
    ADAPTER_NAME,
    METRICS_FILE,
    PAIRS_FILE,
    DpoError,
    Pair,
    _Message,
    pair_group,
    preference_pairs,
    read_talk_traces,
    run_dpo,
    train_dpo,
)
from backroom.trainer.learner import LoraSettings

ROOT = Path(__file__).resolve().parent.parent
SEATS = ["alice", "bob", "carol"]
PROMPT = [11, 12, 13, 14]


# --- hand-built records ---------------------------------------------------------------------


def episode(
    match: str,
    returns: tuple[float, float, float],
    seats: list[str] = SEATS,
    reason: str = "normal",
    timed_out: bool = False,
) -> EpisodeRecord:
    """Turn 1: seat 0 talks; turn 2: seat 0 acts; turn 3: seat 1 talks; turn 4: seat 1 acts."""
    actions = [
        ActionRecord(
            turn=t,
            t=float(t),
            seat=s,
            agent=seats[s],
            phase=p,
            action="x",  # type: ignore[arg-type]
            timed_out=timed_out and p == "talk",
        )
        for t, s, p in [(1, 0, "talk"), (2, 0, "act"), (3, 1, "talk"), (4, 1, "act")]
    ]
    return EpisodeRecord(
        match=match,
        run="hand",
        referee="referee",
        spec=MatchSpec(game="kuhn", params={"variant": "loki"}, seats=seats),
        game="kuhn",
        params={"variant": "loki"},
        seed=0,
        crn_group=None,
        seats=seats,
        actions=actions,
        deliveries=[],
        round_rewards=[list(returns)],
        raw_returns=list(returns),
        returns=list(returns),
        reason=reason,  # type: ignore[arg-type]
        started_at=0.0,
        ended_at=1.0,
    )


def talk(
    agent: str,
    match: str,
    completion: list[int],
    seat: int | None = 0,
    turn: int = 1,
    prompt: list[int] = PROMPT,
    phase: str = "talk",
) -> Trace:
    return Trace(
        agent=agent,
        match=match,
        turn=turn,
        seat=seat,
        phase=phase,  # type: ignore[arg-type]
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        logprobs=[-1.0] * len(completion),
        reply={"message": f"said {completion}"},
    )


def test_pairs_prefer_the_message_that_earned_more() -> None:
    episodes = [episode("m1", (1.0, 1.0, -2.0)), episode("m2", (-1.0, -1.0, 2.0))]
    traces = [talk("alice", "m1", [5, 6]), talk("alice", "m2", [7])]
    stats: dict[str, int] = {}
    (pair,) = preference_pairs(episodes, traces, stats=stats)
    assert pair == Pair(
        PROMPT, [5, 6], [7], 1.0, -1.0, seat=0, chosen_text="said [5, 6]", rejected_text="said [7]"
    )
    assert stats == {"talk_used": 2, "states": 1, "states_paired": 1}
    assert Pair.from_json(json.loads(json.dumps(pair.to_json()))) == pair


def test_only_seated_agents_count_and_seat_comes_from_the_episode() -> None:
    episodes = [episode("m1", (1.0, 1.0, -2.0)), episode("m2", (-1.0, -1.0, 2.0))]
    good = talk("alice", "m1", [5])
    forged = [
        talk("mallory", "m2", [7]),  # not in the match at all
        talk("carol", "m2", [7], seat=0),  # in the match, but not at seat 0
        talk("bob", "m2", [7], seat=0),  # a colluder claiming his partner's seat
        talk("bob", "m2", [7], seat=1),  # his own seat, but seat 1 did not talk at turn 1
        talk("alice", "m2", [7], seat=None, turn=2),  # turn 2 was alice's action, not talk
    ]
    stats: dict[str, int] = {}
    assert preference_pairs(episodes, [good, *forged], stats=stats) == []
    assert stats == {
        "talk_used": 1,
        "talk_not_seated": 3,
        "talk_no_talk_turn": 2,
        "states": 1,
        "states_paired": 0,
    }
    # a seat-less trace is placed by the episode: alice holds seat 0, which talked at turn 1
    (pair,) = preference_pairs(episodes, [good, talk("alice", "m2", [7], seat=None)])
    assert (pair.seat, pair.chosen_ids, pair.rejected_ids) == (0, [5], [7])
    # an agent holding two seats (self-play): the turn says which one spoke
    selfplay = ["alice", "alice", "carol"]
    twice = [
        episode(m, r, seats=selfplay)
        for m, r in [("s1", (1.0, 1.0, -2.0)), ("s2", (0.0, 0.0, 0.0))]
    ]
    (pair,) = preference_pairs(
        twice, [talk("alice", "s1", [5], None, 3), talk("alice", "s2", [7], None, 3)]
    )
    assert (pair.seat, pair.chosen_ids) == (1, [5])
    # bob at his own seat and turn is a different information state from alice's
    stats = {}
    assert (
        preference_pairs(episodes, [good, talk("bob", "m2", [7], seat=1, turn=3)], stats=stats)
        == []
    )
    assert stats["states"] == 2


def test_no_pair_from_equal_returns_identical_messages_or_broken_matches() -> None:
    same = [episode("m1", (1.0, 1.0, -2.0)), episode("m2", (1.0, 1.0, -2.0))]
    assert preference_pairs(same, [talk("alice", "m1", [5]), talk("alice", "m2", [7])]) == []
    differ = [episode("m1", (1.0, 1.0, -2.0)), episode("m2", (-1.0, -1.0, 2.0))]
    assert preference_pairs(differ, [talk("alice", "m1", [5]), talk("alice", "m2", [5])]) == []
    # different prompts are different information states
    assert (
        preference_pairs(differ, [talk("alice", "m1", [5]), talk("alice", "m2", [7], prompt=[9])])
        == []
    )
    # a timed-out talk turn, a voided match, act traces and empty (fallback) messages do not count
    stats: dict[str, int] = {}
    broken = [
        episode("m1", (1.0, 1.0, -2.0)),
        episode("m2", (-1.0, -1.0, 2.0), timed_out=True),
        episode("m3", (-1.0, -1.0, 2.0), reason="voided"),
    ]
    traces = [
        talk("alice", "m1", [5]),
        talk("alice", "m2", [7]),
        talk("alice", "m3", [8]),
        talk("alice", "m1", [9], turn=2, phase="act"),
        talk("alice", "m2", []),
    ]
    assert preference_pairs(broken, traces, stats=stats) == []
    assert stats == {
        "episode_not_normal": 1,
        "talk_used": 1,
        "talk_timed_out": 1,
        "talk_no_episode": 1,
        "talk_empty": 1,
        "states": 1,
        "states_paired": 0,
    }
    # a duplicated trace (at-least-once delivery) counts once
    stats = {}
    preference_pairs(differ, [talk("alice", "m1", [5]), talk("alice", "m1", [5])], stats=stats)
    assert stats["talk_duplicate"] == 1


def test_message_values_are_mean_returns_and_each_message_pairs_once() -> None:
    def msg(ids: int, *returns: float) -> _Message:
        return _Message((ids,), "", list(returns))

    # values: a 3, b 2, c 1, d 0, e 0 -> (a, worst 0), (b, other 0); c is left over
    pairs = pair_group([msg(3, 0.0), msg(1, 1.0), msg(4, 3.0), msg(2, 2.0), msg(5, 0.0)])
    assert [(c.ids, r.ids) for c, r in pairs] == [((4,), (5,)), ((2,), (3,))]
    assert pair_group([msg(1, 1.0), msg(2, 1.0), msg(3, 1.0)]) == []
    assert [(c.ids, r.ids) for c, r in pair_group([msg(1, 2.0), msg(2, 2.0), msg(3, 0.0)])] == [
        ((1,), (3,))
    ]
    # a message sent twice is valued at its mean return
    episodes = [episode(f"m{i}", (r, r, -2 * r)) for i, r in enumerate([2.0, 0.0, 0.5])]
    traces = [talk("alice", "m0", [5]), talk("alice", "m1", [5]), talk("alice", "m2", [7])]
    (pair,) = preference_pairs(episodes, traces)
    assert (pair.chosen_ids, pair.chosen_return, pair.chosen_count) == ([5], 1.0, 2)
    assert (pair.rejected_ids, pair.rejected_return, pair.rejected_count) == ([7], 0.5, 1)


def test_max_pairs_keeps_the_largest_margins() -> None:
    episodes, traces = [], []
    for k, (hi, lo) in enumerate([(1.0, 0.0), (3.0, -3.0), (2.0, 1.0)]):
        prompt = [100 + k]
        for j, r in enumerate((hi, lo)):
            match = f"m{k}-{j}"
            episodes.append(episode(match, (r, r, -2 * r)))
            traces.append(talk("alice", match, [j + 1], prompt=prompt))
    assert [p.margin for p in preference_pairs(episodes, traces)] == [1.0, 6.0, 1.0]
    stats: dict[str, int] = {}
    kept = preference_pairs(episodes, traces, max_pairs=2, stats=stats)
    assert [p.prompt_ids for p in kept] == [[100], [101]] and stats["pairs_cut"] == 1


def dpo_config(source: Path | str, model: Path | str | None = None, **dpo: Any) -> TrainConfig:
    data: dict[str, Any] = {
        "run": "dpo",
        "game": "kuhn",
        "params": {"variant": "loki"},
        "algorithm": "dpo",
        "dpo": {"source": str(source), **dpo},
    }
    if model is not None:
        data["model"] = {"path": str(model), "device": "cpu"}
        data["lora"] = {"rank": 4, "alpha": 8}
    return parse_train_config(data)


def test_run_dpo_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(DpoError, match=r"dpo\.source: .*nowhere/episodes.jsonl not found"):
        run_dpo(dpo_config(tmp_path / "nowhere"), tmp_path / "out")
    # the settings are checked when the config loads, not when training starts
    with pytest.raises(ConfigError, match=r"dpo\.bta: Extra inputs are not permitted"):
        dpo_config(tmp_path, bta=0.1)
    with pytest.raises(ConfigError, match=r"dpo\.source: Field required"):
        parse_train_config({"game": "kuhn", "algorithm": "dpo", "dpo": {}})
    with pytest.raises(ConfigError, match=r"algorithm: dpo needs dpo: \{source: RUN_DIR\}"):
        parse_train_config({"game": "kuhn", "algorithm": "dpo"})
    with pytest.raises(ConfigError, match=r"dpo: only algorithm: dpo reads it"):
        parse_train_config(
            {"game": "ipd", "algorithm": "grpo", "preset": "ipd", "dpo": {"source": "runs/x"}}
        )
    source = tmp_path / "run"
    source.mkdir()
    same = [episode("m1", (1.0, 1.0, -2.0)), episode("m2", (1.0, 1.0, -2.0))]
    (source / "episodes.jsonl").write_text(
        "".join(e.model_dump_json() + "\n" for e in same) + '{"torn'
    )
    traces = [talk("alice", "m1", [5]), talk("alice", "m2", [7]), talk("mallory", "m2", [8])]
    (source / "traces.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in traces))
    with pytest.raises(
        DpoError,
        match=r"dpo\.source: no preference pair .* 2 talk decisions in 1 "
        r"information states.*talk_not_seated 1, unreadable_lines 1",
    ):
        run_dpo(dpo_config(source), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_example_config_loads() -> None:
    config = load_train_config(ROOT / "examples" / "kuhn_dpo.yaml")
    settings = config.dpo
    assert settings is not None
    assert config.algorithm == "dpo" and config.params == {"variant": "loki"}
    assert (
        settings.beta,
        settings.lr,
        settings.epochs,
        settings.batch_size,
        settings.max_pairs,
    ) == (0.1, 5e-5, 1.0, 4, 10_000)


# --- real TRL steps on a tiny Qwen2 -------------------------------------------------------------


def check_adapter(folder: Path, model: Path, pair: Pair) -> None:
    """A saved DPO adapter: trained (LoRA B left zero), a peft adapter, loadable by the agents."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from backroom.model.backend import Backend

    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    weights = load_file(str(folder / "adapter_model.safetensors"))
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and any(float(w.abs().max()) > 0 for w in lora_b)  # peft starts B at zero
    base = AutoModelForCausalLM.from_pretrained(str(model))
    ids = torch.tensor([pair.prompt_ids + pair.chosen_ids])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, str(folder))(input_ids=ids).logits
    assert not torch.allclose(before, after)
    backend = Backend(
        ModelSpec(path=str(model), device="cpu")
    ).load()  # as an agent loads a checkpoint
    backend.load_adapter("dpo", str(folder))
    assert backend.adapters == {"dpo": str(folder)}


def test_train_dpo_steps_on_the_exact_token_ids(tiny_qwen_model: Path, tmp_path: Path) -> None:
    """TRL scores our ids as they are: its first-step log-probs are the base model's of our ids."""
    from backroom.model.backend import Backend

    backend = Backend(ModelSpec(path=str(tiny_qwen_model), device="cpu")).load()
    ace = backend.encode_chat([{"role": "user", "content": "Your card is the Ace. Message?"}])
    ten = backend.encode_chat([{"role": "user", "content": "Your card is the 10. Message?"}])
    pairs = [
        Pair(
            ace,
            backend.completion_ids("raise, I hold the Ace"),
            backend.completion_ids("fold"),
            1.0,
            -1.0,
        ),
        # cut short like a `length` finish: no end token, and none is added
        Pair(ten, backend.encode("I fold"), backend.encode("raise raise raise"), 0.5, -2.0, seat=1),
    ]
    scored = backend.score_batch(
        [(p.prompt_ids, [p.chosen_ids, p.rejected_ids], None) for p in pairs]
    )
    chosen = sum(s[0].total for s in scored) / 2
    rejected = sum(s[1].total for s in scored) / 2
    folder = tmp_path / "adapters" / "dpo-v1"
    metrics = train_dpo(
        pairs,
        model=ModelSpec(path=str(tiny_qwen_model), device="cpu"),
        out_dir=folder,
        lora=LoraSettings(rank=4, alpha=8),
        beta=0.5,
        lr=1e-2,
        max_steps=3,
        batch_size=2,
        seed=1,
    )
    assert metrics["steps"] == 3 and metrics["pairs"] == 2
    assert math.isclose(metrics["logps/chosen_first"], chosen, rel_tol=1e-3)
    assert math.isclose(metrics["logps/rejected_first"], rejected, rel_tol=1e-3)
    assert math.isclose(metrics["loss_first"], math.log(2), rel_tol=1e-4)  # policy == reference
    assert metrics["rewards/chosen_first"] == metrics["rewards/rejected_first"] == 0.0
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "grad_norm"):
        assert math.isfinite(metrics[key]), key
    assert metrics["loss_last"] < metrics["loss_first"] and metrics["rewards/margins_last"] > 0
    check_adapter(folder, tiny_qwen_model, pairs[0])


# --- a played run, end to end ------------------------------------------------------------------

PLAY = """
run: talk
game: kuhn
params: {{variant: loki}}
matches: {matches}
seed: 0
concurrency: 10
turn_timeout_s: 60
agent_processes: single
agents:
  - {{id: alice, kind: local, options: {opts}}}
  - {{id: bob, kind: local, options: {opts}}}
  - {{id: carol, kind: cfr, options: {{policy: kuhn_loki_cfr}}}}
seats: [alice, bob, carol]
channels:
  - {{name: colluders, members: [alice, bob], eavesdroppers: [carol], opens: before_act, max_messages: 1}}
transform: {{kind: coalition, members: [alice, bob]}}
"""


@pytest.mark.slow
def test_dpo_on_a_played_loki_run(tiny_qwen_model: Path, tmp_path: Path) -> None:
    """``backroom run`` as a user runs it (Loki Kuhn, two local colluders who talk, CFR third),
    then ``run_dpo`` on it: the pairs are checked against the raw traces, and TRL trains."""
    from backroom.model.adapters import adapter_digest

    runs = tmp_path / "runs"
    runs.mkdir()
    opts = json.dumps(
        {"model": str(tiny_qwen_model), "device": "cpu", "max_new_tokens": 6, "temperature": 1.0}
    )
    (runs / "talk.yaml").write_text(PLAY.format(matches=24, opts=opts))
    proc = subprocess.run(
        [sys.executable, "-m", "backroom", "run", str(runs / "talk.yaml"), "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    played = resolve_run_dir(runs / "talk")  # the run's own directory, runs/talk/<UTC time>
    assert played.parent == runs / "talk"

    episodes = list(read_records(played / "episodes.jsonl"))
    assert len(episodes) == 24 and all(e.reason == "normal" for e in episodes)
    raw = [
        Trace.model_validate_json(line)
        for line in (played / "traces.jsonl").read_text().splitlines()
    ]
    talks = [t for t in raw if t.phase == "talk"]
    assert talks and {t.agent for t in talks} == {"alice", "bob"}
    pairs = preference_pairs(episodes, read_talk_traces(played / "traces.jsonl"))
    assert pairs, "24 matches of Loki Kuhn repeat some information state with different outcomes"

    # Every pair against the raw traces: same seat, same prompt ids, both messages really sent
    # from that state by the agent seated there, and the chosen one earned more on average.
    by_match = {e.match: e for e in episodes}
    sent: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[float]] = defaultdict(list)
    for t in talks:
        e = by_match[t.match or ""]
        assert t.seat is not None and e.seats[t.seat] == t.agent
        sent[(t.seat, tuple(t.prompt_ids), tuple(t.completion_ids))].append(e.returns[t.seat])
    for p in pairs:
        chosen = sent[(p.seat, tuple(p.prompt_ids), tuple(p.chosen_ids))]
        rejected = sent[(p.seat, tuple(p.prompt_ids), tuple(p.rejected_ids))]
        assert chosen and rejected and p.chosen_ids != p.rejected_ids
        assert math.isclose(p.chosen_return, sum(chosen) / len(chosen))
        assert math.isclose(p.rejected_return, sum(rejected) / len(rejected))
        assert p.chosen_return > p.rejected_return
        assert p.seat in (0, 1)  # only the colluders are local agents that talk

    # `backroom train` with algorithm: dpo, in-process: TRL steps on a fresh LoRA adapter
    out = tmp_path / "train"
    config = dpo_config(
        runs / "talk", tiny_qwen_model, lr=1e-2, max_steps=2, batch_size=1, beta=0.5
    )  # runs/talk stands for its latest run
    summary = run_dpo(config, out)
    assert f"{len(pairs)} preference pairs" in summary and "2 TRL DPO steps" in summary
    lines = (out / PAIRS_FILE).read_text().splitlines()
    assert [Pair.from_json(json.loads(x)) for x in lines] == pairs
    report = json.loads((out / METRICS_FILE).read_text())
    assert report["source"] == str(played.resolve())
    metrics = report["metrics"]
    assert metrics["steps"] == 2 and metrics["pairs"] == len(pairs)
    assert report["data"]["talk_used"] == len(talks)
    assert math.isclose(metrics["loss_first"], math.log(2), rel_tol=1e-4)
    assert all(math.isfinite(metrics[k]) for k in ("loss", "rewards/accuracies", "rewards/margins"))
    folder = out / "adapters" / ADAPTER_NAME
    assert (report["sha256"], report["size"]) == adapter_digest(folder)
    check_adapter(folder, tiny_qwen_model, pairs[0])


def test_dpo_config_through_the_cli_reports_a_missing_source(tmp_path: Path) -> None:
    """``backroom train`` with a dpo config whose source is not there fails naming ``dpo.source``."""
    config = tmp_path / "dpo.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": "dpo",
                "game": "kuhn",
                "params": {"variant": "loki"},
                "algorithm": "dpo",
                "dpo": {"source": str(tmp_path / "no-such-run")},
            }
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "backroom",
            "train",
            str(config),
            "--run-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "dpo.source" in proc.stdout + proc.stderr, textwrap.shorten(proc.stderr, 2000)
