"""What the bus raises: its own errors, apart from aiomqtt's and paho's."""

from __future__ import annotations


class BusError(RuntimeError):
    """The bus cannot do what was asked: no broker, a refused login, closed before an answer."""


class NotAuthorizedError(BusError):
    """The broker refused a publish or a subscription: the ACL does not let this identity there."""
