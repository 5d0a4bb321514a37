"""The ``human`` agent kind: a person plays a seat from a terminal.

``backroom agent human --id bob`` connects as ``bob`` like any other agent, so
the person sees exactly what the referee sends that seat and nothing more:
their own card or hand and the public history (the observation), the chat of
the channels they are in, and what they overhear as an eavesdropper (marked as
such). Everything is drawn with ``rich``; the input line stays at the bottom
with a countdown to the turn's deadline.

Input never blocks the event loop: the terminal is put in cbreak mode and read
with ``loop.add_reader`` (a small line editor of our own, so the countdown can
be redrawn while the person types); when stdin is not a terminal, whole lines
are read instead, from a reader callback or, where the fd cannot be polled, a
thread.

What the person types:

* in an act turn: the number shown before an action, or its name (a unique
  prefix will do: ``r`` for ``raise``), or a value for games that describe a
  range (a price, a guess);
* in a talk turn: the message; ``/skip`` stays silent;
* at any time: ``/say [CHANNEL] TEXT`` for free chat on an ``always`` channel
  (plain text does the same when no turn is open and there is one such
  channel), ``/view`` to redraw the table, ``/help``, ``/quit``.

A turn that runs out is left to the referee's timeout rule; the agent sends
nothing late.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from backroom.agents.base import JSON, Agent, register_agent
from backroom.bus.wire import Chat, Delivery, Error, MatchEnd, MatchStart, Turn

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

log = logging.getLogger("backroom.human")

HELP = (
    "act turn: type the number or the name of an action (a unique prefix is enough)\n"
    "talk turn: type your message and press Enter; /skip stays silent\n"
    "/say [CHANNEL] TEXT  free chat on a channel that is always open\n"
    "/view  redraw the table    /help  this text    /quit  leave"
)


class TurnExpired(Exception):
    """The person did not answer before the deadline: the referee applies its timeout rule."""


# --- pure helpers (no terminal): what the legal answers are, how typed text maps to one ----------


def action_labels(legal: Mapping[str, Any]) -> list[str]:
    """One label per legal choice: its name when the game names them, else the value itself."""
    choices = list(legal.get("choices", []))
    names = [str(n) for n in legal.get("names", [])]
    if len(names) == len(choices):
        return names
    return [c if isinstance(c, str) else json.dumps(c) for c in choices]


def numbered(legal: Mapping[str, Any]) -> bool:
    """Whether choices get position numbers; not when a label is itself a number (no ambiguity)."""
    return not any(
        label.lstrip("-").replace(".", "", 1).isdigit() for label in action_labels(legal)
    )


def describe_legal(legal: Mapping[str, Any]) -> str:
    """The menu line of an act turn: ``1 fold · 2 call · 3 raise`` or a range."""
    labels = action_labels(legal)
    if labels:
        if numbered(legal):
            return " · ".join(f"{i} {label}" for i, label in enumerate(labels, 1))
        return " · ".join(labels)
    schema = legal.get("schema", {})
    kind = schema.get("type", "value")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None and hi is not None:
        return f"{kind} from {lo} to {hi}"
    return str(kind)


def parse_action(text: str, legal: Mapping[str, Any]) -> JSON:
    """Map what the person typed to a legal answer; ``ValueError`` says what would be accepted."""
    text = text.strip()
    choices = list(legal.get("choices", []))
    if choices:
        labels = action_labels(legal)
        low = text.lower()
        for choice, label in zip(choices, labels, strict=True):
            if label.lower() == low:
                return choice
        if numbered(legal) and text.isdigit():
            i = int(text)
            if 1 <= i <= len(choices):
                return choices[i - 1]
            raise ValueError(f"pick a number from 1 to {len(choices)}")
        prefixed = [
            c
            for c, label in zip(choices, labels, strict=True)
            if low and label.lower().startswith(low)
        ]
        if len(prefixed) == 1:
            return prefixed[0]
        raise ValueError(f"not one of: {describe_legal(legal)}")
    schema = legal.get("schema", {})
    kind = schema.get("type")
    if kind in ("integer", "number"):
        try:
            value: Any = int(text) if kind == "integer" else float(text)
        except ValueError:
            raise ValueError(f"type a{'n integer' if kind == 'integer' else ' number'}") from None
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"must be between {lo} and {hi}")
        return value
    if kind == "string" or not text:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def answer_window(deadline_s: float) -> float:
    """Seconds a person gets: the turn's deadline less a margin, so an answer at the last
    second still reaches the referee (whose clock started before the turn was sent)."""
    return max(0.0, deadline_s - min(0.5, 0.1 * deadline_s))


def card_name(observation: Mapping[str, Any], card: Any) -> str:
    """A Kuhn card as the Loki paper names it (10, Jack, ... Ace); other games' cards as they are."""
    if (
        observation.get("game") == "kuhn"
        and observation.get("variant") == "loki"
        and isinstance(card, int)
    ):
        from backroom.games.kuhn import LOKI_CARD_NAMES

        if 0 <= card < len(LOKI_CARD_NAMES):
            return LOKI_CARD_NAMES[card]
    return str(card)


