"""A config that cannot run is refused at load, at the field to fix, with what is allowed.

Before, ``game: ipdd`` or ``roundz: 10`` loaded fine, started the whole stack
and ended every match in ``error``; an unknown agent kind surfaced as a
spawned process that "exited before the run started".
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from pydantic import ValidationError

from backroom.agents.kinds import agent_kinds
from backroom.games import make_game, registered_games
from backroom.runner.config import ConfigError, RunConfig, parse_config

AGENTS = [{"id": "tft", "kind": "tit-for-tat"}, {"id": "grim", "kind": "grim-trigger"}]


def config(**fields: Any) -> dict[str, Any]:
    return {"run": "t", "game": "ipd", "params": {"rounds": 3}, "agents": AGENTS, **fields}


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="bad.yaml")
    return str(info.value)


def test_a_good_config_still_loads() -> None:
    parsed = parse_config(config())
    assert parsed.game == "ipd" and parsed.params == {"rounds": 3}


def test_unknown_game_names_the_field_and_lists_the_games() -> None:
    message = refusal(config(game="ipdd", params={}))
    assert message.startswith("bad.yaml: game: unknown game 'ipdd'; known: ")
    assert "Value error" not in message  # our words, not pydantic's prefix
    for game in registered_games():
        assert game in message


def test_unknown_parameter_names_it_and_lists_the_engines_parameters() -> None:
    message = refusal(config(params={"roundz": 10}))
    assert "params.roundz: ipd has no parameter 'roundz'; its parameters: " in message
    # the list is the engine's own constructor, so it cannot drift from what the referee takes
    engine = type(make_game("ipd"))
    for name in inspect.signature(engine).parameters:
        assert name in message


def test_a_value_the_engine_refuses_is_reported_at_that_parameter() -> None:
    message = refusal(config(params={"rounds": -1}))
    assert "params.rounds: ipd: rounds must be a positive integer" in message
    message = refusal(config(game="kuhn", params={"variant": "lokii"}, agents=AGENTS))
    assert "params.variant: kuhn variant must be 'classic' or 'loki'" in message


def test_unknown_agent_kind_names_the_entry_and_lists_the_kinds() -> None:
    message = refusal(config(agents=[AGENTS[0], {"id": "eve", "kind": "randon"}]))
    assert "agents.1.kind: unknown agent kind 'randon'; known: " in message
    for kind in [*agent_kinds(), "external"]:
        assert kind in message


def test_bad_kind_and_bad_parameter_are_reported_together() -> None:
    message = refusal(config(params={"roundz": 10}, agents=[AGENTS[0], {"id": "eve", "kind": "x"}]))
    assert "params.roundz" in message and "agents.1.kind" in message


def test_external_is_a_kind_the_runner_waits_for() -> None:
    parsed = parse_config(config(agents=[AGENTS[0], {"id": "dora", "kind": "external"}]))
    assert [a.kind for a in parsed.agents] == ["tit-for-tat", "external"]


def test_seats_the_game_does_not_have_are_refused() -> None:
    loki = {"game": "kuhn", "params": {"variant": "loki"}}
    assert "seats: 2 seats are filled, but kuhn with these params seats 3 players" in refusal(
        config(**loki)
    )
    assert "round_robin: round_robin plays pairs" in refusal(config(**loki, round_robin=True))


def test_channel_members_must_be_seated() -> None:
    message = refusal(config(channels=[{"name": "c", "members": ["tft", "zed"]}]))
    assert "channels.0.members: 'zed' is neither a seat index nor a seated agent" in message
    message = refusal(config(channels=[{"name": "c", "members": [0], "eavesdroppers": [2]}]))
    assert "channels.0.eavesdroppers: seats [2] are outside 0..1" in message
    # in a round robin every pair is a seating: a member named by id is missing from some
    message = refusal(
        config(
            round_robin=True,
            matches=6,
            agents=[*AGENTS, {"id": "x", "kind": "random"}],
            transform={"kind": "coalition", "members": ["tft", "grim"]},
        )
    )
    assert "transform.members: 'grim' is neither a seat index" in message


def test_the_model_itself_refuses_not_only_the_loader() -> None:
    """Configs built in code (benchmarks, notebooks) are checked the same way."""
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(config(params={"roundz": 10}))
    assert [e["loc"] for e in info.value.errors()] == [("params", "roundz")]


MODEL_PLAYERS = [
    {"id": "alice", "kind": "model", "options": {"collusion": "explicit", "window": 5}},
    {"id": "bob", "kind": "model"},
    AGENTS[0],
]


def test_model_agents_play_the_model_field_local_by_default() -> None:
    parsed = parse_config(config(agents=MODEL_PLAYERS, round_robin=True))
    assert [(a.kind, a.options) for a in parsed.agents] == [
        ("local", {"collusion": "explicit", "window": 5}),
        ("local", {}),
        ("tit-for-tat", {}),
    ]


def test_one_field_moves_every_model_agent_to_a_server() -> None:
    server = {"base_url": "http://localhost:8000/v1", "model": "smol", "api_key_env": ""}
    local = parse_config(config(agents=MODEL_PLAYERS, round_robin=True))
    remote = parse_config(
        config(
            agents=MODEL_PLAYERS,
            round_robin=True,
            model={"kind": "llm", "options": {**server, "window": 20}},
        )
    )
    # the block's options first, then the agent's own (which win)
    assert [(a.kind, a.options) for a in remote.agents] == [
        ("llm", {**server, "window": 5, "collusion": "explicit"}),
        ("llm", {**server, "window": 20}),
        ("tit-for-tat", {}),
    ]
    assert remote.model_dump(exclude={"agents", "model"}) == local.model_dump(
        exclude={"agents", "model"}
    )
    # resolved at load: what the runner spawns and dumps parses back to the same run
    assert parse_config(remote.model_dump()) == remote


def test_a_bad_model_field_is_reported_there() -> None:
    message = refusal(config(agents=MODEL_PLAYERS, round_robin=True, model={"kind": "lm"}))
    assert "bad.yaml: model.kind: unknown agent kind 'lm' for `model`; known: " in message
    assert "agents." not in message  # not once per model agent
    message = refusal(config(agents=MODEL_PLAYERS, round_robin=True, model={"kind": "external"}))
    assert "model.kind: unknown agent kind 'external'" in message
    message = refusal(config(agents=MODEL_PLAYERS, round_robin=True, model={"opts": {}}))
    assert "model.opts: Extra inputs are not permitted" in message


# --- the command line's edits: `backroom run CONFIG --set KEY=VALUE --matches N` (issue 40) --------

LLM_EXPLICIT = "examples/llm_kuhn_explicit.yaml"


def test_set_edits_a_run_config_validated_as_the_file_is(tmp_path: Any) -> None:
    from backroom.runner.overrides import load_run_config

    edited, note = load_run_config(LLM_EXPLICIT, ["deals.each=2", "concurrency=3"])
    assert (edited.matches, edited.deals and edited.deals.each, edited.concurrency) == (6, 2, 3)
    assert note is None
    with pytest.raises(ConfigError, match=r"with concurrency=abc: concurrency: Input should be"):
        load_run_config(LLM_EXPLICIT, ["concurrency=abc"])
    with pytest.raises(ConfigError, match=r"--set 'concurrency': expected KEY=VALUE"):
        load_run_config(LLM_EXPLICIT, ["concurrency"])


def test_matches_with_a_deals_schedule_plays_fewer_per_hand_and_says_so() -> None:
    """Refused before ("leave matches out"): a two-minute trial of a paper config meant
    editing its YAML."""
    from backroom.runner.overrides import load_run_config

    six, note = load_run_config(LLM_EXPLICIT, [], matches=6)
    assert six.matches == 6 and six.deals is not None and six.deals.each == 2
    assert note == "--matches 6 with deals: 3 hands x 2 each = 6 matches, instead of x 100 = 300"
    two, note = load_run_config(LLM_EXPLICIT, [], matches=2)  # every hand at least once
    assert two.matches == 3 and note is not None and "the nearest to 2" in note
    assert [s.params["deal"] for _, s in six.match_specs()] == [
        s.params["deal"]
        for _, s in load_run_config(LLM_EXPLICIT, ["deals.each=2"])[0].match_specs()
    ]


def test_an_empty_config_file_says_it_is_empty(tmp_path: Any) -> None:
    from backroom.runner.config import load_config

    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError) as info:
        load_config(empty)
    assert str(info.value) == f"{empty} is empty: a config is a YAML mapping (game:, agents:, ...)"
    assert "valid dictionary" not in str(info.value)


def test_the_trainer_reads_set_with_the_same_implementation() -> None:
    from backroom.runner import overrides
    from backroom.trainer import config as train_config

    assert train_config.apply_overrides is overrides.apply_overrides
    assert train_config.parse_override("lr=1e-4") == (["hyper", "lr"], 1e-4)
    assert overrides.parse_override("lr=1e-4") == (["lr"], 1e-4)
