"""Scripted agent kinds: policies computed from the turn alone (``backroom.agents.kinds``
imports these modules on first use; importing this package registers nothing)."""
