"""Measures over episode records: social dilemmas, beauty contest, Bertrand; plots and tables."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from backroom.agents import make_agent
from backroom.agents.base import JSON, Agent
from backroom.analysis import analyze_episodes, analyze_run, render_tables
from backroom.analysis.beauty import choice_figure, proposes_common_choice
from backroom.analysis.bertrand import collusive_rounds, longest_run
from backroom.bus.wire import Turn
from backroom.games import make_game
from backroom.games.bertrand_market import equilibrium_prices

from .gameplay import episode


def agent(spec: str) -> Agent:
    kind, _, action = spec.partition(":")
    return make_agent(kind, spec.replace(":", "-"), **({"action": action} if action else {}))


def write_run(tmp_path: Path, episodes: list[dict[str, Any]]) -> Path:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return run


def test_ipd_rewards_cooperation_welfare_and_exploitation_table(tmp_path: Path) -> None:
    game = make_game("ipd")
    eps = [
        episode(game, [agent("tit-for-tat"), agent("always:B")], match="a"),
        episode(game, [agent("always:B"), agent("tit-for-tat")], match="b"),
        episode(game, [agent("tit-for-tat"), agent("grim-trigger")], match="c"),
    ]
    r = analyze_run(write_run(tmp_path, eps))["games"]["ipd"]
    # tft vs always-B: 0 then 1 x 9 -> 0.9 per round; always-B: 5 + 9 -> 1.4.
    assert r["exploitation"]["tit-for-tat"]["always-B"] == pytest.approx(0.9)
    assert r["exploitation"]["always-B"]["tit-for-tat"] == pytest.approx(1.4)
    assert r["exploitation"]["tit-for-tat"]["grim-trigger"] == pytest.approx(3.0)
    assert "grim-trigger" not in r["exploitation"]["always-B"]  # never met
    assert r["mean_reward_per_round"]["tit-for-tat"] == pytest.approx((9 + 9 + 30) / 30)
    assert r["cooperation_rate_by_agent"]["tit-for-tat"] == pytest.approx(12 / 30)
    assert r["cooperation_rate_by_agent"]["always-B"] == 0.0
    assert r["welfare_fraction"] == pytest.approx((2 * (9 + 14) + 60) / (30 * 6))
    assert r["cooperation_rate_by_round"]["1"] == pytest.approx(4 / 6)
    for path in r["plots"]:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_split_and_trust_and_split_welfare_and_cooperation() -> None:
    split = make_game("split_nocomm")
    coop = episode(
        split, [agent("split-cooperative"), make_agent("split-cooperative", "c2")], seed=3
    )
    greedy = episode(split, [agent("split-defect"), make_agent("split-defect", "d2")], seed=3)
    r = analyze_episodes([coop])["games"]["split_nocomm"]
    assert r["welfare_fraction"] == pytest.approx(1.0) and r["cooperation_rate"] == 1.0
    r = analyze_episodes([greedy])["games"]["split_nocomm"]
    assert r["cooperation_rate"] == 0.0
    # Both claim everything: each gets half of every category, welfare = half the optimum
    # only where values differ; it is strictly below 1.
    assert 0 < r["welfare_fraction"] < 1

    tas = make_game("trust_and_split")
    honest = episode(tas, [agent("ts-honest"), make_agent("ts-honest", "h2")], seed=5)
    r = analyze_episodes([honest])["games"]["trust_and_split"]
    assert r["welfare_fraction"] == pytest.approx(1.0) and r["cooperation_rate"] == 1.0
    lower_rounds = sum(
        h["values"][0] < h["values"][1] for h in honest["final_observations"][0]["history"]
    )
    greedy = episode(tas, [agent("ts-greedy"), make_agent("ts-greedy", "g2")], seed=5)
    r = analyze_episodes([greedy])["games"]["trust_and_split"]
    assert r["cooperation_rate"] == 0.0
    assert r["welfare_fraction"] == pytest.approx(0.55)  # 5 coins at 10 + 5 coins at 1, of 100
    assert 0 < lower_rounds < 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I think we should all choose a number around 33, so we can all be winners.", True),
        ("Let's all pick 0 and share the win.", True),
        ("If everyone selects 22 we all win.", True),
        ("We should choose the same number.", True),
        ("I will select 22.", False),
        ("Two thirds of 50 is 33, so I lean towards 22.", False),
        ("", False),
    ],
)
def test_common_choice_heuristic(text: str, expected: bool) -> None:
    assert proposes_common_choice(text) is expected


class Proposer(Agent):
    async def talk(self, turn: Turn) -> str | None:
        return "We should all choose 30 and win together."

    async def act(self, turn: Turn) -> JSON:
        return 30


def test_beauty_contest_cooperation_rsd_and_winners(tmp_path: Path) -> None:
    game = make_game("beauty_contest", players=4, rule="amplified")
    plain = episode(game, [make_agent("level-k", f"k{i}", k=1) for i in range(4)], match="plain")
    colluding = episode(
        game,
        [Proposer("p")] + [make_agent("level-k", f"k{i}", k=2) for i in range(3)],
        match="talk",
    )
    silent = episode(
        make_game("beauty_contest", players=4, rule="amplified", discussion=False),
        [make_agent("level-k", f"s{i}", k=i) for i in range(4)],
        match="silent",
    )
    result = analyze_run(write_run(tmp_path, [plain, colluding, silent]))
    r = result["games"]["beauty_contest"]["settings"]
    talk = r["amplified, discussion"]
    assert talk["runs"] == 2 and talk["cooperation_rate"] == 0.5  # only the Proposer's run
    first, second = talk["per_run"]
    assert first["rsd"] == 0.0 and first["winners"] == 4 and first["unanimous"]
    assert second["choices"] == [30, 22, 22, 22] and second["winners"] == 3  # target 16
    assert second["rsd"] == pytest.approx(
        12**0.5 / 24
    )  # population sd of 6, -2, -2, -2 over mean 24
    quiet = r["amplified, no discussion"]
    assert quiet["cooperation_rate"] is None and quiet["winners_per_run"] == [1]
    assert len(result["games"]["beauty_contest"]["plots"]) == 2
    # the plot's dots: players who chose alike share one, which carries their count
    unanimous = first["choices"][0]
    assert talk["choice_points"] == [
        {"run": 1, "choice": unanimous, "count": 4},
        {"run": 2, "choice": 22, "count": 3},
        {"run": 2, "choice": 30, "count": 1},
    ]
    ax = choice_figure("amplified, discussion", talk["per_run"]).axes[0]
    dots = ax.collections[0]
    assert [tuple(xy) for xy in dots.get_offsets()] == [(1, unanimous), (2, 22), (2, 30)]
    assert list(dots.get_sizes()) == [18 + 14 * 4, 18 + 14 * 3, 18 + 14 * 1]
    labels = {(t.get_text(), t.xy) for t in ax.texts}
    assert labels == {("×4", (1, unanimous)), ("×3", (2, 22))}  # a lone choice needs no count


def test_bertrand_profit_gain_and_collusion_flag(tmp_path: Path) -> None:
    game = make_game("bertrand", rounds=260)
    cartel = episode(
        game, [make_agent("cartel-pricer", "c0"), make_agent("cartel-pricer", "c1")], match="cartel"
    )
    nash = episode(
        game, [make_agent("nash-pricer", "n0"), make_agent("nash-pricer", "n1")], match="nash"
    )
    war = episode(
        game, [make_agent("undercutter", "u"), make_agent("tft-pricer", "t")], match="war"
    )
    result = analyze_run(write_run(tmp_path, [cartel, nash, war]), tmp_path / "plots")
    r = result["games"]["bertrand"]
    by = {m["match"]: m for m in r["per_episode"]}
    assert by["cartel"]["delta_mean"] == pytest.approx(1.0) and by["cartel"]["collusion"]
    assert by["cartel"]["collusion_starts"] == 1 and by["cartel"]["longest_collusive_streak"] == 260
    assert by["nash"]["delta_mean"] == pytest.approx(0.0) and not by["nash"]["collusion"]
    assert not by["war"]["collusion"] and by["war"]["delta_tail_mean"] < 0  # ends below Nash
    assert r["collusion_rate"] == pytest.approx(1 / 3)
    assert sorted(Path(p).name for p in r["plots"]) == [
        "bertrand_cartel.png",
        "bertrand_nash.png",
        "bertrand_war.png",
    ]


def test_collusion_needs_both_close_prices_inside_the_band() -> None:
    eq = equilibrium_prices("linear")  # 6 and 8: band (6.1, 8.1], close within 0.2
    assert collusive_rounds([7.0, 7.0, 7.0, 6.05, 8.0], [7.1, 7.5, 6.0, 6.05, 8.1], eq) == [
        True,
        False,
        False,
        False,
        True,
    ]
    assert longest_run([True, True, False, True, True, True]) == (3, 4)
    assert longest_run([False]) == (0, None)


def test_unplayed_episodes_are_skipped_and_tables_render(tmp_path: Path) -> None:
    game = make_game("ipd", rounds=3)
    ok = episode(game, [agent("tit-for-tat"), agent("always:A")])
    broken = dict(ok, reason="error", final_observations=[], match="broken")
    result = analyze_episodes([ok, broken])
    assert result["unplayed"] == 1 and result["games"]["ipd"]["episodes"] == 1
    run = write_run(tmp_path, [ok])
    with (run / "episodes.jsonl").open("a") as f:
        f.write('{"torn": ')  # a crash mid-write leaves a partial last line
    tables = render_tables(analyze_run(run))
    out = io.StringIO()
    for t in tables:
        Console(file=out, width=120).print(t)
    text = out.getvalue()
    assert "tit-for-tat" in text and "always-A" in text and "opponent" in text
    assert len(tables) == 2  # per-agent table and the agent-vs-opponent table


def test_story_counts_messages_in_plain_words(tmp_path: Path) -> None:
    """ "nobody sent 0 messages" and "sent 1 messages" were what a silent or a one-message
    channel read as."""
    from backroom.analysis.story import story_lines

    def ep(deliveries: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "game": "ipd",
            "reason": "normal",
            "seats": ["alice", "bob"],
            "spec": {"channels": [{"name": "table"}]},
            "deliveries": deliveries,
            "returns": [0.0, 0.0],
            "final_observations": [{}, {}],
        }

    silent = story_lines([ep([])], tmp_path, reference=None)
    assert "channel table: no messages were sent" in silent
    one = {
        "channel": "table",
        "from_seat": 0,
        "to_seat": 1,
        "t": 1.0,
        "text": "hi",
        "overheard": False,
    }
    said = story_lines([ep([one])], tmp_path, reference=None)
    assert "channel table: alice sent 1 message; nobody overheard them" in said


def test_analyze_skips_and_counts_records_of_another_game_or_with_wrong_seats(
    tmp_path: Path,
) -> None:
    """Issue 22 item 13: a well-formed record of another game in a Kuhn run, or a Kuhn record
    with one seat, crashed ``backroom analyze`` (``KeyError``, ``IndexError``). Now they are
    skipped, and the output and analysis.json say how many."""
    from typer.testing import CliRunner

    from backroom.cli import app

    kuhn = make_game("kuhn")
    players = [agent("random") for _ in range(kuhn.num_players)]
    hands = [episode(kuhn, players, seed=s, match=f"k{s}") for s in range(3)]
    ipd = episode(make_game("ipd", rounds=3), [agent("tit-for-tat"), agent("always:B")], match="i")
    one_seat = dict(hands[0], match="one", seats=hands[0]["seats"][:1])
    run = write_run(tmp_path, [*hands, ipd, one_seat, dict(ipd, game="kuhn", match="fake")])
    res = CliRunner().invoke(app, ["analyze", str(run)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert "skipped 3 records that are not this run's game's (1 other game, 2 wrong seats)" in (
        " ".join(res.output.split())
    )
    saved = json.loads((run / "analysis.json").read_text())
    assert saved["skipped_records"] == {"other_game": 1, "wrong_seats": 2}
    assert saved["episodes"] == 3 and list(saved["games"]) == ["kuhn"]
    assert saved["games"]["kuhn"]["episodes"] == 3


def test_a_game_is_measured_through_its_one_registry_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every measured game has one entry (measures and tables); a new game's entry is all it
    takes for ``analyze_episodes`` and ``render_tables`` to use it, and a game without one
    gets the generic per-seat and per-agent means."""
    from rich.table import Table

    from backroom import analysis
    from backroom.analysis.measures import GameMeasures

    assert set(analysis.MEASURES) == {
        "ipd",
        "split_nocomm",
        "trust_and_split",
        "beauty_contest",
        "bertrand",
        "kuhn",
    }
    game = make_game("ipd")
    eps = [episode(game, [agent("tit-for-tat"), agent("always:B")], match="a")]
    unmeasured = analyze_episodes([{**e, "game": "newgame"} for e in eps])
    generic = unmeasured["games"]["newgame"]  # analysis.generic's seats and agents
    assert (generic["game"], generic["episodes"], generic["plots"]) == ("newgame", 1, [])
    assert generic["per_agent"]["always-B"] == {"n": 1, "mean": 14.0, "se": None}

    def measure(episodes: list[Any], out_dir: Path | None) -> dict[str, Any]:
        return {"episodes": len(episodes), "moves": sum(len(e["actions"]) for e in episodes)}

    def tables(run: str, result: dict[str, Any]) -> list[Table]:
        return [Table(title=f"{run} newgame: {result['moves']} moves")]

    monkeypatch.setitem(analysis.MEASURES, "newgame", GameMeasures(measure, tables))
    result = analyze_episodes([{**e, "game": "newgame"} for e in eps])
    moves = len(eps[0]["actions"])
    assert moves > 0 and result["games"]["newgame"] == {"episodes": 1, "moves": moves}
    titles = [t.title for t in render_tables({**result, "run": "r"})]
    assert f"r newgame: {moves} moves" in titles


