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
import hashlib
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import unquote, urlparse

from backroom.bus.wire import AdapterRef

if TYPE_CHECKING:
    from backroom.agents.backend import Backend

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
)
#: Largest adapter an agent downloads or loads unless told otherwise.
DEFAULT_MAX_BYTES = 2 * 1024**3

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


def fetch_adapter(
    ref: AdapterRef, cache_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = 60.0
) -> Path:
    """A local folder holding exactly the adapter ``ref`` announces (blocking: run it in a thread).

    A local path (or ``file://`` URI) is checked and used in place. An
    ``http(s)://`` URI names a folder URL: its two files are downloaded into
    ``cache_dir/{policy}/{version}-{sha256[:12]}`` through a temporary folder
    renamed only once checked, so the cache never holds an unchecked copy and a
    second fetch of the same version is a local check. Downloads stop past the
    announced size, and adapters larger than ``max_bytes`` are refused unread.
    """
    if ref.size > max_bytes:
        raise AdapterRejected(
            "too_large", f"{ref.version} is {ref.size} B, the limit is {max_bytes} B"
        )
    url = urlparse(ref.uri)
    try:
        if url.scheme in ("http", "https"):
            return _fetch_http(ref, Path(cache_dir), timeout_s)
        if url.scheme == "file":
            return verify_adapter(Path(unquote(url.path)), ref)
        if url.scheme and len(url.scheme) > 1:  # one letter: a Windows drive, a path after all
            raise AdapterRejected(
                "fetch_failed", f"unsupported URI scheme {url.scheme!r} in {ref.uri}"
            )
        return verify_adapter(Path(ref.uri), ref)
    except OSError as exc:  # unreadable files, a full disk: nothing checked to load
        raise AdapterRejected("fetch_failed", f"{ref.uri}: {exc}") from None


def _fetch_http(ref: AdapterRef, cache_dir: Path, timeout_s: float) -> Path:
    target = cache_dir / ref.policy / f"{ref.version}-{ref.sha256[:12]}"
    if target.exists():
        try:
            return verify_adapter(target, ref)
        except AdapterRejected as exc:  # a damaged cache entry: fetch it again
            log.warning("discarding cached adapter %s: %s", target, exc)
            shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _download(ref, tmp, timeout_s)
        verify_adapter(tmp, ref)
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


def _download(ref: AdapterRef, folder: Path, timeout_s: float) -> None:
    """Both files into ``folder``, never more bytes in all than ``ref.size``."""
    import httpx

    base = ref.uri.rstrip("/")
    left = ref.size
    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
            for name in ADAPTER_FILES:
                with (
                    client.stream("GET", f"{base}/{name}") as resp,
                    (folder / name).open("wb") as out,
                ):
                    if resp.status_code == 404:
                        raise AdapterRejected("missing_files", f"{base}/{name}: 404")
                    if resp.status_code != 200:
                        raise AdapterRejected(
                            "fetch_failed", f"{base}/{name}: HTTP {resp.status_code}"
                        )
                    for chunk in resp.iter_bytes(_CHUNK):
                        left -= len(chunk)
                        if left < 0:
                            raise AdapterRejected(
                                "hash_mismatch", f"{base}: more than the announced {ref.size} B"
                            )
                        out.write(chunk)
    except httpx.HTTPError as exc:
        raise AdapterRejected("fetch_failed", f"{base}: {type(exc).__name__}: {exc}") from None


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
