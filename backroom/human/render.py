"""What one seat knows of a match, and how a terminal draws it with ``rich``.

Kept apart from the terminal agent (``tty.py``) so the drawing can be checked
without a terminal or a bus: ``MatchView`` is what the referee has told the
seat (the start message, the last observation, the chat it heard), and the
``render_*`` functions turn it into ``rich`` renderables. Nothing here adds
knowledge the seat does not have: private keys are the seat's own, and chat
the seat only overheard is marked as such. All text from the bus goes into
``Text`` objects, never markup, so a player cannot style (or fake) a line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backroom.bus.wire import MatchEnd, MatchStart
from backroom.games.kuhn import observed_card_name

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table
    from rich.text import Text

#: Observation keys that are one's own private holding (shown first, highlighted).
PRIVATE_KEYS = ("card", "hand", "cards", "private", "secret", "values", "valuation")
#: Observation keys drawn elsewhere or not worth a row.
SKIP_KEYS = ("game", "variant", "player", "info_state", "history")
#: Chat lines a table shows (the newest); the rest scrolled by as they arrived.
CHAT_LINES = 12


def rules_for(start: MatchStart) -> str:
    """The game's rules for this seat, as the models read them at the head of their prompt.

    Rebuilt here from what the start message says (the game and its
    parameters): engines are pure, so this is the referee's own text, and
    nothing of the deal (the state is never dealt). A game this version does
    not know, or cannot build, gets a line saying so instead.
    """
    from backroom.games.base import make_game

    try:
        game = make_game(start.game, **start.params)
        text = game.new_initial_state().rules(start.seat)
    except Exception as exc:  # any engine's failure: the person is told, the match goes on
        return f"(no rules to show: {exc})"
    return text.strip() or f"(the {start.game} engine has no rules text)"


@dataclass
class ChatLine:
    """One chat line this seat heard (or overheard, or sent itself)."""

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
    _private_rows(grid, obs)
    grid.add_row("Seats", Text(" · ".join(view.who(s) for s in range(len(start.seats)))))
    _table_rows(grid, view, obs)
    history = obs.get("history")
    if isinstance(history, list):
        grid.add_row("History", Text(_history_line(view, history)))
    if "shown" in obs:
        shown_cards = ", ".join(
            f"{view.who(int(s))}: {observed_card_name(obs, c)}" for s, c in obs["shown"].items()
        )
        grid.add_row("Showdown", Text(shown_cards))
    for c in start.channels:
        grid.add_row(Text("Channel", style="bold cyan"), Text(view.channel_line(c.name)))
    parts: list[RenderableType] = [grid]
    if view.chat:
        parts.append(Text("Chat (what this seat heard; overheard lines are marked)", style="dim"))
        for line in view.chat[-CHAT_LINES:]:
            parts.append(chat_text(view, line))
    title = f"match {start.match} · {start.game}"
    if obs.get("variant"):
        title += f" ({obs['variant']})"
    title += f" · you are {view.who(view.seat)}"
    return Panel(Group(*parts), title=title + title_extra, title_align="left", box=box.ROUNDED)


def _private_rows(grid: Table, obs: Mapping[str, Any]) -> None:
    """The seat's own holding, first and highlighted: its card by name, anything else as sent."""
    from rich.text import Text

    for key in PRIVATE_KEYS:
        value = obs.get(key)
        if value is None:
            continue
        if key == "card":
            shown = observed_card_name(obs, value)
        else:
            shown = value if isinstance(value, str) else json.dumps(value)
        grid.add_row(Text(f"Your {key}:", style="bold yellow"), Text(shown, style="bold yellow"))


def _table_rows(grid: Table, view: MatchView, obs: Mapping[str, Any]) -> None:
    """What lies on the table: Kuhn's pot, bets and folds in one line; other games' fields."""
    from rich.text import Text

    if obs.get("game") != "kuhn":
        for key, value in obs.items():
            if key in SKIP_KEYS or key in PRIVATE_KEYS:
                continue
            grid.add_row(Text(key), Text(value if isinstance(value, str) else json.dumps(value)))
        return
    contrib = obs.get("contributions", [])
    folded = [view.who(s) for s, f in enumerate(obs.get("folded", [])) if f]
    grid.add_row(
        "Table",
        Text(
            f"pot {obs.get('pot')} · to call {obs.get('to_call')} · in: {'/'.join(str(c) for c in contrib)}"
            + (f" · folded: {', '.join(folded)}" if folded else "")
        ),
    )


def _history_line(view: MatchView, history: list[Any]) -> str:
    """The moves so far, who did what: ``alice bet → bob call``."""
    moves = [
        f"{view.who(int(h['player']))} {h.get('action')}"
        if isinstance(h, dict) and "player" in h
        else json.dumps(h)
        for h in history
    ]
    return " → ".join(moves) if moves else "(no moves yet)"


def render_rules(start: MatchStart) -> RenderableType:
    """The rules panel a person is shown once, when a match starts."""
    from rich.panel import Panel
    from rich.text import Text

    return Panel(
        Text(rules_for(start)),
        title=f"rules of {start.game} (the text the models are given)",
        title_align="left",
        border_style="blue",
    )


def chat_text(view: MatchView, line: ChatLine) -> Text:
    """One chat line, ``[channel] who: text``; an overheard one says so, in its own colour."""
    from rich.text import Text

    if line.overheard:
        return Text.assemble(
            (f"[{line.channel} · overheard]", "magenta"),
            " ",
            (f"{view.who(line.sender_seat)}: {line.text}", "italic magenta"),
        )
    who = "you" if line.mine else view.who(line.sender_seat)
    return Text.assemble((f"[{line.channel}]", "cyan"), " ", f"{who}: {line.text}")


def render_end(view: MatchView) -> RenderableType:
    """The result: each seat's chips and reward (after the match's reward transform)."""
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
            f" · {observed_card_name(end.observation, shown[str(s)])}" if str(s) in shown else ""
        )
        table.add_row(Text(name), f"{chips:+g}", f"{end.returns[s]:+g}")
    return Panel(table, border_style="green")
