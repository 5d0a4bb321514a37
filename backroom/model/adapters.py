"""LoRA adapter versions: their digest, fetching and checking them, and a bounded set of loaded ones.

A trainer announces each adapter with its digest (``adapter_digest``); an
agent loads only files whose digest matches (``fetch_adapter``), so a torn
copy, a stale cache or a tampered download never becomes a policy. The
``AdapterCache`` keeps a few verified versions loaded in one ``Backend``
(matches of a training run name buffer opponents per seat), pinned while a
match plays them.

No torch here: the backend imports it when it loads an adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import unquote, urlparse

from backroom.bus.wire import AdapterRef

if TYPE_CHECKING:
    from backroom.model.backend import Backend

log = logging.getLogger("backroom.adapters")

#: The files peft writes for a LoRA adapter; the digest covers exactly these.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
#: Why an adapter was refused: the closed label set of ``backroom_adapter_rejected_total``.
REJECT_REASONS = (
    "hash_missing",
    "hash_mismatch",
    "missing_files",
    "fetch_failed",
    "too_large",
    "invalid",
    "unannounced",  # a match named a version no trainer announced (backroom.agents.local_model)
)
#: Largest adapter an agent downloads or loads unless told otherwise.
DEFAULT_MAX_BYTES = 2 * 1024**3
#: Seconds one fetch (both files) may take, start to end, unless the caller says otherwise
#: (a local agent passes its ``adapter_timeout_s``): a dripping server is cut off then.
DEFAULT_TIMEOUT_S = 60.0
#: Largest ``adapter_config.json`` taken: peft writes about 1 KB; it is held in memory.
MAX_CONFIG_BYTES = 1024**2
#: Largest safetensors header read when checking the weights file's format.
MAX_HEADER_BYTES = 16 * 1024**2
#: Bytes per element of each safetensors dtype.
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

_CHUNK = 1 << 20


class AdapterRejected(Exception):
    """An adapter that must not be loaded; ``reason`` is one of ``REJECT_REASONS`` (a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def adapter_digest(folder: str | Path) -> tuple[str, int]:
    """The sha256 (hex) and total size in bytes of a peft adapter folder.

    Definition: for each name of ``ADAPTER_FILES`` in sorted order
    (``adapter_config.json``, then ``adapter_model.safetensors``), feed
    sha256 the name in UTF-8, one NUL byte, the file's length as an 8-byte
    big-endian unsigned integer, then the file's bytes. The size is the sum of
    the two lengths. Other files (peft's README.md) are not covered: they do
    not change the policy. Names and lengths are framed so that no two
    different pairs of files hash alike.

    Raises ``AdapterRejected("missing_files")`` when either file is missing:
    a folder without them is not a peft adapter, whatever else it holds.
    """
    root = Path(folder)
    missing = [n for n in ADAPTER_FILES if not (root / n).is_file()]
    if missing:
        raise AdapterRejected("missing_files", f"{root} lacks {', '.join(missing)}")
    h = hashlib.sha256()
    total = 0
    for name in sorted(ADAPTER_FILES):
        with (root / name).open("rb") as f:
            total += _hash_file(h, name, f)
    return h.hexdigest(), total


def _hash_file(h: Any, name: str, f: BinaryIO) -> int:
    """Feed one framed file to ``h``; the length is taken first, so a file growing meanwhile fails."""
    length = os.fstat(f.fileno()).st_size
    h.update(name.encode() + b"\0" + length.to_bytes(8, "big"))
    seen = 0
    while chunk := f.read(_CHUNK):
        seen += len(chunk)
        h.update(chunk)
    if seen != length:
        raise AdapterRejected("hash_mismatch", f"{name} changed while it was read")
    return length


def verify_adapter(folder: Path, ref: AdapterRef) -> Path:
    """``folder`` if its digest is the one ``ref`` announces; ``AdapterRejected`` otherwise."""
    where = f"{ref.policy} {ref.version} at {ref.uri}"
    sizes = [(folder / n).stat().st_size for n in ADAPTER_FILES if (folder / n).is_file()]
    if len(sizes) == len(ADAPTER_FILES) and sum(sizes) != ref.size:  # no need to read it all
        raise AdapterRejected("hash_mismatch", f"{where}: {sum(sizes)} B, announced {ref.size} B")
    sha, size = adapter_digest(folder)
    if size != ref.size or sha != ref.sha256:
        raise AdapterRejected(
            "hash_mismatch", f"{where}: sha256 {sha[:12]}..., announced {ref.sha256[:12]}..."
        )
    return folder


def check_format(folder: Path) -> Path:
    """``folder`` if its files are what peft reads; ``AdapterRejected("invalid")`` otherwise.

    The digest proves the files are the announced ones, not that they are an
    adapter: a trainer's bug or a hostile announcer can sign garbage. Checked
    here, before a slot is taken and the backend is locked: the config is a
    JSON object, and the weights file is a well-formed safetensors file (an
    8-byte little-endian header length, a JSON header whose tensors each have
    a known dtype, a shape, and offsets that tile the data exactly).
    """
    config, weights = (folder / n for n in ADAPTER_FILES)
    try:
        with config.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"{config.name} is over {MAX_CONFIG_BYTES} B")
        if not isinstance(json.loads(text), dict):
            raise ValueError(f"{config.name} is not a JSON object")
        _check_safetensors(weights)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterRejected("invalid", f"{folder}: {exc}") from None
    return folder


