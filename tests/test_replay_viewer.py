"""``backroom replay``: real runs (real broker, referee and agents; SmolLM2 colluders) in Chromium.

The page is driven as a researcher would: the list filtered through its form,
a match stepped through with the keyboard, a deep link opened in a fresh tab,
two matches of a CRN group side by side, a match followed while it is played.
Everything asserted is compared with the run's own files (``episodes.jsonl``,
``traces.jsonl``), never with numbers written here. Screenshots go to the
test's directory, and to ``$BACKROOM_SCREENSHOTS`` when set (how docs/img was made).
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from backroom.agents import make_agent
from backroom.bus.broker import Broker
from backroom.bus.wire import EpisodeRecord, Turn
from backroom.human.web import web_app
from backroom.replay.index import ReplayIndex
from backroom.replay.routes import load_view
from backroom.runner.config import RunConfig, parse_config, read_yaml
from backroom.runner.local import run_matches

from .conftest import (
    CHROMIUM,
    CHROMIUM_ARGS,
    RawAgent,
    Runner,
    browsing,
    identity,
    load_factor,
    loki_spec,
    play_raw,
    stack,
)

if TYPE_CHECKING:
    from playwright.async_api import Page

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = "mqtt://127.0.0.1:1"  # the replay needs no broker: nothing connects to this


def screenshot_dirs(tmp_path: Path) -> list[Path]:
    extra = os.environ.get("BACKROOM_SCREENSHOTS")
    return [tmp_path, *([Path(extra)] if extra else [])]


async def shoot(page: Page, tmp_path: Path, name: str) -> None:
    for d in screenshot_dirs(tmp_path):
        d.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(d / name), full_page=True)
    assert (tmp_path / name).stat().st_size > 10_000


async def play(
    config: RunConfig, broker: Broker, runs_dir: Path
) -> tuple[list[EpisodeRecord], Path]:
    """The config's matches through a real referee; the run directory holds its episodes and traces."""
    players = [make_agent(a.kind, a.id, **a.options) for a in config.agents]
    run_dir = runs_dir / config.run
    run_dir.mkdir(parents=True, exist_ok=True)
    async with stack(broker, runs_dir, players):
        runner = identity(broker, "runner", "runner")
        waiting = ["referee", *(a.id for a in config.agents)]
        eps = await run_matches(config, runner, waiting, traces_path=run_dir / "traces.jsonl")
    return eps, run_dir


def naive_config(eavesdropper: bool) -> RunConfig:
    """Loki Kuhn with card-telling colluders (scripted): fast, and every opening message says a card."""
    return parse_config(
        {
            "run": "replay-naive",
            "game": "kuhn",
            "params": {"variant": "loki"},
            "matches": 12,
            "seed": 3,
            "concurrency": 4,
            "turn_timeout_s": 10,
            "agents": [
                {"id": "alice", "kind": "kuhn-colluder"},
                {"id": "bob", "kind": "kuhn-colluder"},
                {"id": "carol", "kind": "cfr", "options": {"policy": "kuhn_loki_cfr"}},
            ],
            "seats": ["alice", "bob", "carol"],
            "channels": [
                {
                    "name": "colluders",
                    "members": ["alice", "bob"],
                    "eavesdroppers": ["carol"] if eavesdropper else [],
                    "opens": "start",
                    "max_messages": 1,
                }
            ],
            "transform": {"kind": "coalition", "members": ["alice", "bob"]},
        },
        "test",
    )


def llm_config() -> RunConfig:
    """The paper's explicit-collusion config, short: one hand twice, in one CRN group.

    Cut to what a shared CPU plays in a minute or two: alice is the model
    (SmolLM2), bob a scripted card-teller, and the colluders talk once, at
    the start, rather than before every move.
    """
    path = ROOT / "examples" / "llm_kuhn_explicit.yaml"
    data = read_yaml(path)
    data.update(run="replay-llm", deals={"each": 2, "hands": [[0, 1, 4]]}, crn=2, concurrency=2)
    data["model"]["options"]["max_new_tokens"] = 8
    data["agents"][1] = {"id": "bob", "kind": "kuhn-colluder"}
    data["channels"][0]["opens"] = "start"
    return parse_config(data, str(path))


