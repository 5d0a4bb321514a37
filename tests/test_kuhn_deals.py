"""Fixed Kuhn deals: the engine's ``deal``, the run's ``deals:`` schedule, Table 1's n per hand.

The game plays a fixed deal as given and refuses bad ones; the config turns a
schedule into matches (or refuses it); the referee keeps the deal from the
players; and a real run of the Loki Table-1 protocol (broker, referee, a
kuhn-colluder pair and the CFR player in their processes) plays every hand
exactly as often as the schedule says, which ``backroom analyze`` reports.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from backroom.analysis import analyze_run, kuhn
from backroom.bus.broker import Broker
from backroom.bus.wire import MatchStart, Turn
from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games.kuhn import CALL, KuhnPoker, KuhnState
from backroom.runner.config import ConfigError, parse_config
from backroom.runner.local import run_local
from backroom.solvers.collusion import PAPER_HANDS
from backroom.solvers.tree import build_tree

from .conftest import RawAgent, Runner, agents, identity, loki_spec, play_raw, stack
from .gameplay import episode

LOKI_DEALS = list(itertools.permutations(range(5), 3))


# --- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "deal"),
    [({"variant": "loki"}, [3, 4, 0]), ({"variant": "classic", "players": 3}, [2, 0, 3])],
    ids=["loki", "classic3"],
)
def test_a_fixed_deal_is_dealt_and_played_as_given(params: dict[str, Any], deal: list[int]) -> None:
    game = make_game("kuhn", **params, deal=deal)
    assert isinstance(game, KuhnPoker)
    starts: set[int | None] = set()
    for seed in range(40):
        s = game.new_initial_state(seed)
        assert isinstance(s, KuhnState) and s.cards == deal
        starts.add(s.start)
        while not s.is_terminal():
            (p,) = s.current_players()
            s.apply({p: CALL if params["variant"] == "loki" else 0})  # check down to showdown
        best = max(range(len(deal)), key=lambda p: deal[p])
        assert s.winner == best and s.returns()[best] == len(deal) - 1
    # the seed still draws what the deal leaves to chance: Loki's first player
    assert starts == ({0, 1, 2} if params["variant"] == "loki" else {0})

    # chance stays explicit: a node per card, its only outcome the card given
    s = game.new_initial_state()
    for seat, card in enumerate(deal):
        assert s.current_players() == {CHANCE}
        assert s.chance_outcomes() == [(card, 1.0)]
        other = next(c for c in range(game.num_cards) if c != card and c not in deal[:seat])
        with pytest.raises(IllegalActionError, match=f"seat {seat} gets card {card}"):
            s.clone().apply({CHANCE: other})
        s.apply({CHANCE: card})
    # each seat sees its own card only
    if s.current_players() == {CHANCE}:
        s.apply({CHANCE: 0})
    for seat in range(len(deal)):
        assert s.observation(seat)["card"] == deal[seat]
        assert "shown" not in s.observation(seat)

    # the record keeps the deal and rebuilds the game; the players' parameters leave it out
    assert game.params()["deal"] == deal
    assert make_game("kuhn", **game.params()).params() == game.params()
    assert game.public_params() == make_game("kuhn", **params).params()
    assert "deal" not in make_game("kuhn", **params).params()  # policies' rules are unchanged


def test_a_fixed_deal_tree_has_that_deal_only() -> None:
    """The solver's tree of a fixed deal is the deal's subtree of the full game."""
    fixed = build_tree(make_game("kuhn", variant="loki", deal=[0, 1, 4]))
    full = build_tree(make_game("kuhn", variant="loki"))
    assert (
        fixed.info is not None and fixed.info.max_chance_outcomes == 3
    )  # the start; cards certain
    # one deal of 60: a sixtieth of the terminals, every one of them the full game's
    assert fixed.num_terminals * 60 == full.num_terminals


@pytest.mark.parametrize(
    ("params", "deal", "message"),
    [
        ({"variant": "loki"}, [1, 1, 2], r"kuhn deal \[1, 1, 2\] gives card 1 twice"),
        ({"variant": "loki"}, [0, 1], r"gives 2 cards, but this game seats 3: one card per seat"),
        ({"variant": "loki"}, [0, 1, 2, 3], r"gives 4 cards, but this game seats 3"),
        ({"variant": "loki"}, [0, 1, 7], r"card 7 is not in the deck 0\.\.4"),
        ({"variant": "loki"}, [-1, 1, 2], r"card -1 is not in the deck"),
        ({}, [0, 3], r"card 3 is not in the deck 0\.\.2"),  # classic 2-player: 3 cards
        ({"variant": "loki"}, "014", r"must be a list of 3 cards, one per seat"),
        ({"variant": "loki"}, [0, 1.5, 2], r"must be a list of 3 cards"),
        ({"variant": "loki"}, [True, 0, 2], r"must be a list of 3 cards"),
        ({"variant": "loki"}, 4, r"must be a list of 3 cards"),
    ],
)
def test_bad_deals_are_refused_with_a_clear_message(
    params: dict[str, Any], deal: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_game("kuhn", **params, deal=deal)


# --- the run config -------------------------------------------------------------------------

AGENTS = [
    {"id": "alice", "kind": "kuhn-colluder"},
    {"id": "bob", "kind": "kuhn-colluder"},
    {"id": "carol", "kind": "cfr", "options": {"policy": "kuhn_loki_cfr"}},
]


def loki_config(**extra: Any) -> dict[str, Any]:
    return {"game": "kuhn", "params": {"variant": "loki"}, "agents": AGENTS, **extra}


def scheduled(data: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(s.params["deal"]) for _, s in parse_config(data).match_specs()]


def test_the_schedule_sets_the_match_count_and_plays_each_hand_each_times() -> None:
    config = parse_config(loki_config(deals={"each": 3}))
    assert config.matches == 60 * 3
    order = scheduled(loki_config(deals={"each": 3}))
    assert Counter(order) == {d: 3 for d in LOKI_DEALS}
    # in rounds: every prefix of 60 holds every deal once
    assert all(sorted(order[i : i + 60]) == LOKI_DEALS for i in range(0, 180, 60))

    hands = [list(h) for h in PAPER_HANDS]
    order = scheduled(loki_config(deals={"each": 4, "hands": hands}))
    assert len(order) == 12 and Counter(order) == {h: 4 for h in PAPER_HANDS}
    # two-player classic Kuhn: 3 cards to 2 seats
    classic = {"game": "kuhn", "agents": AGENTS[:2], "deals": {"each": 1}}
    assert sorted(scheduled(classic)) == list(itertools.permutations(range(3), 2))


def test_the_order_follows_the_run_seed_and_the_seeds_stay_as_they_were() -> None:
    data = loki_config(deals={"each": 2}, seed=5)
    assert scheduled(data) == scheduled(data)  # same config, same play
    assert scheduled(data) != scheduled({**data, "seed": 6})
    assert scheduled(data)[:60] != LOKI_DEALS  # shuffled, not the deck's order
    specs = [s for _, s in parse_config(data).match_specs()]
    plain = [s for _, s in parse_config(loki_config(matches=120, seed=5)).match_specs()]
    # only params.deal differs from the same run without a schedule
    for a, b in zip(specs, plain, strict=True):
        assert a.model_copy(update={"params": b.params}) == b
        assert a.params == {**b.params, "deal": a.params["deal"]}

    # a CRN group shares its seed, so it shares its hand
    crn = [s for _, s in parse_config(loki_config(deals={"each": 4}, crn=2)).match_specs()]
    groups: dict[str | None, set[tuple[int, ...]]] = {}
    for s in crn:
        groups.setdefault(s.crn_group, set()).add(tuple(s.params["deal"]))
    assert len(groups) == 120 and all(len(g) == 1 for g in groups.values())
    assert Counter(tuple(s.params["deal"]) for s in crn) == {d: 4 for d in LOKI_DEALS}


def test_matches_given_must_agree_with_the_schedule() -> None:
    assert parse_config(loki_config(deals={"each": 2}, matches=120)).matches == 120
    with pytest.raises(
        ConfigError,
        match=r"matches: 100, but deals plays 60 hands x 2 = 120 matches; leave matches out",
    ):
        parse_config(loki_config(deals={"each": 2}, matches=100))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"deals": {"each": 1, "hands": [[0, 1, 4], [0, 1, 4]]}},
            r"deals\.hands\.1: \[0, 1, 4\] is listed already \(hands\.0\)",
        ),
        ({"deals": {"each": 1, "hands": [[0, 0, 4]]}}, r"deals\.hands\.0: kuhn deal .* twice"),
        ({"deals": {"each": 1, "hands": [[0, 1]]}}, r"deals\.hands\.0: .* this game seats 3"),
        ({"deals": {"each": 1, "hands": []}}, r"deals\.hands: lists no hand"),
        ({"deals": {"each": 0}}, r"deals\.each: Input should be greater than or equal to 1"),
        ({"deals": {"every": 3}}, r"deals\.every: Extra inputs are not permitted"),
        ({"deals": {"each": 3}, "crn": 2}, r"deals\.each: 3 is not a multiple of crn \(2\)"),
        (
            {"deals": {"each": 1}, "params": {"variant": "loki", "deal": [0, 1, 2]}},
            r"params\.deal: fixes one deal for every match, and `deals` schedules several",
        ),
    ],
)
def test_a_bad_schedule_is_refused_at_its_field(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(loki_config(**extra))


def test_the_schedule_on_another_game_is_refused() -> None:
    ipd = {
        "game": "ipd",
        "agents": [
            {"id": "a", "kind": "always", "options": {"action": "A"}},
            {"id": "b", "kind": "always", "options": {"action": "B"}},
        ],
        "deals": {"each": 2},
    }
    with pytest.raises(
        ConfigError, match=r"deals: only kuhn has a deal to fix; this run plays ipd"
    ):
        parse_config(ipd)
    # and without a schedule other games' specs are as they were
    plain = parse_config({k: v for k, v in ipd.items() if k != "deals"} | {"matches": 3, "crn": 3})
    assert [(s.params, s.seed, s.crn_index) for _, s in plain.match_specs()] == [
        ({}, 0, 0),
        ({}, 0, 1),
        ({}, 0, 2),
    ]


def test_a_fixed_deal_in_params_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"params\.deal: kuhn deal \[0, 1, 9\]: card 9"):
        parse_config(loki_config(params={"variant": "loki", "deal": [0, 1, 9]}))
    config = parse_config(loki_config(params={"variant": "loki", "deal": [0, 1, 4]}, matches=3))
    assert all(s.params["deal"] == [0, 1, 4] for _, s in config.match_specs())


# --- the referee ----------------------------------------------------------------------------


async def test_the_players_are_not_told_the_deal(broker: Broker, tmp_path: Path) -> None:
    """``match_start`` carries the rules, not the other seats' cards; the record keeps the deal."""
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    deal = [3, 4, 0]
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with RawAgent(identity(broker, "carol")) as carol:
            stop = asyncio.Event()
            driver = asyncio.create_task(play_raw(carol, "call", stop))
            ids = [f"d{i}" for i in range(4)]
            for i, m in enumerate(ids):
                spec = loki_spec(
                    ["a", "b", "carol"], seed=i, params={"variant": "loki", "deal": deal}
                )
                await run.submit(m, spec)
            eps = await run.wait(ids)
            await carol.barrier()
            stop.set()
            await driver
    starts = carol.of(MatchStart)
    assert len(starts) == len(ids)
    assert all(s.params == {"variant": "loki", "players": 3, "start": "random"} for s in starts)
    turns = carol.of(Turn)
    assert turns and all(t.observation["card"] == 0 for t in turns)
    assert all("Your card is the 10." in t.prompt for t in turns)
    assert not any(f"card is the {c}" in t.prompt for c in ("King", "Ace") for t in turns)
    for ep in eps:
        assert ep.reason == "normal" and ep.params["deal"] == deal
        assert [o["card"] for o in ep.final_observations] == deal


