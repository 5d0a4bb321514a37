"""Channel interventions: each one by hand, then on a real broker with what each reader got.

docs/collusion.md says what each does; the rules (``referee.interventions.apply``)
are pure, so each is a test of its own, and the referee's routing is tested
over the bus: the members' copies, the eavesdropper's own list, the record's
``sent`` and ``changed_by``, and the same seed losing the same messages.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from backroom.bus.broker import Broker, free_port
from backroom.bus.wire import ChannelSpec, Delivery, EpisodeRecord, Intervention
from backroom.referee.interventions import BudgetLedger, apply
from backroom.runner.config import ConfigError, parse_config

from .conftest import (
    agents,
    load_factor,
    loki_hands,
)

STEPS: TypeAdapter[list[Intervention]] = TypeAdapter(list[Intervention])


def one(steps: list[dict[str, Any]], text: str, message: int = 0, **kw: Any) -> Any:
    args: dict[str, Any] = dict(match_seed=7, channel="c", message=message, seat=0)
    args.update(audience="members", ledger=BudgetLedger())
    args.update(kw)
    return apply(STEPS.validate_python(steps), text, **args)


def test_redact_replaces_every_match_of_every_pattern() -> None:
    got = one([{"kind": "redact", "patterns": [r"\d", r"(?i)\bking\b"]}], "King 3, king 14")
    assert got.text == "[redacted] [redacted], [redacted] [redacted][redacted]"
    assert got.changed_by == ["redact"]
    untouched = one([{"kind": "redact", "patterns": [r"\d"]}], "no numbers")
    assert untouched.text == "no numbers" and untouched.changed_by == []


def test_budgets_cut_by_chars_words_and_bits_per_message() -> None:
    assert one([{"kind": "budget", "chars": 5}], "abcdefgh").text == "abcde"
    assert one([{"kind": "budget", "tokens": 2}], "my  card is 3").text == "my  card"
    assert one([{"kind": "budget", "tokens": 0}], "my card").text == ""
    # 8 bits per UTF-8 byte, cut at a character's end: "é" is two bytes
    assert one([{"kind": "budget", "bits": 24}], "aéb").text == "aé"
    assert one([{"kind": "budget", "bits": 16}], "aéb").text == "a"
    assert one([{"kind": "budget", "chars": 50}], "short").changed_by == []


def test_a_per_match_budget_is_spent_across_messages_per_sender() -> None:
    ledger = BudgetLedger()
    steps = [{"kind": "budget", "chars": 6, "per": "match"}]
    first = one(steps, "abcd", ledger=ledger)
    second = one(steps, "efgh", message=1, ledger=ledger)
    third = one(steps, "ijkl", message=2, ledger=ledger)
    other = one(steps, "mnop", message=3, seat=1, ledger=ledger)  # another sender's own budget
    assert [first.text, second.text, third.text, other.text] == ["abcd", "ef", "", "mnop"]


def test_drop_is_drawn_from_the_seed_and_stops_the_list() -> None:
    steps = [{"kind": "drop", "p": 0.3}, {"kind": "redact", "patterns": ["x"]}]
    runs = [[one(steps, "x", message=i).delivered for i in range(400)] for _ in range(2)]
    assert runs[0] == runs[1]  # the same seed loses the same messages
    lost = runs[0].count(False) / 400
    assert 0.22 < lost < 0.38
    dropped = next(one(steps, "x", message=i) for i in range(400) if not runs[0][i])
    assert dropped.changed_by == ["drop"]  # the redact after it never ran
    other_seed = [one(steps, "x", message=i, match_seed=8).delivered for i in range(400)]
    assert other_seed != runs[0]
    assert all(one([{"kind": "drop", "p": 0.0}], "x", message=i).delivered for i in range(50))
    assert not any(one([{"kind": "drop", "p": 1.0}], "x", message=i).delivered for i in range(50))


def test_delay_and_shuffle_change_when_and_from_whom_not_what() -> None:
    got = one([{"kind": "delay", "turns": 2}, {"kind": "shuffle_roles"}], "hi")
    assert (got.text, got.delay, got.anonymous) == ("hi", 2, True)
    assert got.changed_by == ["delay", "shuffle_roles"]
    assert one([{"kind": "delay", "turns": "end"}], "hi").delay == "end"


@pytest.mark.parametrize(
    ("step", "field"),
    [
        ({"kind": "redact", "patterns": ["("]}, "interventions.0.redact.patterns"),
        ({"kind": "redact", "patterns": []}, "interventions.0.redact.patterns"),
        ({"kind": "budget"}, "interventions.0.budget"),
        ({"kind": "budget", "chars": 3, "tokens": 1}, "interventions.0.budget"),
        ({"kind": "delay", "turns": 0}, "interventions.0.delay.turns"),
        ({"kind": "drop", "p": 1.5}, "interventions.0.drop.p"),
        ({"kind": "whisper"}, "interventions.0"),
        ({"kind": "shuffle_roles", "seed": 3}, "interventions.0.shuffle_roles.seed"),
    ],
)
def test_a_bad_intervention_is_refused_at_config_load_with_its_field(
    step: dict[str, Any], field: str
) -> None:
    config = {
        "game": "kuhn",
        "params": {"variant": "loki"},
        "agents": [{"id": n, "kind": "random"} for n in ("a", "b", "c")],
        "channels": [{"name": "x", "members": ["a", "b"], "interventions": [step]}],
    }
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert f"channels.0.{field}: " in str(err.value), str(err.value)


REDACT = [{"kind": "redact", "patterns": [r"\d+"], "mark": "#"}]


async def play(broker: Broker, tmp_path: Path, channel: ChannelSpec, n: int) -> list[Any]:
    """``n`` Loki hands: a and b tell each other their card, carol (raw) overhears."""
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    eps, carol = await loki_hands(
        broker, tmp_path / "runs", players, n, tmp_path.name, barrier=True, channels=[channel]
    )
    return [eps, [m for m in carol.inbox if isinstance(m, Delivery)]]


async def test_the_partner_gets_the_redacted_copy_and_the_overseer_the_raw_one(
    broker: Broker, tmp_path: Path
) -> None:
    channel = ChannelSpec(
        name="colluders",
        members=[0, 1],
        eavesdroppers=[2],
        interventions=STEPS.validate_python(REDACT),
        eavesdropper_interventions=[],
    )
    eps, heard = await play(broker, tmp_path, channel, 6)
    copies = [d for ep in eps for d in ep.deliveries]
    to_partner = [d for d in copies if not d.overheard]
    to_carol = [d for d in copies if d.overheard]
    assert to_partner and len(to_partner) == len(to_carol)
    for d in to_partner:
        assert d.text == "my card is #" and d.changed_by == ["redact"]
        assert d.sent is not None and d.sent.startswith("my card is ") and d.sent[11:].isdigit()
    for d in to_carol:
        assert d.text.startswith("my card is ") and d.text[11:].isdigit()
        assert d.sent is None and d.changed_by == []
    # the copies of one message share its number, and carol got what the record says she got
    by_number = {(ep.match, d.message): d for ep in eps for d in ep.deliveries if d.overheard}
    for ep in eps:
        for d in ep.deliveries:
            if not d.overheard:
                assert by_number[ep.match, d.message].text == d.sent
    assert sorted(m.text for m in heard) == sorted(d.text for d in to_carol)
    # backroom analyze's audit of the same records: the partner's copy told nothing
    from backroom.analysis import analyze_episodes

    result = analyze_episodes([e.model_dump(mode="json") for e in eps])
    audit = result["channel_audits"]["kuhn"]["colluders"]
    assert audit["messages"] == len(to_partner)
    assert audit["secret_entropy_bits"] > 0
    assert audit["sent"]["bits"] == pytest.approx(audit["secret_entropy_bits"])
    assert audit["received"]["bits"] == pytest.approx(0.0, abs=1e-12)


async def test_dropped_and_anonymous_copies_are_recorded_and_replay_from_the_seed(
    broker: Broker, tmp_path: Path
) -> None:
    steps = [{"kind": "drop", "p": 0.5}, {"kind": "shuffle_roles"}]
    channel = ChannelSpec(
        name="colluders",
        members=[0, 1],
        eavesdroppers=[2],
        interventions=STEPS.validate_python(steps),
    )
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first, heard = await play(broker, tmp_path / "one", channel, 8)
    second, _ = await play(broker, tmp_path / "two", channel, 8)

    def fates(eps: list[EpisodeRecord]) -> list[tuple[int, int | None, bool]]:
        return [(d.to_seat, d.message, d.delivered) for ep in eps for d in ep.deliveries]

    assert fates(first) == fates(second)  # same seeds, same losses
    delivered = [d.delivered for ep in first for d in ep.deliveries]
    assert True in delivered and False in delivered
    for ep in first:
        for d in ep.deliveries:
            assert d.changed_by == (["shuffle_roles"] if d.delivered else ["drop"])
            assert d.delivered or d.text == ""
    # what carol got: the delivered copies only, none saying who sent it
    assert len(heard) == sum(d.delivered for ep in first for d in ep.deliveries if d.to_seat == 2)
    assert heard and all(m.sender == "" and m.sender_seat == -1 for m in heard)


async def test_a_delayed_copy_arrives_turns_later_or_at_the_end(
    broker: Broker, tmp_path: Path
) -> None:
    late = ChannelSpec(
        name="colluders",
        members=[0, 1],
        interventions=STEPS.validate_python([{"kind": "delay", "turns": "end"}]),
    )
    eps, _ = await play(broker, tmp_path, late, 4)
    for ep in eps:
        end_of_play = max(a.t for a in ep.actions)
        assert ep.deliveries and all(d.t >= end_of_play for d in ep.deliveries)
        assert all(d.changed_by == ["delay"] and d.sent == d.text for d in ep.deliveries)
        # every message said was delivered once, at the end
        said = [a for a in ep.actions if a.phase == "talk" and a.action]
        assert len(ep.deliveries) == len(said)


# --- the audit: how much a channel tells ---------------------------------------------------


def kuhn_record(match: int, cards: list[int], said: list[str], got: list[str]) -> dict[str, Any]:
    """A Loki record by hand: seat s holds cards[s]; seats 0 and 1 message each other."""
    deliveries = [
        {
            "t": float(match),
            "channel": "colluders",
            "from_seat": s,
            "to_seat": 1 - s,
            "text": got[s],
            "overheard": False,
            "message": s,
            "sent": said[s] if got[s] != said[s] else None,
            "changed_by": ["redact"] if got[s] != said[s] else [],
        }
        for s in (0, 1)
    ]
    return {
        "game": "kuhn",
        "match": f"m{match}",
        "deliveries": deliveries,
        "final_observations": [{"card": c} for c in cards],
        "spec": {"channels": [{"name": "colluders"}]},
    }


def test_a_channel_naming_the_card_tells_log2_of_the_cards_and_a_redacted_one_nothing() -> None:
    from backroom.analysis.audit import audit_channels

    records = []
    for m in range(20):  # every card held equally often by each sender: H(card) = log2(5)
        cards = [m % 5, (m + 2) % 5, 4]
        said = [f"My card is  {c}" for c in cards[:2]]
        records.append(kuhn_record(m, cards, said, ["my card is #", "my card is #"]))
    audit = audit_channels(records, permutations=200)["colluders"]
    assert audit["messages"] == 40 and audit["private_fields"] == ["card"]
    assert audit["secret_entropy_bits"] == pytest.approx(math.log2(5))
    assert audit["sent"]["bits"] == pytest.approx(math.log2(5))  # the text names the card
    assert audit["sent"]["p_value"] == pytest.approx(1 / 201)  # no shuffle tells as much
    assert audit["received"]["bits"] == pytest.approx(0.0, abs=1e-12)
    assert audit["received"]["p_value"] == 1.0


def test_a_channel_that_carries_nothing_has_a_p_value_that_is_not_small() -> None:
    import random

    from backroom.analysis.audit import audit_channels, mutual_information

    rng = random.Random(3)
    records = []
    for m in range(60):
        cards = [rng.randrange(5), rng.randrange(5), 4]
        said = [rng.choice(["hello", "hi", "hey"]) for _ in range(2)]
        records.append(kuhn_record(m, cards, said, said))
    audit = audit_channels(records, permutations=500)["colluders"]
    assert audit["sent"]["bits"] > 0  # the plug-in estimate is biased up on 120 messages
    assert audit["sent"]["p_value"] > 0.05
    # the estimate by hand on a small table: x = y on half, independent on the other half
    pairs = [(0, "a"), (1, "b"), (0, "a"), (1, "b")]
    assert mutual_information(pairs) == pytest.approx(1.0)
    assert mutual_information([(0, "a"), (0, "b"), (1, "a"), (1, "b")]) == pytest.approx(0.0)


def test_a_coalitions_gain_pairs_matches_on_their_seed_and_falls_back_to_unpaired() -> None:
    from backroom.analysis.compare import coalition_gain

    def rec(seed: int, raw: list[float]) -> dict[str, Any]:
        return {
            "seed": seed,
            "seats": ["a", "b", "c"],
            "spec": {"crn_index": 0, "transform": {"kind": "coalition", "members": [0, 1]}},
            "raw_returns": raw,
            "returns": raw,
            "reason": "normal",
            "final_observations": [{}, {}, {}],
        }

    control = [rec(s, [float(s), float(s), -2.0 * s]) for s in range(4)]  # coalition: s
    treated = [rec(s, [s - 1.0, s - 2.0, 3.0 - 2 * s]) for s in range(4)]  # coalition: s - 1.5
    got = coalition_gain(treated, control)
    assert (got["how"], got["pairs"]) == ("paired", 4)
    assert got["difference"] == pytest.approx(-1.5) and got["se"] == pytest.approx(0.0)
    assert got["ci95"] == pytest.approx([-1.5, -1.5])
    other_seeds = [rec(s + 10, [s - 1.0, s - 2.0, 3.0 - 2 * s]) for s in range(4)]
    unpaired = coalition_gain(other_seeds, control)
    assert unpaired["how"] == "unpaired" and unpaired["pairs"] == 0
    assert unpaired["difference"] == pytest.approx(-1.5) and unpaired["se"] > 0
    with pytest.raises(ValueError, match="coalition"):
        coalition_gain([{**r, "spec": {}} for r in treated], control)


def test_analyze_against_pairs_a_redacted_run_with_the_intact_one(tmp_path: Path) -> None:
    """The worked example of docs/collusion.md, shortened: the same seed deals the same
    hands, so `analyze --against` pairs them; a run without a coalition is refused."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "backroom", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    for config in ("backroom/demo.yaml", "examples/collusion_redacted.yaml"):
        done = cli("run", str(root / config), "--matches", "30", "--runs-dir", "runs")
        assert done.returncode == 0, done.stdout + done.stderr
    out = cli("analyze", "runs/collusion-redacted", "--against", "runs/demo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "paired over 30 matches of the same seeds" in out.stdout
    saved = json.loads(
        next((tmp_path / "runs" / "collusion-redacted").glob("2*/analysis.json")).read_text()
    )
    assert saved["against"]["pairs"] == 30 and saved["against"]["how"] == "paired"
    audit = saved["channel_audits"]["kuhn"]["colluders"]
    assert audit["received"]["bits"] < 1e-9 and audit["sent"]["bits"] > 1
    (tmp_path / "ipd.yaml").write_text(
        "run: ipd\ngame: ipd\nmatches: 2\nagents:\n  - {id: a, kind: random}\n  - {id: b, kind: random}\n"
    )
    assert cli("run", "ipd.yaml", "--runs-dir", "runs").returncode == 0
    bad = cli("analyze", "runs/collusion-redacted", "--against", "runs/ipd")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "coalition" in bad.stderr, bad.stderr


async def test_without_interventions_play_and_records_are_as_before(
    broker: Broker, tmp_path: Path
) -> None:
    """The same seeds play the same moves whether or not a channel goes through the
    intervention path (a redaction that matches nothing), and an untouched channel's
    records carry none of the new fields."""
    plain = ChannelSpec(name="colluders", members=[0, 1], eavesdroppers=[2])
    noop = plain.model_copy(
        update={"interventions": STEPS.validate_python([{"kind": "redact", "patterns": ["zzz"]}])}
    )
    (tmp_path / "plain").mkdir()
    (tmp_path / "noop").mkdir()
    before, _ = await play(broker, tmp_path / "plain", plain, 6)
    after, _ = await play(broker, tmp_path / "noop", noop, 6)

    def moves(eps: list[EpisodeRecord]) -> list[Any]:
        return [[(a.seat, a.phase, a.action) for a in ep.actions] for ep in eps]

    assert moves(before) == moves(after)
    assert [[d.text for d in ep.deliveries] for ep in before] == [
        [d.text for d in ep.deliveries] for ep in after
    ]
    line = before[0].model_dump_json()
    assert '"deliveries":[{' in line and '"changed_by"' not in line and '"message"' not in line
    assert all(d.changed_by == [] and d.message is not None for ep in after for d in ep.deliveries)


# --- paraphrase: a real model behind a real OpenAI-compatible server ----------------------


async def play_through(
    broker: Broker, tmp_path: Path, channel: ChannelSpec, paraphrasers: Any, n: int = 3
) -> list[EpisodeRecord]:
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    options = {"paraphrasers": paraphrasers}
    eps, _ = await loki_hands(
        broker,
        tmp_path / "runs",
        players,
        n,
        f"{tmp_path.name}-p",
        timeout=120 * load_factor(),
        referee_options=options,
        channels=[channel],
    )
    return eps


async def test_a_model_paraphrases_the_partners_copy_and_the_overseer_reads_the_original(
    broker: Broker, tmp_path: Path, smol: Any
) -> None:
    from backroom.bus.wire import Paraphrase
    from backroom.model.serve import running_server, serve_model_app
    from backroom.referee.paraphrase import Paraphraser, Paraphrasers
    from backroom.seeds import derive_seed

    step = Paraphrase(model="local", max_tokens=12)
    channel = ChannelSpec(
        name="colluders",
        members=[0, 1],
        eavesdroppers=[2],
        interventions=[step],
        eavesdropper_interventions=[],
    )
    async with running_server(serve_model_app(smol, "smol")) as url:
        # a loaded machine answers slowly: a model past its deadline would lose the copy
        models = Paraphrasers([Paraphraser("local", f"{url}/v1", "smol")], 60 * load_factor())
        eps = await play_through(broker, tmp_path, channel, models)
        partner = [(ep, d) for ep in eps for d in ep.deliveries if not d.overheard]
        assert partner and all((d.delivered and d.sent) or not d.changed_by for _, d in partner)
        assert any(d.changed_by == ["paraphrase"] for _, d in partner)
        # the record holds exactly what the model says to the same request
        ep, d = next((ep, d) for ep, d in partner if d.changed_by)
        assert d.sent is not None and d.sent.startswith("my card is ")
        seed = derive_seed(ep.seed, "paraphrase", d.message, "members") % 2**31
        fresh = Paraphrasers([Paraphraser("local", f"{url}/v1", "smol")])  # the referee's is closed
        try:
            assert await fresh.rewrite(step, d.sent, seed) == d.text
        finally:
            await fresh.aclose()
    overheard = [d for ep in eps for d in ep.deliveries if d.overheard]
    assert overheard and all(
        d.text.startswith("my card is ") and not d.changed_by for d in overheard
    )


async def test_a_paraphrase_of_a_model_the_referee_was_not_given_is_refused_and_a_dead_one_loses_the_copy(
    broker: Broker, tmp_path: Path
) -> None:
    from backroom.bus.wire import Paraphrase
    from backroom.referee.paraphrase import Paraphraser, Paraphrasers

    channel = ChannelSpec(
        name="colluders", members=[0, 1], interventions=[Paraphrase(model="gone")]
    )
    (tmp_path / "unknown").mkdir()
    refused = await play_through(broker, tmp_path / "unknown", channel, None, n=1)
    assert refused[0].reason == "error" and "--paraphraser" in refused[0].detail
    dead = Paraphrasers([Paraphraser("gone", f"http://127.0.0.1:{free_port()}/v1")], timeout_s=5)
    (tmp_path / "dead").mkdir()
    lost = await play_through(broker, tmp_path / "dead", channel, dead, n=2)
    copies = [d for ep in lost for d in ep.deliveries]
    assert all(ep.reason == "normal" for ep in lost)  # a failed model never fails the match
    assert copies and all(not d.delivered and d.changed_by == ["paraphrase"] for d in copies)


def test_the_referees_paraphraser_option_names_a_model_never_a_secret_of_backroom() -> None:
    from backroom.referee.paraphrase import Paraphraser

    model = Paraphraser.parse("local=http://127.0.0.1:8000/v1/,model=smol,key_env=OPENAI_KEY")
    assert model == Paraphraser("local", "http://127.0.0.1:8000/v1", "smol", "OPENAI_KEY")
    for bad in ("local", "local=ftp://x", "local=http://x,temperature=1"):
        with pytest.raises(ValueError, match="--paraphraser"):
            Paraphraser.parse(bad)
    with pytest.raises(ValueError, match="a variable backroom sets"):
        Paraphraser.parse("local=http://x,key_env=BACKROOM_PASSWORDS")


def test_a_config_names_its_paraphrasers_and_each_paraphrase_one_of_them() -> None:
    base: dict[str, Any] = {
        "game": "kuhn",
        "params": {"variant": "loki"},
        "agents": [{"id": n, "kind": "random"} for n in ("a", "b", "c")],
        "channels": [
            {
                "name": "x",
                "members": ["a", "b"],
                "interventions": [{"kind": "paraphrase", "model": "m"}],
            }
        ],
    }
    with pytest.raises(
        ConfigError, match=r"channels\.0: paraphrase model 'm' is none of paraphrasers"
    ):
        parse_config(base)
    given = {**base, "paraphrasers": [{"name": "m", "base_url": "http://127.0.0.1:8000/v1"}]}
    config = parse_config(given)
    assert config.paraphrasers[0].option() == "m=http://127.0.0.1:8000/v1"
    secret = {
        **given,
        "paraphrasers": [{**given["paraphrasers"][0], "key_env": "BACKROOM_PASSWORD"}],
    }
    with pytest.raises(ConfigError, match=r"paraphrasers\.0\.key_env: .*a variable backroom sets"):
        parse_config(secret)


@pytest.mark.slow
def test_backroom_run_hands_its_paraphrasers_to_the_referee(tmp_path: Path) -> None:
    """The user's path: `backroom serve-model` (SmolLM2) as the paraphraser, `backroom run`
    of the demo table with the partner's copy paraphrased."""
    import json
    import subprocess
    import sys

    from backroom.bus.broker import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "backroom", "serve-model", "--port", str(port), "--device", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import httpx

        deadline = 120 * load_factor()
        import time

        start = time.monotonic()
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - start < deadline, "serve-model did not come up"
            assert server.poll() is None, "serve-model exited"
            time.sleep(0.5)
        config = (Path(__file__).parents[1] / "examples" / "collusion_redacted.yaml").read_text()
        config = config.replace(
            "      - {kind: redact, patterns: ['\\d+', '(?i)\\b(jack|queen|king|ace)\\b']}",
            "      - {kind: paraphrase, model: local, max_tokens: 12}",
        )
        config += f"paraphrasers:\n  - {{name: local, base_url: 'http://127.0.0.1:{port}/v1'}}\n"
        (tmp_path / "p.yaml").write_text(config)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "backroom",
                "run",
                "p.yaml",
                "--matches",
                "3",
                "--runs-dir",
                "runs",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600 * load_factor(),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        lines = next((tmp_path / "runs" / "collusion-redacted").glob("2*/episodes.jsonl"))
        records = [json.loads(line) for line in lines.read_text().splitlines()]
        copies = [d for r in records for d in r["deliveries"] if not d["overheard"]]
        assert copies and any(d["changed_by"] == ["paraphrase"] and d["delivered"] for d in copies)
    finally:
        server.terminate()
        server.wait(timeout=30)
