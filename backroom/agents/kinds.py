"""The registry of agent kinds: register one, make one by name, list them.

Configs and the CLI name kinds (``random``, ``llm``, ``local``, ``human``...);
this module maps the name to a class. A kind registers itself with the
decorator::

    @register_agent("always")
    class Always(ScriptedAgent): ...

The built-in kinds' modules (``BUILTIN_MODULES``, from the one list of kinds and
their modules, ``backroom.agent_kinds``) are imported the first time
a kind is made or listed, not by any package ``__init__``: importing
``backroom.agents`` (or the base class a kind subclasses) must not import every
kind, and a registry that imported its kinds at the top would import modules
that import it back. Kinds defined outside this package (``human``, in
``backroom.human``, which builds on this one; other distributions' kinds) are
named by the ``backroom.agents`` entry-point group (``KIND_ENTRY_POINTS``),
read from the installed metadata, so a checkout must be installed
(``pip install -e .``) for them to appear.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from backroom.agent_kinds import registry_modules
from backroom.agents.base import Agent

log = logging.getLogger("backroom.agents")

#: The modules that define the built-in kinds, imported on first use: derived from the one
#: list of kinds (``backroom.agent_kinds``), which the metrics' closed label set reads too.
BUILTIN_MODULES = registry_modules()

#: Entry-point group naming the modules of agent kinds defined outside this package:
#: importing one registers its kinds.
KIND_ENTRY_POINTS = "backroom.agents"

A = TypeVar("A", bound=type[Agent])
_KINDS: dict[str, type[Agent]] = {}
_loaded = False


def register_agent(name: str) -> Callable[[A], A]:
    """Class decorator: make the class the kind ``name`` (a later registration of a name wins)."""

    def deco(cls: A) -> A:
        cls.kind = name
        _KINDS[name] = cls
        return cls

    return deco


def _load() -> None:
    """Import the built-in kinds, then each entry point once; a plugin that fails to import is
    skipped with a warning (a broken plugin must not take the built-in kinds down)."""
    global _loaded
    if _loaded:
        return
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    _loaded = True
    for ep in entry_points(group=KIND_ENTRY_POINTS):
        if ep.name in _KINDS:
            continue
        try:
            ep.load()
        except Exception as exc:
            log.warning("agent kind %r (%s) not loaded: %s", ep.name, ep.value, exc)


def agent_kinds() -> dict[str, type[Agent]]:
    """Every kind by name: the built-in ones, the entry points' and any registered since."""
    _load()
    return dict(_KINDS)


def make_agent(kind: str, agent_id: str, **options: Any) -> Agent:
    """An agent of ``kind`` named ``agent_id``; ``ValueError`` naming the known kinds, or the
    options the kind refused."""
    kinds = agent_kinds()
    if kind not in kinds:
        raise ValueError(f"unknown agent kind {kind!r}; known: {sorted(kinds)}")
    try:
        return kinds[kind](agent_id, **options)
    except TypeError as exc:
        raise ValueError(f"bad options for agent kind {kind!r}: {exc}") from None
