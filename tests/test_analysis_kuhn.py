"""What a Loki Kuhn run says: the demo's story lines and `backroom analyze` against the episodes.

One real demo run (a broker, a referee and three agent processes, 30 hands)
feeds every test here; each number the CLI prints is recomputed by hand from
its episodes.jsonl. Also: the results table's columns fit the game, and every
plot with more than one line has a legend.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure
from rich.console import Console

from backroom.agents import make_agent
from backroom.agents.scripted.kuhn_colluder import naive_choice
from backroom.analysis import analyze_episodes, analyze_run, kuhn, kuhn_reference
from backroom.analysis.story import story_lines
from backroom.bus.wire import EpisodeRecord
from backroom.cli.run import results_table
from backroom.games import make_game
from backroom.runner.config import parse_config
from backroom.runner.local import RunResult, summarize

from .gameplay import episode

HANDS = 30


@pytest.fixture(scope="module")
def solver_cache(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The solver's values kept across sessions in pytest's cache, never in the user's home."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    path = Path(cache.mkdir("backroom-solver")) if cache else tmp_path_factory.mktemp("solver")
    before = os.environ.get("BACKROOM_SOLVER_CACHE")
    os.environ["BACKROOM_SOLVER_CACHE"] = str(path)
    yield path
    if before is None:
        os.environ.pop("BACKROOM_SOLVER_CACHE", None)
    else:
        os.environ["BACKROOM_SOLVER_CACHE"] = before


def _cli(*args: str, timeout: float = 300) -> str:
    env = {**os.environ, "COLUMNS": "250"}  # rich wraps at the terminal width: keep paths whole
    out = subprocess.run(
        [sys.executable, "-m", "backroom", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout


@pytest.fixture(scope="module")
def demo_run(
    solver_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, list[dict[str, Any]]]:
    """``backroom demo`` for a few hands: its output, its run directory, its episodes."""
    runs = tmp_path_factory.mktemp("runs")
    stdout = _cli("demo", "--matches", str(HANDS), "--runs-dir", str(runs))
    m = re.search(r"^episodes: (\S+)$", stdout, re.M)
    assert m, stdout
    run_dir = Path(m.group(1)).parent
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == HANDS and all(e["reason"] == "normal" for e in episodes)
    return stdout, run_dir, episodes


def _mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(len(xs))


def _messages(episodes: list[dict[str, Any]]) -> tuple[int, int, int]:
    """Talk actions that said something, deliveries, overheard deliveries: counted by hand."""
    said = sum(1 for e in episodes for a in e["actions"] if a["phase"] == "talk" and a["action"])
    deliveries = [d for e in episodes for d in e["deliveries"]]
    return said, len(deliveries), sum(d["overheard"] for d in deliveries)


def test_demo_story_matches_the_episodes(demo_run: tuple[str, Path, list[dict[str, Any]]]) -> None:
    stdout, run_dir, episodes = demo_run
    said, _, overheard = _messages(episodes)
    assert f"channel colluders: alice and bob sent {said} messages; " in stdout
    assert f"carol overheard {overheard} of them" in stdout  # one eavesdropper: one each
    coalition = [e["returns"][0] for e in episodes]  # the transform gives both colluders the mean
    assert all(e["returns"][1] == e["returns"][0] for e in episodes)
    mean, se = _mean_se(coalition)
    ref = kuhn.cfr_reference(episodes[0]["params"])
    assert ref is not None and ref.policy == "kuhn_loki_cfr"
    value = ref.value((0, 1))
    assert (
        f"coalition alice + bob: mean reward {mean:+.3f} ± {se:.3f} chips per match; "
        f"all three playing the CFR equilibrium (kuhn_loki_cfr) would give the same seats "
        f"{value:+.3f}, so collusion earned {mean - value:+.3f} ± {se:.3f}"
    ) in stdout
    # the luck of the deal out: each hand's payoff minus its deal's CFR value
    deals = [tuple(o["card"] for o in e["final_observations"]) for e in episodes]
    given, given_se = _mean_se(
        [c - ref.value((0, 1), d) for c, d in zip(coalition, deals, strict=True)]
    )
    assert f"({given:+.3f} ± {given_se:.3f} with each deal's CFR value subtracted)" in stdout
    # the why-line names the colluders that played and what the solver says their play is worth
    report = kuhn.collusion_reference(episodes[0]["params"], (0, 1))
    assert report is not None
    acts = sum(1 for e in episodes for a in e["actions"] if a["phase"] == "act" and a["seat"] < 2)
    assert (
        "why: alice and bob played the team solve (kuhn-team): each told its partner its card "
        f"before the first move, as the solve assumes (the partner's card known at {acts} of "
        f"{acts} decisions), and played its seat's part of the joint strategy, worth "
        f"{report.average_advantage('team_vs_unaware'):+.3f} a hand against kuhn_loki_cfr and "
        f"at least {report.average_advantage('team'):+.3f} against any third player"
    ) in stdout
    # the directory named is the run's own, the one holding episodes.jsonl
    assert f"next: backroom analyze {run_dir} " in stdout
    head = stdout[: stdout.index("channel colluders")]
    assert "mean chips" in head and "seats" not in head  # one seat each: no seats column


def test_demo_colluders_tell_their_cards_on_the_channel_before_any_move(
    demo_run: tuple[str, Path, list[dict[str, Any]]],
) -> None:
    """The team solve assumes both cards known at every colluder's turn: they travel as messages."""
    _, _, episodes = demo_run
    for e in episodes:
        cards = [o["card"] for o in e["final_observations"]]
        opening = [(a["turn"], a["seat"], a["phase"], a["action"]) for a in e["actions"][:2]]
        assert sorted(opening) == [
            (1, 0, "talk", f"my card is {cards[0]}"),
            (1, 1, "talk", f"my card is {cards[1]}"),
        ]
        first_act = min(a["t"] for a in e["actions"] if a["phase"] == "act")
        told = {(d["from_seat"], d["to_seat"]): d for d in e["deliveries"]}
        assert told[(0, 1)]["t"] <= first_act and told[(1, 0)]["t"] <= first_act
        assert not told[(0, 1)]["overheard"] and told[(0, 2)]["overheard"]
        assert all(a["phase"] == "act" for a in e["actions"][2:])  # nothing more is said


