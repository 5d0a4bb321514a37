"""Team (collusion) solve, strategy distillation, per-deal analysis, heatmap and EV table."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from backroom.cli.solve import solve_app
from backroom.games import make_game
from backroom.solvers.cfr import CFRSolver
from backroom.solvers.collusion import (
    PAPER_HANDS,
    READINGS,
    CollusionReport,
    advantage_grid,
    analyse_collusion,
    ev_table,
    hand_evs_from_episodes,
    hand_values,
    per_deal_values,
    plot_heatmap,
    why_different,
    write_report,
)
from backroom.solvers.evaluate import best_response, expected_returns, nash_conv
from backroom.solvers.team import (
    TEAM,
    build_team_tree,
    distill_individual_policy,
    distill_strategy,
    distill_team_policy,
    lift_policy,
    paper_state,
    solve_team,
)
from backroom.solvers.tree import build_tree


@cache
def solved(variant: str, iterations: int) -> tuple:
    """3-player CFR and the team solve for one Kuhn variant (cached across tests)."""
    kw = {"variant": variant, "players": 3} if variant == "classic" else {"variant": variant}
    game = make_game("kuhn", **kw)
    tree = build_tree(game, features=paper_state)
    solver = CFRSolver(tree, "cfr+")
    solver.run(iterations)
    sol = solve_team(game, (0, 1), iterations, "cfr+")
    return game, tree, solver.average_policy(), sol


def test_team_tree_sees_both_cards_and_is_two_player_zero_sum() -> None:
    game = make_game("kuhn", variant="loki")
    tree = build_team_tree(game, (0, 1))
    assert tree.num_players == 2 and tree.owner == (0, 0, 1)
    np.testing.assert_allclose(tree.term_utility.sum(axis=1), 0.0, atol=1e-12)
    np.testing.assert_allclose(tree.term_utility[:, 0], tree.term_returns[:, :2].sum(axis=1))
    team_keys = [
        tree.infoset_key[i] for i in tree.real_infosets() if tree.infoset_player[i] == TEAM
    ]
    assert all(k.startswith("team[") and " / 1:" in k for k in team_keys)
    # 20 ordered colluder card pairs x 3 starts at the first colluder decision
    plain = build_tree(game)
    assert len(team_keys) > sum(
        1 for i in plain.real_infosets() if plain.infoset_player[i] in (0, 1)
    )
    with pytest.raises(ValueError):
        build_team_tree(game, (0, 0))


@pytest.mark.parametrize(("variant", "iterations"), [("classic", 3000), ("loki", 1500)])
def test_team_never_worse_than_independent_cfr(variant: str, iterations: int) -> None:
    """The team solve gives the colluders at least what independent CFR gives them.

    At a three-player equilibrium C already best-responds, so in a zero-sum
    game the colluders' value there is at most the team's max-min value; the
    slack allowed is the solvers' own distance from equilibrium.
    """
    _game, tree, cfr, sol = solved(variant, iterations)
    indep = expected_returns(tree, cfr)[:2].sum()
    slack = nash_conv(tree, cfr) + 2 * sol.exploitability
    assert sol.team_value >= indep - slack
    # worst case over C: the team strategy guarantees at least the independent one
    lifted = lift_policy(sol.tree, tree.policy_dict(cfr))
    np.testing.assert_allclose(expected_returns(sol.tree, lifted)[TEAM], indep, atol=1e-12)
    indep_guaranteed = -best_response(sol.tree, lifted, 1)[0]
    assert sol.guaranteed_value() >= indep_guaranteed - 2 * sol.exploitability
    # and against C's fixed CFR policy, the team's best response beats playing independently
    br_value, response = best_response(sol.tree, lifted, TEAM, with_response=True)
    assert br_value >= indep - 1e-12
    assert response is not None
    assert expected_returns(sol.tree, response)[TEAM] == pytest.approx(br_value, abs=1e-12)


def test_loki_team_gains_strictly() -> None:
    """Sharing cards is worth something real in Loki Kuhn, beyond solver error."""
    _game, tree, cfr, sol = solved("loki", 1500)
    indep = expected_returns(tree, cfr)[:2].sum()
    slack = nash_conv(tree, cfr) + 2 * sol.exploitability
    assert sol.team_value - indep > 10 * slack


def test_distillation_matches_algorithm_3_literally() -> None:
    _game, _tree, _cfr, sol = solved("classic", 3000)
    distilled = distill_team_policy(sol)
    t = sol.tree
    reach = t.infoset_reach(sol.sigma)
    entries = []
    for i in t.real_infosets():
        if t.infoset_player[i] != TEAM:
            continue
        s, k = int(t.infoset_start[i]), int(t.infoset_size[i])
        seat = int(t.infoset_key[i][5])
        entries.append((seat, t.infoset_key[i], sol.sigma[s : s + k].tolist(), float(reach[i])))
    assert distilled

    def own_state(key: str, seat: int) -> str | None:
        """The seat's own information state inside a team key, when that seat is the mover."""
        if not key.startswith(f"team[{seat}] "):
            return None
        parts = dict(p.split(":", 1) for p in key.split(" ", 1)[1].split(" / "))
        return parts[str(seat)]

    checked = 0
    for label, row in distilled.items():
        for seat in (0, 1):
            if not any(own_state(e[1], seat) == label for e in entries):
                continue

            def matches(key: str, s: int = seat, lab: str = label) -> bool:
                return own_state(key, s) == lab

            literal = distill_strategy(entries, [seat], matches, 2)
            np.testing.assert_allclose([row["0"], row["1"]], literal, atol=1e-12)
            checked += 1
    assert checked == len(distilled)
    # no match -> uniform (Algorithm 3, line 16)
    assert distill_strategy(entries, [0], lambda key: False, 3) == [1 / 3] * 3
    # weights matter: a zero-weight entry is ignored
    assert distill_strategy(
        [(0, "a", [1, 0], 0.0), (0, "a", [0, 1], 2.0)], [0], lambda k: True, 2
    ) == [0, 1]
    # players outside the coalition are skipped
    assert distill_strategy([(2, "a", [1, 0], 1.0)], [0, 1], lambda k: True, 2) == [0.5, 0.5]


