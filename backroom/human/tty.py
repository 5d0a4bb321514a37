"""The ``human`` agent kind: a person plays a seat from a terminal.

``backroom agent human --id bob`` connects as ``bob`` like any other agent, so
the person sees exactly what the referee sends that seat and nothing more:
their own card or hand and the public history (the observation), the chat of
the channels they are in, and what they overhear as an eavesdropper (marked as
such). Tables and chat are drawn with ``rich`` (``render.py``) above the input
line; typed answers are read by ``parse.py``.

The input line is prompt_toolkit's (``PromptSession.prompt_async``): it runs on
the agent's event loop, so the bus keeps flowing while the person types; it
edits like a shell (arrow keys, Home/End, Ctrl-U/Ctrl-W) and keeps a history
(Up recalls the last answer); its bottom toolbar shows the turn and the
countdown to its deadline, redrawn four times a second. Output goes above
the line, in order, with ``run_in_terminal`` (``say``); what others print
passes through ``patch_stdout``. When stdin or stdout is not a terminal
(piped), whole lines are read instead and nothing is redrawn.

What the person types:

* in an act turn: the number shown before an action, or its name (a unique
  prefix will do: ``r`` for ``raise``), or a value for games that describe a
  range (a price, a guess);
* in a talk turn: the message; ``/skip`` stays silent;
* at any time: ``/say [CHANNEL] TEXT`` for free chat on an ``always`` channel
  (plain text does the same when no turn is open and there is one such
  channel), ``/view`` to redraw the table, ``/rules`` for the game's rules
  (shown once when a match starts), ``/help``, ``/quit`` (or Ctrl-C, Ctrl-D).

An act turn offers what ``parse.offered`` makes of the legal moves: at a Kuhn
table, ``check`` when nothing is owed and ``fold`` only facing a bet.

A turn that runs out is left to the referee's timeout rule; the agent sends
nothing late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from backroom.agents.base import JSON, Agent
from backroom.agents.kinds import register_agent
from backroom.bus.wire import Chat, Delivery, Error, MatchEnd, MatchStart, Turn
from backroom.human.parse import describe_legal, offered, parse_action
from backroom.human.render import (
    ChatLine,
    MatchView,
    chat_text,
    render_end,
    render_rules,
    render_view,
)

if TYPE_CHECKING:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.formatted_text import StyleAndTextTuples
    from prompt_toolkit.input import Input
    from prompt_toolkit.output import Output
    from rich.console import Console, RenderableType

log = logging.getLogger("backroom.human")

HELP = (
    "act turn: type the number or the name of an action (a unique prefix is enough)\n"
    "talk turn: type your message and press Enter; /skip stays silent\n"
    "/say [CHANNEL] TEXT  free chat on a channel that is always open\n"
    "/view  redraw the table    /rules  the game's rules    /help  this text\n"
    "/quit (Ctrl-C, Ctrl-D)  leave\n"
    "Up/Down: earlier lines    Left/Right, Home/End, Ctrl-U, Ctrl-W: edit the line"
)
#: How often the countdown in the toolbar is redrawn, and turns checked for their deadline.
TICK_S = 0.25


class TurnExpired(Exception):
    """The person did not answer before the deadline: the referee applies its timeout rule."""


def answer_window(deadline_s: float) -> float:
    """Seconds a person gets: the turn's deadline less a margin, so an answer at the last
    second still reaches the referee (whose clock started before the turn was sent)."""
    return max(0.0, deadline_s - min(0.5, 0.1 * deadline_s))


# --- reading lines ---------------------------------------------------------------------------------


def prompt_session(
    toolbar: Any, *, input: Input | None = None, output: Output | None = None
) -> PromptSession[str]:
    """The input line: history (Up/Down), emacs editing keys, ``toolbar`` below it.

    ``toolbar`` is called at every redraw (``TICK_S``), which is what makes the
    countdown tick while the person types. ``input``/``output`` are for tests
    (a pipe and a dummy); by default the terminal's.
    """
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory
    from prompt_toolkit.styles import Style

    style = Style.from_dict(
        {
            "bottom-toolbar": "noreverse bg:#303030 #ffffff",
            "countdown": "bold #ffd75f",
            "countdown.urgent": "bold #ff5f5f",
            "idle": "#a8a8a8",
        }
    )
    return PromptSession(
        history=InMemoryHistory(),  # in memory only: answers and private messages are not saved
        bottom_toolbar=toolbar,
        refresh_interval=TICK_S,
        style=style,
        input=input,
        output=output,
    )


class LineInput:
    """Whole lines from a stdin that is not a terminal, without blocking the loop.

    ``add_reader`` on the fd, or, for a regular file that epoll cannot watch,
    a daemon thread. ``None`` in the queue: stdin is closed.
    """

    def __init__(self, stdin: TextIO | None = None) -> None:
        self.stdin = stdin or sys.stdin
        self.fd = self.stdin.fileno()
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self._pending = b""
        self._reader = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            self.lines.put_nowait(None)
            return
        self._pending += data
        while b"\n" in self._pending:
            line, _, self._pending = self._pending.partition(b"\n")
            self.lines.put_nowait(line.decode("utf-8", "replace").rstrip("\r"))

    def _thread(self) -> None:
        assert self._loop is not None
        for line in self.stdin:
            self._loop.call_soon_threadsafe(self.lines.put_nowait, line.rstrip("\r\n"))
        self._loop.call_soon_threadsafe(self.lines.put_nowait, None)


# --- the agent ------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One turn waiting on the person, with its deadline on our clock."""

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
        self.session: PromptSession[str] | None = None
        self.lines: LineInput | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._shown: Prompt | None = None
        #: The turn whose table is on screen: only it may be named in the toolbar.
        self._announced: Prompt | None = None
        self._writes: set[asyncio.Future[None]] = set()
        self._stack = contextlib.ExitStack()

    # --- lifecycle -------------------------------------------------------------------------------

    async def setup(self) -> None:
        from rich.console import Console

        # The terminal itself, before anything replaces sys.stdout.
        self.console = Console(
            file=sys.stdout,
            force_terminal=self.color,
            no_color=self.color is False,
            highlight=False,
        )
        if sys.stdin.isatty() and sys.stdout.isatty():
            from prompt_toolkit.patch_stdout import patch_stdout

            self.session = prompt_session(self.toolbar)
            # What others print (the CLI's "connected" line, warnings) goes above the
            # input line too; raw: colour codes pass through as they are.
            self._stack.enter_context(patch_stdout(raw=True))
        else:
            self.lines = LineInput()
            self.lines.start()
        # A turn that runs out raises TurnExpired inside the runtime, which would
        # log it with a traceback over the person's screen: that is not an error.
        logging.getLogger("backroom.agent").addFilter(_drop_expired)
        # said before the input line is first drawn, so it is not drawn over
        self.say(
            f"[bold]backroom[/bold] · you are [bold]{self.id}[/bold] · waiting for a match (/help for keys)"
        )
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_lines()), loop.create_task(self._tick())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        # let prompt_toolkit put the terminal back (cooked mode, cursor) before we return
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self.prompts:
            if not p.future.done():
                p.future.cancel()
        if self.lines is not None:
            self.lines.close()
        if self._writes:
            await asyncio.wait(self._writes, timeout=2)
        self._stack.close()
        logging.getLogger("backroom.agent").removeFilter(_drop_expired)

    # --- output --------------------------------------------------------------------------------------

    def say(self, text: str | RenderableType) -> None:
        """Print above the input line, after whatever was said before.

        Written from the event loop with ``run_in_terminal`` (which hides the
        input line, runs, and redraws it): unlike ``patch_stdout``'s writer
        thread, this keeps every line in order with the toolbar's changes
        (``_announce``), so a turn is never named before its table is drawn.
        """
        if self.console is None:
            return
        if self.session is None:
            self.console.print(text)
            return
        with self.console.capture() as captured:
            self.console.print(text)
        output, rendered = self.session.app.output, captured.get()

        def write() -> None:
            output.write_raw(rendered)
            output.flush()

        self._in_terminal(write)

    def _in_terminal(self, func: Any) -> None:
        """Run ``func`` above the input line, after what was queued before it (in order)."""
        from prompt_toolkit.application import run_in_terminal

        future = asyncio.ensure_future(run_in_terminal(func))
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)

    def _announce(self, p: Prompt) -> None:
        """Let the toolbar name ``p``, once what was said before it is on screen."""
        if self.session is None:
            self._announced = p
            return

        def announce() -> None:
            self._announced = p

        self._in_terminal(announce)

    def toolbar(self) -> StyleAndTextTuples:
        """The bottom toolbar: the countdown, the turn and what is expected of the person."""
        p = self.active()
        if p is None or p is not self._announced:
            return [("class:idle", " no turn open · /help for keys ")]
        left = max(0, int(p.deadline - time.monotonic() + 0.999))
        style = "class:countdown.urgent" if left <= 5 else "class:countdown"
        return [(style, f"[{left:>3}s]"), ("", f" {self.turn_line(p.turn)} ")]

    def turn_line(self, t: Turn) -> str:
        """``turn 2 act: 1 fold · 2 call · 3 raise`` or ``turn 1 talk on colluders``."""
        what = f"talk on {t.channel}" if t.phase == "talk" else f"act: {describe_legal(menu(t))}"
        return f"turn {t.turn} {what}"

    def active(self) -> Prompt | None:
        return self.prompts[0] if self.prompts else None

    def _redraw(self) -> None:
        if self.session is not None and self.session.app.is_running:
            self.session.app.invalidate()

    def _show_active(self) -> None:
        """Draw the table for the turn now waiting on the person (once per turn)."""
        self._redraw()
        p = self.active()
        if p is None or p is self._shown:
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
            self.say(Text.assemble(("Your turn to act", "bold"), ": ", describe_legal(menu(t))))
        if self.session is None:  # no toolbar when piped: the countdown goes in a line
            left = int(max(0.0, p.deadline - time.monotonic()))
            self.say(Text(f"[{left:>3}s] {self.turn_line(t)} >"))
        self._announce(p)

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
        # once per match, before its first turn (/rules shows them again)
        self.say(render_rules(start))

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
        self.say(chat_text(view, line))

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
        """Expire turns at their deadline (the toolbar redraws itself, at the same rate)."""
        while True:
            now = time.monotonic()
            for p in list(self.prompts):
                if p.deadline <= now and not p.future.done():
                    self._expire(p)
            await asyncio.sleep(TICK_S)

    def _expire(self, p: Prompt) -> None:
        p.future.set_exception(TurnExpired())
        self.say(f"[red]time is up for turn {p.turn.turn}[/red]: the referee plays its default")

    async def _next_line(self) -> str | None:
        """The next line typed; ``None`` when the person leaves (Ctrl-C, Ctrl-D) or stdin closes."""
        if self.session is not None:
            try:
                # handle_sigint=False: SIGINT stays with the process (the CLI stops the agent on
                # it); prompt_toolkit would take it over while the line is open, then drop it.
                return await self.session.prompt_async("> ", handle_sigint=False)
            except (KeyboardInterrupt, EOFError):
                _quit()
                return None
        assert self.lines is not None
        return await self.lines.lines.get()

    async def _read_lines(self) -> None:
        while True:
            line = await self._next_line()
            if line is None:
                return  # nothing more will be typed: the referee's timeouts apply
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
            await self.command(cmd, rest)
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
            action = parse_action(text, menu(p.turn))
        except ValueError as exc:
            self.say(Text(str(exc), style="red"))
            return
        p.future.set_result(action)

    async def command(self, cmd: str, rest: str) -> None:
        """A line that starts with ``/`` (the list is ``HELP``)."""
        from rich.text import Text

        p = self.active()
        if cmd == "/help":
            self.say(Text(HELP))
        elif cmd == "/quit":
            _quit()
        elif cmd == "/view":
            for v in self.views.values():
                self.say(render_view(v))
        elif cmd == "/rules":
            for v in self.views.values():
                self.say(render_rules(v.start))
        elif cmd == "/skip" and p is not None and p.turn.phase == "talk":
            p.future.set_result(None)
        elif cmd == "/say":
            await self.free_chat(rest)
        else:
            self.say(Text(f"unknown command {cmd!r}; /help lists them"))

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


def menu(turn: Turn) -> dict[str, Any]:
    """What the person is offered in an act turn (``parse.offered``): shown, and read back."""
    return offered(turn.legal, turn.observation)


def _quit() -> None:
    """Leave as Ctrl-C does outside the input line: the CLI stops the agent on SIGINT."""
    os.kill(os.getpid(), signal.SIGINT)


def _drop_expired(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, TurnExpired | asyncio.CancelledError)
