"""The decision path the ``llm`` and ``local`` kinds share (``backroom.agents.decisions``):
parse, one repair round, the fallback; and the budget. The kinds' own tests
(test_llm_agent, test_local_agent, test_fallbacks) play it against real models; here
each branch is pinned with replies written out, so a change of rule shows by name."""

from __future__ import annotations

import pytest

from backroom.agents.decisions import MIN_BUDGET_S, Decided, budget_s, parse_or_repair
from backroom.agents.memory import ChatMessage
from backroom.bus.wire import Turn

PRICE = Turn(
    match="m",
    turn=3,
    seat=0,
    phase="act",
    observation={},
    prompt="Name your price.",
    legal={"schema": {"type": "integer", "minimum": 1, "maximum": 10, "default": 5}},
    deadline_s=2.0,
)
ASKED: list[ChatMessage] = [{"role": "user", "content": "Name your price."}]


class Model:
    """Replies in order, and the conversations it was asked (what the repair prompt says)."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.asked: list[list[ChatMessage]] = []

    async def __call__(self, conversation: list[ChatMessage]) -> str:
        self.asked.append(conversation)
        return self.replies.pop(0)


async def test_a_readable_first_reply_is_the_action_and_asks_nothing_more() -> None:
    model = Model()
    decided = await parse_or_repair(PRICE, ASKED, "My price is 7.", model)
    assert decided == Decided(7, "parsed")
    assert model.asked == []
    assert decided.record(["My price is 7."]) == {
        "text": ["My price is 7."],
        "action": 7,
        "outcome": "parsed",
        "reason": "",
        "detail": "",
    }


async def test_an_unreadable_reply_gets_one_repair_round_marked_repaired() -> None:
    model = Model("8")
    decided = await parse_or_repair(PRICE, ASKED, "a fair price", model)
    assert decided == Decided(8, "repaired", "repaired")
    [conversation] = model.asked
    assert conversation[: len(ASKED)] == ASKED
    assert conversation[len(ASKED)] == {"role": "assistant", "content": "a fair price"}
    repair = conversation[-1]
    assert repair["role"] == "user"
    assert repair["content"].startswith("Your reply was not valid because ")


async def test_two_unreadable_replies_give_the_fallback_marked_unparseable() -> None:
    decided = await parse_or_repair(PRICE, ASKED, "cheap", Model("very cheap"), preferred=3)
    assert (decided.action, decided.outcome, decided.reason) == (3, "fallback", "unparseable")
    assert decided.detail  # the parser's complaint about the second reply
    schema_default = await parse_or_repair(PRICE, ASKED, "cheap", Model("very cheap"))
    assert schema_default.action == 5


async def test_the_models_own_failure_passes_through() -> None:
    async def late(conversation: list[ChatMessage]) -> str:
        raise TimeoutError

    with pytest.raises(TimeoutError):
        await parse_or_repair(PRICE, ASKED, "cheap", late)
    assert Decided.fallback(PRICE, "deadline", None) == Decided(5, "fallback", "deadline")


def test_the_budget_is_the_deadline_less_the_margin_with_a_floor() -> None:
    assert budget_s(2.0, 0.5) == 1.5
    assert budget_s(0.3, 0.5) == MIN_BUDGET_S == 0.05
