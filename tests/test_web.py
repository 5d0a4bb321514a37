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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backroom.bus.broker import Broker, free_port
from backroom.bus.client import BusConfig
from backroom.bus.wire import ChannelSpec
from backroom.games.kuhn import LOKI_CARD_NAMES, LOKI_RULES

from .conftest import (
    CHROMIUM,
    Runner,
    agents,
    browsing,
    eventually,
    identity,
    loki_spec,
    serving,
    stack,
)

if TYPE_CHECKING:
    from playwright.async_api import Page


def url_of(cfg: BusConfig) -> str:
    return f"mqtt://{cfg.host}:{cfg.port}"


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
    from backroom.human.web import web_app

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
                await eventually(
                    lambda: "a" in app.state.hub.presence.names(), 10
                )  # a's retained status
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
                joined = await ws.recv("joined", "error")
                assert joined["op"] == "joined" and joined["key"]
                await ws.send(op="spectate", match="ws1")
                await ws.recv("spectating")
                # a second tab of the same browser presents the seat key and shares bob's connection
                async with Socket(url) as tab:
                    await tab.send(op="join", agent="bob", password="wrong")
                    assert "wrong password" in (await tab.recv("error"))["detail"]
                    await tab.send(op="join", agent="bob", password=bob.password, key=joined["key"])
                    assert (await tab.recv("joined"))["key"] == joined["key"]
                    assert sorted(app.state.hub.seats) == ["bob"]
                lounge = ChannelSpec(name="lounge", members=[0, 1], opens="always", max_messages=3)
                spec = loki_spec(["bob", "a", "c"], seed=3, params={"variant": "loki", "start": 0})
                await run.submit(
                    "ws1", spec.model_copy(update={"channels": [*spec.channels, lounge]})
                )
                publics: list[dict[str, Any]] = []
                inbox: list[dict[str, Any]] = []
                relayed: list[dict[str, Any]] = []
                while True:
                    msg = await ws.recv("inbox", "public")
                    if msg["op"] == "public":
                        publics.append(msg["event"])
                        continue
                    inbox.append(msg["msg"])
                    relayed.append(msg)
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
    # with the start, the rules (the models' text); with each act turn, the moves a person is
    # offered: bob opens with nothing to call, so check (the game's call) and raise, no fold
    assert relayed[0]["rules"] == LOKI_RULES
    acts = [r for r in relayed if r["msg"]["type"] == "turn" and r["msg"]["phase"] == "act"]
    assert acts[0]["msg"]["observation"]["to_call"] == 0
    assert acts[0]["msg"]["legal"]["names"] == ["fold", "call", "raise"]  # relayed unchanged
    assert acts[0]["legal"]["names"] == ["check", "raise"]
    assert acts[0]["legal"]["choices"] == [1, 2]
    for r in acts:
        facing = r["msg"]["observation"]["to_call"] > 0
        assert ("fold" in r["legal"]["names"]) == facing
    # the seat got its own card and nobody else's before the showdown
    turns = [m for m in inbox if m["type"] == "turn"]
    assert all(set(m["observation"]).isdisjoint({"shown", "cards"}) for m in turns)
    # public events carry no card and no private chat
    blob = json.dumps(publics)
    assert "hello partner" not in blob and '"card"' not in blob
    assert next(e["kind"] for e in publics) == "started"


async def test_a_seat_one_browser_holds_is_refused_to_another(broker: Broker) -> None:
    """The token link admits any agent identity, but not one that another browser is playing."""
    from backroom.human.web import web_app

    bob = identity(broker, "bob")
    app = web_app(url_of(bob), broker.dir, token="room", linger_s=30)
    async with serving(app) as url:
        async with Socket(url) as first, Socket(url) as second:
            await first.send(op="join", agent="bob", token="room")
            key = (await first.recv("joined"))["key"]
            # neither the link's token nor bob's own password takes the seat from the first browser
            for login in ({"token": "room"}, {"password": bob.password}):
                await second.send(op="join", agent="bob", **login)
                refusal = await second.recv("joined", "error")
                assert refusal["op"] == "error" and refusal["ref"] == "join"
                assert "another browser" in refusal["detail"]
            await second.send(op="join", agent="bob", token="room", key="a guess")
            assert "another browser" in (await second.recv("joined", "error"))["detail"]
            # the holder releases the seat: now the other browser may sit down
            await first.send(op="leave")
            await first.recv("left")
            await second.send(
                op="join", agent="bob", token="room", key=key
            )  # an old key is no hold
            new_key = (await second.recv("joined", "error"))["key"]
            assert new_key and new_key != key
            await first.send(op="join", agent="bob", token="room")
            assert "another browser" in (await first.recv("joined", "error"))["detail"]
        # the holder's socket dropped: through the reconnect window only its key takes the seat
        # back (the link alone would be replayed bob's private cards)
        async with Socket(url) as third:
            await third.send(op="join", agent="bob", token="room")
            assert "another browser" in (await third.recv("joined", "error"))["detail"]
            await third.send(op="join", agent="bob", token="room", key=new_key)
            assert (await third.recv("joined", "error"))["op"] == "joined"
            assert sorted(app.state.hub.seats) == ["bob"]