async def settled(page: Page, fragment: str | None = None) -> None:
    """Wait until the page has drawn the view its URL names (``fragment``: once the URL names it).

    The page marks ``body[data-ready]`` with the fragment it finished drawing.
    Waited for by selector, as the page's CSP allows no ``eval`` for a predicate.
    """
    if fragment is not None:
        await page.wait_for_url(re.compile(fragment))
    current = "#" + page.url.split("#", 1)[1]
    await page.wait_for_selector(f"body[data-ready={json.dumps(current)}]", state="attached")


async def open_view(page: Page, url: str) -> None:
    await page.goto(url)
    await settled(page)


async def seat_messages(page: Page, seat: int) -> list[tuple[str, str]]:
    """(overheard flag, text) of the messages a seat's private view shows at the current step."""
    return await page.eval_on_selector_all(
        f"#step .seat[data-seat='{seat}'] .msg.heard",
        "ms => ms.map((m) => [m.dataset.overheard, m.textContent])",
    )


# --- the list, its filters, and who heard what (scripted colluders: fast) ---------------------


async def test_the_list_filters_and_a_seat_outside_the_channel_hears_nothing(
    broker: Broker, tmp_path: Path
) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    eps, run_dir = await play(naive_config(eavesdropper=False), broker, tmp_path / "runs")
    carol_wins = sorted(
        (e for e in eps if e.returns[2] > 0), key=lambda e: e.returns[2], reverse=True
    )
    assert 0 < len(carol_wins) < len(eps)  # the filter has something to leave out
    index = ReplayIndex(run_dir)
    async with browsing(web_app(OFFLINE, replay=index)) as (url, browser):
        page = await browser.new_page(viewport={"width": 1400, "height": 900})
        await open_view(page, f"{url}/replay#/list")
        assert f"{len(eps)} matches" in await page.inner_text("h2")
        # the form: carol's wins, best first
        await page.select_option("#f-agent", "carol")
        await settled(page, "agent=carol")
        await page.select_option("#f-outcome", "win")
        await settled(page, "outcome=win")
        await page.select_option("#f-sort", "reward")
        await settled(page, "sort=reward")
        await page.select_option("#f-order", "desc")
        await settled(page, "order=desc")
        assert f"{len(carol_wins)} matches" in await page.inner_text("h2")
        shown = await page.eval_on_selector_all(
            "#matches tbody tr[data-match]", "rs => rs.map((r) => r.dataset.match)"
        )
        assert sorted(shown) == sorted(e.match for e in carol_wins)
        rewards = [next(e.returns[2] for e in eps if e.match == m) for m in shown]
        assert rewards == sorted(rewards, reverse=True)
        await shoot(page, tmp_path, "replay-list.png")
        # keys: j moves down the list, Enter opens the selected match
        await page.keyboard.press("j")
        await page.keyboard.press("Enter")
        await settled(page, f"#/m/{re.escape(shown[1])}/")
        # turn 1 is the colluders' opening talk: alice and bob hear each other, carol nothing
        await open_view(page, f"{url}/replay#/m/{shown[0]}/1")
        ep = next(e for e in eps if e.match == shown[0])
        said = {d.from_seat: d.text for d in ep.deliveries}
        assert set(said) == {0, 1}
        assert await seat_messages(page, 0) == [["0", f"colluders bob: {said[1]}"]]
        assert await seat_messages(page, 1) == [["0", f"colluders alice: {said[0]}"]]
        assert await seat_messages(page, 2) == []
        assert (
            await page.eval_on_selector_all("#step .seat[data-seat='2'] .msg", "m => m.length") == 0
        )
        # the card each seat's view shows is the card the referee dealt it
        for seat in range(3):
            obs = await page.inner_text(f"#step .seat[data-seat='{seat}'] .obs")
            assert re.search(rf"card\s+{ep.final_observations[seat]['card']}\b", obs)
        # a writer killed mid-line: the torn tail is a marked gap, and so is the line the
        # next append makes of it (its record lost inside the torn line, not silently)
        torn = ep.model_dump_json().encode()[:150]
        with (run_dir / "episodes.jsonl").open("ab") as f:
            f.write(torn)
        await open_view(page, f"{url}/replay#/list?reason=normal")
        assert "without a newline" in await page.inner_text("tr.gap")
        assert f"{len(eps)} matches" in await page.inner_text("h2")
        with (run_dir / "episodes.jsonl").open("ab") as f:
            f.write(eps[-1].model_dump_json().encode() + b"\n")
        await open_view(page, f"{url}/replay#/list")
        gaps = await page.eval_on_selector_all("tr.gap", "g => g.map((x) => x.textContent)")
        assert len(gaps) == 1 and "torn or unreadable line" in gaps[0], gaps
        assert f"{len(eps)} matches" in await page.inner_text("h2")
    # bad query parameters are refused, naming the field
    async with browsing(web_app(OFFLINE, replay=index)) as (url, browser):
        page = await browser.new_page()
        for query, field in (
            ("seat=x", "seat"),
            ("outcome=won", "outcome"),
            ("sort=luck", "sort"),
            ("reward_min=lots", "reward_min"),
            ("per_page=100000", "per_page"),
        ):
            resp = await page.goto(f"{url}/api/replay/matches?{query}")
            assert resp is not None and resp.status == 400
            assert field in json.loads(await resp.text())["error"]
    index.close()


