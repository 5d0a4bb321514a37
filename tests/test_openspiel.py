"""OpenSpiel games through backroom's engine interface (``game: openspiel``), in lockstep with pyspiel.

Each history is played twice at once: on a bare pyspiel state and on the
adapter, through backroom's own interface only (``current_players``,
``action_spec``, ``apply`` with a number or OpenSpiel's name, ``observation``).
At every step both must agree on who moves, the legal actions and their
names, chance and its probabilities, every seat's information-state and
observation strings and tensors; at the end on the returns, which must keep
the ``GameInfo`` the adapter declared. The games cover two-player zero-sum,
n-player, simultaneous, chance, one-shot and general-sum play. A bigger sweep
is marked slow.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from backroom.games import CHANCE, IllegalActionError, make_game
from backroom.games.openspiel import MAX_TENSOR, OpenSpielGame, OpenSpielState
from backroom.runner.config import ConfigError, parse_config

pyspiel = pytest.importorskip("pyspiel")

#: (OpenSpiel name, parameters): the games docs/games.md lists as checked in lockstep.
LOCKSTEP: list[tuple[str, dict[str, Any]]] = [
    ("kuhn_poker", {}),
    ("kuhn_poker", {"players": 3}),
    ("leduc_poker", {}),
    ("leduc_poker", {"players": 3}),
    ("liars_dice", {}),
    ("goofspiel", {"num_cards": 5}),
    ("goofspiel", {"num_cards": 4, "players": 3, "imp_info": True}),
    ("tic_tac_toe", {}),
    ("connect_four", {}),
    ("matrix_pd", {}),
    ("matrix_rps", {}),
    ("first_sealed_auction", {}),
    ("oshi_zumo", {"coins": 12}),
    ("blotto", {}),
    ("bargaining", {}),
    ("hearts", {}),
]
IDS = [f"{n}{'-' + '-'.join(f'{k}={v}' for k, v in p.items()) if p else ''}" for n, p in LOCKSTEP]
#: Random histories per game: the default suite plays 4,000 in all, the slow sweep ten times more.
HISTORIES, SWEEP = 250, 2500


def same_views(ours: OpenSpielState, ref: Any, game: Any) -> None:
    """Every seat's strings and tensors, as OpenSpiel gives them."""
    t = game.get_type()
    for p in range(game.num_players()):
        obs = ours.observation(p)
        if t.provides_information_state_string:
            assert obs["info_state"] == ref.information_state_string(p)
            assert ours.information_state(p) == obs["info_state"]
        if t.provides_observation_string:
            assert obs["observation"] == ref.observation_string(p)
        if t.provides_information_state_tensor:
            if game.information_state_tensor_size() <= MAX_TENSOR:
                assert obs["info_state_tensor"] == list(ref.information_state_tensor(p))
            else:
                assert "info_state_tensor" in obs["tensors_left_out"]
        if t.provides_observation_tensor:
            assert obs["observation_tensor"] == list(ref.observation_tensor(p))


def play_lockstep(name: str, params: dict[str, Any], rng: random.Random) -> int:
    """One random history on both; returns its number of moves."""
    game = pyspiel.load_game(name, params)
    ours_game = make_game("openspiel", name=name, **params)
    info = ours_game.info
    ours, ref = ours_game.new_initial_state(), game.new_initial_state()
    moves = chance_nodes = 0
    while not ref.is_terminal():
        assert not ours.is_terminal()
        if ref.is_chance_node():
            assert ours.current_players() == {CHANCE}
            outcomes = ref.chance_outcomes()
            assert ours.chance_outcomes() == [(a, p) for a, p in outcomes]
            assert len(outcomes) <= info.max_chance_outcomes
            action = rng.choices([a for a, _ in outcomes], [p for _, p in outcomes])[0]
            ours.apply({CHANCE: action})
            ref.apply_action(action)
            chance_nodes += 1
            continue
        movers = (
            list(range(game.num_players()))
            if ref.is_simultaneous_node()
            else [ref.current_player()]
        )
        assert sorted(ours.current_players()) == movers
        same_views(ours, ref, game)
        joint: dict[int, Any] = {}
        picked = []
        for p in movers:
            spec = ours.action_spec(p)
            legal = list(ref.legal_actions(p))
            assert list(spec.choices) == legal
            assert list(spec.names) == [ref.action_to_string(p, a) for a in legal]
            if (bad := max(legal) + 1) < game.num_distinct_actions():
                with pytest.raises(IllegalActionError):
                    ours.check_action(p, bad)
            k = rng.randrange(len(legal))
            picked.append(legal[k])
            # half the time by OpenSpiel's name, as an LLM answers
            joint[p] = (
                spec.names[k]
                if rng.random() < 0.5 and spec.names.count(spec.names[k]) == 1
                else legal[k]
            )
        ours.apply(joint)
        if ref.is_simultaneous_node():
            ref.apply_actions(picked)
        else:
            ref.apply_action(picked[0])
        moves += 1
    assert ours.is_terminal() and not ours.current_players()
    same_views(ours, ref, game)
    returns = ours.returns()
    assert returns == list(ref.returns())
    assert all(info.min_utility - 1e-9 <= r <= info.max_utility + 1e-9 for r in returns)
    if info.utility_sum is not None:
        assert sum(returns) == pytest.approx(info.utility_sum)
    assert moves <= info.max_game_length and chance_nodes <= info.max_chance_nodes
    assert ours.observation(0)["returns"] == returns
    return moves