# --- a real run of Table 1's protocol, then `backroom analyze` --------------------------------


@pytest.fixture(scope="module")
def solver_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The solver's values kept in pytest's cache across sessions, never in the user's home."""
    cache = getattr(request.config, "cache", None)
    path = Path(cache.mkdir("backroom-solver")) if cache else tmp_path_factory.mktemp("solver")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BACKROOM_SOLVER_CACHE", str(path))
        yield path


EACH = 2


def test_table1_protocol_plays_every_hand_each_times_and_analyze_counts_them(
    solver_cache: Path, tmp_path: Path
) -> None:
    config = parse_config(
        {
            **loki_config(deals={"each": EACH}, seed=11),
            "run": "table1",
            "concurrency": 20,
            "agent_processes": "single",
            "seats": ["alice", "bob", "carol"],
            "channels": [
                {
                    "name": "colluders",
                    "members": ["alice", "bob"],
                    "eavesdroppers": ["carol"],
                    "max_messages": 1,
                }
            ],
            "transform": {"kind": "coalition", "members": ["alice", "bob"]},
        }
    )
    result = asyncio.run(run_local(config, runs_dir=tmp_path))
    lines = (result.run_dir / "episodes.jsonl").read_text().splitlines()
    eps = [json.loads(line) for line in lines]
    assert len(eps) == config.matches == 60 * EACH
    assert all(e["reason"] == "normal" for e in eps)
    # every hand of the deck exactly EACH times, dealt as its spec said
    dealt = Counter(tuple(o["card"] for o in e["final_observations"]) for e in eps)
    assert dealt == {d: EACH for d in LOKI_DEALS}
    assert all([o["card"] for o in e["final_observations"]] == e["params"]["deal"] for e in eps)

    r = analyze_run(result.run_dir)["games"]["kuhn"]
    assert r["episodes"] == len(eps) and r["other_rules"] == 0  # one game, whatever the deal
    assert r["params"] == {"variant": "loki", "players": 3, "start": "random"}
    assert r["dealt"] == {
        "chance": 0,
        "fixed": len(eps),
        "hands": 60,
        "per_hand": [EACH, EACH],
        "every_deal": True,
    }
    t = r["table1"]
    assert t["hands"] == [list(h) for h in PAPER_HANDS] and t["last"] == "all hands"
    measured = t["rows"]["this run"]
    assert [c["n"] for c in measured] == [EACH, EACH, EACH, len(eps)]
    for hand, cell in zip(PAPER_HANDS, measured[:3], strict=True):
        chips = [e["raw_returns"][2] for e in eps if tuple(e["params"]["deal"]) == hand]
        assert cell["mean"] == pytest.approx(sum(chips) / EACH)
    # every deal alike: the comparisons are the whole game's
    ref = kuhn.cfr_reference(r["params"])
    assert ref is not None and ref.policy == r["policy"] == "kuhn_loki_cfr"
    for seat, row in enumerate(r["seats"]):
        assert row["cfr_value"] == pytest.approx(ref.seat_values[seat], abs=1e-9)


