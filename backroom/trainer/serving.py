"""Adapters for agents on other machines: a read-only HTTP folder, and runtime-LoRA servers.

``AdapterServer`` serves ``RUN_DIR/adapters/{version}/{adapter_config.json,
adapter_model.safetensors}`` and nothing else (no listing, no other file, no
path outside a version folder), so a checkpoint's URI can be an ``http://``
folder URL that a ``local`` agent anywhere downloads and verifies against the
announced sha256. The standard library's threaded HTTP server is enough for a
few files fetched once per version; it binds 127.0.0.1 unless asked.

``announce_to_servers`` tells OpenAI-compatible servers with vLLM's runtime
LoRA API (vLLM, ``backroom serve-model``) to load a new version under the name
``{policy}@{version}``, so ``llm`` agents can play it by that model name. It
sends the version's sha256 and size (``serve-model`` fetches an http(s)
adapter only with them, and checks a local one against them) and the servers'
API key, ``$BACKROOM_SERVE_KEY``, as a Bearer token.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from backroom.bus.wire import AdapterRef
from backroom.model.adapters import ADAPTER_FILES
from backroom.model.serve import KEY_ENV

log = logging.getLogger("backroom.trainer")

_PATH = re.compile(r"^/adapters/([A-Za-z0-9_.-]{1,64})/([A-Za-z0-9_.-]+)$")


class AdapterServer:
    """``with AdapterServer(adapters_dir, host, port) as server: server.url_for("v3")``."""

    def __init__(
        self,
        adapters_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        public_url: str | None = None,
    ) -> None:
        self.dir = Path(adapters_dir).resolve()
        root = self.dir

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                m = _PATH.match(self.path)
                if m is None or m.group(2) not in ADAPTER_FILES or m.group(1).startswith("."):
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                path = root / m.group(1) / m.group(2)
                try:
                    data = path.read_bytes()
                except OSError:
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("adapter server: " + format, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.host, self.port = str(self.httpd.server_address[0]), int(self.httpd.server_address[1])
        self.public_url = (public_url or f"http://{self.host}:{self.port}").rstrip("/")
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="adapter-server", daemon=True
        )

    def __enter__(self) -> AdapterServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def url_for(self, version: str) -> str:
        return f"{self.public_url}/adapters/{version}"


async def announce_to_servers(
    servers: list[str], ref: AdapterRef, timeout_s: float = 120.0, api_key: str | None = None
) -> dict[str, str]:
    """POST ``/v1/load_lora_adapter`` to each server; per server "ok" or the reason it failed.

    A server that refuses is logged and reported, never fatal: rollouts that
    name the version on that server fail on their own, visibly. ``api_key``
    (default ``$BACKROOM_SERVE_KEY``) goes to every server as a Bearer token.
    """
    name = f"{ref.policy}@{ref.version}"
    key = api_key or os.environ.get(KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"lora_name": name, "lora_path": ref.uri, "sha256": ref.sha256, "size": ref.size}
    results: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        for base in servers:
            try:
                r = await client.post(f"{base.rstrip('/')}/v1/load_lora_adapter", json=body)
                results[base] = (
                    "ok" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
                )
            except httpx.HTTPError as exc:
                results[base] = f"{type(exc).__name__}: {exc}"
            if results[base] != "ok":
                log.warning("server %s did not load adapter %s: %s", base, name, results[base])
    return results