@pytest.mark.parametrize(("name", "params"), LOCKSTEP, ids=IDS)
def test_lockstep_with_pyspiel(name: str, params: dict[str, Any]) -> None:
    rng = random.Random(f"lockstep-{name}-{params}")
    lengths = [play_lockstep(name, params, rng) for _ in range(HISTORIES)]
    assert max(lengths) > 0


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params"), LOCKSTEP, ids=IDS)
def test_lockstep_with_pyspiel_sweep(name: str, params: dict[str, Any]) -> None:
    rng = random.Random(f"sweep-{name}-{params}")
    for _ in range(SWEEP):
        play_lockstep(name, params, rng)


def test_lockstep_covers_the_kinds_of_game() -> None:
    """Two-player zero-sum, n-player, simultaneous, chance and general-sum games are all in."""
    types = [pyspiel.load_game(n, p) for n, p in LOCKSTEP]
    kinds = pyspiel.GameType
    assert len({n for n, _ in LOCKSTEP}) >= 12
    assert any(g.num_players() >= 4 for g in types)
    assert any(g.get_type().dynamics == kinds.Dynamics.SIMULTANEOUS for g in types)
    assert any(g.get_type().chance_mode != kinds.ChanceMode.DETERMINISTIC for g in types)
    assert any(g.get_type().utility == kinds.Utility.GENERAL_SUM for g in types)
    assert any(
        g.get_type().utility == kinds.Utility.ZERO_SUM and g.num_players() == 2 for g in types
    )


def test_game_info_is_openspiels() -> None:
    game = make_game("openspiel", name="leduc_poker", players=3)
    ref = pyspiel.load_game("leduc_poker", {"players": 3})
    info = game.info
    assert (info.num_players, info.min_utility, info.max_utility) == (3, -13.0, 26.0)
    assert info.utility_sum == 0.0 and info.max_game_length == ref.max_game_length()
    # OpenSpiel says 3 chance nodes for any number of players; a 3-player deal has 4
    assert (ref.max_chance_nodes_in_history(), info.max_chance_nodes) == (3, 4)
    assert info.max_chance_outcomes == ref.max_chance_outcomes()
    pd = make_game("openspiel", name="matrix_pd").info
    assert pd.utility_sum is None and pd.max_chance_nodes == 0 and pd.max_game_length == 1


def test_the_seed_resolves_chance_and_replays() -> None:
    """Same seed, same deal (a CRN group); other seeds deal otherwise; play replays exactly."""
    game = make_game("openspiel", name="leduc_poker")
    deals = {s: game.new_initial_state(seed=s).os.history() for s in range(40)}
    assert all(game.new_initial_state(seed=s).os.history() == h for s, h in deals.items())
    assert len({tuple(h) for h in deals.values()}) > 10  # 30 possible private deals

    def play(seed: int) -> list[int]:
        state, rng = game.new_initial_state(seed=seed), random.Random(seed)
        while not state.is_terminal():
            (p,) = state.current_players()
            state.apply({p: rng.choice(state.legal_actions(p))})
        return list(state.os.history())

    assert play(7) == play(7)
    # a clone plays on alone: the original and its chance generator are untouched
    state = game.new_initial_state(seed=3)
    copy = state.clone()
    (p,) = copy.current_players()
    copy.apply({p: copy.legal_actions(p)[0]})
    assert state.os.history() != copy.os.history() and len(state.os.history()) == 2


