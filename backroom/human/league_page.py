"""The ``/league`` page of ``backroom web``: the standings of the leagues it was given.

The page polls ``/api/league`` (every second) and redraws: ratings with their
uncertainty, the head-to-head matrix, exploitability where the game has a
solver. The server reads each league directory's ``standings.json``, which
the league rewrites as results come in (backroom/league/standings.py), so a
running league shows its progress and the web server imports nothing of the
league package (it sits below it in the layers). Which directories are shown
is the operator's choice (``backroom web --league DIR``); the page takes no
path from the browser.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.routing import Route

STATIC = Path(__file__).parent / "web_static"
#: The file a league writes its standings to (backroom.league.standings.STANDINGS).
STANDINGS = "standings.json"


def read_league(directory: Path) -> dict[str, Any]:
    """A league's standings, or why there are none yet (the league may not have started)."""
    path = directory / STANDINGS
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return {"league": directory.name, "missing": f"no {STANDINGS} in {directory} yet"}
    except (OSError, ValueError) as exc:
        return {"league": directory.name, "missing": f"cannot read {path}: {exc}"}
    return data


def league_routes(directories: Sequence[Path], headers: dict[str, str]) -> list[Route]:
    """``/league`` (the page) and ``/api/league`` (every league's standings)."""
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    page = (STATIC / "league.html").read_text()
    dirs = [Path(d) for d in directories]

    async def league_page(_request: Request) -> Response:
        return HTMLResponse(page, headers=headers)

    async def league_api(_request: Request) -> Response:
        return JSONResponse({"leagues": [read_league(d) for d in dirs]}, headers=headers)

    return [Route("/league", league_page), Route("/api/league", league_api)]
