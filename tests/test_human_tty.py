"""A person at a terminal: ``backroom agent human`` in tmux against a real broker and referee.

The test plays the person: it reads the screen with ``capture-pane``, types
with ``send-keys`` and checks the episode record afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backroom.agents.scripted.kuhn_colluder import KuhnColluder
from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.wire import (
    ChannelSpec,
    MatchSpec,
    MatchStart,
    Status,
    Turn,
    WireError,
    parse,
)
from backroom.games import make_game
from backroom.games.base import registered_games
from backroom.games.kuhn import LOKI_CARD_NAMES, LOKI_RULES, observed_card_name
from backroom.human.parse import describe_legal, offered, parse_action
from backroom.human.render import (
    ChatLine,
    MatchView,
    render_rules,
    render_view,
    rules_for,
)
from backroom.human.tty import HumanTTY, Prompt, prompt_session

from .conftest import ITEMS, Runner, agents, identity, loki_spec, stack

LOKI_LEGAL = {"choices": [0, 1, 2], "names": ["fold", "call", "raise"]}
PROMPT = re.compile(r"\[\s*(\d+)s\] turn (\d+) (talk|act)")


def open_turn(screen: str) -> tuple[int, str] | None:
    """The turn the input line waits on, read off the screen, or None.

    Ready means: the last line is the toolbar with a turn's countdown, and the
    line above it the empty input line (``>``), so what is typed next answers
    that turn.
    """
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    if len(lines) < 2 or lines[-2] != ">":
        return None
    m = PROMPT.search(lines[-1])
    return (int(m.group(2)), m.group(3)) if m else None


def test_typed_text_maps_to_legal_actions() -> None:
    assert describe_legal(LOKI_LEGAL) == "1 fold · 2 call · 3 raise"
    assert parse_action("2", LOKI_LEGAL) == 1
    assert parse_action("Raise", LOKI_LEGAL) == 2
    assert parse_action("f", LOKI_LEGAL) == 0
    with pytest.raises(ValueError, match="1 to 3"):
        parse_action("4", LOKI_LEGAL)
    with pytest.raises(ValueError, match="not one of"):
        parse_action("shove", LOKI_LEGAL)
    # numbers that are themselves the labels are taken as values, never as positions
    unnamed = {"choices": [0, 1]}
    assert describe_legal(unnamed) == "0 · 1"
    assert parse_action("1", unnamed) == 1
    ipd = {"choices": ["A", "B"]}
    assert parse_action("2", ipd) == "B" and parse_action("a", ipd) == "A"
    price = {"schema": {"type": "number", "minimum": 0.0, "maximum": 10.0}}
    assert describe_legal(price) == "number from 0.0 to 10.0"
    assert parse_action("6.5", price) == 6.5
    with pytest.raises(ValueError, match="between"):
        parse_action("11", price)
    guess = {"schema": {"type": "integer", "minimum": 0, "maximum": 100}}
    with pytest.raises(ValueError, match="integer"):
        parse_action("ten", guess)
    # a proposal (Split No-Comm) is checked at once too, typed as the paper writes it or as JSON
    assert (
        describe_legal(ITEMS) == "a proposal such as '0 hats, 0 books, 0 balls' (or a JSON object)"
    )
    assert parse_action("5 hats, 0 books, 5 balls", ITEMS) == {"hats": 5, "books": 0, "balls": 5}
    assert parse_action('{"hats": 1, "books": 2, "balls": 3}', ITEMS)["books"] == 2
    with pytest.raises(ValueError, match="outside"):
        parse_action("11 hats", ITEMS)


def test_view_marks_private_and_overheard() -> None:
    from rich.console import Console

    start = MatchStart(
        match="m",
        seat=2,
        seats=["a", "b", "carol"],
        game="kuhn",
        channels=[ChannelSpec(name="colluders", members=[0, 1], eavesdroppers=[2])],
        turn_timeout_s=5,
    )
    view = MatchView(
        start,
        {
            "game": "kuhn",
            "variant": "loki",
            "card": 4,
            "pot": 3,
            "to_call": 0,
            "contributions": [1, 1, 1],
            "folded": [False] * 3,
            "history": [{"player": 0, "action": "call"}],
        },
    )
    view.chat.append(ChatLine("colluders", "a", 0, "[bold]my card is 3", overheard=True))
    console = Console(width=120, record=True, force_terminal=False)
    console.print(render_view(view))
    text = console.export_text()
    assert "Your card:  Ace (card 4)" in text
    assert (
        "[colluders · overheard] a (seat 0): [bold]my card is 3" in text
    )  # shown literally, not as markup
    assert "you only overhear it" in text
    assert "a (seat 0) call" in text


def unboxed(screen: str) -> str:
    """The screen's words in one line: a panel's borders and wrapping taken out."""
    return re.sub(r"[│\s]+", " ", screen)


def kuhn_turns(variant: str, moves: list[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(legal, observation) of each turn as the referee sends them, as ``moves`` are played."""
    state = make_game("kuhn", variant=variant, start=0).new_initial_state(seed=7)
    turns = []
    for move in [*moves, None]:
        (seat,) = state.current_players()
        turns.append((state.action_spec(seat).to_json(), state.observation(seat)))
        if move is not None:
            state.apply({seat: move})
    return turns