def test_analyze_compares_chosen_hands_with_those_hands(solver_cache: Path) -> None:
    """Table 1's three hands only: the last column and the CFR values are those hands', not the deck's."""
    from backroom.agents import make_agent

    eps = []
    for i, hand in enumerate([*PAPER_HANDS, *PAPER_HANDS, (0, 1, 4)]):
        game = make_game("kuhn", variant="loki", deal=list(hand))
        players = [make_agent("random", a) for a in ("alice", "bob", "carol")]
        eps.append(episode(game, players, seed=i, match=f"m{i}"))
    r = kuhn.analyze(eps)
    assert r["dealt"]["every_deal"] is False and r["dealt"]["per_hand"] == [2, 3]
    t = r["table1"]
    assert t["last"] == "hands played"
    assert [c["n"] for c in t["rows"]["this run"]] == [3, 2, 2, 7]
    ref = kuhn.cfr_reference(r["params"])
    assert ref is not None
    played = [tuple(e["params"]["deal"]) for e in eps]
    for seat, row in enumerate(r["seats"]):
        expected = sum(ref.deal_values[d][seat] for d in played) / len(played)
        assert row["cfr_value"] == pytest.approx(expected)
    cfr_cells = t["rows"]["CFR"]
    weights = [3, 2, 2]
    assert cfr_cells[-1] == pytest.approx(
        sum(w * v for w, v in zip(weights, cfr_cells[:3], strict=True)) / 7
    )
    text = "\n".join(str(c) for tab in kuhn.tables("x", r) for c in (tab.title, tab.caption))
    assert "fixed deals: 3 hands, 2 to 3 each" in text
    assert "on the hands played" in text
