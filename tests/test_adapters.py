"""Adapter versions without a broker: the digest, fetching and checking, the bounded cache.

The cache runs on a real backend (the tiny random Qwen2 of ``conftest.tiny_qwen``)
with real peft adapters; downloads come from a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from backroom.bus.wire import AdapterRef
from backroom.model.adapters import (
    ADAPTER_FILES,
    AdapterCache,
    AdapterRejected,
    adapter_digest,
    fetch_adapter,
)
from backroom.model.backend import Backend
from backroom.model.spec import ModelSpec

from .conftest import eventually, load_factor, perturbed_adapter, serve_folder

# --- digest ------------------------------------------------------------------------------


def write_adapter(folder: Path, config: bytes, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_bytes(config)
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def tensors(data: bytes) -> bytes:
    """A well-formed safetensors file holding ``data`` as one U8 tensor (what ``check_format`` takes)."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    )
    return len(header).to_bytes(8, "little") + header.encode() + data


def ref_for(folder: Path, uri: str | None = None, version: str = "v1") -> AdapterRef:
    sha, size = adapter_digest(folder)
    return AdapterRef(policy="pol", version=version, uri=uri or str(folder), sha256=sha, size=size)


def test_digest_is_the_documented_framing(tmp_path: Path) -> None:
    config, weights = b'{"r": 4}', bytes(range(256)) * 5
    folder = write_adapter(tmp_path / "a", config, weights)
    (folder / "README.md").write_text("not part of the policy")
    h = hashlib.sha256()
    for name, data in (("adapter_config.json", config), ("adapter_model.safetensors", weights)):
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    assert adapter_digest(folder) == (h.hexdigest(), len(config) + len(weights))
    # moving bytes from one file to the other changes the digest (lengths are framed)
    moved = write_adapter(tmp_path / "b", config + weights[:1], weights[1:])
    assert adapter_digest(moved)[0] != adapter_digest(folder)[0]
    assert adapter_digest(moved)[1] == adapter_digest(folder)[1]


@pytest.mark.parametrize("missing", ADAPTER_FILES)
def test_digest_refuses_a_folder_without_the_adapter_files(tmp_path: Path, missing: str) -> None:
    folder = write_adapter(tmp_path / "a", b"{}", b"w")
    (folder / missing).unlink()
    with pytest.raises(AdapterRejected, match=missing) as err:
        adapter_digest(folder)
    assert err.value.reason == "missing_files"


# --- fetch -------------------------------------------------------------------------------


def test_fetch_checks_a_local_folder_in_place(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", b"{}", tensors(b"weights"))
    ref = ref_for(folder)
    cache = tmp_path / "cache"
    assert fetch_adapter(ref, cache) == folder
    assert fetch_adapter(ref.model_copy(update={"uri": folder.as_uri()}), cache) == folder
    assert not cache.exists()  # nothing copied
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref.model_copy(update={"sha256": "0" * 64}), cache)
    assert err.value.reason == "hash_mismatch"
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref, cache, max_bytes=ref.size - 1)
    assert err.value.reason == "too_large"
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref.model_copy(update={"size": ref.size + 1}), cache)
    assert err.value.reason == "hash_mismatch"
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref.model_copy(update={"uri": str(tmp_path / "nowhere")}), cache)
    assert err.value.reason == "missing_files"
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref.model_copy(update={"uri": "s3://bucket/a"}), cache)
    assert err.value.reason == "fetch_failed"


def test_fetch_downloads_checks_and_caches_over_http(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", json.dumps({"r": 4}).encode(), tensors(b"w" * 100_000))
    cache = tmp_path / "cache"
    with serve_folder(folder) as url:
        ref = ref_for(folder, url)
        got = fetch_adapter(ref, cache)
    assert got == cache / "pol" / f"v1-{ref.sha256[:12]}"
    assert adapter_digest(got) == (ref.sha256, ref.size)
    # the server is gone: the checked copy is used again
    assert fetch_adapter(ref, cache) == got
    # a damaged cache entry is not trusted: it is fetched anew
    (got / "adapter_model.safetensors").write_bytes(b"x")
    with serve_folder(folder) as url:
        assert fetch_adapter(ref.model_copy(update={"uri": url}), cache) == got
    assert adapter_digest(got) == (ref.sha256, ref.size)
    assert [p.name for p in (cache / "pol").iterdir()] == [got.name]  # no temporary folders left


def test_fetch_refuses_what_a_server_gets_wrong(tmp_path: Path) -> None:
    good = write_adapter(tmp_path / "good", b"{}", tensors(b"w" * 50_000))
    tampered = write_adapter(tmp_path / "tampered", b"{}", tensors(b"v" * 50_000))
    longer = write_adapter(tmp_path / "longer", b"{}", tensors(b"w" * 500_000))
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(good / "adapter_config.json", partial)
    cache = tmp_path / "cache"
    ref = ref_for(good)
    for folder, reason in (
        (tampered, "hash_mismatch"),
        (longer, "hash_mismatch"),
        (partial, "missing_files"),
    ):
        with serve_folder(folder) as url, pytest.raises(AdapterRejected) as err:
            fetch_adapter(ref.model_copy(update={"uri": url}), cache)
        assert err.value.reason == reason, folder.name
    with serve_folder(good) as url:
        pass  # the port is closed again
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref.model_copy(update={"uri": url}), cache, timeout_s=5)
    assert err.value.reason == "fetch_failed"
    assert list((cache / "pol").iterdir()) == []  # nothing unchecked stays behind