# --- model colluders: who heard what, prompts and log-probs, deep links, CRN, gaps -----------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def step_through(page: Page, ep: EpisodeRecord) -> dict[int, set[tuple[str, str]]]:
    """Every step from the start by the → key; what each seat's view showed it heard, over all steps."""
    heard: dict[int, set[tuple[str, str]]] = {s: set() for s in range(3)}
    while True:
        for seat in range(3):
            heard[seat] |= {(o, t) for o, t in await seat_messages(page, seat)}
        if await page.is_disabled("#next"):
            return heard
        key = await page.get_attribute("#step", "data-step")
        await page.keyboard.press("ArrowRight")
        await page.wait_for_selector(f"#step:not([data-step='{key}'])")
        await settled(page)


@pytest.mark.slow  # SmolLM2 plays two of Table 1's hands
@pytest.mark.timeout(1200)
async def test_model_colluders_replayed_turn_by_turn_with_prompts_and_log_probs(
    broker: Broker, tmp_path: Path
) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    eps, run_dir = await play(llm_config(), broker, tmp_path / "runs")
    traces = read_jsonl(run_dir / "traces.jsonl")
    ep = eps[0]
    chosen = [
        t
        for t in traces
        if t["match"] == ep.match and t["agent"] == "alice" and t["candidate_logprobs"]
    ]
    assert chosen, "alice's moves were scored over the legal actions"
    trace = chosen[0]
    index = ReplayIndex(run_dir)
    async with browsing(web_app(OFFLINE, replay=index)) as (url, browser):
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await open_view(page, f"{url}/replay#/m/{ep.match}/start")
        heard = await step_through(page, ep)
        # each seat's view showed exactly what the referee delivered to it, marked as it was
        for seat in range(3):
            delivered = {
                (
                    "1" if d.overheard else "0",
                    f"colluders{'overheard' if d.overheard else ''} {ep.seats[d.from_seat]}: {d.text}",
                )
                for d in ep.deliveries
                if d.to_seat == seat
            }
            assert heard[seat] == delivered, seat
        assert heard[2] and all(o == "1" for o, _ in heard[2])  # carol only overhears
        assert heard[0] and all(o == "0" for o, _ in heard[0])
        # a deep link to one of alice's decisions, in a fresh tab: the same turn, its trace
        link = f"{url}/replay#/m/{ep.match}/{trace['turn']}"
        tab = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await open_view(tab, link)
        assert await tab.get_attribute("#step", "data-step") == str(trace["turn"])
        box = "#step .decision[data-seat='0']"
        shown = await tab.eval_on_selector_all(
            f"{box} .logprob", "c => c.map((x) => x.textContent)"
        )
        assert shown == [f"{lp:.4f}" for lp in trace["candidate_logprobs"]]
        prompts = await tab.eval_on_selector_all(
            f"{box} pre.prompt", "c => c.map((x) => x.textContent)"
        )
        assert prompts == [m["content"] for m in trace["request"]["messages"]]
        assert await tab.inner_text(f"{box} pre.completion") == trace["reply"]["text"]
        version = trace["adapter_version"] or "base model"
        assert await tab.inner_text(f"{box} [data-version]") == f"adapter {version}"
        await shoot(tab, tmp_path, "replay-llm-decision.png")
        await tab.reload()
        await settled(tab)
        assert await tab.get_attribute("#step", "data-step") == str(trace["turn"])
        # a talk turn where carol overhears: the screenshot of who heard what
        talk = next(d for d in ep.deliveries if d.overheard)
        turn = next(
            a.turn
            for a in ep.actions
            if a.phase == "talk" and a.seat == talk.from_seat and a.action == talk.text
        )
        await open_view(tab, f"{url}/replay#/m/{ep.match}/{turn}")
        await shoot(tab, tmp_path, "replay-loki-talk.png")
        # the CRN group side by side: same deal, each seat the same card on both sides
        other = next(e for e in eps if e.match != ep.match)
        assert other.crn_group == ep.crn_group and other.seed == ep.seed
        await open_view(tab, f"{url}/replay#/cmp/{ep.match}/{other.match}/start")
        sides = await tab.eval_on_selector_all(".cmp > div", "d => d.map((x) => x.innerText)")
        assert len(sides) == 2 and ep.match in sides[0] and other.match in sides[1]
        for seat, obs in enumerate(ep.final_observations):
            assert obs["card"] == other.final_observations[seat]["card"]
        # gaps: a trace lost, a torn last line; all marked, none breaks the page
        # (and every trace of the other match: a match without traces)
        kept = [t for t in traces if t is not trace and t["match"] != other.match]
        (run_dir / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in kept))
        with (run_dir / "episodes.jsonl").open("ab") as f:
            f.write(ep.model_dump_json().encode()[:200])
        await open_view(tab, f"{url}/replay#/list")
        await tab.wait_for_selector("tr.gap")
        assert "without a newline" in await tab.inner_text("tr.gap")
        assert f"{len(eps)} matches" in await tab.inner_text("h2")
        await open_view(tab, link)
        assert "trace missing" in await tab.inner_text("#step .decision.gap[data-seat='0']")
        assert f"turn {trace['turn']}: no trace of alice" in await tab.inner_text("#gaps")
        await open_view(tab, f"{url}/replay#/m/{other.match}/start")
        assert "no traces for this match" in await tab.inner_text("#gaps")
    index.close()


