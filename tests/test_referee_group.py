"""The referees' group protocol as an object (``referee.group``): its rules without a broker.

Joining and moving between groups talk to the broker: tests/test_abuse.py and
tests/test_faults.py play them against a real Mosquitto.
"""

from __future__ import annotations

import logging

from backroom.bus import topics
from backroom.referee.group import RefereeGroup

A = "referees-" + "a" * 32
B = "referees-" + "b" * 32


async def _announce() -> None:
    return None


def group(name: str = "ref-1") -> RefereeGroup:
    return RefereeGroup(name, lambda _t, _p: None, _announce, logging.getLogger("test"))


def test_a_peer_is_a_named_group_member_that_is_online() -> None:
    """An agent may say ``kind: referee`` in its own status, but only the referee role
    writes group records: a peer needs both; itself never counts."""
    g = group()
    g.follow("mallory", online=True)  # a status saying referee, without a group record
    assert not g.has_peers()
    g._on_record(topics.referee_group("ref-2"), A.encode())
    assert not g.has_peers()  # a record, but its status is not online
    g.follow("ref-2", online=True)
    assert g.has_peers()
    g.follow("ref-2", online=False)  # its will: gone, though its record stays retained
    assert not g.has_peers()
    g._on_record(topics.referee_group("ref-1"), A.encode())
    g.follow("ref-1", online=True)
    assert not g.has_peers()  # only itself


def test_records_that_are_no_group_name_are_dropped() -> None:
    g = group()
    g._on_record(topics.referee_group("ref-2"), A.encode())
    g._on_record(topics.referee_group("ref-2"), b"")  # emptied by a referee that stopped
    assert g.records == {}
    g._on_record(topics.referee_group("ref-3"), b"referees-guessable")
    g._on_record(topics.referee_group("ref-4"), "referees-\udcff".encode(errors="surrogateescape"))
    assert g.records == {}


def test_the_name_was_announced_only_by_a_record_not_its_own_proposal() -> None:
    g = group("ref-1")
    assert not g.name_announced()
    g._proposed = A  # this referee proposed A while starting (``join``)
    g._on_record(topics.referee_group("ref-1"), A.encode())
    assert not g.name_announced()  # its own proposal, come back
    g._on_record(topics.referee_group("ref-1"), B.encode())
    assert g.name_announced()  # another holder of the name announced its group
