"""Issue 22, items 11 and 12: the web front end and checkpoint downloads, attacked.

Self-contained async parts for ``bench/abuse.py`` to combine. Each replays one
attack against a real broker (``url``, its credentials directory
``creds_dir``), bounded in seconds, and returns what happened as a dict of
plain numbers; ``ok`` says whether the defence held. The web parts start
``backroom web`` (``python -m backroom web``, this interpreter, so whatever
``PYTHONPATH`` the bench runs with) on a free port with a fixed token.

Run alone, from ``bench/``: ``python -m abuse_parts.webfetch`` (starts its own broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN = "abuse-token"


@contextlib.asynccontextmanager
async def _web(url: str, creds_dir: Path) -> AsyncIterator[int]:
    """``backroom web`` for the broker at ``url``, on a free port (yielded) until the block ends."""
    import httpx

    from backroom.bus.broker import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKROOM_WEB_")}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "backroom", "web", "--broker", url, "--port", str(port)),
        *("--credentials", str(creds_dir)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={**env, "BACKROOM_WEB_TOKEN": TOKEN},
    )
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                        break
                if proc.returncode is not None:
                    raise RuntimeError("backroom web exited at start")
                await asyncio.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def _join(port: int, agent: str, token: str, **headers: str) -> tuple[Any, dict[str, Any]]:
    """A socket that asked to join ``agent``; the socket (still open) and the answer."""
    import websockets

    ws = await websockets.connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers)
    await ws.recv()  # hello
    await ws.send(json.dumps({"op": "join", "agent": agent, "token": token}))
    while True:
        msg = json.loads(await asyncio.wait_for(ws.recv(), 20))
        if msg["op"] in ("joined", "error"):
            return ws, msg


async def forwarded_guesses(url: str, creds_dir: Path, seconds: float) -> dict[str, Any]:
    """Wrong tokens from loopback, each with a new ``X-Forwarded-For``; then the right one.

    Held when the address is locked out (``too many failed sign-ins``) after
    the guard's 5 failures whatever the header says.
    """
    guesses = locked = 0
    async with _web(url, creds_dir) as port:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end and guesses < 40:
            ws, msg = await _join(port, "abuse-seat", f"guess-{guesses}", **_xff(guesses))
            await ws.close()
            guesses += 1
            if "too many failed" in msg.get("detail", ""):
                locked += 1
        ws, msg = await _join(port, "abuse-seat", TOKEN, **_xff(999))
        await ws.close()
    right_refused = msg["op"] == "error" and "too many failed" in msg["detail"]
    return {"guesses": guesses, "locked_out": locked, "ok": locked > 0 and right_refused}


def _xff(i: int) -> dict[str, str]:
    return {"X-Forwarded-For": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"}


async def rebound_host(url: str, creds_dir: Path, seconds: float) -> dict[str, Any]:
    """Requests naming a foreign ``Host`` (a rebound DNS name) to every route; held when all get 400."""
    import httpx
    import websockets
    from websockets.exceptions import InvalidStatus
    from websockets.typing import Origin

    answered = refused = 0
    async with _web(url, creds_dir) as port, httpx.AsyncClient() as http:
        rebound = f"rebound.example:{port}"
        t_end = time.monotonic() + seconds
        for path in ("/", "/api/matches", "/healthz"):
            resp = await http.get(f"http://127.0.0.1:{port}{path}", headers={"Host": rebound})
            refused += resp.status_code == 400
            answered += resp.status_code == 200
            if time.monotonic() > t_end:
                break
        try:
            async with websockets.connect(
                f"ws://{rebound}/ws",
                host="127.0.0.1",
                port=port,
                origin=Origin(f"http://{rebound}"),
            ):
                answered += 1
        except InvalidStatus:
            refused += 1
    return {"answered": answered, "refused": refused, "ok": answered == 0}


async def seat_takeover(url: str, creds_dir: Path, seconds: float) -> dict[str, Any]:
    """A seat's holder drops its socket; 0.5 s later the token link asks for the seat.

    Held when the link is refused for the reconnect window (the holder's key
    gets it back); ``seconds`` is not used beyond that one try.
    """
    from backroom.bus.auth import CredentialStore
    from backroom.bus.broker import reload_broker

    CredentialStore(creds_dir).add("abuse-seat", role="agent")
    reload_broker(creds_dir)
    async with _web(url, creds_dir) as port:
        holder, _ = await _join(port, "abuse-seat", TOKEN)
        await holder.close()
        await asyncio.sleep(0.5)
        thief, taken = await _join(port, "abuse-seat", TOKEN)
        await thief.close()
    return {"taken": taken["op"] == "joined", "ok": taken["op"] == "error"}


def _serve(handle: Any) -> tuple[ThreadingHTTPServer, threading.Event]:
    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with contextlib.suppress(OSError):
                handle(self, done)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, done


async def drip_checkpoint(url: str, creds_dir: Path, seconds: float) -> dict[str, Any]:
    """An adapter server that drips a byte every 0.2 s; the fetch (``timeout_s=1``) must end.

    Held when ``fetch_adapter`` gives up within ``seconds`` with ``fetch_failed``.
    ``url`` and ``creds_dir`` are unused: the attack needs no broker.
    """
    from backroom.bus.wire import AdapterRef
    from backroom.model.adapters import AdapterRejected, fetch_adapter

    config = b"{}"

    def drip(h: BaseHTTPRequestHandler, done: threading.Event) -> None:
        h.send_response(200)
        body = config if h.path.endswith(".json") else b""
        h.send_header("Content-Length", str(len(config) if body else 10_000))
        h.end_headers()
        h.wfile.write(body)
        while not body and not done.wait(0.2):
            h.wfile.write(b"w")
            h.wfile.flush()

    server, done = _serve(drip)
    ref = AdapterRef(
        policy="abuse",
        version="drip",
        uri=f"http://127.0.0.1:{server.server_address[1]}/",
        sha256="0" * 64,
        size=len(config) + 10_000,
    )
    t0 = time.monotonic()
    reason = "accepted"
    with tempfile.TemporaryDirectory() as cache:
        try:
            await asyncio.wait_for(
                asyncio.to_thread(fetch_adapter, ref, Path(cache), timeout_s=1), seconds
            )
        except AdapterRejected as exc:
            reason = exc.reason
        except TimeoutError:
            reason = "still running"
        finally:
            done.set()
            server.shutdown()
            server.server_close()
    took = time.monotonic() - t0
    return {"took_s": round(took, 2), "reason": reason, "ok": reason == "fetch_failed"}


async def _main() -> None:
    from backroom.bus.broker import Broker

    with tempfile.TemporaryDirectory() as tmp:
        broker = Broker(Path(tmp) / "broker")
        broker.credentials.add("abuse-seat", role="agent")
        broker.start()
        try:
            for part in (forwarded_guesses, rebound_host, seat_takeover, drip_checkpoint):
                print(part.__name__, await part(broker.url, broker.dir, 10.0))
        finally:
            broker.stop()


if __name__ == "__main__":
    asyncio.run(_main())
