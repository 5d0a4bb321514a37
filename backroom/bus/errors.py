"""What the bus raises: its own errors, apart from aiomqtt's and paho's."""

from __future__ import annotations


class BusError(RuntimeError):
    """The bus cannot do what was asked: no broker, a refused login, closed before an answer."""


class NotAuthorizedError(BusError):
    """The broker refused a publish or a subscription: the ACL does not let this identity there."""


class IdentityInUse(BusError):
    """Another process is logged in under this identity: this one does not start.

    The broker keeps one connection per identity (the MQTT client id is the
    username), so two processes under one name throw each other off, round and
    round (a referee voiding its matches in flight every time, an agent missing
    its turns).
    """


class ConnectTimeout(BusError):
    """The first connection did not come up in time: no broker, or (with the broker there)
    another process under this identity throwing each login off as it comes."""


class LoginRefused(BusError):
    """The broker refused this identity's first login: no such user, or the wrong password.

    A broker that rereads its password file (after ``backroom credentials add``)
    may refuse a new identity for a moment; callers that just added one retry
    on this error, and only on this one."""
