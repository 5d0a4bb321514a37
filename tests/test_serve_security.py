"""``backroom serve-model`` exposed: its API key, where adapters load from, names bound to content.

Real HTTP against a real server (``running_server``) over a tiny random Qwen2
and real peft adapters, as ``tests/test_trainer_api_agents.py`` does.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from backroom.bus.broker import free_port
from backroom.bus.wire import AdapterRef
from backroom.model.adapters import adapter_digest
from backroom.model.backend import Backend
from backroom.model.serve import KEY_ENV, check_settings, is_loopback, running_server
from backroom.model.serve import serve_model_app as app_of
from backroom.model.spec import ModelSpec
from backroom.trainer.serving import AdapterServer, announce_to_servers

ROOT = Path(__file__).resolve().parent.parent


def make_adapter(model_dir: Path, folder: Path, seed: int) -> Path:
    """A peft LoRA adapter for the tiny model, its weights drawn from ``seed``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings():  # peft asks transformers 5 for a deprecated attribute
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_qwen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of different content inside ``served/``, one outside it, and symlinks out."""
    root = tmp_path_factory.mktemp("adapters")
    served, outside = root / "served", root / "outside"
    a = make_adapter(tiny_qwen_model, served / "a", seed=1)
    b = make_adapter(tiny_qwen_model, served / "b", seed=2)
    out = make_adapter(tiny_qwen_model, outside / "x", seed=3)
    (served / "link").symlink_to(out, target_is_directory=True)  # a folder that leads out
    (served / "files").mkdir()  # a folder inside whose files lead out
    for f in out.iterdir():
        (served / "files" / f.name).symlink_to(f)
    return {"served": served, "a": a, "b": b, "outside": out}


@pytest.fixture
def backend(tiny_qwen_model: Path) -> Backend:
    return Backend(ModelSpec(path=str(tiny_qwen_model), device="cpu")).load()


@asynccontextmanager
async def serving(backend: Backend, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app on a free loopback port; an HTTP client for it (with the key, if any)."""
    key = options.get("api_key")
    async with (
        running_server(app_of(backend, "tiny", **options)) as url,
        httpx.AsyncClient(
            base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"} if key else {}
        ) as http,
    ):
        yield http


async def load(
    http: httpx.AsyncClient, name: str, path: str | Path, **extra: Any
) -> httpx.Response:
    return await http.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra}
    )


# --- the key ------------------------------------------------------------------------------


async def test_every_endpoint_but_health_needs_the_key(
    backend: Backend, adapters: dict[str, Path]
) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with serving(backend, api_key="s3cret", adapter_dir=adapters["served"]) as http:
        requests: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a"}),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
            ("GET", "/docs", None),
            ("GET", "/openapi.json", None),
            ("GET", "/no/such/page", None),
        ]
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            for method, path, body in requests:
                r = await http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
        assert backend.adapters == {}  # the refused load did nothing
        open_ = await http.get("/health", headers={"Authorization": ""})
        assert open_.status_code == 200  # a container healthcheck has no key
        assert (await http.get("/v1/models")).status_code == 200
        reply = await http.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 200 and reply.json()["choices"]


def test_loopback_is_this_machine_only() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LocalHost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.4", "example.org", "localhost.example.org"):
        assert not is_loopback(host), host
    check_settings("127.0.0.1", None)
    check_settings("0.0.0.0", "a key")
    with pytest.raises(ValueError, match="--api-key"):
        check_settings("0.0.0.0", None)
    with pytest.raises(ValueError, match="not a directory"):
        check_settings("127.0.0.1", None, ROOT / "no-such-dir")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
async def test_serve_model_refuses_to_start_beyond_loopback_without_a_key(host: str) -> None:
    """Before it loads anything: one clear line and exit status 2."""
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "backroom",
        "serve-model",
        "--host",
        host,
        "--port",
        str(free_port()),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2, (out, err)
    message = err.decode()
    assert message.startswith("error: serve-model bound to") and KEY_ENV in message
    assert "--api-key" in message and "Traceback" not in message


# --- where adapters come from ---------------------------------------------------------------