#: Observation keys that are one's own private holding (shown first, highlighted).
PRIVATE_KEYS = ("card", "hand", "cards", "private", "secret", "values", "valuation")
#: Observation keys drawn elsewhere or not worth a row.
SKIP_KEYS = ("game", "variant", "player", "info_state", "history")


@dataclass
class ChatLine:
    channel: str
    sender: str
    sender_seat: int
    text: str
    overheard: bool = False
    mine: bool = False


@dataclass
class MatchView:
    """What this seat knows of one match: the start message, the last observation, the chat."""

    start: MatchStart
    observation: dict[str, Any] = field(default_factory=dict)
    chat: list[ChatLine] = field(default_factory=list)
    end: MatchEnd | None = None

    @property
    def seat(self) -> int:
        return self.start.seat

    def who(self, seat: int) -> str:
        seats = self.start.seats
        name = seats[seat] if 0 <= seat < len(seats) else "?"
        return f"{name} (seat {seat}{', you' if seat == self.seat else ''})"

    def channel_line(self, name: str) -> str:
        """Who hears a channel: members, and who overhears it (the referee told this seat)."""
        for c in self.start.channels:
            if c.name == name:
                members = ", ".join(self.who(s) for s in c.members)
                text = f"{name}: {members}"
                if c.eavesdroppers:
                    text += "; overheard by " + ", ".join(self.who(s) for s in c.eavesdroppers)
                if self.seat in c.eavesdroppers and self.seat not in c.members:
                    text += " — you only overhear it"
                elif c.opens == "always" and self.seat in c.members:
                    text += f" — open any time: /say {name} TEXT"
                return text
        return name

    def free_channels(self) -> list[str]:
        """Channels this seat may write to at any time (``opens: always``)."""
        return [
            c.name for c in self.start.channels if c.opens == "always" and self.seat in c.members
        ]