async def test_a_dropped_seat_is_held_for_its_holder_through_the_reconnect_window(
    broker: Broker,
) -> None:
    """Would have caught: the hold ended with the holder's last socket, so the token link took
    the seat at once during the linger and was replayed the private cards the holder was dealt.
    After the window the seat is free again (its connection closed)."""
    from prometheus_client import REGISTRY

    from backroom.human.web import web_app

    def held() -> float:
        return REGISTRY.get_sample_value("backroom_web_refused_total", {"reason": "seat_held"}) or 0

    bob = identity(broker, "bob")
    app = web_app(url_of(bob), broker.dir, token="room", linger_s=5.0)
    hub = app.state.hub
    before = held()
    async with serving(app) as url:
        async with Socket(url) as holder:
            await holder.send(op="join", agent="bob", token="room")
            key = (await holder.recv("joined"))["key"]
        await eventually(lambda: not hub.seats["bob"].clients, 10)  # the socket is gone
        async with Socket(url) as other:
            await other.send(op="join", agent="bob", token="room")
            assert "another browser" in (await other.recv("joined", "error"))["detail"]
            await other.send(op="join", agent="bob", password=bob.password)
            assert "another browser" in (await other.recv("joined", "error"))["detail"]
        assert held() == before + 2  # counted, as every refusal of backroom web is
        await eventually(lambda: "bob" not in hub.seats, 30)  # the window ran out
        async with Socket(url) as other:
            await other.send(op="join", agent="bob", token="room", key=key)  # a stale key: no hold
            joined = await other.recv("joined", "error")
            assert joined["op"] == "joined" and joined["key"] != key


async def test_an_online_status_left_by_a_vanished_process_stops_blocking_its_seat(
    broker: Broker,
) -> None:
    """Retained ``online`` statuses whose publishers left without a will expire; a live agent's do not.

    ``ghost`` declared a 0.4 s renewal period, ``mute`` (a raw client) none, so
    the page's default (0.4 s here) applies; both closed their connections
    normally, so no will said ``offline``. Both seats are refused at first,
    then free within three periods. ``live`` renews its status and stays refused.
    """
    from backroom.agents.runtime import AgentRunner
    from backroom.bus.client import Bus
    from backroom.bus.topics import status
    from backroom.bus.wire import Status
    from backroom.human.web import web_app

    observer = identity(broker, "web-observer", "observer")
    for name, declared in (("ghost", 0.4), ("mute", None)):
        async with Bus(identity(broker, name)) as bus:  # no will, and a normal DISCONNECT
            online = Status(state="online", kind="scripted", heartbeat_s=declared)
            await bus.publish(status(name), online, retain=True)
    (live,) = agents(("live", "random"))
    async with AgentRunner(live, identity(broker, "live"), status_refresh_s=0.4):
        app = web_app(url_of(observer), broker.dir, token="room", observer=observer)
        app.state.hub.presence.default_heartbeat_s = 0.4
        async with serving(app) as url, Socket(url) as ws:
            loop = asyncio.get_running_loop()
            started = loop.time()

            async def join(agent: str) -> dict[str, Any]:
                await ws.send(op="join", agent=agent, token="room")
                return await ws.recv("joined", "error")

            while not {"ghost", "mute", "live"} <= app.state.hub.presence.names():
                await asyncio.sleep(0.02)
            for agent in ("ghost", "mute", "live"):  # the retained statuses just arrived
                assert "already online" in (await join(agent))["detail"], agent
            freed: dict[str, float] = {}
            while len(freed) < 2:
                assert loop.time() - started < 10, "a stale status still blocks its seat"
                for agent in {"ghost", "mute"} - set(freed):
                    reply = await join(agent)
                    if reply["op"] == "joined":
                        freed[agent] = loop.time() - started
                        await ws.send(op="leave")
                        await ws.recv("left")
                await asyncio.sleep(0.1)
            assert all(t < 3 for t in freed.values()), freed
            # the behaviour under test is time: past any expiry window, live's renewals hold
            await asyncio.sleep(max(0.0, 2.0 - (loop.time() - started)))
            assert "already online" in (await join("live"))["detail"]


