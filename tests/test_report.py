"""``backroom analyze --html``: one self-contained page, opened in Debian's Chromium.

A real run is played and analyzed as a user does it; the page must load every
plot from itself alone (``data:`` URIs), show the numbers of analysis.json,
and show hostile text as text.
"""

from __future__ import annotations

import json
import os
import re
from html import escape
from pathlib import Path
from typing import Any

from .conftest import CHROMIUM, CHROMIUM_ARGS
from .test_run_dirs import backroom, run_config

IPD = (
    "run: x\ngame: ipd\nparams: {rounds: 3}\nmatches: 4\nround_robin: true\n"
    "agents:\n  - {id: a.tft, kind: tit-for-tat}\n  - {id: b-rand, kind: random}\n"
)
# No character of it may act: the record's game name and the directory reach the page.
SCRIPT = "<script>document.title='pwned'</script>"
IMG = "<img src=x onerror=\"document.title='pwned'\">"


async def open_page(page_file: Path, screenshot: Path) -> dict[str, Any]:
    """What Chromium makes of the page once loaded: its images, text and title."""
    import playwright.async_api as playwright

    async with playwright.async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = await browser.new_page()
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            await page.goto(page_file.as_uri(), wait_until="load")
            seen: dict[str, Any] = await page.evaluate(
                """() => ({
                    title: document.title,
                    scripts: document.scripts.length,
                    images: [...document.images].map(i => ({
                        src: i.getAttribute('src').slice(0, 22),
                        complete: i.complete,
                        width: i.naturalWidth,
                    })),
                    tables: document.querySelector('pre.tables').innerText,
                    runDir: document.getElementById('run-dir').textContent,
                    command: document.getElementById('command').textContent,
                })"""
            )
            await page.screenshot(path=str(screenshot), full_page=True)
            seen["requests"] = requests
            return seen
        finally:
            await browser.close()


async def test_analyze_html_is_one_file_whose_plots_and_numbers_load_in_chromium(
    tmp_path: Path,
) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    run_dir = run_config(tmp_path, IPD)
    out = backroom("analyze", "runs/x", "--html", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    report = run_dir / "report.html"
    assert f"report: runs/x/{run_dir.name}/report.html" in out.stdout
    numbers = json.loads((run_dir / "analysis.json").read_text())
    ipd = numbers["games"]["ipd"]
    assert len(ipd["plots"]) >= 2

    text = report.read_text()
    assert 'src="http' not in text and "href=" not in text and "<script" not in text
    srcs = re.findall(r'<img[^>]*\ssrc="([^"]*)"', text)
    assert len(srcs) == len(ipd["plots"])
    assert all(s.startswith("data:image/png;base64,") for s in srcs)

    # The page alone: moved away from the run (and its plots/) it still shows everything.
    alone = tmp_path / "elsewhere" / "shared.html"
    alone.parent.mkdir()
    report.rename(alone)
    seen = await open_page(alone, tmp_path / "report.png")
    assert seen["requests"] == [alone.as_uri()]  # nothing fetched but the page itself
    assert len(seen["images"]) == len(ipd["plots"])
    for image in seen["images"]:
        assert image["src"] == "data:image/png;base64," and image["complete"], image
        assert image["width"] > 0, image
    assert seen["title"] == f"backroom analyze: x/{run_dir.name}"
    assert seen["runDir"] == f"runs/x/{run_dir.name}"
    assert seen["command"] == "backroom analyze runs/x --html"

    # The tables say the numbers analysis.json holds, row by agent.
    first_table = seen["tables"].split("└")[0]  # the agents' table, not the opponents' one
    rows = {
        cells[0]: cells[1:]
        for line in first_table.splitlines()
        if len(cells := [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]) == 3
    }
    for agent, mean in ipd["mean_reward_per_round"].items():
        coop = ipd["cooperation_rate_by_agent"][agent]
        assert rows[agent] == [f"{mean:.3f}", f"{coop:.3f}"], (agent, rows)
    assert f"welfare {ipd['welfare_fraction']:.3f} of the cooperative optimum" in seen["tables"]


async def test_hostile_text_reaches_the_html_report_as_text(tmp_path: Path) -> None:
    assert os.path.exists(CHROMIUM), "needs Debian's chromium: scripts/setup.sh --test installs it"
    run_dir = tmp_path / IMG
    run_dir.mkdir()
    record = {
        "match": "m1",
        "game": SCRIPT,
        "seats": ["a"],
        "returns": [1.0],
        "raw_returns": [1.0],
        "reason": "normal",
        "final_observations": [{}],
    }
    (run_dir / "episodes.jsonl").write_text(json.dumps(record) + "\n" + '{"torn')
    out = backroom("analyze", str(run_dir), "--html-to", "out/r.html", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (tmp_path / "out" / "r.html").read_text()
    assert "<script" not in text and "<img" not in text
    assert f'<code id="run-dir">{escape(str(run_dir))}</code>' in text

    seen = await open_page(tmp_path / "out" / "r.html", tmp_path / "hostile.png")
    assert seen["title"] == f"backroom analyze: {IMG}" and seen["scripts"] == 0
    assert seen["images"] == []
    assert seen["runDir"] == str(run_dir)
    # Titles wrap at the table's width, as in a terminal: the characters are there, in order.
    title = "".join(seen["tables"].split())
    assert "".join(f"{IMG} / {SCRIPT}: mean raw return per seat, 1 matches".split()) in title
    assert f"skipped 1 unreadable lines in {run_dir / 'episodes.jsonl'}" in seen["tables"]


def test_a_report_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    run_dir = run_config(tmp_path, IPD)
    out = backroom("analyze", str(run_dir), "--html-to", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: could not write the HTML report:"), out.stderr
    assert (run_dir / "analysis.json").is_file()  # the measures are kept