def test_paper_state_is_hand_bets_folds() -> None:
    """Algorithm 3's query: own card, chips in by seat, folds by seat, and what the mover may do."""
    state = make_game("kuhn", variant="loki", start=0).new_initial_state(seed=3)
    state.apply({0: 2})  # seat 0 raises
    state.apply({1: 0})  # seat 1 folds
    card = state.observation(2)["card"]
    assert json.loads(paper_state(state, 2)) == [card, [2, 1, 1], [False, True, False], [0, 1, 2]]
    state.apply({2: 2})  # seat 2 raises; seat 0, who raised already, may only fold or call
    assert json.loads(paper_state(state, 0))[1:] == [[2, 1, 3], [False, True, False], [0, 1]]


def test_individual_distillation_by_hand() -> None:
    """The paper's construction on a hand-made profile, against a computation on paper.

    Everybody calls, except that seat 0 raises at its first decision. The query
    (card c, bets [1,1,1], no folds) then matches, among the colluders' states,
    seat 0 first to act, after seat 2 called, after seats 1 and 2 called (each
    reached with probability 1/5 · 1/3, raising) and seat 1 first to act
    (1/15, calling); seat 1 never sees [1,1,1] otherwise, because seat 0 has
    raised before its turn. Algorithm 3: (3·raise + 1·call) / 4.
    """
    _game, tree, _cfr, _sol = solved("loki", 1500)
    sigma = np.zeros(tree.num_slots)
    sigma[tree.root_slot] = 1.0
    for i in tree.real_infosets():
        s = int(tree.infoset_start[i])
        first = tree.infoset_parent[i] == tree.root_slot[tree.infoset_player[i]]
        act = 2 if tree.infoset_player[i] == 0 and first else 1  # raise : call
        sigma[s + tree.infoset_actions[i].index(act)] = 1.0
    paper = distill_individual_policy(tree, sigma, (0, 1))
    for c in range(5):
        for key in (f"{c} s0 ", f"{c} s2 c", f"{c} s1 cc", f"{c} s1 "):  # seat 0 x3, seat 1
            assert paper[key] == pytest.approx({"0": 0.0, "1": 0.25, "2": 0.75}), key
        assert paper[f"{c} s0 r"] == pytest.approx({"0": 0.0, "1": 1.0, "2": 0.0})  # facing a raise
    assert len(paper) == sum(1 for i in tree.real_infosets() if tree.infoset_player[i] < 2)
    # seat 2 is no colluder: its states are not distilled
    assert "0 s2 " not in paper
    # one colluder alone pools only its own states: seat 1's opening stays a call
    alone = distill_individual_policy(tree, sigma, (1,))
    assert alone["3 s1 "] == pytest.approx({"0": 0.0, "1": 1.0, "2": 0.0})