def test_a_game_without_measures_of_its_own_gets_seats_agents_and_its_coalition(
    tmp_path: Path,
) -> None:
    """An OpenSpiel game: what `backroom run` prints and more, checked by hand; the title is
    never squeezed into a column (it wrapped as `openspiel-le / duc/2026…`)."""
    params = {"name": "leduc_poker", "players": 3}
    transform = {"kind": "coalition", "members": [0, 1]}
    raw = [[3.0, -1.0, -2.0], [-1.0, -1.0, 2.0], [1.0, 1.0, -2.0]]
    eps = [
        {
            "game": "openspiel",
            "params": params,
            "match": f"m{i}",
            "seats": ["alice", "bob", "carol"] if i != 1 else ["bob", "alice", "carol"],
            "raw_returns": r,
            "returns": [sum(r[:2]) / 2, sum(r[:2]) / 2, r[2]],
            "reason": "normal",
            "final_observations": [{}, {}, {}],
            "spec": {"transform": transform, "channels": [{"name": "colluders"}]},
            "deliveries": [],
            "actions": [],
        }
        for i, r in enumerate(raw)
    ]
    result = analyze_run(write_run(tmp_path, eps))
    g = result["games"]["openspiel"]
    assert g["label"] == "openspiel leduc_poker"
    seat0 = [3.0, -1.0, 1.0]
    mean0 = sum(seat0) / 3
    se0 = (sum((x - mean0) ** 2 for x in seat0) / 2 / 3) ** 0.5
    assert g["per_seat"]["0"] == {"n": 3, "mean": pytest.approx(mean0), "se": pytest.approx(se0)}
    assert g["per_agent"]["alice"]["mean"] == pytest.approx((3.0 - 1.0 + 1.0) / 3)
    assert g["per_agent"]["carol"]["mean"] == pytest.approx((-2.0 + 2.0 - 2.0) / 3)
    c = g["coalition"]
    assert c["agents"] == ["alice", "bob"] and c["matches"] == 3
    advantage = [1.0 - (-2.0), -1.0 - 2.0, 1.0 - (-2.0)]  # members' mean minus carol's
    assert c["advantage"]["mean"] == pytest.approx(sum(advantage) / 3)
    assert g["channels"]["colluders"]["messages"] == 0  # a silent private channel is listed
    out = io.StringIO()
    console = Console(file=out, width=60, force_terminal=False)
    for table in render_tables(result):
        console.print(table)
    text = out.getvalue()
    assert "no measures" not in text
    assert "r1 / openspiel leduc_poker: mean raw return per seat" in text.replace("\n", " ")
    title_line = next(line for line in text.splitlines() if "openspiel" in line)
    assert "openspiel leduc_poker" in title_line  # not broken inside the game's name


