"""``ModelSpec``: the one value that names a local model (``backroom/model/spec.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from backroom.agents.kinds import make_agent
from backroom.model.spec import ModelSpec, default_model
from backroom.trainer.config import load_train_config
from backroom.trainer.launch import agent_entries

ROOT = Path(__file__).resolve().parents[1]


def test_resolved_fills_in_the_default_model_and_keeps_a_named_file() -> None:
    folder, file = default_model()
    assert ModelSpec(device="cpu").resolved() == ModelSpec(
        path=folder, gguf_file=file, device="cpu"
    )
    other = ModelSpec(gguf_file="other.gguf").resolved()
    assert (other.path, other.gguf_file) == (folder, "other.gguf")
    given = ModelSpec(path="/models/x", dtype="bfloat16")
    assert given.resolved() is given
    assert given.name == "x" and ModelSpec(path="/m", gguf_file="q.gguf").name == "q"


def test_equal_specs_are_one_key_and_a_spec_cannot_change() -> None:
    assert {ModelSpec(path=Path("/m")): 1}[ModelSpec(path="/m")] == 1
    spec = ModelSpec(path="/m")
    with pytest.raises(ValidationError, match="frozen"):
        spec.device = "cuda"  # type: ignore[misc]


def test_a_misspelt_setting_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="devic"):
        ModelSpec.model_validate({"devic": "cpu"})
    with pytest.raises(ValueError, match="bad options for agent kind 'local'"):
        make_agent("local", "p", devic="cpu")


def test_the_trainers_players_load_the_configs_model() -> None:
    """``model:`` of a training config reaches the local agents it starts unchanged."""
    config = load_train_config(
        ROOT / "examples" / "ipd_quick.yaml",
        ["model.path=/m", "model.gguf_file=q.gguf", "model.device=cpu", "model.dtype=float32"],
    )
    assert config.model == ModelSpec(path="/m", gguf_file="q.gguf", device="cpu", dtype="float32")
    [player, *_] = agent_entries(config)
    agent = make_agent(player["kind"], player["id"], **player["options"])
    assert agent.spec == config.model  # type: ignore[attr-defined]