# --- live: the list grows, a running match is followed, then replayed --------------------------


async def test_a_match_being_played_is_followed_then_replayed(
    broker: Broker, tmp_path: Path
) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    observer = identity(broker, "web-observer", "observer")
    raw_cfg = identity(broker, "human")
    from .conftest import agents as make_agents

    players = make_agents(("a", "kuhn-colluder"), ("c", "random"))
    runs = tmp_path / "runs"
    async with stack(broker, runs, players), Runner(broker) as run, RawAgent(raw_cfg) as raw:
        stop = asyncio.Event()
        first = "t.live.1"
        await run.submit(first, loki_spec(["a", "human", "c"], seed=1, turn_timeout_s=30))
        player = asyncio.create_task(play_raw(raw, stop=stop))
        await run.wait([first], timeout=30 * load_factor())
        stop.set()
        await player
        index = ReplayIndex(runs / "t")
        app = web_app(f"mqtt://{observer.host}:{observer.port}", observer=observer, replay=index)
        async with browsing(app) as (url, browser):
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await open_view(page, f"{url}/replay#/list")
            assert "1 matches" in await page.inner_text("h2")
            second = "t.live.2"
            await run.submit(
                second, loki_spec(["a", "human", "c"], seed=2, turn_timeout_s=30 * load_factor())
            )
            # the human seat has not answered: the match runs, and the list shows it live
            row = f"#matches tr.live a[href='#/live/{second}']"
            await page.wait_for_selector(row, timeout=20_000 * load_factor())
            await page.click(row)
            await page.wait_for_selector("#live-log .event", timeout=20_000 * load_factor())
            stop = asyncio.Event()
            player = asyncio.create_task(play_raw(raw, stop=stop))
            (ep,) = await run.wait([second], timeout=30 * load_factor())
            # when it ends, the page opens its full replay, and the list has grown
            await page.wait_for_url(
                re.compile(f"#/m/{re.escape(second)}/start$"), timeout=20_000 * load_factor()
            )
            await settled(page)
            assert ep.reason == "normal"
            await open_view(page, f"{url}/replay#/list")
            assert "2 matches" in await page.inner_text("h2")
            stop.set()
            await player
    # each view the replay rebuilt is the one the referee sent: the human seat's inbox has them
    view = load_view(index, second)
    assert view is not None and not view["gaps"]
    steps = {s["turn"]: s for s in view["steps"] if s["kind"] == "turn"}
    sent = [m for m in raw.inbox if isinstance(m, Turn) and m.match == second]
    assert sent and {m.turn for m in sent} <= set(steps)
    for m in sent:
        seen = steps[m.turn]["views"][m.seat]
        assert seen["asked"] and seen["observation"] == m.observation and seen["prompt"] == m.prompt
        assert steps[m.turn]["phase"] == m.phase and steps[m.turn]["channel"] == m.channel
    index.close()