def test_individual_distillation_matches_algorithm_3_literally() -> None:
    """Grouped implementation = Algorithm 3 scanned over every CFR state, on solved Loki CFR."""
    _game, tree, cfr, _sol = solved("loki", 1500)
    paper = distill_individual_policy(tree, cfr, (0, 1))
    reach = tree.infoset_reach(cfr)
    feature = dict(zip(tree.node_infoset.tolist(), tree.node_features, strict=True))
    entries = []
    for i in tree.real_infosets():
        s, k = int(tree.infoset_start[i]), int(tree.infoset_size[i])
        player = int(tree.infoset_player[i])
        entries.append((player, feature[i], cfr[s : s + k].tolist(), float(reach[i])))
    for i in tree.real_infosets()[::7]:  # a sample: the scan is quadratic
        if tree.infoset_player[i] == 2:
            continue
        q, k = feature[i], int(tree.infoset_size[i])

        def matches(state: str, q: str = q) -> bool:
            return state == q

        literal = distill_strategy(entries, [0, 1], matches, k)
        got = [paper[tree.infoset_key[i]][json.dumps(a)] for a in tree.infoset_actions[i]]
        np.testing.assert_allclose(got, literal, atol=1e-12)
    # with the full information state as the query, pooling changes nothing (classic Kuhn)
    game = make_game("kuhn", variant="classic", players=3)
    small = build_tree(game, features=lambda state, seat: state.information_state(seat))
    solver = CFRSolver(small, "cfr+")
    solver.run(200)
    avg = solver.average_policy()
    rows = small.policy_dict(avg)
    for key, row in distill_individual_policy(small, avg, (0, 1)).items():
        assert row == pytest.approx(rows[key])
    with pytest.raises(ValueError, match="features"):
        distill_individual_policy(build_tree(game), avg, (0, 1))


def test_seeded_cfr_starts_elsewhere_and_still_converges() -> None:
    """``seed`` is how the collusion spread looks for other equilibria: a random start, same limit."""
    tree = build_tree(make_game("kuhn", variant="classic", players=3))
    uniform = CFRSolver(tree, "cfr+")
    a, b = CFRSolver(tree, "cfr+", seed=0), CFRSolver(tree, "cfr+", seed=1)
    np.testing.assert_array_equal(uniform.current_policy(), tree.uniform())
    assert not np.allclose(a.current_policy(), tree.uniform())
    assert not np.allclose(a.current_policy(), b.current_policy())
    np.testing.assert_array_equal(
        a.current_policy(), CFRSolver(tree, "cfr+", seed=0).current_policy()
    )
    a.run(3000)
    assert nash_conv(tree, a.average_policy()) < 2e-3