def render_view(view: MatchView, title_extra: str = "") -> RenderableType:
    """The table as this seat sees it; private things first, overheard chat marked."""
    from rich import box
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    obs = view.observation
    start = view.start
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for key in PRIVATE_KEYS:
        if key in obs and obs[key] is not None:
            value = obs[key]
            shown = (
                card_name(obs, value)
                if key == "card"
                else json.dumps(value)
                if not isinstance(value, str)
                else value
            )
            grid.add_row(
                Text(f"Your {key}:", style="bold yellow"), Text(shown, style="bold yellow")
            )
    grid.add_row("Seats", Text(" · ".join(view.who(s) for s in range(len(start.seats)))))
    if obs.get("game") == "kuhn":
        contrib = obs.get("contributions", [])
        folded = [view.who(s) for s, f in enumerate(obs.get("folded", [])) if f]
        grid.add_row(
            "Table",
            Text(
                f"pot {obs.get('pot')} · to call {obs.get('to_call')} · in: {'/'.join(str(c) for c in contrib)}"
                + (f" · folded: {', '.join(folded)}" if folded else "")
            ),
        )
    else:
        for key, value in obs.items():
            if key in SKIP_KEYS or key in PRIVATE_KEYS:
                continue
            grid.add_row(Text(key), Text(value if isinstance(value, str) else json.dumps(value)))
    history = obs.get("history")
    if isinstance(history, list):
        moves = []
        for h in history:
            if isinstance(h, dict) and "player" in h:
                moves.append(f"{view.who(int(h['player']))} {h.get('action')}")
            else:
                moves.append(json.dumps(h))
        grid.add_row("History", Text(" → ".join(moves) if moves else "(no moves yet)"))
    if "shown" in obs:
        shown_cards = ", ".join(
            f"{view.who(int(s))}: {card_name(obs, c)}" for s, c in obs["shown"].items()
        )
        grid.add_row("Showdown", Text(shown_cards))
    for c in start.channels:
        grid.add_row(Text("Channel", style="bold cyan"), Text(view.channel_line(c.name)))
    parts: list[RenderableType] = [grid]
    if view.chat:
        parts.append(Text("Chat (what this seat heard; overheard lines are marked)", style="dim"))
        for line in view.chat[-12:]:
            tag, body = chat_cells(view, line)
            parts.append(Text.assemble(tag, " ", body))
    title = f"match {start.match} · {start.game}"
    if obs.get("variant"):
        title += f" ({obs['variant']})"
    title += f" · you are {view.who(view.seat)}"
    return Panel(Group(*parts), title=title + title_extra, title_align="left", box=box.ROUNDED)


def chat_cells(view: MatchView, line: ChatLine) -> tuple[Any, Any]:
    from rich.text import Text

    if line.overheard:
        return Text(f"[{line.channel} · overheard]", style="magenta"), Text(
            f"{view.who(line.sender_seat)}: {line.text}", style="italic magenta"
        )
    who = "you" if line.mine else view.who(line.sender_seat)
    return Text(f"[{line.channel}]", style="cyan"), Text(f"{who}: {line.text}")


def render_end(view: MatchView) -> RenderableType:
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    assert view.end is not None
    end = view.end
    table = Table(title=f"match {end.match} ended ({end.reason})", title_justify="left")
    for col in ("seat", "chips", "reward"):
        table.add_column(col)
    shown = end.observation.get("shown", {})
    for s in range(len(end.returns)):
        chips = end.raw_returns[s] if s < len(end.raw_returns) else 0.0
        name = view.who(s) + (
            f" · {card_name(end.observation, shown[str(s)])}" if str(s) in shown else ""
        )
        table.add_row(Text(name), f"{chips:+g}", f"{end.returns[s]:+g}")
    return Panel(table, border_style="green")


# --- the terminal: a line editor on a non-blocking reader ---------------------------------------


