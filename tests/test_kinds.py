"""The registry of agent kinds (``backroom.agents.kinds``): built-ins on first use, plugins
by entry point, and nothing imported for its side effects by a package ``__init__``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from backroom.agents import Agent, ScriptedAgent, kinds
from backroom.bus.wire import Turn

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_agents_package_imports_no_kind() -> None:
    code = (
        "import sys, backroom.agents, backroom.agents.base, backroom.agents.scripted; "
        f"print(sorted(m for m in {list(kinds.BUILTIN_MODULES)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_first_listing_loads_every_builtin_module_and_the_entry_points() -> None:
    code = (
        "import sys; from backroom.agents.kinds import BUILTIN_MODULES, agent_kinds; "
        "k = agent_kinds(); "
        "print(all(m in sys.modules for m in BUILTIN_MODULES), sorted(k))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, names = out.stdout.split(" ", 1)
    assert loaded == "True"
    for name in ("random", "always", "cfr", "llm", "local", "human"):  # human: entry point
        assert f"'{name}'" in names, names


def test_every_module_that_registers_a_kind_is_a_builtin_or_an_entry_point() -> None:
    """A new kind's module left out of BUILTIN_MODULES would never be registered."""
    registering: set[str] = set()
    for path in (ROOT / "backroom").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(
            isinstance(n, ast.Call) and getattr(n.func, "id", None) == "register_agent"
            for n in ast.walk(tree)
        ):
            registering.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    pyproject = (ROOT / "pyproject.toml").read_text()
    plugins = {m for m in registering if f'"{m}"' in pyproject}
    assert plugins == {"backroom.human.tty"}
    assert registering - plugins == set(kinds.BUILTIN_MODULES)


def test_make_builds_a_kind_and_names_what_is_wrong() -> None:
    agent = kinds.make_agent("always", "a1", action="B")
    assert agent.kind == "always" and agent.id == "a1"
    with pytest.raises(ValueError, match=r"unknown agent kind 'alwayz'; known: \[.*'always'"):
        kinds.make_agent("alwayz", "a2")
    with pytest.raises(ValueError, match="bad options for agent kind 'random'"):
        kinds.make_agent("random", "a3", colour="blue")


def test_a_kind_registered_by_a_third_party_is_listed_and_made() -> None:
    @kinds.register_agent("test-echo-first")
    class EchoFirst(ScriptedAgent):
        async def act(self, turn: Turn) -> object:
            return turn.legal["choices"][0]

    try:
        assert EchoFirst.kind == "test-echo-first"
        assert kinds.agent_kinds()["test-echo-first"] is EchoFirst
        made: Agent = kinds.make_agent("test-echo-first", "e1")
        assert isinstance(made, EchoFirst)
    finally:
        kinds._KINDS.pop("test-echo-first", None)


def test_the_registry_is_the_one_list_of_kinds_kind_for_kind_and_module_for_module() -> None:
    """``agent_kinds.BUILTIN_KINDS`` names each built-in kind and its module; the metrics'
    closed label set is that list. A kind registered but not listed would be labelled
    ``other``; one listed but not registered, a label no agent has."""
    from backroom import metrics
    from backroom.agent_kinds import BUILTIN_KINDS

    registry = kinds.agent_kinds()
    own = {name: cls.__module__ for name, cls in registry.items() if name in BUILTIN_KINDS}
    assert own == BUILTIN_KINDS
    third_party = {n: c.__module__ for n, c in registry.items() if n not in BUILTIN_KINDS}
    assert not [m for m in third_party.values() if m.startswith("backroom.")], third_party
    assert set(BUILTIN_KINDS) == metrics.KNOWN_AGENT_KINDS