def _check_safetensors(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is a well-formed safetensors file (header only read)."""
    header, data_bytes = _safetensors_header(path)
    spans = [
        _tensor_span(path.name, name, info)
        for name, info in header.items()
        if name != "__metadata__"
    ]
    end = 0
    for start, stop in sorted(spans):  # the tensors tile the data: no gap, no overlap
        if start != end:
            raise ValueError(f"{path.name}: tensor data overlaps or leaves a gap at byte {end}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"{path.name}: the tensors cover {end} B of {data_bytes} B of data")


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file, and how many bytes of data follow it."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path.name}: a header of {n} B in a file of {size} B")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the header is not a JSON object")
    return header, size - 8 - n


def _tensor_span(file: str, name: str, info: Any) -> tuple[int, int]:
    """Where tensor ``name``'s data lies, once its dtype, shape and offsets agree."""
    if not isinstance(info, dict):
        raise ValueError(f"{file}: tensor {name!r} is not described")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{file}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{file}: tensor {name!r} has shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{file}: tensor {name!r} has offsets {offsets!r}")
    if offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
        raise ValueError(f"{file}: tensor {name!r} has offsets that do not fit its shape")
    return offsets[0], offsets[1]


def fetch_adapter(
    ref: AdapterRef,
    cache_dir: Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> Path:
    """A local folder holding exactly the adapter ``ref`` announces (blocking: run it in a thread).

    A local path (or ``file://`` URI) is checked and used in place. An
    ``http(s)://`` URI names a folder URL: its two files are downloaded into
    ``cache_dir/{policy}/{version}-{sha256[:12]}`` through a temporary folder
    renamed only once checked, so the cache never holds an unchecked copy and a
    second fetch of the same version is a local check. Adapters larger than
    ``max_bytes`` are refused unread; a download takes at most ``timeout_s``
    from its first byte asked to its last, and stops as soon as ``cancel`` is
    set (a newer checkpoint overtook it: ``AdapterRejected("fetch_failed")``,
    which the caller does not count). Either way the files' format is checked
    last (``check_format``).
    """
    if ref.size > max_bytes:
        raise AdapterRejected(
            "too_large", f"{ref.version} is {ref.size} B, the limit is {max_bytes} B"
        )
    url = urlparse(ref.uri)
    try:
        if url.scheme in ("http", "https"):
            return check_format(_fetch_http(ref, Path(cache_dir), timeout_s, cancel))
        if url.scheme == "file":
            return check_format(verify_adapter(Path(unquote(url.path)), ref))
        if url.scheme and len(url.scheme) > 1:  # one letter: a Windows drive, a path after all
            raise AdapterRejected(
                "fetch_failed", f"unsupported URI scheme {url.scheme!r} in {ref.uri}"
            )
        return check_format(verify_adapter(Path(ref.uri), ref))
    except OSError as exc:  # unreadable files, a full disk: nothing checked to load
        raise AdapterRejected("fetch_failed", f"{ref.uri}: {exc}") from None


def _fetch_http(
    ref: AdapterRef, cache_dir: Path, timeout_s: float, cancel: threading.Event | None
) -> Path:
    target = cache_dir / ref.policy / f"{ref.version}-{ref.sha256[:12]}"
    if target.exists():
        try:
            return verify_adapter(target, ref)
        except AdapterRejected as exc:  # a damaged cache entry: fetch it again
            log.warning("discarding cached adapter %s: %s", target, exc)
            shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < ref.size:
        raise AdapterRejected(
            "fetch_failed", f"{ref.version} is {ref.size} B, {target.parent} has {free} B free"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        # Its own event loop in this worker thread: asyncio.timeout is a deadline on
        # the whole download, which httpx's per-read timeouts are not.
        asyncio.run(_cancellable(_download(ref, tmp, timeout_s), cancel, ref))
        try:
            tmp.rename(target)
        except OSError:  # another fetcher renamed its copy first
            if not target.exists():
                raise
            return verify_adapter(target, ref)
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


async def _cancellable(
    download: Coroutine[Any, Any, None], cancel: threading.Event | None, ref: AdapterRef
) -> None:
    """``download``, abandoned within a tenth of a second of ``cancel`` being set (from another thread)."""
    if cancel is None:
        await download
        return
    main = asyncio.ensure_future(download)
    while not main.done():
        await asyncio.wait({main}, timeout=0.1)
        if cancel.is_set() and not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
            raise AdapterRejected(
                "fetch_failed", f"{ref.policy} {ref.version}: cancelled (a newer one came)"
            )
    main.result()


async def _download(ref: AdapterRef, folder: Path, timeout_s: float) -> None:  # noqa: PLR0915 (one streamed fetch: each size and time bound its docstring lists is a branch)
    """Both files into ``folder``, hashed as they arrive; ``AdapterRejected`` unless they are ``ref``.

    Never more bytes than announced: the config (first in digest order, at
    most ``MAX_CONFIG_BYTES``) comes first, which fixes the weights' length
    (``ref.size`` minus the config's); a ``Content-Length`` that disagrees is
    refused before the body, and a body that runs past it is cut off. No
    redirect is followed: the announced URL is the one the trainer chose. The
    whole fetch ends within ``timeout_s`` (one deadline, not httpx's per-read
    timeouts), so a server dripping a byte at a time holds it no longer.
    """
    import httpx

    base = ref.uri.rstrip("/")
    config_name, weights_name = sorted(ADAPTER_FILES)
    got = 0  # bytes of both files so far

    async def fetch(
        client: httpx.AsyncClient, name: str, limit: int, exact: int | None
    ) -> AsyncGenerator[bytes]:
        nonlocal got
        url = f"{base}/{name}"
        # identity: the bytes counted and hashed are the bytes sent (no gzip bomb)
        async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as resp:
            if resp.status_code == 404:
                raise AdapterRejected("missing_files", f"{url}: 404")
            if resp.is_redirect:
                raise AdapterRejected(
                    "fetch_failed",
                    f"{url}: redirected to {resp.headers.get('location')!r}; not followed",
                )
            if resp.status_code != 200:
                raise AdapterRejected("fetch_failed", f"{url}: HTTP {resp.status_code}")
            length = resp.headers.get("content-length")
            offered = int(length) if length is not None and length.isdigit() else None
            if offered is not None and (offered > limit or exact not in (None, offered)):
                raise AdapterRejected(
                    "hash_mismatch",
                    f"{url}: {offered} B offered, the announcement leaves {exact or limit} B",
                )
            async for chunk in resp.aiter_raw():
                got += len(chunk)
                yield chunk

    h = hashlib.sha256()
    deadline = timeout_s
    try:
        async with (
            asyncio.timeout(deadline),
            httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client,
        ):
            config = bytearray()
            cap = min(ref.size, MAX_CONFIG_BYTES)
            async with aclosing(fetch(client, config_name, cap, None)) as chunks:
                async for chunk in chunks:
                    config += chunk
                    if len(config) > cap:
                        raise AdapterRejected(
                            "hash_mismatch" if cap == ref.size else "too_large",
                            f"{base}/{config_name}: over {cap} B",
                        )
            (folder / config_name).write_bytes(config)
            h.update(config_name.encode() + b"\0" + len(config).to_bytes(8, "big") + config)
            exact = ref.size - len(config)
            h.update(weights_name.encode() + b"\0" + exact.to_bytes(8, "big"))
            seen = 0
            with (folder / weights_name).open("wb") as out:
                async with aclosing(fetch(client, weights_name, exact, exact)) as chunks:
                    async for chunk in chunks:
                        seen += len(chunk)
                        if seen > exact:
                            raise AdapterRejected(
                                "hash_mismatch", f"{base}: more than the announced {ref.size} B"
                            )
                        h.update(chunk)
                        out.write(chunk)
            if seen != exact:
                raise AdapterRejected(
                    "hash_mismatch", f"{base}: {len(config) + seen} B, announced {ref.size} B"
                )
    except TimeoutError:
        raise AdapterRejected(
            "fetch_failed", f"{base}: not fetched within {deadline:.0f} s ({got} B arrived)"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise AdapterRejected("fetch_failed", f"{base}: {type(exc).__name__}: {exc}") from None
    if h.hexdigest() != ref.sha256:
        raise AdapterRejected(
            "hash_mismatch",
            f"{ref.policy} {ref.version} at {ref.uri}: sha256 {h.hexdigest()[:12]}..., "
            f"announced {ref.sha256[:12]}...",
        )


class AdapterCache:
    """At most ``max_loaded`` adapter versions loaded in one backend, least recently used out first.

    Versions are named by the caller (a name should identify the content: the
    local agent puts the digest in it). A version is pinned while an owner (a
    match's seat, or the agent's current adapter) plays it and is then never
    evicted; when every slot is pinned, a new load waits until an owner lets
    go. Loads (fetch, check, peft) run in worker threads; callers asking for
    the same version at once share one load. The backend counts users per
    name, so agents of one process that share a backend and a version share
    its weights too.
    """

    def __init__(self, backend: Backend, max_loaded: int = 4) -> None:
        if max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")
        self.backend = backend
        self.max_loaded = int(max_loaded)
        #: Most versions ever loaded at once (with those being loaded): for tests and benchmarks.
        self.high_water = 0
        self._loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._pins: dict[str, str] = {}  # owner -> name
        self._wanted: dict[str, int] = {}  # name -> acquires in flight (pinned while loading)
        self._reserved = 0  # slots taken by loads under way
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def loaded(self) -> list[str]:
        """Loaded version names, least recently used first."""
        return list(self._loaded)

    @property
    def pins(self) -> dict[str, str]:
        """Owner -> the version it plays."""
        return dict(self._pins)

    async def acquire(self, owner: str, name: str, source: Callable[[], Path]) -> str:
        """Load ``name`` (``source`` gives its checked folder, in a thread) and pin it for ``owner``.

        The owner's previous pin is dropped only once the new one holds, so an
        owner whose load fails keeps what it had.
        """
        self._wanted[name] = self._wanted.get(name, 0) + 1
        try:
            await self._until_loaded(name, source)
            self.pin(owner, name)
        finally:
            self._wanted[name] -= 1
            if not self._wanted[name]:
                del self._wanted[name]
            self._notify()
        return name

    def pin(self, owner: str, name: str) -> None:
        """Pin a loaded version for ``owner`` (replacing its previous pin) and mark it recently used."""
        if self._closed:  # shutting down: nothing is kept for anyone
            return
        if name not in self._loaded:
            raise KeyError(f"adapter {name!r} is not loaded")
        self._loaded.move_to_end(name)
        self._pins[owner] = name
        self._notify()

    def unpin(self, owner: str) -> None:
        """``owner`` no longer plays its version; it stays loaded until its slot is needed."""
        if self._pins.pop(owner, None) is not None:
            self._notify()

    async def close(self) -> None:
        """Finish loads under way, then release every version this cache loaded."""
        self._closed = True
        self._notify()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        names = list(self._loaded)
        self._loaded.clear()
        self._pins.clear()
        for name in names:
            await asyncio.to_thread(self.backend.release_adapter, name)

    # --- internals -------------------------------------------------------------------

    async def _until_loaded(self, name: str, source: Callable[[], Path]) -> None:
        """Join the load of ``name`` under way, or start one from ``source``.

        A joined load that fails used another caller's source (another URL
        announcing the same digest): this caller then tries its own, so one
        bad mirror cannot fail a good one. A load it started itself fails it.
        """
        while name not in self._loaded:
            task = self._loading.get(name)
            mine = task is None
            if task is None:
                task = asyncio.get_running_loop().create_task(self._load(name, source))
                task.add_done_callback(_consume)
                self._loading[name] = task
            try:
                await asyncio.shield(task)  # a caller giving up does not cancel the shared load
            except Exception:
                if mine:
                    raise

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _pinned(self) -> set[str]:
        return set(self._pins.values()) | set(self._wanted)

    async def _load(self, name: str, source: Callable[[], Path]) -> None:
        try:
            folder = await asyncio.to_thread(source)  # download and check before taking a slot
            await self._reserve()
            try:
                await asyncio.to_thread(self.backend.load_adapter, name, str(folder))
            except (MemoryError, AdapterRejected):
                raise
            except Exception as exc:  # checked files the model cannot take: refused, and counted
                if "OutOfMemory" in type(exc).__name__:  # a full GPU says nothing of the files
                    raise
                raise AdapterRejected(
                    "invalid", f"{name}: the backend could not load it: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                self._reserved -= 1
            self._loaded[name] = None
        finally:
            del self._loading[name]
            self._notify()

    async def _reserve(self) -> None:
        """Take a slot for a new load: a free one, else the least recently used unpinned version's."""
        while True:
            if self._closed:
                raise RuntimeError("the adapter cache is closed")
            if len(self._loaded) + self._reserved < self.max_loaded:
                self._take_slot()
                return
            pinned = self._pinned()
            victim = next((n for n in self._loaded if n not in pinned), None)
            if victim is not None:
                del self._loaded[victim]
                self._take_slot()
                log.info("evicting adapter %s (least recently used)", victim)
                await asyncio.to_thread(self.backend.release_adapter, victim)
                return
            await self._changed.wait()

    def _take_slot(self) -> None:
        self._reserved += 1
        self.high_water = max(self.high_water, len(self._loaded) + self._reserved)


def _consume(task: asyncio.Task[None]) -> None:
    """Retrieve a shared load's outcome: its waiters report failures, nobody else needs to."""
    if not task.cancelled():
        task.exception()
