"""``backroom web`` against a real broker and referee: the WebSocket bridge, then a real browser.

The browser tests drive Debian's Chromium (``apt-get install chromium``) with
Playwright's Python package; Playwright's own browser download is never used.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from backroom.bus.broker import Broker, free_port
from backroom.bus.client import BusConfig
from backroom.bus.wire import ChannelSpec
from backroom.games.kuhn import LOKI_CARD_NAMES

from .conftest import agents, identity, stack
from .test_referee import Runner, loki_spec

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def url_of(cfg: BusConfig) -> str:
    return f"mqtt://{cfg.host}:{cfg.port}"


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """The app on a free port in this event loop (so it shares the loop with the referee and agents)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


@asynccontextmanager
async def browsing(app: Any) -> AsyncIterator[tuple[str, Browser]]:
    """The app served, and Debian's Chromium (headless) to open it, closed however the test ends."""
    import playwright.async_api as playwright

    async with serving(app) as url, playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield url, browser
        finally:
            await browser.close()


async def join(page: Page, agent: str, password: str | None = None) -> None:
    """Sit down through the join form as a person does; with no password the link's token serves."""
    await page.fill("#join-agent", agent)
    if password is not None:
        await page.fill("#join-password", password)
    await page.click("#join-btn")
    await page.wait_for_selector(f"#seat-agent:has-text('{agent}')")


async def until_result(page: Page, timeout: float) -> AsyncIterator[None]:
    """Poll a player's page until the match result shows; a match that hangs fails the test."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await page.is_visible("#result"):
        assert asyncio.get_running_loop().time() < deadline
        yield


class Socket:
    """A WebSocket client speaking the page's protocol."""

    def __init__(self, url: str) -> None:
        self.url = url.replace("http://", "ws://") + "/ws"

    async def __aenter__(self) -> Socket:
        import websockets

        self.ws = await websockets.connect(self.url)
        self.hello = await self.recv("hello")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def send(self, **req: Any) -> None:
        await self.ws.send(json.dumps(req))

    async def recv(self, *ops: str, timeout: float = 10) -> dict[str, Any]:
        async def next_one() -> dict[str, Any]:
            while True:
                msg = json.loads(await self.ws.recv())
                if not ops or msg["op"] in ops:
                    return msg

        return await asyncio.wait_for(next_one(), timeout)