async def test_an_agent_renews_its_online_status_until_it_says_offline(broker: Broker) -> None:
    """The runtime's renewals declare their period and stop before ``offline``: none undoes it."""
    from backroom.agents.runtime import AgentRunner
    from backroom.bus.client import Bus
    from backroom.bus.topics import status
    from backroom.bus.wire import Status, parse

    payloads: list[bytes] = []
    marker = b"barrier"
    async with Bus(identity(broker, "watcher", "observer")) as watcher:
        await watcher.subscribe(status("live"), lambda _t, p: payloads.append(p))
        (live,) = agents(("live", "random"))
        live_config = identity(broker, "live")
        async with AgentRunner(live, live_config, status_refresh_s=0.1):
            await asyncio.sleep(0.65)  # the behaviour under test: renewals every 0.1 s
        # The runner closed its connection after "offline", so a renewal after it would have
        # left on that connection first: a marker on the same topic from a new one comes
        # after it (the broker has read the old connection's last packets before the new
        # one's login, handshake and publish), so once the marker is here, nothing is missing.
        async with Bus(live_config) as again:
            await again.publish(status("live"), marker)
        await eventually(lambda: marker in payloads, 10)
    seen = [parse(p) for p in payloads[: payloads.index(marker)]]
    assert all(isinstance(s, Status) for s in seen)
    assert [s.state for s in seen[:-1]] == ["online"] * (len(seen) - 1) and len(seen) >= 5
    assert {s.heartbeat_s for s in seen[:-1]} == {0.1}
    assert seen[-1].state == "offline"


async def test_websockets_from_another_origin_are_refused(broker: Broker) -> None:
    """Another site's page in a person's browser cannot open the bridge; listed origins can."""
    import websockets
    from websockets.exceptions import InvalidStatus
    from websockets.typing import Origin

    from backroom.human.web import web_app

    bob = identity(broker, "bob")
    app = web_app(url_of(bob), allowed_origins=["https://Play.Example.org/"])
    async with serving(app) as url:
        ws_url = url.replace("http://", "ws://") + "/ws"
        for origin in ("http://evil.example", "null", url.replace("127.0.0.1", "localhost")):
            try:
                async with websockets.connect(ws_url, origin=Origin(origin)) as ws:
                    raise AssertionError(f"{origin} was let in: {await ws.recv()}")
            except InvalidStatus as exc:
                assert exc.response.status_code == 403
                assert b"BACKROOM_WEB_ORIGINS" in exc.response.body
        for origin in (url, "https://play.example.org"):  # the page itself; a listed proxy
            async with websockets.connect(ws_url, origin=Origin(origin)) as ws:
                assert json.loads(await ws.recv())["op"] == "hello"


async def test_password_and_token_guesses_are_rate_limited_per_address(broker: Broker) -> None:
    """Five wrong secrets from one address, then each further try waits, longer each time."""
    from backroom.human.web import web_app

    bob = identity(broker, "bob")
    app = web_app(url_of(bob), broker.dir, token="room", login_backoff_s=1.0)
    async with serving(app) as url:
        async with Socket(url) as ws:
            for guess in ("a", "b", "c"):
                await ws.send(op="join", agent="bob", token=guess)
                assert "token is not valid" in (await ws.recv("error"))["detail"]
            for guess in ("d", "e"):  # a password the broker refuses counts as well
                await ws.send(op="join", agent="bob", password=guess)
                assert "refused" in (await ws.recv("error"))["detail"]
            # locked out: even the right token is not looked at, from a new socket as well
            async with Socket(url) as other:
                await other.send(op="join", agent="bob", token="room")
                err = await other.recv("joined", "error")
            assert err["op"] == "error" and "too many failed sign-ins" in err["detail"]
            assert "try again in 1 s" in err["detail"]
            await asyncio.sleep(1.1)  # the lockout under test runs out
            await ws.send(op="join", agent="bob", token="nope")  # a sixth failure: 2 s now
            await ws.recv("error")
            await ws.send(op="join", agent="bob", token="room")
            assert "try again in 2 s" in (await ws.recv("joined", "error"))["detail"]
            await asyncio.sleep(2.1)  # and the doubled one
            await ws.send(op="join", agent="bob", token="room")
            assert (await ws.recv("joined", "error"))["op"] == "joined"