def test_kuhn_menu_offers_fold_only_facing_a_bet() -> None:
    """Nothing owed: check (and bet or raise); facing a bet: fold, call (and raise)."""
    # Loki: seat 0 opens (fold stays legal for programs), seat 1 raises, seat 2 faces the bet
    (open_legal, open_obs), (_, _), (bet_legal, bet_obs) = kuhn_turns("loki", ["call", "raise"])
    assert open_legal["names"] == ["fold", "call", "raise"] and open_obs["to_call"] == 0
    menu = offered(open_legal, open_obs)
    assert describe_legal(menu) == "1 check · 2 raise"
    assert parse_action("1", menu) == 1 and parse_action("check", menu) == 1
    assert parse_action("call", menu) == 1  # the game's own name still works
    with pytest.raises(ValueError, match="not one of: 1 check · 2 raise"):
        parse_action("fold", menu)
    assert bet_obs["to_call"] == 1
    menu = offered(bet_legal, bet_obs)
    assert describe_legal(menu) == "1 fold · 2 call · 3 raise"
    assert [parse_action(x, menu) for x in ("1", "call", "r")] == [0, 1, 2]
    # classic (OpenSpiel's pass/bet): a pass is a check, or a fold facing a bet
    (c_open, c_open_obs), (c_bet, c_bet_obs) = kuhn_turns("classic", ["bet"])
    menu = offered(c_open, c_open_obs)
    assert describe_legal(menu) == "1 check · 2 bet" and parse_action("pass", menu) == 0
    menu = offered(c_bet, c_bet_obs)
    assert describe_legal(menu) == "1 fold · 2 call"
    assert parse_action("call", menu) == 1 and parse_action("bet", menu) == 1
    # other games are offered as they list their moves
    assert offered({"choices": ["A", "B"]}, {"game": "ipd"}) == {"choices": ["A", "B"]}


async def test_card_label_matches_the_partners_numbering() -> None:
    """A person sees "Ace (card 4)" where the scripted partner says "my card is 4"."""
    colluder = KuhnColluder("a")
    for card, name in enumerate(LOKI_CARD_NAMES):
        obs = {"game": "kuhn", "variant": "loki", "card": card, "to_call": 0}
        turn = Turn(match="m", turn=0, seat=1, phase="talk", observation=obs, deadline_s=5)
        said = await colluder.talk(turn)
        assert said is not None
        (number,) = re.findall(r"\d+", said)
        assert observed_card_name(obs, card) == f"{name} (card {number})"
    # classic Kuhn's cards are numbers already
    assert observed_card_name({"game": "kuhn", "variant": "classic"}, 2) == "2"


