"""What the model-backed kinds (``llm``, ``local``) share in a decision: its time budget,
and the path from a model's reply to an action.

One rule for both, so that their fallbacks mean the same in an episode record:

* **The budget.** A decision may take the turn's deadline less the agent's
  margin (so the answer arrives before the referee gives up), and never less
  than ``MIN_BUDGET_S``: a margin larger than the deadline still leaves the
  model a moment rather than none.
* **Parse, repair, fall back.** A reply is parsed (``parsing.parse_action``);
  an unreadable one gets one repair round, with one repair prompt ("Your reply
  was not valid because ..." and the turn's format hint); a second unreadable
  reply gives the documented fallback (``parsing.fallback_action``), marked
  ``unparseable``. An action that needed the repair is marked ``repaired``: it
  is the model's, but not its first answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from backroom.agents.base import JSON
from backroom.agents.memory import ChatMessage
from backroom.agents.parsing import ParseError, fallback_action, format_hint, parse_action
from backroom.bus.wire import AgentFallback, Turn

#: The least time a decision gets, however close its deadline.
MIN_BUDGET_S = 0.05

Outcome = Literal["parsed", "repaired", "fallback"]


def budget_s(deadline_s: float, margin_s: float) -> float:
    """Seconds a decision may take when the referee waits ``deadline_s`` for it."""
    return max(MIN_BUDGET_S, deadline_s - margin_s)


def deadline_detail(turn: Turn, margin_s: float) -> str:
    """A deadline fallback's ``reply.detail``: the budget that ran out, and where it came from."""
    return (
        f"no answer within {budget_s(turn.deadline_s, margin_s):.3g} s "
        f"(the turn's {turn.deadline_s:.3g} s less a {margin_s:.3g} s margin)"
    )


@dataclass(frozen=True)
class Decided:
    """An act turn's answer, and how it came about (what traces and metrics record)."""

    action: JSON
    outcome: Outcome
    #: Why the answer is not the model's first reply (``Agent.mark_fallback``); None if it is.
    reason: AgentFallback | None = None
    #: The parser's complaint about the last reply, or the request's failure.
    detail: str = ""

    @classmethod
    def fallback(
        cls, turn: Turn, reason: AgentFallback, preferred: JSON, detail: str = ""
    ) -> Decided:
        """The documented fallback for ``turn`` (``preferred`` if legal), marked ``reason``."""
        return cls(fallback_action(turn.legal, preferred), "fallback", reason, detail)

    def record(self, replies: list[str]) -> dict[str, Any]:
        """The trace's ``reply`` for this decision: every raw reply, the action, the outcome."""
        return {
            "text": replies,
            "action": self.action,
            "outcome": self.outcome,
            "reason": self.reason or "",
            "detail": self.detail,
        }


def repair_prompt(
    messages: list[ChatMessage], reply: str, error: ParseError, turn: Turn
) -> list[ChatMessage]:
    """The conversation that asks once more: the unreadable reply, what was wrong, the format."""
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {
            "role": "user",
            "content": f"Your reply was not valid because {error.reason}. "
            f"{format_hint(turn.legal, turn.prompt)}",
        },
    ]


async def parse_or_repair(
    turn: Turn,
    messages: list[ChatMessage],
    reply: str,
    ask: Callable[[list[ChatMessage]], Awaitable[str]],
    preferred: JSON = None,
) -> Decided:
    """The action in ``reply`` to ``messages``; else ``ask`` the model again with the repair
    prompt and take the action in its answer; else the fallback (``preferred`` if legal).

    ``ask``'s own exceptions (a deadline, a failed request) pass through: the caller
    decides what they mean.
    """
    try:
        return Decided(parse_action(reply, turn.legal), "parsed")
    except ParseError as exc:
        again = await ask(repair_prompt(messages, reply, exc, turn))
    try:
        return Decided(parse_action(again, turn.legal), "repaired", "repaired")
    except ParseError as exc:
        return Decided.fallback(turn, "unparseable", preferred, exc.reason)