async def test_adapters_load_only_from_inside_the_adapter_dir(
    backend: Backend, adapters: dict[str, Path]
) -> None:
    served = adapters["served"]
    async with serving(backend) as http:  # no --adapter-dir: no runtime loads at all
        r = await load(http, "a", adapters["a"])
        assert r.status_code == 403 and "--adapter-dir" in r.text
    async with serving(backend, adapter_dir=served) as http:
        refused = {
            "outside, absolute": (adapters["outside"], 403),
            "outside, relative": ("../outside/x", 403),
            "outside, file URI": (adapters["outside"].as_uri(), 403),
            "a symlinked folder leading out": ("link", 403),
            "symlinked files leading out": ("files", 403),
            "a hub id": ("HuggingFaceTB/SmolLM2-135M-Instruct-lora", 400),
            "no such folder": ("nope", 400),
            "a folder without an adapter": (".", 400),
            "another scheme": ("s3://bucket/adapter", 400),
            "a NUL byte": ("a\x00b", 400),
        }
        for why, (path, status) in refused.items():
            r = await load(http, f"x-{len(why)}", path)
            assert r.status_code == status, (why, r.text)
        assert backend.adapters == {}
        assert (await load(http, "pol@v1", "a")).status_code == 200  # relative to the dir
        assert (await load(http, "pol@v2", adapters["b"].as_uri())).status_code == 200
        wrong = adapter_digest(adapters["a"])[0]
        r = await load(http, "pol@v3", adapters["b"], sha256=wrong)  # not what was announced
        assert r.status_code == 400 and "announced" in r.text
        assert sorted(backend.adapters) == ["pol@v1", "pol@v2"]
        assert backend.adapters["pol@v1"] == str(adapters["a"].resolve())


async def test_an_http_adapter_loads_only_with_its_digest(
    backend: Backend, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The trainer's adapter server, announced with the key: fetched into the dir, checked."""
    run_adapters = tmp_path / "run" / "adapters"
    (run_adapters / "v1").mkdir(parents=True)
    for f in adapters["b"].iterdir():
        (run_adapters / "v1" / f.name).write_bytes(f.read_bytes())
    sha, size = adapter_digest(run_adapters / "v1")
    served = tmp_path / "served"
    served.mkdir()
    with AdapterServer(run_adapters) as files:
        url = files.url_for("v1")
        ref = AdapterRef(policy="pol", version="v1", uri=url, sha256=sha, size=size)
        async with serving(backend, api_key="k", adapter_dir=served) as http:
            r = await load(http, "pol@v1", url)  # vLLM's request: no digest
            assert r.status_code == 400 and "sha256" in r.text
            r = await load(http, "pol@v1", url, sha256="0" * 64, size=size)
            assert r.status_code == 400 and "hash_mismatch" in r.text
            base = str(http.base_url).rstrip("/")
            assert (await announce_to_servers([base], ref, api_key="wrong"))[base].startswith(
                "HTTP 401"
            )
            assert await announce_to_servers([base], ref, api_key="k") == {base: "ok"}
    fetched = Path(backend.adapters["pol@v1"])
    assert fetched.is_relative_to(served.resolve() / ".fetched")
    assert adapter_digest(fetched) == (sha, size)


async def test_announce_sends_the_key_from_the_environment(
    backend: Backend, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    sha, size = adapter_digest(adapters["a"])
    ref = AdapterRef(policy="pol", version="v9", uri=str(adapters["a"]), sha256=sha, size=size)
    monkeypatch.setenv(KEY_ENV, "from-env")
    async with serving(backend, api_key="from-env", adapter_dir=adapters["served"]) as http:
        base = str(http.base_url).rstrip("/")
        assert await announce_to_servers([base], ref) == {base: "ok"}
    assert "pol@v9" in backend.adapters


# --- a name means one content ------------------------------------------------------------------


async def test_a_loaded_name_is_never_given_other_content(
    backend: Backend, adapters: dict[str, Path]
) -> None:
    sha_a, size_a = adapter_digest(adapters["a"])
    sha_b, size_b = adapter_digest(adapters["b"])
    async with serving(backend, adapter_dir=adapters["served"]) as http:
        assert (await load(http, "pol@v1", "a")).status_code == 200
        r = await load(http, "pol@v1", "b")  # other files under the name agents play
        assert r.status_code == 409 and "new version" in r.text
        r = await load(http, "pol@v1", "b", sha256=sha_b, size=size_b)  # refused before reading
        assert r.status_code == 409
        r = await load(http, "pol@v1", "a", sha256=sha_a, size=size_a)  # the same again
        assert r.status_code == 400 and "already been loaded" in r.text
        assert (await load(http, "pol@v2", "b")).status_code == 200  # new content, new name
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "pol@v1"})
        assert unloaded.status_code == 200 and "pol@v1" not in backend.adapters
        # unloaded, the name still means a's files: b may not take it, a may come back
        assert (await load(http, "pol@v1", "b")).status_code == 409
        assert (await load(http, "pol@v1", "a")).status_code == 200
        assert backend.adapters == {
            "pol@v1": str(adapters["a"].resolve()),
            "pol@v2": str(adapters["b"].resolve()),
        }
