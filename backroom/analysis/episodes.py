"""Reading a run's episodes: the lines of ``runs/<run>/episodes.jsonl`` as dicts.

Measures take plain dicts (not pydantic models) so they work on files written
by any version of the referee and on records built by hand in notebooks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from backroom.runs import read_episodes

Episode = dict[str, Any]

#: Episodes that reached the end of the game; timeouts were played by default actions.
PLAYED = ("normal", "timeout")


def load_episodes(path: str | Path, stats: dict[str, int] | None = None) -> list[Episode]:
    """Records of a run directory or an episodes.jsonl; unreadable lines (a torn write) are
    skipped and counted in ``stats["unreadable_lines"]`` (``read_episodes``)."""
    return list(read_episodes(path, stats))


def played(episodes: Iterable[Episode]) -> list[Episode]:
    """Episodes with a terminal state to measure (errors and voided matches have none)."""
    return [
        e for e in episodes if e.get("reason", "normal") in PLAYED and e.get("final_observations")
    ]


def by_game(episodes: Iterable[Episode]) -> dict[str, list[Episode]]:
    out: dict[str, list[Episode]] = {}
    for e in episodes:
        out.setdefault(str(e["game"]), []).append(e)
    return out


def channel_stats(episodes: Iterable[Episode]) -> dict[str, dict[str, Any]]:
    """Per channel: messages sent, deliveries, and what eavesdroppers overheard.

    A record keeps one delivery per reader; the deliveries of one message
    share its sender, time and text (or, on a channel with interventions, its
    number), so a message is counted once however many read it; ``dropped``
    counts the copies an intervention lost. Channels named in the match specs but never used are
    listed with zeros: a silent private channel is itself a finding.
    """
    stats: dict[str, dict[str, Any]] = {}
    senders: dict[str, set[str]] = {}
    overhearers: dict[str, set[str]] = {}

    def row(name: str) -> dict[str, Any]:
        senders.setdefault(name, set())
        overhearers.setdefault(name, set())
        return stats.setdefault(
            name,
            {"messages": 0, "deliveries": 0, "overheard": 0, "overheard_messages": 0, "dropped": 0},
        )

    for e in episodes:
        for spec in (e.get("spec") or {}).get("channels") or []:
            row(str(spec["name"]))
        seats = _readers(e)
        messages: dict[tuple[Any, ...], bool] = {}  # message -> overheard by someone
        for d in e.get("deliveries") or []:
            r = row(str(d["channel"]))
            key = _message_key(d)
            senders[d["channel"]].add(str(seats[d["from_seat"]]))
            delivered = d.get("delivered", True)  # a copy an intervention dropped reached nobody
            messages[key] = messages.get(key, False) or (delivered and bool(d["overheard"]))
            if not delivered:
                r["dropped"] += 1
                continue
            r["deliveries"] += 1
            if d["overheard"]:
                r["overheard"] += 1
                overhearers[d["channel"]].add(str(seats[d["to_seat"]]))
        for (channel, *_), heard in messages.items():
            stats[channel]["messages"] += 1
            stats[channel]["overheard_messages"] += heard
    for name, r in stats.items():
        r["senders"] = sorted(senders[name])
        r["overhearers"] = sorted(overhearers[name])
    return stats


def _readers(e: Episode) -> list[Any]:
    """Who a delivery's seat numbers name: players, then observers (overseers), as the referee
    numbers them."""
    return [*e["seats"], *((e.get("spec") or {}).get("observers") or [])]


def _message_key(d: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the copies of one message share: on a channel with interventions its number (their
    text and time may differ); elsewhere its sender, time and text."""
    number = d.get("message")
    if number is not None:
        return (d["channel"], d["from_seat"], number)
    return (d["channel"], d["from_seat"], d["t"], d["text"])