def test_demo_naive_plays_the_card_telling_colluders(
    solver_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    runs = tmp_path_factory.mktemp("runs")
    stdout = _cli("demo", "--naive", "--matches", "20", "--runs-dir", str(runs))
    m = re.search(r"^episodes: (\S+)$", stdout, re.M)
    assert m, stdout
    run_dir = Path(m.group(1)).parent
    assert run_dir.parent == runs / "demo-naive"  # beside the team demo's runs, not among them
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 20
    assert all(e["spec"]["channels"][0]["opens"] == "before_act" for e in episodes)
    ref = kuhn.cfr_reference(episodes[0]["params"])
    values = kuhn.naive_values(episodes[0]["params"], (0, 1))
    assert ref is not None and values is not None
    worth = (values[0] + values[1]) / 2 - ref.value((0, 1))
    acts = [a for e in episodes for a in e["actions"] if a["phase"] == "act" and a["seat"] < 2]
    informed = sum(
        any(
            d["from_seat"] == 1 - a["seat"] and d["to_seat"] == a["seat"] and d["t"] <= a["t"]
            for d in e["deliveries"]
        )
        for e in episodes
        for a in e["actions"]
        if a["phase"] == "act" and a["seat"] < 2
    )
    assert 0 < informed < len(acts)  # the first colluder to act has not heard its partner
    assert (
        "why: alice and bob played naive card-telling (kuhn-colluder): a fixed rule in place of "
        "the equilibrium's mixed play"
    ) in stdout
    assert f"the partner's card known at {informed} of {len(acts)} decisions" in stdout
    assert f"worth {worth:+.3f} a hand against kuhn_loki_cfr by the game tree" in stdout
    assert "team solve (kuhn-team)" not in stdout
    # naive_values' model of the table is the table: every colluder move the referee recorded is
    # the naive rule given the partner's card once the partner has acted (it talked just before)
    game = make_game("kuhn", **episodes[0]["params"])
    for e in episodes:
        state = game.new_initial_state(e["seed"])
        for a in (a for a in e["actions"] if a["phase"] == "act"):
            seat, obs = a["seat"], state.observation(a["seat"])
            if seat < 2:
                heard = any(h["player"] == 1 - seat for h in obs["history"])
                partner = state.observation(1 - seat)["card"] if heard else None
                spec = state.action_spec(seat)
                assert a["action"] == naive_choice(obs, spec.choices, spec.names, partner)
            state.apply({seat: a["action"]})
        assert state.is_terminal() and state.returns() == e["raw_returns"]
    assert sum(values) == pytest.approx(0.0, abs=1e-12)  # chips are zero-sum
    assert kuhn.naive_values({"variant": "classic"}, (0, 1)) is None  # no shipped policy


def test_cfr_reference_is_the_policy_evaluated_and_fast_once_cached(solver_cache: Path) -> None:
    params = {"variant": "loki"}
    ref = kuhn.cfr_reference(params)
    assert ref is not None
    doc = json.loads(
        (Path(kuhn.__file__).parent.parent / "policies/kuhn_loki_cfr.json").read_text()
    )
    # the solver recorded the values of the policy it wrote: the same evaluation, made then
    assert ref.seat_values == pytest.approx(doc["meta"]["values"], abs=1e-9)
    assert len(ref.deal_values) == 60  # 5 cards to 3 seats
    assert statistics.fmean(v[2] for v in ref.deal_values.values()) == pytest.approx(
        ref.seat_values[2], abs=1e-9
    )
    kuhn_reference._cfr_reference.cache_clear()  # a new process: only the file cache is warm
    t0 = time.perf_counter()
    again = kuhn.cfr_reference(params)
    assert time.perf_counter() - t0 < 1.0
    assert again == ref
    assert kuhn.cfr_reference({"variant": "classic"}) is None  # no shipped policy: no reference


def test_analyze_kuhn_measures_match_the_episodes(
    demo_run: tuple[str, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, run_dir, episodes = demo_run
    r = analyze_run(run_dir, tmp_path / "plots")["games"]["kuhn"]
    assert r["episodes"] == HANDS and r["policy"] == "kuhn_loki_cfr"
    ref = kuhn.cfr_reference(episodes[0]["params"])
    assert ref is not None
    for seat, row in enumerate(r["seats"]):
        chips = [float(e["raw_returns"][seat]) for e in episodes]
        mean, se = _mean_se(chips)
        assert row["agents"] == [["alice", "bob", "carol"][seat]]
        assert row["mean_chips"] == pytest.approx(mean) and row["se"] == pytest.approx(se)
        assert row["cfr_value"] == pytest.approx(ref.seat_values[seat])

    c = r["coalition"]
    payoff = [(e["raw_returns"][0] + e["raw_returns"][1]) / 2 for e in episodes]
    mean, se = _mean_se(payoff)
    assert c["seats"] == [0, 1] and c["source"] == "reward transform"
    assert c["mean"] == pytest.approx(mean) and c["se"] == pytest.approx(se)
    assert c["advantage"] == pytest.approx(mean - ref.value((0, 1)))
    deals = [tuple(o["card"] for o in e["final_observations"]) for e in episodes]
    given = [p - ref.value((0, 1), d) for p, d in zip(payoff, deals, strict=True)]
    assert c["advantage_given_deal"] == pytest.approx(statistics.fmean(given))
    assert c["advantage_by_hand"][-1] == pytest.approx(statistics.fmean(given))
    # the solver's side is `backroom solve collusion`'s: the team solve gains 0.051 (docs/solvers.md)
    assert c["solver_advantage"]["team"] == pytest.approx(0.0511, abs=1e-3)

    # Figure 2, played: every hand in its (A card, B card) cell, cells averaging to the whole
    h = r["heatmap"]
    cells = [
        (n, v)
        for ns, vs in zip(h["hands"], h["played"], strict=True)
        for n, v in zip(ns, vs, strict=True)
        if n
    ]
    assert sum(n for n, _ in cells) == HANDS
    assert sum(n * v for n, v in cells) / HANDS == pytest.approx(c["advantage_given_deal"])
    assert h["solver"][0][0] is None  # A and B cannot both hold card 0

    # Table 1: C's chips; the last column is all hands
    t = r["table1"]
    assert t["seat"] == 2 and t["hands"] == [[0, 1, 4], [2, 3, 4], [3, 4, 0]]
    carol = [float(e["raw_returns"][2]) for e in episodes]
    assert t["rows"]["this run"][-1]["mean"] == pytest.approx(statistics.fmean(carol))
    assert t["rows"]["this run"][-1]["n"] == HANDS
    for i, hand in enumerate(t["hands"]):
        played = [x for x, d in zip(carol, deals, strict=True) if list(d) == hand]
        assert t["rows"]["this run"][i]["n"] == len(played)
    assert t["rows"]["CFR"][1] == pytest.approx(ref.deal_values[(2, 3, 4)][2])

    said, deliveries, overheard = _messages(episodes)
    ch = r["channels"]["colluders"]
    assert (ch["messages"], ch["deliveries"], ch["overheard"]) == (said, deliveries, overheard)
    assert ch["senders"] == ["alice", "bob"] and ch["overhearers"] == ["carol"]
    assert sorted(Path(p).name for p in r["plots"]) == [
        "kuhn_coalition_advantage.png",
        "kuhn_collusion_heatmap.png",
        "kuhn_seats.png",
    ]
    for p in r["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_reads_the_team_solve_from_its_cache_the_second_time(
    demo_run: tuple[str, Path, list[dict[str, Any]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Like the all-CFR values, the team solve is made once per policy, rules and coalition."""
    _, run_dir, _ = demo_run
    cache = tmp_path / "cache"
    monkeypatch.setenv("BACKROOM_SOLVER_CACHE", str(cache))
    try:
        kuhn_reference._collusion_reference.cache_clear()  # as a new process: nothing held in memory
        first = analyze_run(run_dir, tmp_path / "a")["games"]["kuhn"]
        (entry,) = cache.glob("collusion-*.json")
        assert first["solver"]["team_iterations"] == kuhn.TEAM_ITERATIONS
        # Mark the entry: a second analyze that solved again could not show the mark.
        data = json.loads(entry.read_text())
        data["summary"]["team_iterations"] = 1234
        entry.write_text(json.dumps(data))
        written = entry.stat().st_mtime_ns
        kuhn_reference._collusion_reference.cache_clear()
        second = analyze_run(run_dir, tmp_path / "b")["games"]["kuhn"]
        assert second["solver"]["team_iterations"] == 1234  # read from the file
        assert entry.stat().st_mtime_ns == written  # and not written again
        assert second["coalition"]["solver_advantage"] == first["coalition"]["solver_advantage"]
    finally:
        kuhn_reference._collusion_reference.cache_clear()  # the marked report must not outlive the test


@pytest.mark.slow
def test_team_colluders_gain_what_the_team_solve_says(solver_cache: Path, tmp_path: Path) -> None:
    """3,000 hands of the demo: the coalition's advantage is the solver's, within 2 s.e.

    The demo's colluders play the team solve's joint strategy against carol's
    CFR policy: the solver's "team vs unaware C" reading, which is at least the
    team game's value (the joint strategy's guarantee against any third player).
    """
    stdout = _cli("demo", "--matches", "3000", "--runs-dir", str(tmp_path), timeout=900)
    m = re.search(r"^episodes: (\S+)$", stdout, re.M)
    assert m, stdout
    episodes = [json.loads(line) for line in Path(m.group(1)).read_text().splitlines()]
    assert len(episodes) == 3000 and all(e["reason"] == "normal" for e in episodes)
    params = episodes[0]["params"]
    ref, report = kuhn.cfr_reference(params), kuhn.collusion_reference(params, (0, 1))
    assert ref is not None and report is not None
    expected = report.average_advantage("team_vs_unaware")
    payoff = [(e["raw_returns"][0] + e["raw_returns"][1]) / 2 for e in episodes]
    mean, se = _mean_se([p - ref.value((0, 1)) for p in payoff])
    assert abs(mean - expected) < 2 * se, (mean, se, expected)
    deals = [tuple(o["card"] for o in e["final_observations"]) for e in episodes]
    given, given_se = _mean_se(
        [p - ref.value((0, 1), d) for p, d in zip(payoff, deals, strict=True)]
    )
    assert abs(given - expected) < 2 * given_se, (given, given_se, expected)
    assert given > report.average_advantage("team") - 2 * given_se
    acts = sum(1 for e in episodes for a in e["actions"] if a["phase"] == "act" and a["seat"] < 2)
    assert f"(the partner's card known at {acts} of {acts} decisions)" in stdout


def test_cli_analyze_prints_the_tables_and_the_plots_it_wrote(
    demo_run: tuple[str, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, run_dir, episodes = demo_run
    stdout = _cli("analyze", str(run_dir), "--out-dir", str(tmp_path / "plots"))
    plots = re.findall(r"^plot: (\S+)$", stdout, re.M)
    assert sorted(Path(p).name for p in plots) == [
        "kuhn_coalition_advantage.png",
        "kuhn_collusion_heatmap.png",
        "kuhn_seats.png",
    ]
    assert all(Path(p).is_file() and Path(p).parent == tmp_path / "plots" for p in plots)
    for title in ("mean chips ± s.e.", "coalition alice + bob", "Table 1", "messages per channel"):
        assert title in stdout
    said, deliveries, _ = _messages(episodes)
    assert re.search(rf"colluders\s+│\s+{said}\s+│\s+{said}\s+│\s+{deliveries}\s+│", stdout)


def _record(ep: dict[str, Any]) -> EpisodeRecord:
    return EpisodeRecord.model_validate(ep)


def _table_text(result: RunResult) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(results_table(result, summarize(result)))
    return out.getvalue()


def test_beauty_contest_table_counts_matches_not_seats(tmp_path: Path) -> None:
    game = make_game("beauty_contest", players=4, rule="amplified", discussion=False)
    eps = [
        _record(
            episode(
                game,
                [make_agent("level-k", f"k{i % 2}", k=i % 2 + 1) for i in range(4)],
                seed=s,
                match=f"m{s}",
            )
        )
        for s in range(3)
    ]
    config = parse_config(
        {
            "run": "bc",
            "game": "beauty_contest",
            "params": {"players": 4, "rule": "amplified", "discussion": False},
            "matches": 3,
            "agents": [{"id": "k0", "kind": "level-k"}, {"id": "k1", "kind": "level-k"}],
            "seats": ["k0", "k1", "k0", "k1"],
        }
    )
    result = RunResult(config, eps, 1.0, tmp_path, "mqtt://x", 1.0)
    rows = summarize(result)["agents"]
    assert rows["k0"]["matches"] == 3 and rows["k0"]["seats"] == 6
    points = [e.raw_returns[s] for e in eps for s in (0, 2)]
    assert rows["k0"]["raw"] == pytest.approx(statistics.fmean(points))
    text = _table_text(result)
    assert "mean points" in text and "chips" not in text and "seats" in text
    assert re.search(r"k0\s+│\s+3\s+│\s+6\s+│", text)


@pytest.mark.parametrize(
    ("game", "unit"), [("kuhn", "chips"), ("bertrand", "profit"), ("ipd", "points")]
)
def test_the_mean_column_is_named_for_the_game(game: str, unit: str, tmp_path: Path) -> None:
    kinds = {"kuhn": "random", "bertrand": "nash-pricer", "ipd": "tit-for-tat"}
    g = make_game(game, **({"rounds": 3} if game != "kuhn" else {}))
    agents = [make_agent(kinds[game], f"a{i}") for i in range(g.num_players)]
    eps = [_record(episode(g, agents))]
    config = parse_config(
        {
            "run": "u",
            "game": game,
            "params": {"rounds": 3} if game != "kuhn" else {},
            "agents": [{"id": a.id, "kind": kinds[game]} for a in agents],
        }
    )
    text = _table_text(RunResult(config, eps, 1.0, tmp_path, "mqtt://x", 1.0))
    assert f"mean {unit}" in text
    assert all(f"mean {u}" not in text for u in ("chips", "profit", "points") if u != unit)
    assert "seats" not in text


def test_story_without_channels_or_coalition_only_points_to_analyze(tmp_path: Path) -> None:
    g = make_game("ipd", rounds=3)
    ep = episode(g, [make_agent("tit-for-tat", "t"), make_agent("always", "b", action="B")])
    assert story_lines([ep], tmp_path) == [f"next: backroom analyze {tmp_path}"]


def _line_groups(fig: Figure) -> list[list[Any]]:
    """Axes that share a plot area (twinx pairs) together; every other axes alone."""
    groups: list[list[Any]] = []
    for ax in fig.axes:
        if not any(ax in g for g in groups):
            groups.append(list(ax.get_shared_x_axes().get_siblings(ax)))
    return groups


def test_every_plot_with_several_lines_has_a_legend(
    demo_run: tuple[str, Path, list[dict[str, Any]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved: list[tuple[str, Figure]] = []
    real = Figure.savefig

    def capture(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        saved.append((Path(fname).name, self))
        real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", capture)
    ipd, tas = make_game("ipd", rounds=4), make_game("trust_and_split", rounds=3)
    beauty, bertrand = make_game("beauty_contest", players=4), make_game("bertrand", rounds=20)
    episodes = [
        episode(ipd, [make_agent("tit-for-tat", "t"), make_agent("always", "b", action="B")]),
        episode(tas, [make_agent("ts-honest", "h"), make_agent("ts-greedy", "g")]),
        episode(beauty, [make_agent("level-k", f"k{i}", k=i) for i in range(4)]),
        episode(bertrand, [make_agent("cartel-pricer", "c"), make_agent("undercutter", "u")]),
        *demo_run[2],
    ]
    analyze_episodes(episodes, tmp_path)
    names = {name for name, _ in saved}
    for expected in ("ipd_by_round.png", "trust_and_split_by_round.png", "kuhn_seats.png"):
        assert expected in names
    assert any(n.startswith("beauty_contest") for n in names)
    assert any(n.startswith("bertrand") for n in names)
    for name, fig in saved:
        for group in _line_groups(fig):
            lines = [line for ax in group for line in ax.get_lines()]
            if len(lines) > 1:
                legends = [ax.get_legend() for ax in group if ax.get_legend() is not None]
                assert legends, f"{name}: {len(lines)} lines, no legend"
                assert max(len(lg.get_texts()) for lg in legends) >= 2, name


def test_two_player_kuhn_without_a_shipped_policy_gets_seats_only(tmp_path: Path) -> None:
    game = make_game("kuhn")  # classic, two players: no shipped policy, no coalition
    eps = [
        episode(
            game, [make_agent("random", "r0"), make_agent("random", "r1")], seed=s, match=f"m{s}"
        )
        for s in range(6)
    ]
    r = analyze_episodes(eps, tmp_path)["games"]["kuhn"]
    assert r["policy"] is None and r["coalition"] is None and r["table1"] is None
    chips = [float(e["raw_returns"][0]) for e in eps]
    assert r["seats"][0]["mean_chips"] == pytest.approx(statistics.fmean(chips))
    assert r["seats"][0]["cfr_value"] is None
    assert [Path(p).name for p in r["plots"]] == ["kuhn_seats.png"]
    out = io.StringIO()
    for t in kuhn.tables("r", r):
        Console(file=out, width=150).print(t)
    assert "r0" in out.getvalue() and "Table 1" not in out.getvalue()


def test_the_advantage_plot_draws_what_the_demo_expects_and_the_team_games_value(
    demo_run: tuple[str, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The demo's colluders expect the team solve's worth against carol's CFR policy (about
    +0.059), not only the team game's value (+0.051), which the plot once drew alone under
    the label "team CFR vs CFR"."""
    from backroom.analysis.kuhn import SOLVER_READINGS, figures

    r = analyze_episodes(demo_run[2], tmp_path)["games"]["kuhn"]
    solver = r["coalition"]["solver_advantage"]
    assert solver["team_vs_unaware"] > solver["team"] > 0
    ax = figures(r)["kuhn_coalition_advantage"].axes[0]
    drawn = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines()}
    for name in ("team_vs_unaware", "team"):
        assert drawn[SOLVER_READINGS[name]] == pytest.approx(solver[name])


def test_a_run_of_chosen_hands_quotes_the_solver_on_those_hands(tmp_path: Path) -> None:
    """A fixed-deal run's why-line quotes the team solve's worth on the hands it played, not
    the whole deck's average (+0.059 quoted where the hands played were worth -0.087)."""
    from backroom.analysis.kuhn import collusion_reference
    from backroom.analysis.story import story_lines

    deal = (0, 1, 4)  # both colluders hold the two lowest cards; carol holds the Ace
    game = make_game("kuhn", variant="loki", deal=list(deal))
    agents = [make_agent("random", n) for n in ("alice", "bob", "carol")]
    eps = [episode(game, agents, seed=s, match=f"m{s}") for s in range(3)]
    for e in eps:
        e["spec"]["transform"] = {"kind": "coalition", "members": [0, 1]}
    kinds = {"alice": "kuhn-team", "bob": "kuhn-team", "carol": "cfr"}
    lines = story_lines(eps, tmp_path, kinds=kinds)
    why = next(line for line in lines if line.startswith("why:"))
    report = collusion_reference(game.params(), [0, 1])
    assert report is not None
    on_hand = float(report.advantage("team_vs_unaware")[report.deals.index(deal)])
    whole = report.average_advantage("team_vs_unaware")
    assert f"worth {on_hand:+.3f} a hand on the hands played" in why, why
    assert f"{whole:+.3f}" not in why and abs(on_hand - whole) > 0.01


def test_solve_collusion_says_how_to_get_analyzes_table_1_and_then_gives_it(
    demo_run: tuple[str, Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """`solve collusion` (3.06) and `analyze`'s Table 1 (3.04) once differed unexplained: the
    command solves its own three-player equilibrium. It says so, and the flags it names
    give analyze's numbers to the digit."""
    from backroom.analysis.kuhn import TEAM_ITERATIONS

    r = analyze_episodes(demo_run[2], tmp_path / "plots")["games"]["kuhn"]
    analyze_rows = r["table1"]["rows"]
    flags = ["--cfr-policy", "kuhn_loki_cfr", "--iterations", str(TEAM_ITERATIONS)]
    out = _cli("solve", "collusion", *flags, "--out-dir", str(tmp_path / "c"))
    assert "these are backroom analyze's numbers" in out, out
    for label in ("CFR", "CFR Collusion", "CFR Collusion vs unaware C"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {label} |"))
        printed = [float(x) for x in row.strip("|").split("|")[1:4]]
        assert printed == [round(x, 2) for x in analyze_rows[label][:3]], (label, row)
    other = _cli("solve", "collusion", "--iterations", "200", "--out-dir", str(tmp_path / "d"))
    assert f"--cfr-policy kuhn_loki_cfr --iterations {TEAM_ITERATIONS} --algo cfr+" in other