# --- the cache ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tiny_qwen: tuple[Path, Path]) -> Backend:
    """A backend of this module's own: what these tests leave loaded never reaches the
    process-wide one that the ``local`` agents and ``serve-model`` of other files share."""
    return Backend(ModelSpec(path=str(tiny_qwen[0]), device="cpu")).load()


@pytest.fixture
def versions(tiny_qwen: tuple[Path, Path], tmp_path: Path) -> dict[str, Path]:
    """Four adapter versions; names are unique to the test so the shared backend never mixes them up."""
    adapter = tiny_qwen[1]
    return {
        f"{tmp_path.name}-{k}": perturbed_adapter(adapter, tmp_path / k, seed=i)
        for i, k in enumerate("abcd")
    }


def parked(cache: AdapterCache, name: str) -> bool:
    """Whether the load of ``name`` waits for a slot on the cache's current change event.

    Every change of the cache (a pin, an unpin, a load done) sets that event
    and makes a new one, so a load waiting on the current one has looked since
    the last change and found no slot: it cannot finish before the next change,
    and an absence checked now is checked for good. Read off the load's chain of
    awaits (``cr_await``), where a suspended coroutine says what it waits on.
    """
    task = cache._loading.get(name)
    coro: Any = task.get_coro() if task is not None else None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None)
        if frame is not None and frame.f_code is asyncio.Event.wait.__code__:
            return frame.f_locals.get("self") is cache._changed
        coro = getattr(coro, "cr_await", None)
    return False


class Sources:
    """Folders handed to the cache, counting how often each one is asked for (one per load)."""

    def __init__(self, versions: dict[str, Path]) -> None:
        self.versions = versions
        self.calls: dict[str, int] = {}

    def __call__(self, name: str) -> Path:
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.versions[name]


async def test_cache_evicts_the_least_recently_used_unpinned_version(
    backend: Backend, versions: dict[str, Path]
) -> None:
    a, b, c, d = versions
    src = Sources(versions)
    cache = AdapterCache(backend, max_loaded=2)
    await cache.acquire("m1", a, lambda: src(a))
    await cache.acquire("m2", b, lambda: src(b))
    assert cache.loaded == [a, b] and {a, b} <= set(backend.adapters)
    cache.unpin("m1")
    cache.unpin("m2")
    await cache.acquire("m3", a, lambda: src(a))  # a is used again: b is now the older one
    assert src.calls[a] == 1  # still loaded, not fetched again
    await cache.acquire("m4", c, lambda: src(c))
    assert cache.loaded == [a, c] and b not in backend.adapters
    cache.unpin("m3")
    await cache.acquire("m5", d, lambda: src(d))  # c is pinned by m4: a goes although more recent
    assert cache.loaded == [c, d] and a not in backend.adapters
    assert cache.pins == {"m4": c, "m5": d}
    assert cache.high_water == 2
    await cache.close()
    assert all(backend.adapter_users.get(n, 0) == 0 for n in versions)


