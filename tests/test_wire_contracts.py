"""Strings that carry contracts are types: the documented lists are the literals' lists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pydantic
import pytest

from backroom.bus.wire import EndReason, Error, ErrorReason, MatchEnd

ARCHITECTURE = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()


def _codes(paragraph: str) -> list[str]:
    """The backquoted codes of a paragraph, the literal's name (``wire.X``) left out."""
    return [c for c in re.findall(r"`([a-z_]+)`", paragraph)]


def test_the_documented_error_reasons_are_error_reason() -> None:
    start = ARCHITECTURE.index("Error reasons (`wire.ErrorReason`")
    paragraph = ARCHITECTURE[start : ARCHITECTURE.index("\n\n", start)]
    assert _codes(paragraph) == list(get_args(ErrorReason))


def test_the_documented_end_reasons_are_end_reason() -> None:
    start = ARCHITECTURE.index("why it ended (`wire.EndReason`")
    paragraph = ARCHITECTURE[start : ARCHITECTURE.index(")", start)]
    assert _codes(paragraph) == list(get_args(EndReason))


def test_a_reason_off_the_list_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="reason"):
        Error.model_validate({"type": "error", "reason": "no_such_reason"})
    with pytest.raises(pydantic.ValidationError, match="reason"):
        MatchEnd.model_validate(
            {"type": "match_end", "seat": 0, "returns": [], "raw_returns": [], "reason": "won"}
        )
    assert Error(reason="rate_limited").reason == "rate_limited"