def test_rules_are_the_head_of_every_games_prompt() -> None:
    """The rules a person reads at the start are what the models read first, for every game."""
    for game in registered_games():
        for params in [{"variant": "classic"}, {"variant": "loki"}] if game == "kuhn" else [{}]:
            built = make_game(game, **params)
            start = MatchStart(
                match="m",
                seat=1,
                seats=["a", "b", "c"][: built.num_players],
                game=game,
                params=built.params(),
                turn_timeout_s=5,
            )
            rules = rules_for(start)
            assert len(rules) > 80, (game, rules)
            # the first prompt seat 1 gets in a dealt play opens with the same text
            state = built.new_initial_state(seed=3)
            assert state.prompt(1).startswith(rules), game
    start = MatchStart(match="m", seat=0, seats=["a"], game="chess", turn_timeout_s=5)
    assert rules_for(start).startswith("(no rules to show: unknown game 'chess'")
    from rich.console import Console

    console = Console(width=200, record=True, force_terminal=False)
    loki = MatchStart(
        match="m",
        seat=0,
        seats=["bob", "a", "c"],
        game="kuhn",
        params={"variant": "loki"},
        turn_timeout_s=5,
    )
    console.print(render_rules(loki))
    assert unboxed(console.export_text()).count(LOKI_RULES[:120]) == 1


async def test_input_line_edits_and_recalls_history() -> None:
    """prompt_toolkit's line: arrow keys move in the line, Up recalls what was typed before."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    typed = [
        "rase\x1b[D\x1b[Di\r",  # Left twice, then the missing letter: "raise"
        "my card is 3 oops\x17\r",  # Ctrl-W drops the last word
        "\x1b[A\x1b[A\r",  # Up twice: the line before the last one
        "nonsense\x15call\r",  # Ctrl-U clears what is before the cursor
    ]
    with create_pipe_input() as keys:
        session = prompt_session(lambda: "[ 9s]", input=keys, output=DummyOutput())
        lines = []
        for text in typed:
            keys.send_text(text)
            lines.append(await asyncio.wait_for(session.prompt_async("> "), 5))
    assert lines == ["raise", "my card is 3 ", "raise", "call"]


async def test_toolbar_counts_down_the_open_turn() -> None:
    import time

    bob = HumanTTY("bob")
    assert "no turn open" in "".join(text for _style, text, *_ in bob.toolbar())
    turn = Turn(
        match="m", turn=2, seat=0, phase="act", observation={}, legal=LOKI_LEGAL, deadline_s=30
    )
    future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    bob.prompts.append(Prompt(turn, time.monotonic() + 27.5, future))
    assert "no turn open" in bob.toolbar()[0][1]  # not named before its table is on screen
    bob._announce(bob.prompts[0])
    (style, countdown), (_, rest) = bob.toolbar()
    assert countdown == "[ 28s]" and style == "class:countdown"
    assert PROMPT.search(countdown + rest) and "1 fold · 2 call · 3 raise" in rest
    bob.prompts[0].deadline = time.monotonic() + 3
    assert bob.toolbar()[0][0] == "class:countdown.urgent"


# --- end to end in tmux -------------------------------------------------------------------------


class Tmux:
    """A private tmux server (its own socket) running one command in a pane."""

    def __init__(self, workdir: Path, width: int = 150, height: int = 50) -> None:
        self.sock = str(workdir / "tmux.sock")
        self.conf = workdir / "tmux.conf"
        self.conf.write_text("set -g history-limit 50000\nset -g remain-on-exit on\n")
        self.size = (width, height)
        #: The pane as ``screen`` last read it, kept for a post-mortem when a test fails.
        self.last_screen = ""

    async def tmux(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "tmux",
            "-S",
            self.sock,
            "-f",
            str(self.conf),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"tmux {args[0]}: {err.decode()}")
        return out.decode()

    async def start(self, argv: list[str], env: dict[str, str]) -> None:
        command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        w, h = self.size
        await self.tmux("new-session", "-d", "-s", "human", "-x", str(w), "-y", str(h), command)

    async def screen(self) -> str:
        """The whole pane, scrollback included."""
        screen = await self.tmux("capture-pane", "-p", "-J", "-t", "human", "-S", "-50000")
        self.last_screen = screen
        return screen

    async def type(self, text: str) -> None:
        await self.tmux("send-keys", "-t", "human", "-l", text)
        await self.tmux("send-keys", "-t", "human", "Enter")

    async def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            await self.tmux("kill-server")


async def wait_online(run: Runner, agent: str, timeout: float = 20) -> None:
    online = asyncio.Event()

    def on_status(_t: str, payload: bytes) -> None:
        try:
            msg = parse(payload)
        except WireError:
            return
        if isinstance(msg, Status) and msg.state == "online":
            online.set()

    # AgentRunner announces "online" only once the broker has confirmed its inbox
    # subscription (``Bus`` subscribes before the on-connect hooks run), so nothing
    # sent to it from now on is missed.
    await run.bus.subscribe(topics.status(agent), on_status)
    await asyncio.wait_for(online.wait(), timeout)


async def screen_with(term: Tmux, text: str, timeout: float = 20) -> str:
    """The screen once ``text`` shows on it (polled, like a person looking)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while text not in (screen := await term.screen()):
        assert asyncio.get_running_loop().time() < deadline, screen[-3000:]
        await asyncio.sleep(0.2)
    return screen