async def test_person_plays_and_another_watches_in_chromium(broker: Broker, tmp_path: Path) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    from backroom.human.web import web_app

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
            offers: list[tuple[str, list[str]]] = []
            # the rules, open as the match starts
            await page.wait_for_selector("#rules[open] #rules-text:has-text('Kuhn Poker')")
            rules_seen = await page.inner_text("#rules-text")
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
                    # the number under the card is the one the partner's messages use
                    number = (await page.inner_text("#card small.num")).strip()
                    said = f"my {number.replace('card ', 'card is ')}"
                    if len(answered) == 1:
                        await page.screenshot(path=str(tmp_path / "web-talk.png"), full_page=True)
                    await page.fill("#talk-text", said)
                    await page.click("#talk-send")
                else:
                    to_call = await page.inner_text("#facts")
                    buttons = await page.eval_on_selector_all(
                        "#turn-act button", "bs => bs.map((b) => b.lastChild.textContent)"
                    )
                    offers.append((to_call, buttons))
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
    # the person saw their own card, by name and by the number the partner's messages use,
    # and the partner's private message
    card = ep.final_observations[0]["card"]
    assert card_seen == LOKI_CARD_NAMES[card] and said == f"my card is {card}"
    assert " ".join(rules_seen.split()) == LOKI_RULES
    # bob opens with nothing to call: check and raise; fold only when facing a bet
    assert offers[0][1] == ["check", "raise"]
    facing_seen = set()
    for facts, buttons in offers:
        facing = not re.search(r"To call\s+0\b", facts)
        assert ("fold" in buttons) == facing, (facts, buttons)
        facing_seen.add(facing)
    assert facing_seen == {False, True}  # seed 7: seat 2 raises after bob's check
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
    from backroom.human.web import web_app

    eve = identity(broker, "eve")
    players = agents(("a", "kuhn-colluder"), ("b", "kuhn-colluder"))
    async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
        app = web_app(
            url_of(eve), broker.dir, token="room-42"
        )  # the observer comes from the directory, if any
        async with browsing(app) as (url, browser):
            ours = await browser.new_context(viewport={"width": 1400, "height": 1000})
            page = await ours.new_page()
            await page.goto(f"{url}/#token=room-42")
            assert not await page.is_visible(
                "#join-password"
            )  # the link's token stands for the password
            await join(page, "eve")
            # another tab of this browser shares the seat (the key is in localStorage) ...
            tab = await ours.new_page()
            await tab.goto(f"{url}/#token=room-42")
            await join(tab, "eve")
            await tab.close()
            # ... while another browser with the same link is refused, and told why
            outsider = await browser.new_page()
            await outsider.goto(f"{url}/#token=room-42")
            await outsider.fill("#join-agent", "eve")
            await outsider.click("#join-btn")
            await outsider.wait_for_selector("#login-error:has-text('another browser')")
            assert not await outsider.is_visible("#seat")
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
                    # number keys pick an action: the key shown on the call (or check) button
                    key = await page.inner_text("#turn-act button[data-action='call'] kbd")
                    await page.keyboard.press(key.strip())
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
        "from pathlib import Path; from backroom.human.web import web_command; "
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