# --- a big run: the benchmark's figures, bounded loosely ----------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_of_100000_episodes_pages_and_opens_a_match_fast(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "replay.py"),
            "--repeats",
            "3",
            "--dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=1700,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = {
        name: float(m.group(1))
        for name, pattern in (
            ("open", r"open \(fresh server, first page\):\s+([0-9.]+) ms"),
            ("match", r"match \(steps derived, as JSON\):\s+([0-9.]+) ms"),
        )
        if (m := re.search(pattern, out.stdout))
    }
    assert set(figures) == {"open", "match"}, out.stdout
    slack = 3 * load_factor()  # a loose bound: the figures themselves are bench/replay.py's
    assert figures["open"] < 2000 * slack, out.stdout
    assert figures["match"] < 500 * slack, out.stdout


# --- a training run: train_log.csv's steps, each linked to its matches --------------------------


@pytest.mark.slow  # two LoRA steps of the quick example
@pytest.mark.timeout(1800)
async def test_a_training_run_groups_its_matches_by_step_and_version(tmp_path: Path) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    run_dir = tmp_path / "quick"
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "backroom",
            "train",
            str(ROOT / "examples" / "ipd_quick.yaml"),
            "--run-dir",
            str(run_dir),
            "--steps",
            "2",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    log = list(csv.DictReader((run_dir / "train_log.csv").open()))
    with sqlite3.connect(run_dir / "store.sqlite") as db:  # what the trainer stored, per step
        per_step = dict(db.execute("SELECT step, count(*) FROM requests GROUP BY step").fetchall())
        some = db.execute(
            "SELECT e.match, e.record, t.turn, t.seat, t.trace FROM episodes e JOIN requests r"
            " ON r.match = e.match JOIN traces t ON t.match = e.match"
            " WHERE r.step = 1 AND r.kind = 'train' LIMIT 1"
        ).fetchone()
    index = ReplayIndex(run_dir)
    async with browsing(web_app(OFFLINE, replay=index)) as (url, browser):
        page = await browser.new_page(viewport={"width": 1400, "height": 900})
        await open_view(page, f"{url}/replay#/steps")
        rows = await page.eval_on_selector_all(
            "#steps tbody tr", "rs => rs.map((r) => r.dataset.step)"
        )
        assert rows == [r["step"] for r in log] == ["0", "1"]
        for r in log:  # each row shows train_log.csv's figures
            text = await page.inner_text(f"#steps tr[data-step='{r['step']}']")
            assert r["loss"] in text and r["version"] in text
        await shoot(page, tmp_path, "replay-training-steps.png")
        await page.click("#steps tr[data-step='1'] td a")
        await settled(page, "step=1")
        assert f"{per_step[1]} matches" in await page.inner_text("h2")
        # a trained decision of step 1: the adapter version that played it, as its trace says
        match, record, turn, seat, trace = some
        await open_view(page, f"{url}/replay#/m/{match}/{turn}")
        version = json.loads(trace)["adapter_version"]
        box = f"#step .decision[data-seat='{seat}'] [data-version]"
        assert await page.inner_text(box) == f"adapter {version}"
        wanted = {a["version"] for a in json.loads(record)["spec"]["adapters"] if a}
        assert version in wanted
    index.close()


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p / "nowhere", "is not a run directory"),
        (lambda p: p, "has no episodes.jsonl"),
    ],
    ids=["missing", "not-a-run"],
)
def test_replay_refuses_a_directory_that_is_not_a_run(
    tmp_path: Path, make: Any, words: str
) -> None:
    from typer.testing import CliRunner

    from backroom.cli import app

    result = CliRunner().invoke(app, ["replay", str(make(tmp_path)), "--port", "1"])
    assert result.exit_code != 0
    assert words in result.output, result.output


