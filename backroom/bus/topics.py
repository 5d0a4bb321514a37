"""Topic names of DESIGN.md, in one place. Everything lives under ``backroom/v1/``."""

from __future__ import annotations

PREFIX = "backroom/v1"

CONTROL_MATCHES = f"{PREFIX}/control/matches"
#: Each referee's retained record of the shared-subscription group it reads
#: match requests in. Only referees may read or write under ``control/referees``
#: (``backroom.bus.auth``): the group's name is what keeps others out of it.
REFEREE_GROUPS = f"{PREFIX}/control/referees/+/group"
#: Each referee's retained roster record: only the referee role may write under
#: ``control/referees``, so a record here proves its identity is a referee, where a
#: status saying ``kind: referee`` proves only what its sender claims. Runners and
#: trainers may read the rosters (not the groups).
REFEREE_ROSTERS = f"{PREFIX}/control/referees/+/roster"
#: Every agent's outbox to every referee: each referee may read only
#: ``agents/+/outbox/{itself}`` (``bus.auth``), and reads its seated agents' of those.
ALL_OUTBOXES = f"{PREFIX}/agents/+/outbox/+"
ALL_STATUS = f"{PREFIX}/agents/+/status"
ALL_EPISODES = f"{PREFIX}/episodes/#"
ALL_TRACES = f"{PREFIX}/traces/+"
ALL_PUBLIC = f"{PREFIX}/matches/+/public"
#: Every adapter version any trainer announced, one retained message each: what a
#: ``local`` agent may load when a match names it (only the trainer role writes here).
ALL_MODEL_VERSIONS = f"{PREFIX}/models/+/versions/+"


def control_matches_shared(group: str) -> str:
    """Referees read match requests through a shared subscription in ``group``, so they split the work."""
    return f"$share/{group}/{CONTROL_MATCHES}"


def referee_group(referee: str) -> str:
    return f"{PREFIX}/control/referees/{referee}/group"


def referee_roster(referee: str) -> str:
    return f"{PREFIX}/control/referees/{referee}/roster"


def referee_of(topic: str) -> str | None:
    """The referee in ``backroom/v1/control/referees/{referee}/...``; the ACL makes it the sender."""
    parts = topic.split("/")
    if len(parts) == 6 and parts[2:4] == ["control", "referees"]:
        return parts[4]
    return None


def referee_probe(referee: str) -> str:
    """A referee's echo topic: its own message coming back says the broker has sent all before it."""
    return f"{PREFIX}/control/referees/{referee}/probe"


def inbox(agent: str) -> str:
    return f"{PREFIX}/agents/{agent}/inbox"


def outbox(agent: str, referee: str | None) -> str:
    """Where ``agent`` sends its moves and chat for a match ``referee`` runs (the referee the
    match's ``MatchStart`` names): only that referee reads them, so K referees parse the
    moves of their own matches, not K times every move.

    ``None`` (a match whose referee said no name: one from before outboxes per referee)
    is the old shared ``agents/{agent}/outbox``, which only such a referee (and the ACL
    of its time) reads."""
    if referee is None:
        return f"{PREFIX}/agents/{agent}/outbox"
    return f"{PREFIX}/agents/{agent}/outbox/{referee}"


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


def model_version(policy: str, version: str) -> str:
    """One announced version of ``policy`` (retained): the checkpoint topic keeps only the latest."""
    return f"{PREFIX}/models/{policy}/versions/{version}"


def model_version_of(topic: str) -> tuple[str, str] | None:
    """(policy, version) of ``backroom/v1/models/{policy}/versions/{version}``."""
    parts = topic.split("/")
    if len(parts) == 6 and parts[2] == "models" and parts[4] == "versions":
        return parts[3], parts[5]
    return None


def agent_of(topic: str) -> str | None:
    """The agent id in ``backroom/v1/agents/{agent}/...`` (its outbox to a referee,
    ``.../outbox/{referee}``, included); the broker's ACL makes it the sender."""
    parts = topic.split("/")
    if parts[2:3] == ["agents"] and (len(parts) == 5 or (len(parts) == 6 and parts[4] == "outbox")):
        return parts[3]
    return None