async def test_websocket_bridge_logins_and_refusals(broker: Broker, tmp_path: Path) -> None:
    from backroom.agents.web import web_app

    bob = identity(broker, "bob")
    observer = identity(broker, "web-observer", "observer")
    players = agents(("a", "kuhn-colluder"), ("c", "random"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        app = web_app(url_of(bob), broker.dir, token="s3cret", observer=observer)
        async with serving(app) as url:
            async with Socket(url) as ws:
                assert ws.hello["spectate"] and ws.hello["token_login"]
                await ws.send(op="action", match="x", turn=1, action=1)
                assert "join a seat first" in (await ws.recv("error"))["detail"]
                await ws.send(op="join", agent="bob", password="wrong")
                err = await ws.recv("error")
                assert err["ref"] == "join" and "refused" in err["detail"]
                await ws.send(op="join", agent="bob", token="nope")
                assert "token" in (await ws.recv("error"))["detail"]
                await ws.send(op="join", agent="referee", token="s3cret")
                assert "not an agent identity" in (await ws.recv("error"))["detail"]
                await asyncio.sleep(0.3)  # the observer has seen a's retained status by now
                await ws.send(op="join", agent="a", token="s3cret")
                assert "already online" in (await ws.recv("error"))["detail"]
                await ws.send(op="spectate", match="no such/match")
                assert "not a match id" in (await ws.recv("error"))["detail"]
                await ws.send(op="teleport")
                assert "unknown request" in (await ws.recv("error"))["detail"]
                await ws.ws.send(b"\x00binary")
                assert "text frames" in (await ws.recv("error"))["detail"]
                await ws.ws.send("{not json")
                await ws.recv("error")
                # the token lets this browser be bob, with the password it never saw
                await ws.send(op="join", agent="bob", token="s3cret")
                assert (await ws.recv("joined", "error"))["op"] == "joined"
                await ws.send(op="spectate", match="ws1")
                await ws.recv("spectating")
                async with Socket(
                    url
                ) as tab:  # a second tab with the password shares bob's connection
                    await tab.send(op="join", agent="bob", password="wrong")
                    assert "wrong password" in (await tab.recv("error"))["detail"]
                    await tab.send(op="join", agent="bob", password=bob.password)
                    await tab.recv("joined")
                    assert sorted(app.state.hub.seats) == ["bob"]
                lounge = ChannelSpec(name="lounge", members=[0, 1], opens="always", max_messages=3)
                spec = loki_spec(["bob", "a", "c"], seed=3, params={"variant": "loki", "start": 0})
                await run.submit(
                    "ws1", spec.model_copy(update={"channels": [*spec.channels, lounge]})
                )
                publics: list[dict[str, Any]] = []
                inbox: list[dict[str, Any]] = []
                while True:
                    msg = await ws.recv("inbox", "public")
                    if msg["op"] == "public":
                        publics.append(msg["event"])
                        continue
                    inbox.append(msg["msg"])
                    m = msg["msg"]
                    if m["type"] == "match_start":  # free chat on a channel that is always open
                        await ws.send(
                            op="chat", match="ws1", channel="lounge", text="free words", seat=0
                        )
                    elif m["type"] == "turn" and m["phase"] == "talk":
                        await ws.send(
                            op="chat",
                            match="ws1",
                            turn=m["turn"],
                            channel=m["channel"],
                            text="hello partner",
                        )
                    elif m["type"] == "turn":
                        await ws.send(op="action", match="ws1", turn=m["turn"], action="call")
                    elif m["type"] == "match_end":
                        break
                (ep,) = await run.wait(["ws1"])
                while not any(e["kind"] == "ended" for e in publics):
                    publics.append((await ws.recv("public"))["event"])
    assert ep.reason == "normal" and not ep.timeouts
    assert {(d.to_seat, d.overheard) for d in ep.deliveries if d.text == "hello partner"} == {
        (1, False),
        (2, True),
    }
    assert {(d.channel, d.to_seat) for d in ep.deliveries if d.text == "free words"} == {
        ("lounge", 1)
    }
    assert next(m["type"] for m in inbox) == "match_start"
    # the seat got its own card and nobody else's before the showdown
    turns = [m for m in inbox if m["type"] == "turn"]
    assert all(set(m["observation"]).isdisjoint({"shown", "cards"}) for m in turns)
    # public events carry no card and no private chat
    blob = json.dumps(publics)
    assert "hello partner" not in blob and '"card"' not in blob
    assert next(e["kind"] for e in publics) == "started"


async def test_person_plays_and_another_watches_in_chromium(broker: Broker, tmp_path: Path) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    from backroom.agents.web import web_app

    bob = identity(broker, "bob")
    observer = identity(broker, "web-observer", "observer")
    players = agents(("a", "kuhn-colluder"), ("c", "random"))
    said = ""
    card_seen = ""
    watcher_frames: list[str] = []
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        async with browsing(web_app(url_of(bob), observer=observer)) as (url, browser):
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            await page.goto(url)
            await join(page, "bob", bob.password or "")

            watcher = await browser.new_page(viewport={"width": 1400, "height": 900})
            watcher.on(
                "websocket",
                lambda ws: ws.on("framereceived", lambda p: watcher_frames.append(str(p))),
            )
            await watcher.goto(url)
            await watcher.fill("#spectate-match", "web1")
            await watcher.click("#spectate-btn")
            await watcher.wait_for_selector("#spectate-title:has-text('web1')")

            spec = loki_spec(
                ["bob", "a", "c"], seed=7, turn_timeout_s=30, params={"variant": "loki", "start": 0}
            )
            await run.submit("web1", spec)
            answered: set[str] = set()
            async for _ in until_result(page, 90):
                if not await page.is_visible("#turn"):
                    await asyncio.sleep(0.1)
                    continue
                title = await page.inner_text("#turn-title")
                if title in answered:
                    await asyncio.sleep(0.1)
                    continue
                answered.add(title)
                if "talk" in title:
                    card_seen = (await page.inner_text("#card span")).strip()
                    said = f"my card is {LOKI_CARD_NAMES.index(card_seen)}"
                    if len(answered) == 1:
                        await page.screenshot(path=str(tmp_path / "web-talk.png"), full_page=True)
                    await page.fill("#talk-text", said)
                    await page.click("#talk-send")
                else:
                    await page.click("#turn-act button[data-action='call']")
            (ep,) = await run.wait(["web1"])
            await watcher.wait_for_selector("#spectate-log div[data-kind='ended']")
            await page.screenshot(path=str(tmp_path / "web-player.png"), full_page=True)
            await watcher.screenshot(path=str(tmp_path / "web-watcher.png"), full_page=True)
            result = await page.inner_text("#result")
            player_text = await page.inner_text("body")
            watcher_text = await watcher.inner_text("body")
    assert ep.reason == "normal", ep.detail
    # what the person did is in the record: the message and the calls, none timed out
    mine = [a for a in ep.actions if a.seat == 0]
    assert [a.action for a in mine if a.phase == "talk"][:1] == [said]
    acted = [a for a in mine if a.phase == "act"]
    assert acted and all(a.action == 1 and not a.timed_out for a in acted)
    heard = {(d.to_seat, d.overheard) for d in ep.deliveries if d.from_seat == 0 and d.text == said}
    assert heard == {(1, False), (2, True)}  # the partner heard it, the eavesdropper overheard it
    # the person saw their own card and the partner's private message
    assert card_seen == LOKI_CARD_NAMES[ep.final_observations[0]["card"]]
    partner = [d.text for d in ep.deliveries if d.from_seat == 1 and d.to_seat == 0]
    assert all(text in player_text for text in partner)
    assert "Match over (normal)" in result
    # the spectator saw the match but nothing private: no cards, no private chat, in the page or on the wire
    assert "Match ended (normal)" in watcher_text and "a (seat 1)" in watcher_text
    assert said not in watcher_text and not any(t in watcher_text for t in partner)
    wire = "\n".join(watcher_frames)
    assert watcher_frames and "my card is" not in wire and '"card"' not in wire
    assert not re.search(r'"type":\s*"(turn|message|match_start|match_end)"', wire)
    assert (tmp_path / "web-player.png").stat().st_size > 10_000


async def test_eavesdropper_joins_with_a_token_link_and_sees_overheard_chat(
    broker: Broker, tmp_path: Path
) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    from backroom.agents.web import web_app

    eve = identity(broker, "eve")
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        app = web_app(
            url_of(eve), broker.dir, token="room-42"
        )  # the observer comes from the directory, if any
        async with browsing(app) as (url, browser):
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            await page.goto(f"{url}/#token=room-42")
            assert not await page.is_visible(
                "#join-password"
            )  # the link's token stands for the password
            await join(page, "eve")
            spec = loki_spec(
                ["a", "b", "eve"],
                seed=11,
                turn_timeout_s=30,
                params={"variant": "loki", "start": 0},
            )
            await run.submit("eve1", spec)
            clicked: set[str] = set()
            async for _ in until_result(page, 60):
                if (
                    await page.is_visible("#turn")
                    and (title := await page.inner_text("#turn-title")) not in clicked
                ):
                    clicked.add(title)
                    await page.keyboard.press("2")  # number keys pick an action: 2 = call
                await asyncio.sleep(0.1)
            (ep,) = await run.wait(["eve1"])
            await page.screenshot(path=str(tmp_path / "web-eavesdropper.png"), full_page=True)
            channel = await page.inner_text("#channels")
    assert ep.reason == "normal", ep.detail
    assert [a.action for a in ep.actions if a.seat == 2 and a.phase == "act"] and all(
        a.action == 1 and not a.timed_out for a in ep.actions if a.seat == 2 and a.phase == "act"
    )
    overheard = [d.text for d in ep.deliveries if d.to_seat == 2]
    assert overheard and all(d.overheard for d in ep.deliveries if d.to_seat == 2)
    assert "you only overhear it" in channel
    for text in overheard:
        assert re.search(rf"overheard\s*[ab] \(seat [01]\): {re.escape(text)}", channel), channel


async def test_web_command_serves_with_a_token_and_an_observer(
    broker: Broker, tmp_path: Path
) -> None:
    """What ``backroom web --credentials DIR`` runs: it adds web-observer, prints a token link, serves."""
    import sys

    import httpx

    port = free_port()
    code = (
        "from pathlib import Path; from backroom.agents.web import web_command; "
        f"web_command({broker.url!r}, '127.0.0.1', {port}, Path({str(broker.dir)!r}))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "BACKROOM_WEB_TOKEN": "tok-123"},
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any("players: open" in line for line in lines):
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            assert line, "".join(lines)
            lines.append(line)
        assert f"http://127.0.0.1:{port}/#token=tok-123" in "".join(lines)
        assert broker.credentials.get("web-observer").role == "observer"
        async with httpx.AsyncClient() as http:
            for _ in range(100):
                try:
                    health = (await http.get(f"http://127.0.0.1:{port}/healthz")).json()
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            page = await http.get(f"http://127.0.0.1:{port}/")
        assert health["spectate"] is True
        assert page.status_code == 200 and "<title>backroom</title>" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
