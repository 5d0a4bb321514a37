"""``backroom replay RUN_DIR``: a run's matches in the browser, one turn at a time.

The routes here are mounted into ``backroom web``'s app (``web_app(replay=...)``,
``backroom.human.web``; ``backroom.human.web_replay`` serves it for ``backroom replay``):
``/replay`` the page (``replay.html`` beside this module), ``/api/replay/...`` its JSON.
Offline (no broker) the same app runs without an observer: the replay works
and nothing connects anywhere; given a broker and an observer identity, the
same page also follows a match still being played,
over the spectators' socket (``/ws``, public events only, as a spectator
sees it), and the run's list grows as the referee appends to the run.

Everything the page gets is one page of the list or one match: the index
(``index.ReplayIndex``, a SQLite file beside the run) answers filters
and sorts, and a match's record and traces are read from disk by offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backroom.replay import training
from backroom.replay.index import ReplayIndex
from backroom.replay.query import Query, ReplayError
from backroom.replay.view import match_view

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import BaseRoute

#: The page: plain HTML and JavaScript, no build step, as the web app's own.
PAGE = Path(__file__).with_name("replay.html")
#: Seconds a request waits for a refresh before it answers with what is indexed so far.
WAIT_S = 1.0
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self' ws: wss:; img-src 'self' data:"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class Spectators(Protocol):
    """What the replay reads of ``web.WebHub``: the public matches its observer has seen."""

    @property
    def matches(self) -> Any: ...  # match id -> summary (state running/ended, moves, seats)
    @property
    def observer_bus(self) -> Any: ...


class Replay:
    """The index of one run, refreshed at most every ``REFRESH_S`` and always off the event loop."""

    def __init__(self, index: ReplayIndex, hub: Spectators | None = None) -> None:
        self.index = index
        self.hub = hub
        self._task: asyncio.Future[int] | None = None

    async def fresh(self) -> None:
        """Look for appended matches; answer with what is indexed if that takes longer than ``WAIT_S``.

        Every list request looks (a ``stat`` of each file when nothing was
        appended). A big run's first build goes on in its thread while the page
        shows the matches indexed so far (``indexing`` in the answers says how far).
        """
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(asyncio.to_thread(self.index.refresh))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), WAIT_S)

    def prefix(self) -> str:
        """Match ids of this run start with it: ``<run>.<nonce>.`` once a record names one."""
        first = self.index.matches(Query(per_page=1))["rows"]
        if first and first[0]["match"].count(".") >= 2:
            run, nonce, _ = first[0]["match"].split(".", 2)
            return f"{run}.{nonce}."
        stamped = re.fullmatch(r"\d{8}-\d{6}(-\d+)?", self.index.run_dir.name)
        return f"{(self.index.run_dir.parent if stamped else self.index.run_dir).name}."

    def live(self) -> list[dict[str, Any]]:
        """Matches of this run the observer sees being played, not yet in the run's file."""
        if self.hub is None or self.hub.observer_bus is None:
            return []
        prefix = self.prefix()
        running = [
            m
            for m in list(self.hub.matches.values())
            if m.get("state") == "running" and str(m.get("match", "")).startswith(prefix)
        ]
        return [m for m in running if self.index.locate(m["match"]) is None]


def replay_routes(index: ReplayIndex, hub: Spectators | None = None) -> list[BaseRoute]:
    """The page and its API, for ``web_app`` to mount."""
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    replay = Replay(index, hub)
    page = PAGE.read_text()

    def error(exc: Exception, status: int = 400) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=status, headers=HEADERS)

    async def page_route(_request: Request) -> Response:
        return HTMLResponse(page, headers=HEADERS)

    async def info(_request: Request) -> Response:
        await replay.fresh()
        data = await asyncio.to_thread(index.facets)
        data["live"] = hub is not None and hub.observer_bus is not None
        data["indexing"] = {k: {"done": d, "size": n} for k, (d, n) in index.progress.items()}
        return JSONResponse(data, headers=HEADERS)

    async def matches(request: Request) -> Response:
        try:
            q = Query.from_params(dict(request.query_params))
        except ReplayError as exc:
            return error(exc)
        await replay.fresh()
        data = await asyncio.to_thread(index.matches, q)
        data["live"] = replay.live() if q.page == 0 else []
        data["indexing"] = {k: {"done": d, "size": n} for k, (d, n) in index.progress.items()}
        return JSONResponse(data, headers=HEADERS)

    async def one_match(request: Request) -> Response:
        match = request.path_params["match"]
        view = await asyncio.to_thread(load_view, index, match)
        if view is None:
            await replay.fresh()  # it may have ended a moment ago
            view = await asyncio.to_thread(load_view, index, match)
        if view is None:
            return error(ReplayError(f"no match {match!r} in {index.run_dir}"), 404)
        return JSONResponse(view, headers=HEADERS)

    async def group(request: Request) -> Response:
        rows = await asyncio.to_thread(index.group, request.path_params["group"])
        return JSONResponse(rows, headers=HEADERS)

    async def steps(_request: Request) -> Response:
        await replay.fresh()
        data = await asyncio.to_thread(training_steps, index)
        return JSONResponse(data, headers=HEADERS)

    return [
        Route("/replay", page_route),
        Route("/api/replay/info", info),
        Route("/api/replay/matches", matches),
        Route("/api/replay/match/{match:path}", one_match),
        Route("/api/replay/group/{group:path}", group),
        Route("/api/replay/steps", steps),
    ]


def load_view(index: ReplayIndex, match: str) -> dict[str, Any] | None:
    """One match for the page: its steps, its traces joined, and every gap marked.

    A record that is not a valid episode (an older schema, a hand-edited line)
    comes back as a gap with the raw record, never as a server error.
    """
    record = index.record(match)
    if record is None:
        return None
    traces, bad = index.traces(match)
    try:
        view = match_view(record, traces, index.traced_agents())
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        return {
            "match": match,
            "steps": [],
            "gaps": [f"the record is not a valid episode: {exc}"],
            "raw": record,
        }
    view["gaps"] = [*bad, *view["gaps"]]
    if not traces and any(a in index.traced_agents() for a in view["seats"]):
        view["gaps"].insert(0, "no traces for this match (the run recorded some for its agents)")
    return view


def training_steps(index: ReplayIndex) -> dict[str, Any]:
    """A training run's steps: each ``train_log.csv`` row with its matches per kind and version."""
    rows = training.train_log(index.run_dir)
    with index.lock:
        counts = index.db.execute(
            "SELECT step, kind, version, count(*) FROM matches WHERE step IS NOT NULL"
            " GROUP BY step, kind, version ORDER BY step"
        ).fetchall()
    by_step: dict[int, list[dict[str, Any]]] = {}
    for step, kind, version, n in counts:
        by_step.setdefault(step, []).append({"kind": kind, "version": version, "matches": n})
    used = training.used_steps(index.store) if index.store is not None else {}
    logged = {int(r["step"]): r for r in rows if (r.get("step") or "").isdigit()}
    out = []
    for step in sorted(set(by_step) | set(logged)):
        out.append(
            {
                "step": step,
                "log": logged.get(step),
                "groups": by_step.get(step, []),
                "used": used.get(step, 0),
            }
        )
    return {"training": index.store is not None, "steps": out}
