"""``backroom replay RUN_DIR``: index a run, then serve ``backroom web``'s app with the replay mounted.

Here, beside the web app, and not in ``backroom.replay``: it builds the whole
app (``web.web_app``), which itself mounts ``backroom.replay.routes``, so the
replay viewer stays a package the web app imports and that imports nothing of it.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from backroom.human.access import TOKEN_ENV, is_loopback
from backroom.human.web import served_names, server_config, web_app, web_command
from backroom.replay.index import INDEX_FILE, ReplayIndex
from backroom.runs import resolve_run_dir


def replay_command(
    run_dir: Path,
    host: str,
    port: int,
    broker: str | None,
    credentials: Path | None,
    hosts: str | None = None,
    rebuild: bool = False,
) -> None:
    """Index the run (once; later only what was appended), then serve the page until Ctrl-C."""
    import uvicorn

    from backroom.bus.client import run

    if rebuild:
        for suffix in ("", "-wal", "-shm"):
            (resolve_run_dir(run_dir) / f"{INDEX_FILE}{suffix}").unlink(missing_ok=True)
    index = ReplayIndex(run_dir)
    known = sum(index.facets()["reasons"].values())
    print(
        f"backroom replay: {index.run_dir} ({known:,} matches in its index {index.path.name}; "
        "what was appended since is indexed now, and the page lists matches as they are indexed)"
    )
    threading.Thread(target=index.refresh, name="replay-index", daemon=True).start()
    token = access_token(host)
    page = f"http://{host}:{port}/replay" + (f"?token={token}" if token else "")
    if token:
        print(
            f"  every request needs the access token ({TOKEN_ENV} fixes it): the URL below has it"
        )
    if broker is not None:
        print(f"  the page: {page} (following live matches on {broker})")
        web_command(broker, host, port, credentials, hosts=hosts, replay=index, access_token=token)
        return
    app = web_app(
        "mqtt://127.0.0.1",
        replay=index,
        served_hosts=served_names(host, hosts),
        access_token=token,
    )
    print(f"  the page: {page}  (offline; --broker URL follows live matches)")
    run(uvicorn.Server(server_config(app, host, port)).serve())


def access_token(host: str) -> str | None:
    """The token every request must carry when ``host`` is not loopback (``access.AccessGate``).

    The replay shows every seat's private view; beyond this machine the
    ``Host`` header is no gate, so whoever may look must hold this token.
    """
    if is_loopback(host):
        return None
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(18)