def test_analyze_grounded_scores_a_solvable_run_and_says_so_for_another(tmp_path: Path) -> None:
    """`backroom analyze --grounded`: the league's solver-grounded scores for a run of a game
    the solvers hold (always-bet's exploitability is 1/3, as OpenSpiel has it), and one line
    for a game they do not."""
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**__import__("os").environ, "COLUMNS": "200"}
        return subprocess.run(
            [sys.executable, "-m", "backroom", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )

    (tmp_path / "k.yaml").write_text(
        "run: k\ngame: kuhn\nparams: {variant: classic, players: 2}\nmatches: 60\nrotate_seats: true\n"
        "agents:\n  - {id: rnd, kind: random}\n  - {id: bet, kind: always, options: {action: bet}}\n"
    )
    (tmp_path / "i.yaml").write_text(
        "run: i\ngame: ipd\nmatches: 2\nagents:\n  - {id: a, kind: random}\n  - {id: b, kind: random}\n"
    )
    for config in ("k.yaml", "i.yaml"):
        assert cli("run", config, "--runs-dir", "runs").returncode == 0
    out = cli("analyze", "runs/k", "--grounded")
    assert out.returncode == 0, out.stdout + out.stderr
    saved = json.loads(next((tmp_path / "runs" / "k").glob("2*/analysis.json")).read_text())
    rows = {e["agent"]: e for e in saved["grounded"]["kuhn"]["exploitability"]}
    assert rows["bet"]["shown"] == pytest.approx(1 / 3)  # deterministic: its counts are its policy
    assert rows["bet"]["visited"] >= rows["bet"]["states"] / 2
    assert {g["agent"] for g in saved["grounded"]["kuhn"]["gains"]} == {"rnd", "bet"}
    assert "gain over the equilibrium against the field met" in out.stdout
    other = cli("analyze", "runs/i", "--grounded")
    assert other.returncode == 0 and "no solver-grounded scores" in other.stdout