def test_per_deal_values_average_to_expected_returns() -> None:
    _game, tree, cfr, _sol = solved("loki", 1500)
    deals, values = per_deal_values(tree, cfr)
    assert len(deals) == 60 and len(set(deals)) == 60
    np.testing.assert_allclose(values.mean(axis=0), expected_returns(tree, cfr), atol=1e-12)
    np.testing.assert_allclose(values.sum(axis=1), 0.0, atol=1e-12)
    # the Ace holder never loses chips at showdown: its conditional value beats the 10's
    ace = np.mean([v[2] for d, v in zip(deals, values, strict=True) if d[2] == 4])
    ten = np.mean([v[2] for d, v in zip(deals, values, strict=True) if d[2] == 0])
    assert ace > 0 > ten


@pytest.fixture(scope="module")
def report() -> CollusionReport:
    return analyse_collusion(make_game("kuhn", variant="loki"), 1500)


def test_collusion_report_heatmap_and_table(report: CollusionReport, tmp_path: Path) -> None:
    adv = report.advantage()
    assert adv.shape == (60,)
    assert report.average_advantage() == pytest.approx(float(adv.mean()))
    s = report.summary
    # coalition payoff is the mean of the two colluders: half the team's summed advantage
    cfr_team = sum(s["mean_values"]["cfr"][:2])
    assert report.average_advantage() == pytest.approx(
        (s["team_value_sum"] - cfr_team) / 2, abs=1e-9
    )
    assert s["team_br_value_sum"] >= max(cfr_team, s["team_value_sum"] - 1e-3)
    grid = advantage_grid(report)
    assert np.isnan(grid[:, 2, 2]).all() and np.isnan(grid[2, 2, :]).all()  # impossible deals blank
    assert np.nanmean(grid[-1]) == pytest.approx(report.average_advantage())
    png = plot_heatmap(report, tmp_path / "fig2.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    files = write_report(report, tmp_path / "out", heatmaps=("paper",))  # team's: fig2.png above
    data = json.loads(files["json"].read_text())
    assert len(data["deals"]) == 60
    for name in ("cfr", "team", "distilled", "paper"):
        doc = json.loads(files[f"{name}_policy"].read_text())
        assert doc["game"] == "kuhn" and doc["policy"]
    table = files["table"].read_text()
    row = hand_values(report, "cfr", PAPER_HANDS, 2)
    assert f"{row[(0, 1, 4)]:.2f}" in table and "CFR Collusion" in table
    paper_row = hand_values(report, "paper", PAPER_HANDS, 2)
    assert f"| CFR Collusion, paper's construction | {paper_row[(0, 1, 4)]:.2f} |" in table
    # the paper's construction has its own Figure 2 beside the team solve's
    assert files["heatmap_paper"].name == "collusion_heatmap_paper.png"
    assert files["heatmap_paper"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "paper" in data["deals"][0]


def test_paper_construction_reading(report: CollusionReport) -> None:
    """The paper's reading: Algorithm 3 on the colluders' own CFR strategies, C keeps CFR."""
    s = report.summary
    assert set(READINGS) == set(report.values) == set(s["readings"])
    paper = report.policies["paper"]
    cfr = report.policies["cfr"]
    # only colluders' states are distilled, and the result differs from their CFR strategies
    assert paper and all(key in cfr for key in paper)
    assert max(abs(paper[k][a] - cfr[k][a]) for k in paper for a in paper[k]) > 0.05
    # its values are the per-deal values of exactly that profile
    _game, tree, _cfr, _sol = solved("loki", 1500)
    deals, values = per_deal_values(tree, tree.sigma_from_policy({**cfr, **paper}))
    assert deals == report.deals
    np.testing.assert_allclose(report.values["paper"], values, atol=1e-12)
    # no card is shared: it is not the team reading, and it is far smaller
    adv = s["average_advantage"]
    assert adv["paper"] == pytest.approx(report.average_advantage("paper"))
    assert not np.allclose(report.values["paper"], report.values["team"], atol=1e-3)
    assert abs(adv["paper"]) < 0.02 < adv["team"]
    assert np.nanmean(advantage_grid(report, "paper")[-1]) == pytest.approx(adv["paper"])
    line = why_different(report)
    assert "docs/solvers.md" in line and f"{adv['paper']:+.4f}" in line and "\n" not in line


def test_ev_table_takes_measured_rows() -> None:
    records = []
    for seed in range(40):
        state = make_game("kuhn", variant="loki").new_initial_state(seed=seed)
        while not state.is_terminal():
            (p,) = state.current_players()
            state.apply({p: 1})  # everybody calls: straight to showdown
        rec = {
            "game": "kuhn",
            "params": {"variant": "loki"},
            "seed": seed,
            "seats": ["a", "b", "c"],
            "reason": "normal",
            "raw_returns": state.returns(),
            "returns": state.returns(),
            # half the records lack final observations: the hand comes from replaying the seed
            "final_observations": [state.observation(s) for s in range(3)] if seed % 2 else [],
        }
        records.append(rec)
    measured = hand_evs_from_episodes(records, seat=2)
    assert sum(n for _, n in measured.values()) == 40
    for hand, (mean, _n) in measured.items():
        assert mean == (2.0 if hand[2] == max(hand) else -1.0)  # showdown: pot 3, ante 1
    table = ev_table(
        {"CFR": {(0, 1, 4): 2.5}, "measured": measured}, hands=[(0, 1, 4), *measured][:3]
    )
    assert "| CFR | 2.50 |" in table and "(n=" in table
    assert table.count("\n") == 6


@pytest.mark.slow
def test_collusion_cli(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        solve_app, ["collusion", "--iterations", "300", "--out-dir", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    assert "average collusion advantage" in res.output
    assert "average collusion advantage (paper - cfr)" in res.output
    assert (tmp_path / "collusion_heatmap.png").exists() and (tmp_path / "ev_table.md").exists()
    assert (tmp_path / "collusion_heatmap_paper.png").exists()
    # next to the paper's figure, one line on why ours differs and where the doc says more
    lines = res.output.splitlines()
    why = lines[lines.index("paper: 0.0078") + 1]
    assert why.startswith("why ours differs") and "docs/solvers.md" in why


@pytest.mark.slow
def test_collusion_cli_takes_a_baseline_policy(tmp_path: Path) -> None:
    """``--cfr-policy`` fixes the three-player equilibrium the readings are measured from."""
    res = CliRunner().invoke(
        solve_app,
        ["collusion", "-n", "200", "--cfr-policy", "kuhn_loki_cfr", "--out-dir", str(tmp_path)],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "collusion.json").read_text())
    assert doc["summary"]["cfr_policy"] == "given" and doc["summary"]["iterations"] is None
    # the shipped policy's NashConv, not a 200-iteration solve's
    assert doc["summary"]["cfr_nash_conv"] < 2e-3
    bad = CliRunner().invoke(
        solve_app, ["collusion", "--cfr-policy", "no_such_policy", "--out-dir", str(tmp_path)]
    )
    assert bad.exit_code != 0


def test_shipped_team_policy_is_the_team_solve(tmp_path: Path) -> None:
    """kuhn_loki_team.json is `backroom solve team`'s output: analyze's team solve, rounded.

    Tolerance: each probability within 1e-6 of a fresh solve (the file keeps
    6 decimals, rounding moves a probability by at most 5e-7), and the team
    value of the file's strategy within 1e-5 of the fresh solve's.
    """
    from backroom.analysis.kuhn import TEAM_ITERATIONS
    from backroom.solvers.policy_file import read_policy

    shipped = read_policy("kuhn_loki_team")
    out = tmp_path / "team.json"
    res = CliRunner().invoke(solve_app, ["team", "--out", str(out)])
    assert res.exit_code == 0, res.output
    fresh = json.loads(out.read_text())
    meta = shipped["meta"]
    assert (meta["kind"], meta["team"], meta["algo"]) == ("team", [0, 1], "cfr+")
    assert meta["iterations"] == fresh["meta"]["iterations"] == TEAM_ITERATIONS
    assert shipped["params"] == fresh["params"] == dict(make_game("kuhn", variant="loki").params())
    assert shipped["policy"].keys() == fresh["policy"].keys()
    assert all(key.startswith("team[") for key in shipped["policy"])  # the colluders' rows only
    worst = max(
        abs(p - fresh["policy"][key][a])
        for key, row in shipped["policy"].items()
        for a, p in row.items()
    )
    assert worst <= 1e-6
    # what the table plays: the file's strategy on the team tree, the third player the solve's
    solution = solve_team(make_game("kuhn", variant="loki"), (0, 1), TEAM_ITERATIONS, "cfr+")
    tree = solution.tree
    rows = {k: v for k, v in solution.policy().items() if not k.startswith("team[")}
    sigma = tree.sigma_from_policy({**rows, **shipped["policy"]})
    assert expected_returns(tree, sigma)[TEAM] == pytest.approx(solution.team_value, abs=1e-5)
    assert meta["team_value_sum"] == pytest.approx(solution.team_value, abs=1e-9)


def test_kuhn_team_agent_plays_the_row_of_the_cards_it_was_told() -> None:
    """Told its partner's card, a colluder plays that team row; not told, it averages and counts."""
    import asyncio

    from backroom.agents import make_agent
    from backroom.agents.scripted.kuhn_team import KuhnTeamAgent
    from backroom.bus.wire import ChannelSpec, Delivery, MatchStart, Turn
    from backroom.solvers.team import joint_key

    game = make_game("kuhn", variant="loki")
    state = game.new_initial_state(3)
    seat = next(iter(state.current_players()))
    while seat not in (0, 1):  # play the third player's moves until a colluder is to act
        state.apply({seat: state.legal_actions(seat)[0]})
        seat = next(iter(state.current_players()))
    partner = 1 - seat
    obs = state.observation(seat)
    agent = make_agent("kuhn-team", "a")
    assert isinstance(agent, KuhnTeamAgent) and agent.team == (0, 1)
    channel = ChannelSpec(name="colluders", members=[0, 1], eavesdroppers=[2], opens="start")
    start = MatchStart(
        match="m", seat=seat, seats=["a", "b", "c"], game="kuhn", params=game.params(),
        channels=[channel], turn_timeout_s=5,
    )  # fmt: skip
    turn = Turn(
        match="m", turn=2, seat=seat, phase="act", observation=obs,
        legal=state.action_spec(seat).to_json(), deadline_s=5,
    )  # fmt: skip
    talk = Turn(match="m", turn=1, seat=seat, phase="talk", channel="colluders",
                observation=obs, deadline_s=5)  # fmt: skip

    async def go() -> None:
        await agent.on_match_start(start)
        assert await agent.talk(talk) == f"my card is {obs['card']}"
        rows, unknown = agent.rows(turn)  # nothing heard yet: every card the partner may hold
        assert unknown == [partner] and len(rows) == 4
        await agent.act(turn)
        assert agent.uninformed == 1
        partner_card = state.observation(partner)["card"]
        await agent.on_message(
            Delivery(match="m", channel="colluders", sender="b", sender_seat=partner,
                     text=f"my card is {partner_card}")
        )  # fmt: skip
        rows, unknown = agent.rows(turn)
        states = {s: state.information_state(s) for s in (0, 1)}
        assert unknown == [] and rows == [agent.table[joint_key(seat, states)]]
        assert await agent.act(turn) in state.legal_actions(seat)
        assert (agent.uninformed, agent.misses) == (1, 0)

    asyncio.run(go())
    with pytest.raises(ValueError, match="not a team policy"):
        make_agent("kuhn-team", "x", policy="kuhn_loki_cfr")