def test_actions_by_name_and_refusals() -> None:
    state = make_game("openspiel", name="leduc_poker").new_initial_state(seed=1)
    assert state.action_spec(0).names == ("Call", "Raise")
    assert state.check_action(0, "raise") == 2 and state.check_action(0, " Call ") == 1
    with pytest.raises(IllegalActionError, match=r"legal: Call \(1\), Raise \(2\)"):
        state.check_action(0, "Fold")  # nothing to fold against yet
    with pytest.raises(IllegalActionError, match="not to move"):
        state.check_action(1, 1)
    assert state.default_action(0) == 1  # a timed-out seat checks
    assert "Choose one action: Call, Raise" in state.prompt(0)
    assert "Leduc poker" in state.prompt(0) and "[Private: " in state.prompt(0)


def test_leduc_without_a_name_and_the_name_in_the_record() -> None:
    assert make_game("openspiel").params() == {"name": "leduc_poker"}
    assert make_game("openspiel", name="blotto", coins=5).params() == {"name": "blotto", "coins": 5}


def test_rules_for_games_without_a_text_use_openspiels_long_name() -> None:
    state = make_game("openspiel", name="nim").new_initial_state(seed=0)
    assert "Nim" in state.rules(0) and "OpenSpiel's nim" in state.rules(0)
    assert state.observation(0)["observation"] in state.prompt(0)


@pytest.mark.parametrize(
    ("params", "field", "says"),
    [
        ({"name": 3}, "params", "must name an OpenSpiel game, not 3"),
        ({"name": "leduk_poker"}, "params", "did you mean leduc_poker"),
        ({"name": "leduc_poker", "plyers": 3}, "params", "its parameters: action_mapping"),
        ({"name": "leduc_poker", "players": "3"}, "params", "must be of type int"),
        ({"name": "leduc_poker", "players": 30}, "params", "OpenSpiel refused"),
        ({"name": "misere"}, "params", "wrapper around another game"),
        ({"name": "mfg_garnet"}, "params", "mean-field"),
        ({"name": "crossword"}, "params", "action structs"),
    ],
)
def test_the_config_refuses_unknown_games_and_parameters(
    params: dict[str, Any], field: str, says: str
) -> None:
    data = {
        "game": "openspiel",
        "params": params,
        "agents": [{"id": "a", "kind": "random"}, {"id": "b", "kind": "random"}],
    }
    with pytest.raises(ConfigError, match=says) as exc:
        parse_config(data)
    assert field in str(exc.value)


def test_a_config_seats_an_openspiel_game() -> None:
    config = parse_config(
        {
            "game": "openspiel",
            "params": {"name": "liars_dice", "numdice": 1},
            "agents": [
                {"id": "a", "kind": "random"},
                {"id": "b", "kind": "always", "options": {"action": "Liar"}},
            ],
            "channels": [{"name": "table", "members": [0, 1], "opens": "before_act"}],
        }
    )
    game = make_game(config.game, **config.params)
    assert isinstance(game, OpenSpielGame) and game.params() == {"name": "liars_dice", "numdice": 1}
    with pytest.raises(ConfigError, match="Liar"):
        parse_config(
            {
                "game": "openspiel",
                "params": {"name": "liars_dice"},
                "agents": [
                    {"id": "a", "kind": "random"},
                    {"id": "b", "kind": "always", "options": {"action": "Truth"}},
                ],
            }
        )


#: Games that need a file to load (``filename``); they build when given one.
NEED_A_FILE = {"efg_game", "nfg_game"}


def test_every_supported_game_plays_through_the_interface() -> None:
    """Each of OpenSpiel's games (but those that need a file): built bare, seeded, up to 100
    random moves through ``apply`` with views and prompts at every step, and the declared
    ``GameInfo`` holding as far as the play went."""
    from backroom.games.openspiel import supported_games

    played = 0
    for name in sorted(set(supported_games()) - NEED_A_FILE):
        game = make_game("openspiel", name=name)
        state, info = game.new_initial_state(seed=1), game.info
        rng = random.Random(name)
        moves = 0
        while moves < 100 and not state.is_terminal():
            movers = sorted(state.current_players())
            for p in movers:
                assert state.observation(p)["name"] == name and state.prompt(p)
            state.apply({p: rng.choice(state.action_spec(p).choices) for p in movers})
            moves += 1
        # the declared facts hold as far as the play went
        chance = [e for e in state.os.full_history() if e.player == CHANCE]
        assert moves <= info.max_game_length and len(chance) <= info.max_chance_nodes, name
        if state.is_terminal():
            returns = state.returns()
            assert min(returns) >= info.min_utility - 1e-9, name
            assert max(returns) <= info.max_utility + 1e-9, name
            if info.utility_sum is not None:
                assert sum(returns) == pytest.approx(info.utility_sum), name
        played += 1
    assert played >= 100
