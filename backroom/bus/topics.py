"""Topic names of DESIGN.md, in one place. Everything lives under ``backroom/v1/``."""

from __future__ import annotations

PREFIX = "backroom/v1"
SHARE_GROUP = "referees"

CONTROL_MATCHES = f"{PREFIX}/control/matches"
#: Referees read match requests through a shared subscription so they split the work.
CONTROL_MATCHES_SHARED = f"$share/{SHARE_GROUP}/{CONTROL_MATCHES}"
ALL_OUTBOXES = f"{PREFIX}/agents/+/outbox"
ALL_STATUS = f"{PREFIX}/agents/+/status"
ALL_EPISODES = f"{PREFIX}/episodes/#"
ALL_TRACES = f"{PREFIX}/traces/+"
ALL_PUBLIC = f"{PREFIX}/matches/+/public"


def inbox(agent: str) -> str:
    return f"{PREFIX}/agents/{agent}/inbox"


def outbox(agent: str) -> str:
    return f"{PREFIX}/agents/{agent}/outbox"


def status(agent: str) -> str:
    return f"{PREFIX}/agents/{agent}/status"


def public(match: str) -> str:
    return f"{PREFIX}/matches/{match}/public"


def episodes(game: str) -> str:
    return f"{PREFIX}/episodes/{game}"


def traces(agent: str) -> str:
    return f"{PREFIX}/traces/{agent}"


def checkpoint(policy: str) -> str:
    return f"{PREFIX}/models/{policy}/checkpoint"


def agent_of(topic: str) -> str | None:
    """The agent id in ``backroom/v1/agents/{agent}/...``; the broker's ACL makes it the sender."""
    parts = topic.split("/")
    if len(parts) == 5 and parts[2] == "agents":
        return parts[3]
    return None
