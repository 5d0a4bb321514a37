"""The attacks of ``bench/abuse.py``, one module per area (issue 22); see that script."""

from __future__ import annotations

from pathlib import Path

from backroom.bus.auth import CredentialStore
from backroom.bus.connection import BusConfig


def login(url: str, creds_dir: str | Path, name: str) -> BusConfig:
    """Connection settings for ``name`` from the credential store at ``creds_dir``."""
    cred = CredentialStore(creds_dir).get(name)
    return BusConfig.from_url(url, username=cred.username, password=cred.password)