class TerminalInput:
    """Reads lines from stdin without blocking the loop; keeps a redrawable prompt line.

    On a terminal: cbreak mode (no echo, no line buffering; Ctrl-C still sends
    SIGINT) and ``add_reader`` on the fd, so each key is handled as it comes
    and the prompt (with its countdown) can be redrawn around what is typed.
    Otherwise: whole lines, with ``add_reader`` or, for a regular file that
    epoll cannot watch, a daemon thread.
    """

    def __init__(self, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.fd = self.stdin.fileno()
        self.tty = os.isatty(self.fd)
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self.prompt = ""
        self.buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._escape = ""
        self._saved: Any = None
        self._reader = False
        self._pending = b""
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.tty:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        try:
            self._loop.add_reader(self.fd, self._readable)
            self._reader = True
        except (OSError, NotImplementedError, ValueError):
            threading.Thread(target=self._thread, name="human-stdin", daemon=True).start()

    def close(self) -> None:
        if self._reader and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.fd)
            self._reader = False
        if self._saved is not None:
            import termios

            with contextlib.suppress(Exception):
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None
        self.clear()

    # --- output around the prompt -----------------------------------------------------------

    def clear(self) -> None:
        if self.tty:
            self.out.write("\r\x1b[2K")
            self.out.flush()

    def redraw(self) -> None:
        if self.tty:
            self.out.write("\r\x1b[2K" + self.prompt + self.buffer)
            self.out.flush()

    def set_prompt(self, prompt: str) -> None:
        if prompt != self.prompt:
            self.prompt = prompt
            self.redraw()

    # --- input --------------------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            assert self._loop is not None
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.fd)
            self._reader = False
            self.lines.put_nowait(None)
            return
        if self.tty:
            self.feed(self._decoder.decode(data))
        else:
            self._pending += data
            while b"\n" in self._pending:
                line, _, self._pending = self._pending.partition(b"\n")
                self.lines.put_nowait(line.decode("utf-8", "replace").rstrip("\r"))

    def _thread(self) -> None:
        assert self._loop is not None
        for line in self.stdin:
            self._loop.call_soon_threadsafe(self.lines.put_nowait, line.rstrip("\r\n"))
        self._loop.call_soon_threadsafe(self.lines.put_nowait, None)

    def feed(self, text: str) -> None:
        """Apply keystrokes to the line being edited (cbreak mode)."""
        for ch in text:
            if self._escape:
                # skip an escape sequence (arrow keys and the like): ESC [ ... final byte
                self._escape += ch
                if (len(self._escape) == 2 and ch not in "[O") or (
                    len(self._escape) > 2 and "@" <= ch <= "~"
                ):
                    self._escape = ""
                continue
            if ch == "\x1b":
                self._escape = ch
            elif ch in "\r\n":
                line, self.buffer = self.buffer, ""
                self.out.write("\r\x1b[2K" + self.prompt + line + "\n")
                self.lines.put_nowait(line)
            elif ch in "\x7f\x08":
                self.buffer = self.buffer[:-1]
            elif ch == "\x15":  # Ctrl-U
                self.buffer = ""
            elif ch == "\x17":  # Ctrl-W: drop the last word
                kept = self.buffer.rstrip()
                self.buffer = kept[: kept.rfind(" ") + 1]
            elif ch >= " ":
                self.buffer += ch
        self.redraw()


# --- the agent ------------------------------------------------------------------------------------


@dataclass
class Prompt:
    turn: Turn
    deadline: float  # time.monotonic()
    future: asyncio.Future[Any]