async def test_cache_shares_loads_and_waits_for_a_free_slot(
    backend: Backend, versions: dict[str, Path]
) -> None:
    a, b, c, _ = versions
    src = Sources(versions)
    cache = AdapterCache(backend, max_loaded=2)
    # two matches asking for one version at once: one load, two pins
    await asyncio.gather(
        cache.acquire("m1", a, lambda: src(a)), cache.acquire("m2", a, lambda: src(a))
    )
    assert src.calls[a] == 1 and backend.adapter_users[a] == 1
    await cache.acquire("m3", b, lambda: src(b))
    # every slot is pinned: a third version waits until a match lets go
    waiting = asyncio.create_task(cache.acquire("m4", c, lambda: src(c)))
    await eventually(lambda: parked(cache, c), 30)  # fetched in a thread, then found no slot
    assert not waiting.done() and cache.loaded == [a, b]
    cache.unpin("m1")  # m2 still plays a
    await eventually(lambda: parked(cache, c), 30)  # woken by the change, it looked and waits on
    assert not waiting.done()
    cache.unpin("m3")
    assert await asyncio.wait_for(waiting, 30) == c
    assert cache.loaded == [a, c] and b not in backend.adapters
    assert cache.high_water == 2
    await cache.close()


async def test_cache_keeps_the_old_pin_when_a_load_fails(
    backend: Backend, versions: dict[str, Path]
) -> None:
    a, b, _, _ = versions
    src = Sources(versions)
    cache = AdapterCache(backend, max_loaded=2)
    await cache.acquire("current", a, lambda: src(a))

    def refused() -> Path:
        raise AdapterRejected("hash_mismatch", "test")

    with pytest.raises(AdapterRejected):
        await cache.acquire("current", b, refused)
    assert cache.pins == {"current": a} and cache.loaded == [a]
    # the failed load took no slot: the next one goes through and moves the pin
    await cache.acquire("current", b, lambda: src(b))
    assert cache.pins == {"current": b} and cache.loaded == [a, b]
    await cache.close()
    assert cache.loaded == [] and all(backend.adapter_users.get(n, 0) == 0 for n in versions)


# --- hostile servers (issue 22, item 12) ---------------------------------------------------


