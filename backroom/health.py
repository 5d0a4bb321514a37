"""``backroom health``: is this process ready? For container healthchecks and scripts.

A backroom process is ready when its metrics endpoint answers and, for a
process that talks on the bus as soon as it starts (referee, agents), when it
has published at least one message there: the referee and every agent
announce ``online`` on their status topic once connected and subscribed, and
``backroom_bus_messages_total{direction="out"}`` counts a publish only once
the broker has acknowledged it. So a count of one or more means the broker
accepted the login, the ACL let the process write, and the process reads what
it must. (A runner or trainer publishes only when it has work: check those
with ``--no-bus``.)

``--url`` checks any HTTP endpoint instead (the web front end's ``/healthz``,
``serve-model``'s ``/health``): ready when it answers 2xx.

Kept free of the CLI's imports (typer, rich, the agents): a healthcheck runs
every few seconds in every container, as ``python -m backroom.health``, and
must cost next to nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.error
import urllib.request

#: What the metrics endpoint must show once the process has spoken on the bus.
BUS_OUT = re.compile(r'^backroom_bus_messages_total\{[^}]*direction="out"[^}]*\}\s+(\S+)', re.M)
METRICS_HOST_ENV = "BACKROOM_METRICS_HOST"  # as backroom.metrics reads it, without importing it


def metrics_url(port: int, host: str | None = None) -> str:
    """Where this process's own metrics are: the host it binds (``$BACKROOM_METRICS_HOST``), else loopback."""
    host = host or os.environ.get(METRICS_HOST_ENV) or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):  # bound to every interface: loopback reaches it
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def _get(url: str, timeout_s: float) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.status, reply.read().decode("utf-8", "replace")


def check(
    metrics_port: int | None = None,
    *,
    bus: bool = True,
    url: str | None = None,
    host: str | None = None,
    timeout_s: float = 3.0,
) -> tuple[bool, str]:
    """(ready, one line saying why)."""
    target = url or (metrics_url(metrics_port, host) if metrics_port else None)
    if target is None:
        return False, "nothing to check: pass --metrics-port or --url"
    try:
        status, body = _get(target, timeout_s)
    except urllib.error.HTTPError as exc:
        return False, f"{target} answered {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{target} does not answer: {exc}"
    if not 200 <= status < 300:
        return False, f"{target} answered {status}"
    if url is not None:
        return True, f"{target} answered {status}"
    if "backroom_" not in body:
        return False, f"{target} serves no backroom metrics"
    if bus:
        sent = sum(float(v) for v in BUS_OUT.findall(body))
        if sent < 1:
            return False, "not on the bus yet: no message published (connecting, or refused)"
        return True, f"ready: {sent:.0f} messages published"
    return True, f"ready: {target} answers"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backroom.health", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--metrics-host", default=None, help="default: $BACKROOM_METRICS_HOST")
    parser.add_argument(
        "--no-bus", dest="bus", action="store_false", help="the metrics endpoint is enough"
    )
    parser.add_argument("--url", default=None, help="check this HTTP endpoint instead")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--quiet", "-q", action="store_true")
    args = parser.parse_args(argv)
    ok, why = check(
        args.metrics_port,
        bus=args.bus,
        url=args.url,
        host=args.metrics_host,
        timeout_s=args.timeout,
    )
    if not args.quiet or not ok:
        print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