@register_agent("human")
class HumanTTY(Agent):
    """A person at a terminal. Turns are answered one at a time, oldest first."""

    def __init__(
        self, agent_id: str, seed: int | None = None, color: bool | None = None, **options: Any
    ) -> None:
        super().__init__(agent_id, seed=seed, **options)
        self.color = color
        self.views: dict[str, MatchView] = {}
        self.prompts: list[Prompt] = []
        self.console: Console | None = None
        self.input: TerminalInput | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._shown: Prompt | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def setup(self) -> None:
        from rich.console import Console

        self.input = TerminalInput()
        self.console = Console(
            force_terminal=self.color, no_color=self.color is False, highlight=False
        )
        # A turn that runs out raises TurnExpired inside the runtime, which would
        # log it with a traceback over the person's screen: that is not an error.
        logging.getLogger("backroom.agent").addFilter(_drop_expired)
        self.input.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_lines()), loop.create_task(self._tick())]
        self.say(
            f"[bold]backroom[/bold] · you are [bold]{self.id}[/bold] · waiting for a match (/help for keys)"
        )
        self._refresh_prompt()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for p in self.prompts:
            if not p.future.done():
                p.future.cancel()
        if self.input is not None:
            self.input.close()
        logging.getLogger("backroom.agent").removeFilter(_drop_expired)

    # --- output --------------------------------------------------------------------------------------

    def say(self, text: str | RenderableType) -> None:
        """Print above the input line and redraw it."""
        if self.console is None:
            return
        if self.input is not None:
            self.input.clear()
        self.console.print(text)
        if self.input is not None:
            self.input.redraw()

    def _refresh_prompt(self) -> None:
        if self.input is None:
            return
        self.input.set_prompt(self.prompt_text())

    def prompt_text(self) -> str:
        """The input line's prompt: the countdown, the turn and what is expected."""
        p = self.active()
        if p is None:
            return "> "
        left = max(0, int(p.deadline - time.monotonic() + 0.999))
        color = "\x1b[1;31m" if left <= 5 else "\x1b[1;33m"
        reset = "\x1b[0m"
        if not (self.input and self.input.tty) or self.color is False:
            color = reset = ""
        t = p.turn
        what = f"talk on {t.channel}" if t.phase == "talk" else f"act: {describe_legal(t.legal)}"
        return f"{color}[{left:>3}s]{reset} turn {t.turn} {what} > "

    def active(self) -> Prompt | None:
        return self.prompts[0] if self.prompts else None

    def _show_active(self) -> None:
        """Draw the table for the turn now waiting on the person (once per turn)."""
        p = self.active()
        if p is None or p is self._shown:
            self._refresh_prompt()
            return
        self._shown = p
        view = self.views.get(p.turn.match or "")
        if view is not None:
            self.say(render_view(view))
        t = p.turn
        from rich.text import Text

        if t.phase == "talk":
            hint = view.channel_line(t.channel or "") if view else str(t.channel)
            self.say(
                Text.assemble(
                    ("Your turn to talk", "bold"),
                    " on ",
                    (hint, "cyan"),
                    " — type a message (/skip: stay silent)",
                )
            )
        else:
            self.say(Text.assemble(("Your turn to act", "bold"), ": ", describe_legal(t.legal)))
        self._refresh_prompt()

    # --- hooks from the runtime --------------------------------------------------------------------

    async def on_match_start(self, start: MatchStart) -> None:
        await super().on_match_start(start)
        view = MatchView(start=start)
        self.views[start.match or ""] = view
        from rich.text import Text

        self.say(
            Text.assemble(
                (f"Match {start.match} starts", "bold green"),
                f": {start.game}, you are {view.who(start.seat)}",
            )
        )
        for c in start.channels:
            self.say(Text(f"  channel {view.channel_line(c.name)}"))

    async def on_message(self, delivery: Delivery) -> None:
        await super().on_message(delivery)
        view = self.views.get(delivery.match or "")
        line = ChatLine(
            delivery.channel,
            delivery.sender,
            delivery.sender_seat,
            delivery.text,
            delivery.overheard,
        )
        from rich.text import Text

        if view is None:
            self.say(Text(f"[{delivery.channel}] {delivery.sender}: {delivery.text}"))
            return
        view.chat.append(line)
        tag, body = chat_cells(view, line)
        self.say(Text.assemble(tag, " ", body))

    async def on_match_end(self, end: MatchEnd) -> None:
        view = self.views.pop(end.match or "", None)
        await super().on_match_end(end)
        for p in [p for p in self.prompts if p.turn.match == end.match]:
            if not p.future.done():
                self.say(f"[red]turn {p.turn.turn} closed[/red]: the match ended")
                p.future.cancel()
        if view is not None:
            view.end = end
            if end.observation:
                view.observation = dict(end.observation)
                self.say(render_view(view, " · final"))
            self.say(render_end(view))
        self.say("waiting for the next match…")

    async def on_error(self, error: Any) -> None:
        if isinstance(error, Error):
            from rich.text import Text

            self.say(Text.assemble(("referee: " + error.reason, "red"), " ", error.detail))

    # --- decisions ------------------------------------------------------------------------------------

    async def _ask(self, turn: Turn) -> Any:
        view = self.views.get(turn.match or "")
        if view is not None:
            view.observation = dict(turn.observation)
        for old in self.prompts:
            if old.turn.match == turn.match and not old.future.done():
                # the referee has moved on, so that turn is closed whatever our clock says
                self._expire(old)
        loop = asyncio.get_running_loop()
        prompt = Prompt(
            turn, time.monotonic() + answer_window(turn.deadline_s), loop.create_future()
        )
        self.prompts.append(prompt)
        self._show_active()
        try:
            return await prompt.future
        finally:
            if prompt in self.prompts:
                self.prompts.remove(prompt)
            self._show_active()

    async def act(self, turn: Turn) -> JSON:
        return await self._ask(turn)

    async def talk(self, turn: Turn) -> str | None:
        text = await self._ask(turn)
        if text:
            view = self.views.get(turn.match or "")
            if view is not None:
                view.chat.append(ChatLine(turn.channel or "", self.id, turn.seat, text, mine=True))
        return text or None

    async def _tick(self) -> None:
        """Expire turns at their deadline and redraw the countdown."""
        while True:
            now = time.monotonic()
            for p in list(self.prompts):
                if p.deadline <= now and not p.future.done():
                    self._expire(p)
            self._refresh_prompt()
            await asyncio.sleep(0.25)

    def _expire(self, p: Prompt) -> None:
        p.future.set_exception(TurnExpired())
        self.say(f"[red]time is up for turn {p.turn.turn}[/red]: the referee plays its default")

    async def _read_lines(self) -> None:
        assert self.input is not None
        while True:
            line = await self.input.lines.get()
            if line is None:
                return  # stdin closed: keep playing nothing, the referee's timeouts apply
            try:
                await self.handle_line(line)
            except Exception as exc:  # a typo must never end the session
                from rich.text import Text

                self.say(Text(f"{type(exc).__name__}: {exc}", style="red"))

    async def handle_line(self, line: str) -> None:
        """One line the person typed: a command, an answer to the open turn, or free chat."""
        from rich.text import Text

        text = line.strip()
        p = self.active()
        if text.startswith("/"):
            cmd, _, rest = text.partition(" ")
            if cmd == "/help":
                self.say(Text(HELP))
            elif cmd == "/quit":
                os.kill(os.getpid(), signal.SIGINT)
            elif cmd == "/view":
                for v in self.views.values():
                    self.say(render_view(v))
            elif cmd == "/skip" and p is not None and p.turn.phase == "talk":
                p.future.set_result(None)
            elif cmd == "/say":
                await self.free_chat(rest)
            else:
                self.say(Text(f"unknown command {cmd!r}; /help lists them"))
            return
        if p is None:
            if text:
                await self.free_chat(text, plain=True)
            return
        if p.turn.phase == "talk":
            if not text:
                self.say("type a message, or /skip to stay silent")
                return
            limit = p.turn.legal.get("schema", {}).get("maxLength")
            if limit is not None and len(text) > int(limit):
                self.say(f"[red]too long[/red]: {len(text)} characters, this channel takes {limit}")
                return
            p.future.set_result(text)
            return
        if not text:
            return
        try:
            action = parse_action(text, p.turn.legal)
        except ValueError as exc:
            self.say(Text(str(exc), style="red"))
            return
        p.future.set_result(action)

    async def free_chat(self, rest: str, plain: bool = False) -> None:
        """Chat outside talk turns, on a channel that is always open to this seat."""
        channels = {
            (m, c) for m, v in self.views.items() if v.end is None for c in v.free_channels()
        }
        if not channels:
            self.say(
                "no turn is open and no channel is open for free chat"
                if plain
                else "no channel here is open for free chat"
            )
            return
        names = {c for _, c in channels}
        first, _, after = rest.partition(" ")
        if first in names and after.strip():
            channel, text = first, after.strip()
        elif len(names) == 1:
            channel, text = next(iter(names)), rest.strip()
        else:
            self.say(f"say which channel: /say CHANNEL TEXT (one of {', '.join(sorted(names))})")
            return
        if not text:
            return
        match = sorted(m for m, c in channels if c == channel)[-1]
        view = self.views[match]
        await self._publish(Chat(match=match, channel=channel, text=text, seat=view.seat))
        view.chat.append(ChatLine(channel, self.id, view.seat, text, mine=True))
        from rich.text import Text

        self.say(Text.assemble((f"[{channel}]", "cyan"), f" you: {text}"))

    async def _publish(self, msg: Chat) -> None:
        await self.send_chat(msg.match or "", msg.channel, msg.text, msg.seat)


def _drop_expired(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, TurnExpired | asyncio.CancelledError)
