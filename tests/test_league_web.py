"""The ``/league`` page of ``backroom web`` in Chromium: a finished league, then a running one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from backroom.human.web import web_app
from backroom.league.config import parse_league
from backroom.league.play import run_league

from .conftest import load_factor
from .test_league import ipd_league
from .test_web import CHROMIUM, browsing

if TYPE_CHECKING:
    from playwright.async_api import Locator

NO_BROKER = "mqtt://127.0.0.1:1"  # the page reads files: no observer, no connection


async def counted(section: Locator) -> int:
    return int(await section.locator("[data-testid=counted]").inner_text())


async def test_league_page_shows_a_finished_league_and_follows_a_running_one(
    tmp_path: Path,
) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    done_dir, live_dir = tmp_path / "done", tmp_path / "live"
    finished = await run_league(parse_league(ipd_league(tmp_path, name="done")), done_dir)
    order = [r["agent"] for r in finished.standings["games"]["ipd"]["ratings"]]
    assert order == ["d1", "d2", "d3", "d4", "d5", "allc"]

    live = ipd_league(tmp_path, name="live", seeds=40)
    live["concurrency"] = 2  # slow enough to be seen running: 600 matches, two at a time
    app = web_app(NO_BROKER, leagues=[done_dir, live_dir])
    wait_ms = 30_000 * load_factor()
    async with browsing(app) as (url, browser):
        page = await browser.new_page(viewport={"width": 1400, "height": 1200})
        await page.goto(f"{url}/league")
        done = page.locator("section[data-league=done]")
        await done.locator("[data-testid=state]:has-text('finished')").wait_for(timeout=wait_ms)
        rows = done.locator("[data-testid=ratings-ipd] tr[data-agent]")
        assert await rows.evaluate_all("rs => rs.map(r => r.dataset.agent)") == order
        mu = await done.locator("tr[data-agent=d1] td.mu").inner_text()
        assert float(mu) == round(finished.standings["games"]["ipd"]["ratings"][0]["mu"], 2)
        assert await done.locator("[data-testid=h2h-ipd] tr").count() == 7
        assert "(fallbacks): none" in await done.locator("[data-testid=fallbacks]").inner_text()

        stop = asyncio.Event()
        task = asyncio.create_task(run_league(parse_league(live), live_dir, stop=stop))
        try:
            section = page.locator("section[data-league=live]")
            await section.locator("[data-testid=state]:has-text('running')").wait_for(
                timeout=wait_ms
            )
            first = await counted(section)
            deadline = asyncio.get_running_loop().time() + wait_ms / 1000
            while await counted(section) <= max(first, 0):
                assert asyncio.get_running_loop().time() < deadline, "the page did not update"
                await asyncio.sleep(0.2)
            assert await section.locator("[data-testid=ratings-ipd] tr[data-agent]").count() == 6
            stop.set()  # Ctrl-C: the league ends, its standings say finished
            summary = await asyncio.wait_for(task, 60 * load_factor())
            await section.locator("[data-testid=state]:has-text('finished')").wait_for(
                timeout=wait_ms
            )
            assert await counted(section) == summary.standings["counted"] > first
        finally:
            stop.set()
            if not task.done():
                task.cancel()


async def test_the_lobby_links_the_league_page(tmp_path: Path) -> None:
    """A newcomer at `backroom web` finds the league standings from the lobby; the replay
    link shows only where a replay is served."""
    app = web_app(NO_BROKER, leagues=[tmp_path / "none"])
    async with browsing(app) as (url, browser):
        page = await browser.new_page()
        await page.goto(url)
        assert await page.locator("#replay-link").is_hidden()
        await page.get_by_role("link", name="league standings").click()
        await page.wait_for_url(f"{url}/league", timeout=30_000 * load_factor())
        assert "league" in (await page.title()).lower()
