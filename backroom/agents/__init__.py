"""Agents: the public ``Agent`` API, its bus runtime and the built-in kinds."""

from backroom.agents.base import Agent, ScriptedAgent
from backroom.agents.kinds import agent_kinds, make_agent, register_agent

__all__ = ["Agent", "ScriptedAgent", "agent_kinds", "make_agent", "register_agent"]