@contextlib.asynccontextmanager
async def bob_at_a_terminal(
    broker: Broker, tmp_path: Path, **env: str
) -> AsyncIterator[tuple[Runner, Tmux]]:
    """Bob at ``backroom agent human`` in tmux, online, with a colluder and a random player.

    The end-to-end tests differ only in what the person types; whatever
    happens, the last screen is left in ``screen.txt`` to see what the person saw,
    and tmux is stopped. ``env`` adds to the terminal's environment.
    """
    bob = identity(broker, "bob")
    players = agents(("a", "kuhn-colluder"), ("c", "random"))
    term = Tmux(tmp_path)
    login = {
        "BACKROOM_BROKER": f"mqtt://{bob.host}:{bob.port}",
        "BACKROOM_USERNAME": "bob",
        "BACKROOM_PASSWORD": bob.password or "",
        "TERM": "xterm-256color",
    }
    try:
        async with stack(broker, tmp_path / "runs", players), Runner(broker) as run:
            argv = [sys.executable, "-m", "backroom", "agent", "human", "--id", "bob"]
            await term.start(argv, {**login, **env})
            await wait_online(run, "bob")
            yield run, term
    finally:
        (tmp_path / "screen.txt").write_text(term.last_screen)
        await term.stop()


def bob_opens_loki(turn_timeout_s: float) -> MatchSpec:
    """Loki Kuhn with bob in seat 0 and first to act, the same deal (seed 7) in every test."""
    params = {"variant": "loki", "start": 0}
    return loki_spec(["bob", "a", "c"], seed=7, turn_timeout_s=turn_timeout_s, params=params)