@contextmanager
def hostile(handle: Callable[[BaseHTTPRequestHandler, threading.Event], None]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 whose GETs ``handle`` answers; a handler still stalling when the
    test ends is let go (the event is set), so no thread outlives the test."""
    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with contextlib.suppress(OSError):  # the client hung up: what these servers expect
                handle(self, done)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        done.set()
        server.shutdown()
        server.server_close()
        thread.join()


def headers(h: BaseHTTPRequestHandler, status: int, length: int, **extra: str) -> None:
    h.send_response(status)
    h.send_header("Content-Length", str(length))
    for k, v in extra.items():
        h.send_header(k, v)
    h.end_headers()


def in_thread(fn: Callable[[], Path], within_s: float) -> AdapterRejected:
    """The rejection ``fn`` ends with, which must come within ``within_s`` (else the test fails;
    the thread, a daemon, ends when the test's server lets go of it)."""
    out: list[BaseException | Path] = []
    thread = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(within_s)
    if not out:
        raise AssertionError(f"the fetch still ran after {within_s} s")
    if not isinstance(out[0], AdapterRejected):
        raise AssertionError(f"the fetch ended with {out[0]!r}")
    return out[0]


def _outcome(fn: Callable[[], Path]) -> BaseException | Path:
    try:
        return fn()
    except Exception as exc:
        return exc


def test_a_dripping_server_is_cut_off_at_the_fetch_deadline(tmp_path: Path) -> None:
    """Would have caught: httpx's timeout is per read, so a byte every 0.2 s kept a fetch
    alive for as long as the server liked, and the agent's later checkpoints waited behind it."""
    good = write_adapter(tmp_path / "good", b"{}", tensors(b"w" * 50_000))
    ref = ref_for(good)
    config = (good / "adapter_config.json").read_bytes()

    def drip(h: BaseHTTPRequestHandler, done: threading.Event) -> None:
        if h.path.endswith("adapter_config.json"):
            headers(h, 200, len(config))
            h.wfile.write(config)
            return
        headers(h, 200, ref.size - len(config))
        while not done.wait(0.2):
            h.wfile.write(b"w")
            h.wfile.flush()

    with hostile(drip) as url:
        t0 = time.monotonic()
        err = in_thread(
            lambda: fetch_adapter(ref.model_copy(update={"uri": url}), tmp_path / "c", timeout_s=1),
            within_s=60,
        )
        took = time.monotonic() - t0
    assert err.reason == "fetch_failed" and ("within" in err.detail or "slower" in err.detail), err
    assert took < 30  # about timeout_s; the bound is loose for a loaded machine


def test_a_redirect_is_not_followed(tmp_path: Path) -> None:
    """Would have caught: redirects were followed, so the announced URL did not bound where the
    agent fetched from (another host, a file:// proxy, an internal address)."""
    good = write_adapter(tmp_path / "good", b"{}", tensors(b"w" * 50_000))
    with serve_folder(good) as elsewhere:

        def redirect(h: BaseHTTPRequestHandler, _done: threading.Event) -> None:
            headers(h, 302, 0, Location=elsewhere + h.path.rsplit("/", 1)[1])

        with hostile(redirect) as url:
            with pytest.raises(AdapterRejected) as err:
                fetch_adapter(ref_for(good, url), tmp_path / "c")
    assert err.value.reason == "fetch_failed" and "not followed" in err.value.detail


def test_an_oversized_body_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Would have caught: the whole announced size was read (up to 2 GiB) before anything was
    checked; a Content-Length the announcement rules out is now refused from the headers, so
    this server, which never sends its body, gets a prompt hash_mismatch, not a read timeout."""
    good = write_adapter(tmp_path / "good", b"{}", tensors(b"w" * 50_000))
    config = (good / "adapter_config.json").read_bytes()

    def liar(h: BaseHTTPRequestHandler, done: threading.Event) -> None:
        if h.path.endswith("adapter_config.json"):
            headers(h, 200, len(config))
            h.wfile.write(config)
            return
        headers(h, 200, 2 * 1024**3)
        h.wfile.flush()
        done.wait()  # no body: only the headers can have been judged

    with hostile(liar) as url:
        err = in_thread(
            lambda: fetch_adapter(ref_for(good, url), tmp_path / "c", timeout_s=30), within_s=20
        )
    assert err.reason == "hash_mismatch" and "offered" in err.detail, err


def test_a_malformed_adapter_with_the_right_digest_is_rejected_as_invalid(tmp_path: Path) -> None:
    """Would have caught: the digest proved the bytes were the announced ones, and garbage signed
    by the announcer was handed to the backend (a load error, not counted as a rejection)."""
    cases = {
        "short": b"abc",
        "header past the end": (10_000).to_bytes(8, "little") + b"{}",
        "not json": (3).to_bytes(8, "little") + b"{{{",
        "gap": tensors(b"x" * 10) + b"trailing",
        "bad dtype": tensors(b"x" * 4).replace(b'"U8"', b'"Q8"'),
    }
    for why, weights in cases.items():
        folder = write_adapter(tmp_path / why, b'{"r": 4}', weights)
        with pytest.raises(AdapterRejected) as err:
            fetch_adapter(ref_for(folder), tmp_path / "c")
        assert err.value.reason == "invalid", why
        with serve_folder(folder) as url, pytest.raises(AdapterRejected) as err:
            fetch_adapter(ref_for(folder, url), tmp_path / "c")
        assert err.value.reason == "invalid", why
    config_list = write_adapter(tmp_path / "config", b"[1]", tensors(b"x"))
    with pytest.raises(AdapterRejected) as err:
        fetch_adapter(ref_for(config_list), tmp_path / "c")
    assert err.value.reason == "invalid"


async def test_an_adapter_the_backend_cannot_load_is_rejected_as_invalid(
    backend: Backend, versions: dict[str, Path], tmp_path: Path
) -> None:
    """Would have caught: well-formed safetensors whose tensors do not fit the model made the
    backend raise, and the local agent logged it without counting a rejection."""
    import torch
    from safetensors.torch import load_file, save_file

    a, *_ = versions
    odd = tmp_path / "odd"
    shutil.copytree(versions[a], odd)
    weights = odd / "adapter_model.safetensors"
    loaded = load_file(str(weights))
    save_file({k: torch.zeros(3) for k in loaded}, str(weights))  # well formed, wrong shapes
    cache = AdapterCache(backend, max_loaded=2)
    with pytest.raises(AdapterRejected) as err:
        await cache.acquire("m1", f"{tmp_path.name}-odd", lambda: odd)
    assert err.value.reason == "invalid"
    assert cache.loaded == [] and cache.pins == {}
    await cache.close()


# --- checkpoints of a local agent: one deadline, each in its own task, the newest wins --------


def dripping(config: bytes, weights_size: int, asked: threading.Event) -> Any:
    """A handler that serves the config, then the weights' headers and a byte every 0.2 s."""

    def handle(h: BaseHTTPRequestHandler, done: threading.Event) -> None:
        if h.path.endswith("adapter_config.json"):
            headers(h, 200, len(config))
            h.wfile.write(config)
            return
        asked.set()
        headers(h, 200, weights_size)
        while not done.wait(0.2):
            h.wfile.write(b"w")
            h.wfile.flush()

    return handle


def rejected(reason: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"reason": reason}
    return REGISTRY.get_sample_value("backroom_adapter_rejected_total", labels) or 0.0


def seats_agent(backend: Backend, tmp_path: Path, timeout_s: float) -> Any:
    from backroom.agents.adapter_seats import AdapterSeats

    agent = AdapterSeats(
        "learner", policy="pol", adapter_timeout_s=timeout_s, adapter_cache=str(tmp_path / "c")
    )
    agent.cache = AdapterCache(backend, max_loaded=2)
    return agent


def checkpoint_of(folder: Path, uri: str, version: str) -> Any:
    from backroom.bus.wire import Checkpoint

    sha, size = adapter_digest(folder)
    return Checkpoint(policy="pol", version=version, uri=uri, sha256=sha, size=size)


async def test_a_dripping_checkpoint_holds_up_no_later_one_and_the_newest_wins(
    backend: Backend, versions: dict[str, Path], tmp_path: Path
) -> None:
    """Would have caught: checkpoints were fetched one after another, so a dripping server
    held every later checkpoint back for its whole fetch deadline (60 s each)."""
    from backroom.agents.adapter_seats import CURRENT

    a, b, *_ = versions
    agent = seats_agent(backend, tmp_path, timeout_s=120)
    asked = threading.Event()
    config = (versions[a] / "adapter_config.json").read_bytes()
    size = adapter_digest(versions[a])[1]
    before = rejected("fetch_failed")
    with (
        hostile(dripping(config, size - len(config), asked)) as slow,
        serve_folder(versions[b]) as good,
    ):
        first = asyncio.create_task(agent.on_checkpoint(checkpoint_of(versions[a], slow, a)))
        await eventually(asked.is_set, 30)  # its weights are dripping now
        # well under the old 60 s per dripping fetch, however loaded the machine
        bound = min(50.0, 20 * load_factor())
        await asyncio.wait_for(agent.on_checkpoint(checkpoint_of(versions[b], good, b)), bound)
        assert agent.version == b
        await asyncio.wait_for(first, bound)  # abandoned once overtaken, not at its deadline
    assert agent.version == b
    name = agent.current[0]
    assert agent.cache.pins == {CURRENT: name} and agent.cache.loaded == [name]
    assert rejected("fetch_failed") == before  # overtaken, not refused: nothing counted
    assert not list((tmp_path / "c" / "pol").glob(f"{a}*"))  # no partial download kept
    await agent.cache.close()


async def test_a_checkpoint_fetch_ends_at_the_agents_adapter_timeout(
    backend: Backend, versions: dict[str, Path], tmp_path: Path
) -> None:
    """Would have caught: a checkpoint's fetch ran under a fixed 60 s, whatever the agent's
    ``adapter_timeout_s`` said."""
    a, *_ = versions
    agent = seats_agent(backend, tmp_path, timeout_s=1)
    asked = threading.Event()
    config = (versions[a] / "adapter_config.json").read_bytes()
    size = adapter_digest(versions[a])[1]
    before = rejected("fetch_failed")
    with hostile(dripping(config, size - len(config), asked)) as slow:
        t0 = time.monotonic()
        await asyncio.wait_for(agent.on_checkpoint(checkpoint_of(versions[a], slow, a)), 50)
        took = time.monotonic() - t0
    assert agent.version is None and rejected("fetch_failed") == before + 1
    assert took < min(50.0, 20 * load_factor())  # about the 1 s asked, not the old fixed 60 s
    await agent.cache.close()


def test_a_body_longer_than_announced_is_cut_at_the_announced_size(tmp_path: Path) -> None:
    """A server that names no length and keeps sending: the fetch stops reading at the
    announced size (never more is downloaded), refused, nothing kept."""
    good = write_adapter(tmp_path / "good", b"{}", tensors(b"w" * 50_000))
    ref = ref_for(good)
    config = (good / "adapter_config.json").read_bytes()

    def endless(h: BaseHTTPRequestHandler, done: threading.Event) -> None:
        if h.path.endswith("adapter_config.json"):
            headers(h, 200, len(config))
            h.wfile.write(config)
            return
        h.send_response(200)
        h.send_header("Connection", "close")  # no length: the body ends when the server says
        h.end_headers()
        while not done.is_set():
            h.wfile.write(b"w" * 65536)

    with hostile(endless) as url:
        err = in_thread(
            lambda: fetch_adapter(
                ref.model_copy(update={"uri": url}), tmp_path / "c", timeout_s=30
            ),
            within_s=20,
        )
    assert err.reason == "hash_mismatch" and "more than the announced" in err.detail, err
    assert list((tmp_path / "c" / "pol").iterdir()) == []
