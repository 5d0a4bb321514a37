"""The queue that turns concurrent requests into batches, run in a worker thread.

Requests from every concurrent match (and every agent of the process sharing
one backend) go through one ``Batcher`` per event loop: it collects requests
for ``batch_window_s`` (or until ``max_batch``), groups them by operation and
adapter (and, for generation, sampling settings), and runs each group as one
batch in a worker thread, so the event loop keeps serving the bus.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backroom.model.generation import Generated
from backroom.model.scoring import Scored, ScoreRequest

log = logging.getLogger("backroom.backend")


class Runs(Protocol):
    """What the batcher needs of a backend: its batching knobs and the two batched operations."""

    max_batch: int
    batch_window_s: float

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list[list[Scored]]: ...

    def generate_batch(
        self,
        requests: Sequence[tuple[list[int], str | None]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        seeds: Sequence[int | None] | None = None,
    ) -> list[Generated]: ...


@dataclass
class Request:
    """One caller's request, answered through its future."""

    kind: str  # "score" | "generate"
    prompt_ids: list[int]
    adapter: str | None
    future: asyncio.Future[Any]
    candidates: list[list[int]] = field(default_factory=list)
    max_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # this row's own sampler (not in the key: seeded rows batch together)

    def key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share a batch."""
        if self.kind == "score":
            return ("score", self.adapter)
        return ("generate", self.adapter, self.max_new_tokens, self.temperature, self.top_p)


class Batcher:
    """Collects requests for a few ms, then runs each group as one batch in a worker thread."""

    def __init__(self, backend: Runs) -> None:
        self.backend = backend
        self.queue: asyncio.Queue[Request] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.last_size = 0

    async def put(self, req: Request) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="backroom-batcher")
        await self.queue.put(req)

    async def _collect(self) -> list[Request]:
        """What has queued up, up to ``max_batch``; wait up to the window only under load.

        While a batch runs, new requests queue up and the next collect takes them
        at once. The window matters when requests trickle in: it is waited only
        if the previous batch held more than one request, so a lone match pays
        no latency for batching it cannot use.
        """
        loop = asyncio.get_running_loop()
        items = [await self.queue.get()]
        limit = self.backend.max_batch
        window = self.backend.batch_window_s if self.last_size > 1 else 0.0
        deadline = loop.time() + window
        while len(items) < limit:
            try:
                items.append(self.queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                items.append(await asyncio.wait_for(self.queue.get(), left))
            except TimeoutError:
                break
        self.last_size = len(items)
        return items

    async def _run(self) -> None:
        while True:
            items = await self._collect()
            groups: dict[tuple[Any, ...], list[Request]] = {}
            for it in items:
                if not it.future.cancelled():
                    groups.setdefault(it.key(), []).append(it)
            for key, group in groups.items():
                try:
                    results = await asyncio.to_thread(self._execute, key, group)
                except Exception as exc:  # a bad request fails its batch, not the worker
                    log.exception("batch of %d %s requests failed", len(group), key[0])
                    for it in group:
                        if not it.future.done():
                            it.future.set_exception(exc)
                    continue
                for it, res in zip(group, results, strict=True):
                    if not it.future.done():
                        it.future.set_result(res)

    def _execute(self, key: tuple[Any, ...], group: list[Request]) -> list[Any]:
        b = self.backend
        if key[0] == "score":
            return b.score_batch([(it.prompt_ids, it.candidates, it.adapter) for it in group])
        _, _, max_new, temp, top_p = key
        return b.generate_batch(
            [(it.prompt_ids, it.adapter) for it in group],
            max_new,
            temp,
            top_p,
            seeds=[it.seed for it in group],
        )