async def test_person_plays_a_loki_match_from_a_terminal(broker: Broker, tmp_path: Path) -> None:
    screen = ""
    async with bob_at_a_terminal(broker, tmp_path, COLUMNS="150") as (run, term):
        spec = bob_opens_loki(turn_timeout_s=30)
        lounge = ChannelSpec(name="lounge", members=[0, 1], opens="always", max_messages=3)
        await run.submit("tty1", spec.model_copy(update={"channels": [*spec.channels, lounge]}))
        answered: set[int] = set()
        said = ""
        acts = 0
        menus: list[str] = []
        deadline = asyncio.get_running_loop().time() + 90
        while "tty1" not in run.episodes:
            assert asyncio.get_running_loop().time() < deadline, screen[-3000:]
            await asyncio.sleep(0.2)
            screen = await term.screen()
            ready = open_turn(screen)
            if ready is None or ready[0] in answered:
                continue
            turn_no, phase = ready
            answered.add(turn_no)
            if phase == "talk":
                # the number the person reads is the one the partner's messages use
                number = re.findall(r"Your card:\s+\w+ \(card (\d)\)", screen)[-1]
                said = f"my card is {number}"
                if len(answered) == 1:  # a command is not the talk turn's answer
                    await term.type("/say lounge hi from the terminal")
                await term.type(said)
            else:
                if acts == 0:  # bob opens: nothing to call, so no fold on offer
                    menus.append(re.findall(r"Your turn to act: (.*)", screen)[-1].strip())
                # 1 is check when bob opens; later "call" by name (the game's name for a check too)
                await term.type("1" if acts == 0 else "call")
                acts += 1
        (ep,) = await run.wait(["tty1"])
        # the last line a match's end prints, after its result table
        screen = await screen_with(term, "waiting for the next match")
    assert ep.reason == "normal", ep.detail
    mine = [a for a in ep.actions if a.seat == 0]
    talks = [a for a in mine if a.phase == "talk"]
    acted = [a for a in mine if a.phase == "act"]
    assert talks and talks[0].action == said and not talks[0].timed_out
    assert acted and all(
        a.action == 1 and not a.timed_out for a in acted
    )  # call, typed by number then name
    # the person's message reached the partner, and the eavesdropper overheard it
    heard = {(d.to_seat, d.overheard) for d in ep.deliveries if d.from_seat == 0 and d.text == said}
    assert heard == {(1, False), (2, True)}
    free = {(d.channel, d.to_seat) for d in ep.deliveries if d.text == "hi from the terminal"}
    assert free == {("lounge", 1)}
    # the screen showed the card by name and number, the partner's message, the result
    card = ep.final_observations[0]["card"]
    assert said == f"my card is {card}"
    assert re.search(rf"Your card:\s+{LOKI_CARD_NAMES[card]} \(card {card}\)", screen)
    partner = [d.text for d in ep.deliveries if d.from_seat == 1 and d.to_seat == 0]
    if partner:
        assert f"[colluders] a (seat 1): {partner[0]}" in screen
    # the rules, once, as the match started (before its first turn)
    flat = unboxed(screen)
    assert screen.count("rules of kuhn") == 1
    assert LOKI_RULES[:100] in flat
    assert flat.index("rules of kuhn") < flat.index("Your turn to")
    assert menus == ["1 check · 2 raise"]
    assert "match tty1 ended (normal)" in screen
    assert "overheard by c (seat 2)" in screen


async def test_typos_are_refused_and_a_missed_turn_is_left_to_the_referee(
    broker: Broker, tmp_path: Path
) -> None:
    async with bob_at_a_terminal(broker, tmp_path) as (run, term):
        spec = bob_opens_loki(turn_timeout_s=6)
        await run.submit("tty2", spec)
        seen: set[int] = set()
        while "tty2" not in run.episodes:
            await asyncio.sleep(0.2)
            screen = await term.screen()
            ready = open_turn(screen)
            if ready is None or ready[0] in seen:
                continue
            turn_no, phase = ready
            seen.add(turn_no)
            if phase == "talk":
                if len(seen) == 1:
                    await term.type("")  # an empty line is not a message
                await term.type("/skip")
            elif "shove" not in screen:
                await term.type("shove")  # refused on the spot; then the clock runs out
            else:
                await term.type("call")
        (ep,) = await asyncio.wait_for(run.wait(["tty2"]), 60)
        # The match's end is shown (its last line, after the result table) once every
        # turn was answered, or failed, which the runtime logs before the referee can go
        # on: an error checked after it is not one still on its way.
        screen = await screen_with(term, "waiting for the next match")
    assert ep.reason == "timeout"
    first_act = next(a for a in ep.actions if a.seat == 0 and a.phase == "act")
    assert first_act.timed_out and first_act.fallback == "timeout" and 0 in ep.timeouts
    first_talk = next(a for a in ep.actions if a.seat == 0 and a.phase == "talk")
    assert (
        first_talk.action == "" and not first_talk.timed_out and first_talk.fallback is None
    )  # /skip answered in time, with silence: the person's own choice
    assert "type a message, or /skip to stay silent" in screen
    assert "not one of: 1 check · 2 raise" in screen  # bob opens: nothing to call, no fold
    assert "time is up for turn" in screen
    assert "Traceback" not in screen and "decision failed" not in screen