# --- beyond loopback: a token on every request; bad query parameters -------------------------


async def test_replay_beyond_loopback_needs_its_token_and_bad_pages_are_400(
    broker: Broker, tmp_path: Path
) -> None:
    """Would have caught: ``backroom replay --host 0.0.0.0`` served every seat's private view
    to anyone who sent ``Host: localhost``; ``page=10**23`` answered 500."""
    import httpx
    import websockets
    from websockets.exceptions import InvalidStatus

    from backroom.bus.broker import free_port

    _, run_dir = await play(naive_config(eavesdropper=False), broker, tmp_path / "runs")
    port = free_port()
    code = (
        "from pathlib import Path; from backroom.human.web_replay import replay_command; "
        f"replay_command(Path({str(run_dir)!r}), '0.0.0.0', {port}, None, None)"
    )
    env = {k: v for k, v in os.environ.items() if k != "BACKROOM_REPLAY_TOKEN"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-u", "-c", code, stdout=asyncio.subprocess.PIPE, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any("the page:" in line for line in lines):
            line = (await asyncio.wait_for(proc.stdout.readline(), 60 * load_factor())).decode()
            assert line, "".join(lines)
            lines.append(line)
        found = re.search(rf"http://0\.0\.0\.0:{port}/replay\?token=([\w-]+)", "".join(lines))
        assert found, "".join(lines)
        token = found.group(1)
        async with httpx.AsyncClient() as http:
            for _ in range(int(300 * load_factor())):
                try:
                    first = await http.get(f"{base}/replay")
                    break
                except httpx.TransportError:
                    assert proc.returncode is None
                    await asyncio.sleep(0.1)
            assert first.status_code == 401 and "token" in first.text
            for path in ("/replay", "/api/replay/matches", "/api/replay/info", "/healthz", "/"):
                for headers in ({}, {"Host": "localhost"}, {"Host": f"127.0.0.1:{port}"}):
                    resp = await http.get(f"{base}{path}", headers=headers)
                    assert resp.status_code == 401, (path, headers, resp.text)
                wrong = await http.get(f"{base}{path}", headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 403
            opened = await http.get(f"{base}/replay?token={token}")
            assert opened.status_code == 303 and opened.headers["location"] == "/replay"
            assert "httponly" in opened.headers["set-cookie"].lower()
            async with httpx.AsyncClient(cookies=opened.cookies) as browser:
                page = await browser.get(f"{base}/replay")
            assert page.status_code == 200
            bearer = {"Authorization": f"Bearer {token}"}
            listed = await http.get(f"{base}/api/replay/matches", headers=bearer)
            assert listed.status_code == 200 and listed.json()["rows"]
            for query in (
                "page=1e23",
                f"page={10**23}",
                "page=-1",
                "page=x",
                "per_page=-5",
                f"seat={10**30}",
                "reward_min=nan",
                "step=1.5",
            ):
                bad = await http.get(f"{base}/api/replay/matches?{query}", headers=bearer)
                assert bad.status_code == 400, (query, bad.status_code, bad.text)
                assert "error" in bad.json()
        ws_url = f"ws://127.0.0.1:{port}/ws"
        for named in (ws_url, f"ws://localhost:{port}/ws"):  # Host: localhost helps no more
            try:
                async with websockets.connect(named, host="127.0.0.1", port=port) as ws:
                    raise AssertionError(f"a socket without the token: {await ws.recv()}")
            except InvalidStatus as exc:
                assert exc.response.status_code == 401
        async with websockets.connect(ws_url, additional_headers=bearer) as ws:
            assert json.loads(await ws.recv())["op"] == "hello"
        # a browser: the printed URL once, then the page and its API on the cookie alone
        import playwright.async_api as playwright

        async with playwright.async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            try:
                page = await browser.new_page()
                await page.goto(f"{base}/replay?token={token}")
                assert page.url == f"{base}/replay"  # the token left the address bar
                await open_view(page, f"{base}/replay#/list")
                assert "12 matches" in await page.inner_text("h2")
                other = await browser.new_context()  # no cookie: refused
                refused = await (await other.new_page()).goto(f"{base}/replay")
                assert refused is not None and refused.status == 401
            finally:
                await browser.close()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


# --- readable: cards and moves in words, empty fields hidden, (silent), rounded, fallbacks ----


async def test_a_match_reads_in_words(broker: Broker, tmp_path: Path) -> None:
    """Would have caught: the replay showed ``card 4`` for Loki's Ace, history as a JSON list,
    ``round rewards []``, ``null`` for a silent talk turn, floats to 17 digits, and a
    deadline fallback's reason and detail nowhere in the decision panel."""
    from backroom.agents.decisions import Decided, deadline_detail
    from backroom.games.kuhn import LOKI_CARD_NAMES
    from backroom.replay.view import match_view
    from backroom.replay.words import SILENT, Words, number

    data = naive_config(eavesdropper=False).model_dump()
    data["channels"][0]["members"] = ["alice", "bob", "carol"]  # carol (cfr) says nothing
    config = parse_config({**data, "run": "replay-words", "matches": 4}, "test")
    eps, run_dir = await play(config, broker, tmp_path / "runs")
    index = ReplayIndex(run_dir)
    index.refresh()
    ep = eps[0]
    view = load_view(index, ep.match)
    assert view is not None and not view["gaps"], view and view["gaps"]
    start = view["steps"][0]
    for v in start["views"]:
        rows = dict(v["rows"])
        card = v["observation"]["card"]
        assert rows["card"] == f"{LOKI_CARD_NAMES[card]} (card {card})"
        assert "history" not in rows and "info state" not in rows  # empty, or said again
        assert all(text not in ("", "[]", "{}", "None", "null") for text in rows.values())
    end = view["steps"][-1]
    finals = {k: t for k, t in end["views"][0]["rows"]}
    names = {"check", "bet", "call", "fold"}
    assert " → " in finals["history"] or finals["history"].split()[-1] in names
    assert finals["history"].split()[0] in ep.seats and "{" not in finals["history"]
    assert not any(line.startswith("round rewards") for line in end["lines"])  # Kuhn has none
    assert end["lines"][0].startswith("returns ") and all(s in end["lines"][0] for s in ep.seats)
    silent = [
        m for s in view["steps"] if s["kind"] == "turn" for m in s["moves"] if m["agent"] == "carol"
    ]
    talked = [m for m in silent if m["action"] in (None, "")]
    assert talked and all(m["name"] == SILENT for m in talked)
    # rounding: 3 decimals, 3 significant digits below 1
    assert number(-0.0009764480637386441) == "-0.000976"
    assert number(3.0612345) == "3.061" and number(2.0) == "2" and number(0.0591) == "0.0591"
    assert Words(["a", "b"]).rows({"pot": 2.123456789, "round_rewards": []}) == [["pot", "2.123"]]
    # a deadline fallback: its reason and detail reach the decision panel
    record = EpisodeRecord.model_validate(json.loads(json.dumps(ep.model_dump(mode="json"))))
    turn_of = next(a for a in record.actions if a.agent == "alice" and a.phase == "act")
    act = Turn(
        match=record.match,
        turn=turn_of.turn,
        seat=turn_of.seat,
        phase="act",
        observation={},
        legal={"choices": [0, 1]},
        deadline_s=0.2,
    )
    detail = deadline_detail(act, 0.5)
    trace = {
        "agent": "alice",
        "request": {"messages": []},
        "reply": Decided.fallback(act, "deadline", None, detail).record([]),
    }
    shown = match_view(
        record.model_dump(mode="json"), {(turn_of.turn, turn_of.seat): trace}, {"alice"}
    )
    step = next(s for s in shown["steps"] if s.get("turn") == turn_of.turn)
    decided = next(d for d in step["decisions"] if d["seat"] == turn_of.seat)
    assert decided["reason"] == "deadline" and decided["detail"] == detail
    assert detail.startswith("no answer within 0.05 s")
    index.close()
