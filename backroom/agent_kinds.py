"""backroom's own agent kinds, listed once: each kind's name and the module that defines it.

Two readers need the list before any kind is imported, and they sit at
opposite ends of the layering: the agents' registry
(``backroom.agents.kinds``), which imports these modules on first use to
register their kinds, and the metrics (``backroom.metrics``), whose ``kind``
label takes a value from this closed set only (a label must never take a
value an agent made up: a status with a new ``kind`` before every move would
add a series per move). The metrics may not import the agents, so the list
lives here, below both, as data: names and module paths, nothing imported.

The kind's class still says its own name (``@register_agent("random")``);
``tests/test_kinds.py`` holds the registry, once loaded, equal to this table,
kind for kind and module for module. A kind defined above ``backroom.agents``
(``human``, in ``backroom.human``) is reached through the ``backroom.agents``
entry point in pyproject.toml, not imported by the registry, which the
layering forbids; it is listed here all the same, for the metrics.
Third-party kinds are not listed: their label is ``other``.
"""

from __future__ import annotations

#: Every built-in kind -> the module whose ``@register_agent`` defines it.
BUILTIN_KINDS: dict[str, str] = {
    "always": "backroom.agents.scripted.basic",
    "random": "backroom.agents.scripted.basic",
    "table": "backroom.agents.scripted.basic",
    "level-k": "backroom.agents.scripted.beauty",
    "cartel-pricer": "backroom.agents.scripted.bertrand",
    "nash-pricer": "backroom.agents.scripted.bertrand",
    "tft-pricer": "backroom.agents.scripted.bertrand",
    "undercutter": "backroom.agents.scripted.bertrand",
    "cfr": "backroom.agents.scripted.cfr",
    "grim-trigger": "backroom.agents.scripted.ipd",
    "memory-one": "backroom.agents.scripted.ipd",
    "tit-for-tat": "backroom.agents.scripted.ipd",
    "kuhn-colluder": "backroom.agents.scripted.kuhn_colluder",
    "kuhn-team": "backroom.agents.scripted.kuhn_team",
    "llm-monitor": "backroom.agents.scripted.monitor",
    "monitor": "backroom.agents.scripted.monitor",
    "poker-colluder": "backroom.agents.scripted.poker_colluder",
    "split-cooperative": "backroom.agents.scripted.split",
    "split-defect": "backroom.agents.scripted.split",
    "ts-greedy": "backroom.agents.scripted.trust_split",
    "ts-honest": "backroom.agents.scripted.trust_split",
    "llm": "backroom.agents.llm",
    "local": "backroom.agents.local_model",
    "human": "backroom.human.tty",
}

#: The package whose modules the registry imports itself; kinds defined elsewhere come by
#: entry point.
AGENTS_PACKAGE = "backroom.agents."


def registry_modules() -> tuple[str, ...]:
    """The modules the agents' registry imports on first use: the built-in kinds' own."""
    return tuple(sorted({m for m in BUILTIN_KINDS.values() if m.startswith(AGENTS_PACKAGE)}))