async def test_web_command_believes_no_forwarded_header_and_answers_only_its_own_names(
    broker: Broker,
) -> None:
    """Would have caught: uvicorn believed ``X-Forwarded-For`` from loopback, so a guesser on
    this machine naming a new address per guess was never locked out; and pages, /healthz,
    /api/matches and the socket answered any ``Host``, so a rebound DNS name with its own
    matching ``Origin`` passed the Origin check."""
    import sys

    import httpx
    import websockets
    from websockets.exceptions import InvalidStatus
    from websockets.typing import Origin

    port = free_port()
    code = (
        "from pathlib import Path; from backroom.human.web import web_command; "
        f"web_command({broker.url!r}, '127.0.0.1', {port}, Path({str(broker.dir)!r}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKROOM_WEB_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        "-c",
        code,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={**env, "BACKROOM_WEB_TOKEN": "tok-123"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(300):
                try:
                    assert (await http.get(f"{base}/healthz")).status_code == 200
                    break
                except httpx.TransportError:
                    assert proc.returncode is None
                    await asyncio.sleep(0.1)
            for path in ("/", "/healthz", "/api/matches"):
                for name in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
                    resp = await http.get(f"{base}{path}", headers={"Host": name})
                    assert resp.status_code == 400, (path, name, resp.text)
                    assert "BACKROOM_WEB_HOSTS" in resp.text
            assert (await http.get(f"http://localhost:{port}/healthz")).status_code == 200
        # the rebound pair: the browser sends the attacker's name as Host and as Origin
        rebound = f"evil.example:{port}"
        try:
            async with websockets.connect(
                f"ws://{rebound}/ws",
                host="127.0.0.1",
                port=port,
                origin=Origin(f"http://{rebound}"),
            ) as ws:
                raise AssertionError(f"a rebound host was let in: {await ws.recv()}")
        except InvalidStatus as exc:
            assert exc.response.status_code == 400
        ws_url = f"ws://127.0.0.1:{port}/ws"
        async with websockets.connect(ws_url, origin=Origin(base)) as ws:
            assert json.loads(await ws.recv())["op"] == "hello"

        async def join(forwarded: str, token: str) -> dict[str, Any]:
            async with websockets.connect(
                ws_url, additional_headers={"X-Forwarded-For": forwarded}
            ) as ws:
                await ws.recv()  # hello
                await ws.send(json.dumps({"op": "join", "agent": "bob", "token": token}))
                while True:
                    msg: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 20))
                    if msg["op"] in ("joined", "error"):
                        return msg

        identity(broker, "bob")
        for i in range(5):  # a new "address" per guess: all of them are this one peer
            assert "not valid" in (await join(f"10.0.0.{i}", f"guess-{i}"))["detail"]
        locked = await join("10.0.0.99", "tok-123")
        assert locked["op"] == "error" and "too many failed sign-ins" in locked["detail"]
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def test_sockets_without_a_token_are_capped_and_the_refusals_counted() -> None:
    """Would have caught: 600 unauthenticated sockets were all kept open, with no cap."""
    import websockets
    from prometheus_client import REGISTRY
    from websockets.exceptions import InvalidStatus

    from backroom.human.access import MAX_ANONYMOUS_SOCKETS
    from backroom.human.web import web_app

    def refused() -> float:
        return REGISTRY.get_sample_value("backroom_web_refused_total", {"reason": "sockets"}) or 0

    assert MAX_ANONYMOUS_SOCKETS <= 100  # small and fixed by default
    app = web_app("mqtt://127.0.0.1:1", max_anonymous_sockets=3)
    before = refused()
    async with serving(app) as url:
        ws_url = url.replace("http://", "ws://") + "/ws"
        held = [await websockets.connect(ws_url) for _ in range(3)]
        try:
            for ws in held:
                assert json.loads(await ws.recv())["op"] == "hello"
            for _ in range(2):
                try:
                    async with websockets.connect(ws_url) as ws:
                        raise AssertionError(f"a 4th socket was kept: {await ws.recv()}")
                except InvalidStatus as exc:
                    assert exc.response.status_code == 503
            assert refused() == before + 2
            await held.pop().close()

            async def one_more() -> bool:
                try:
                    async with websockets.connect(ws_url) as ws:
                        return bool(json.loads(await ws.recv())["op"] == "hello")
                except InvalidStatus:
                    return False

            for _ in range(100):  # the server sees the close a moment after the client
                if await one_more():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a closed socket's place was never freed")
        finally:
            for ws in held:
                await ws.close()


async def test_a_token_that_is_not_ascii_is_wrong_not_a_server_error() -> None:
    """``hmac.compare_digest`` raises on a non-ASCII ``str``: a query, bearer or cookie
    token of any bytes is a wrong token (403), never a 500 with a traceback."""
    import httpx

    from backroom.human.access import cookie_name
    from backroom.human.web import web_app

    app = web_app("mqtt://127.0.0.1:1", access_token="s3cret")
    async with serving(app) as url, httpx.AsyncClient() as client:
        port = int(url.rsplit(":", 1)[1])
        asked = [
            await client.get(f"{url}/healthz?token=%C3%A9"),
            await client.get(
                f"{url}/healthz", headers={"Authorization": b"Bearer \xc3\xa9t\xc3\xa9"}
            ),
            await client.get(
                f"{url}/healthz", headers={"Cookie": f"{cookie_name(port)}=".encode() + b"\xc3\xa9"}
            ),
        ]
        assert [r.status_code for r in asked] == [403, 403, 401], [
            r.text for r in asked
        ]  # SimpleCookie drops it
        good = await client.get(f"{url}/healthz", headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
