"""Parsing model replies into actions, in the formats the papers' prompts ask for."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backroom.agents.parsing import (
    ParseError,
    answer_format,
    choice_names,
    fallback_action,
    format_hint,
    legal_choices,
    parse_action,
    parse_message,
    parse_number,
    parse_object,
    render_choice,
)
from backroom.games import make_game

from .conftest import ITEMS

KUHN = {"choices": [0, 1, 2], "names": ["fold", "call", "raise"]}
IPD = {"choices": ["A", "B"]}
COINS = {"schema": {"type": "integer", "minimum": 0, "maximum": 10}}
PRICE = {"schema": {"type": "number", "minimum": 0.0, "maximum": 16.0}}
TEXT = {"schema": {"type": "string", "maxLength": 20}}


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("raise", 2),
        ("Raise.", 2),
        ("  CALL  ", 1),
        ("fold\nBecause my card is weak.", 0),
        ("I will raise because I hold the Ace.", 2),
        ("<raise>", 2),
        ("**call**", 1),
    ],
)
def test_kuhn_choice_names(reply: str, action: int) -> None:
    assert parse_action(reply, KUHN) == action


@pytest.mark.parametrize("reply", ["I could fold or raise here", "", "check", "2 maybe"])
def test_ambiguous_or_missing_choices_are_refused(reply: str) -> None:
    with pytest.raises(ParseError) as exc:
        parse_action(reply, KUHN)
    assert exc.value.reason


@pytest.mark.parametrize(
    ("reply", "action"),
    [("<A>", "A"), ("<B>", "B"), ("B", "B"), (" a ", "A"), ("I play <A> this round", "A")],
)
def test_ipd_tags(reply: str, action: str) -> None:
    assert parse_action(reply, IPD) == action


def test_single_letters_are_not_found_inside_words() -> None:
    with pytest.raises(ParseError):
        parse_action("As a player I think cooperation is best", IPD)
    with pytest.raises(ParseError):
        parse_action("<A> then <B>", IPD)


@pytest.mark.parametrize(
    ("reply", "value"),
    [
        ("<<proposal_start>>9<<proposal_end>>", 9),
        ("<<proposal_start>> 1 <<proposal_end>>", 1),
        ("7", 7),
        ("10\nI have the upper hand.", 10),
        ("<<proposal_start>>10", 10),
    ],
)
def test_integer_proposals(reply: str, value: int) -> None:
    assert parse_action(reply, COINS) == value


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ("11", "outside"),
        ("3.5", "whole"),
        ("I pick 3, not 5", "2 numbers"),
        ("none", "no number"),
        ("", "empty"),
    ],
)
def test_bad_numbers_say_why(reply: str, why: str) -> None:
    with pytest.raises(ParseError, match=why):
        parse_action(reply, COINS)


def test_prices_first_line() -> None:
    assert parse_action("7.5", PRICE) == 7.5
    assert parse_action("8\nThe cartel price maximises joint profit.", PRICE) == 8.0
    assert parse_number("1,000", {"type": "number"}) == 1000.0
    with pytest.raises(ParseError):
        parse_action("20", PRICE)


def test_dict_proposals_json_and_items() -> None:
    assert parse_action('{"hats": 5, "books": 0, "balls": 5}', ITEMS) == {
        "hats": 5,
        "books": 0,
        "balls": 5,
    }
    fenced = 'Here:\n```json\n{"hats": 1, "books": 2, "balls": 3}\n```'
    assert parse_action(fenced, ITEMS) == {"hats": 1, "books": 2, "balls": 3}
    assert parse_action("Proposal: 10 hats, 0 books, 0 balls", ITEMS) == {
        "hats": 10,
        "books": 0,
        "balls": 0,
    }
    assert parse_action("Proposal: 4 hats, 3 balls", ITEMS) == {"hats": 4, "books": 0, "balls": 3}
    with pytest.raises(ParseError, match="outside"):
        parse_object('{"hats": 11, "books": 0, "balls": 0}', ITEMS["schema"])
    with pytest.raises(ParseError, match="keys"):
        parse_object('{"hats": 1, "books": 0, "balls": 0, "cars": 2}', ITEMS["schema"])
    with pytest.raises(ParseError):
        parse_object("no idea", ITEMS["schema"])


def test_messages() -> None:
    assert parse_message("<<message_start>>My hand is paper.<<message_end>>") == "My hand is paper."
    assert parse_message('"Let us split fairly."') == "Let us split fairly."
    assert parse_message("x" * 50, 20) == "x" * 20
    assert parse_action("<<message_start>>hello", TEXT) == "hello"


def test_legal_choices_enumerate_small_integer_ranges() -> None:
    assert legal_choices(KUHN) == [0, 1, 2]
    assert legal_choices(COINS) == list(range(11))
    assert legal_choices(PRICE) == [] and legal_choices(ITEMS) == [] and legal_choices(TEXT) == []
    assert legal_choices({"schema": {"type": "integer", "minimum": 0, "maximum": 1000}}) == []
    assert choice_names(KUHN) == ["fold", "call", "raise"]
    assert choice_names(COINS)[:3] == ["0", "1", "2"]


def test_formats_follow_the_games_prompts() -> None:
    ipd = make_game("ipd").new_initial_state(0)
    ts = make_game("trust_and_split", first_speaker=0).new_initial_state(0)
    kuhn = make_game("kuhn", variant="loki").new_initial_state(0)
    assert answer_format(ipd.prompt(0)) == "tag"
    assert answer_format(kuhn.prompt(kuhn.to_move)) == "plain"  # type: ignore[attr-defined]
    while ts.phase == "talk":
        ts.apply({next(iter(ts.current_players())): "hi"})
    assert answer_format(ts.prompt(0)) == "proposal"
    assert render_choice("A", "tag") == "<A>"
    assert render_choice("7", "proposal") == "<<proposal_start>>7<<proposal_end>>"
    assert render_choice("raise", "plain") == "raise"
    # what we render is what the engine accepts
    assert ipd.check_action(0, render_choice("A", "tag")) == "A"
    assert ts.check_action(0, render_choice("7", "proposal")) == 7


def test_hints_name_the_format() -> None:
    assert "fold, call, raise" in format_hint(KUHN)
    assert "<A>, <B>" in format_hint(IPD, '"<A>" or "<B>"')
    assert "<<proposal_start>>" in format_hint(
        COINS, "Respond with <<proposal_start>> x <<proposal_end>>"
    )
    assert "first line" in format_hint(PRICE)
    assert "JSON" in format_hint(ITEMS)


def test_fallbacks_are_legal_and_documented() -> None:
    assert fallback_action(KUHN) == 0
    assert fallback_action(KUHN, "call") == 1 and fallback_action(KUHN, 2) == 2
    assert fallback_action(KUHN, "shove") == 0
    assert (
        fallback_action(COINS) == 0
        and fallback_action(COINS, 5) == 5
        and fallback_action(COINS, 50) == 0
    )
    assert (
        fallback_action(PRICE) == 0.0
        and fallback_action({"schema": {**PRICE["schema"], "default": 6}}) == 6.0
    )
    assert fallback_action(ITEMS) == {"hats": 0, "books": 0, "balls": 0}
    assert fallback_action(TEXT) == ""


@given(st.text(max_size=200))
def test_parsers_never_crash_and_only_return_legal_actions(reply: str) -> None:
    for legal in (KUHN, IPD, COINS, PRICE, ITEMS, TEXT):
        try:
            action = parse_action(reply, legal)
        except ParseError:
            continue
        if "choices" in legal:
            assert action in legal["choices"]  # type: ignore[operator]
        elif legal is COINS:
            assert isinstance(action, int) and 0 <= action <= 10
        elif legal is PRICE:
            assert 0.0 <= action <= 16.0
        elif legal is ITEMS:
            assert set(action) == {"hats", "books", "balls"} and all(
                0 <= v <= 10 for v in action.values()
            )
        else:
            assert len(action) <= 20
