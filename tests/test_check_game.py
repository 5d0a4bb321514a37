"""``check_game`` catches each fault it claims to, and third-party engines come in by entry point.

``Toy`` is a small correct engine (chance, simultaneous moves, per-round
rewards); each ``fault`` breaks one part of the contract, and the check that
claims that part must name it. The worked example of docs/games.md
(``examples/custom_game.py``) passes every check.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from backroom.games import base
from backroom.games.base import CHANCE, Action, Game, GameInfo, IllegalActionError, State
from backroom.games.testing import CHECKS, GameCheckError, check_game

ROOT = Path(__file__).resolve().parents[1]
_draws = itertools.count()


class Toy(Game):
    """Each round both show 0 or 1; showing 1 against 0 takes the pot (1 or 2, by chance)."""

    name = "toy"
    num_players = 2

    def __init__(self, fault: str = "", rounds: int = 3) -> None:
        self.fault, self.rounds = fault, rounds
        self.state_class = ToyState

    @property
    def info(self) -> GameInfo:
        top = 1.0 if self.fault == "boastful" else 2.0 * self.rounds
        return GameInfo(2, -top, top, 0.0, self.rounds, 1, 2)


class ToyState(State):
    game: Toy

    def __init__(self, game: Game, seed: int | None) -> None:
        super().__init__(game, seed)
        self.pot: int | None = None
        self.moves: list[list[int]] = []

    def current_players(self) -> frozenset[int]:
        if self.pot is None:
            return frozenset({CHANCE})
        return frozenset() if self.is_terminal() else frozenset({0, 1})

    def chance_outcomes(self) -> list[tuple[Action, float]]:
        return [(1, 0.5), (2, 0.5)]

    def _apply_chance(self, outcome: Action) -> None:
        # "unseeded": chance from somewhere other than the seed (here, a process-wide counter)
        self.pot = 1 + next(_draws) % 2 if self.game.fault == "unseeded" else outcome

    def legal_actions(self, player: int) -> list[int]:
        return [0, 1]

    def check_action(self, player: int, action: Action) -> Action:
        fault = self.game.fault
        if fault == "lax":
            return action
        self.require_mover(player)
        if fault == "picky" and action == 1:
            raise IllegalActionError("1 is not allowed")
        if action in (0, 1) or (fault == "unbounded" and isinstance(action, int)):
            return action
        if fault == "mute":
            raise IllegalActionError("")
        if fault == "crashes":
            raise KeyError(action)
        raise IllegalActionError(f"{action!r}: show 0 or 1")

    def _apply(self, actions: Mapping[int, Action]) -> None:
        a, b = actions[0], actions[1]
        self.moves.append([a, b])
        assert self.pot is not None
        self.round_rewards.append([float(self.pot * (a - b)), float(self.pot * (b - a))])

    def is_terminal(self) -> bool:
        if self.game.fault == "endless":
            return False
        return self.pot is not None and len(self.moves) >= self.game.rounds

    def observation(self, player: int) -> dict[str, Any]:
        seen: dict[str, Any] = {"pot": self.pot, "moves": self.moves}
        if self.game.fault == "unjsonable":
            seen["shown"] = {m[player] for m in self.moves}  # a set: no JSON for it
        return seen

    def prompt(self, player: int) -> str:
        return f"Pot {self.pot}. Show 0 or 1."

    def clone(self) -> State:
        if self.game.fault == "shallow":
            copy = ToyState(self.game, self.seed)
            copy.__dict__.update(self.__dict__)  # shares the moves list with the original
            return copy
        return super().clone()


def test_the_toy_passes_every_check() -> None:
    report = check_game(Toy, playouts=10)
    assert report.checks == CHECKS and report.seen.terminals == 10
    assert report.seen.moves == 3 and report.seen.chance_nodes == 1


FAULTS = [
    ("endless", "end", "ran past the declaration"),
    ("boastful", "info", "outside the declared"),
    ("unseeded", "seed", "played differently"),
    ("shallow", "clone", "playing a clone changed the original"),
    ("lax", "legal", "was accepted"),
    ("unbounded", "legal", "2 from seat 0, outside what its action spec offers was accepted"),
    ("picky", "legal", "refused answers the action specs offered: 1 is not allowed"),
    ("mute", "legal", "without a reason"),
    ("crashes", "legal", "raised KeyError"),
    ("unjsonable", "json", "observation(0) is not JSON"),
]


@pytest.mark.parametrize(("fault", "check", "says"), FAULTS, ids=[f[0] for f in FAULTS])
def test_each_check_catches_its_fault(fault: str, check: str, says: str) -> None:
    with pytest.raises(GameCheckError, match=re.escape(says)) as caught:
        check_game(Toy, fault=fault)
    assert caught.value.check == check
    # the checks that neither play to the end nor clone pass the same engine: the fault is
    # caught by the check that claims it, not by accident (an endless game hangs every play,
    # a shared clone corrupts the plays of every check that clones, and refusing a legal
    # answer stops every play)
    if fault not in ("endless", "shallow", "picky"):
        check_game(Toy, fault=fault, checks=[c for c in CHECKS if c != check])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown checks"):
        check_game(Toy, checks=["clones"])
    with pytest.raises(ValueError, match="a built game and parameters"):
        check_game(Toy(), rounds=2)
    with pytest.raises(ValueError, match="unknown game 'toy'"):
        check_game("toy")


@pytest.fixture
def example() -> Iterator[Any]:
    """examples/custom_game.py, imported; its registration undone afterwards."""
    saved = dict(base._REGISTRY)
    spec = importlib.util.spec_from_file_location(
        "custom_game", ROOT / "examples" / "custom_game.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    base._REGISTRY.clear()
    base._REGISTRY.update(saved)


def test_the_worked_example_passes_check_game(example: Any) -> None:
    for players in (2, 3, 5):
        report = check_game(example.SealedBid, players=players, playouts=30)
        assert report.seen.chance_nodes == players and report.seen.moves == 1
        assert report.seen.low < 0 < report.seen.high
    state = example.SealedBid().new_initial_state(4)
    assert state.check_action(0, " 7 ") == 7
    with pytest.raises(IllegalActionError, match=r"bid a whole number 0\.\.10"):
        state.check_action(0, "11")


def test_an_entry_point_registers_a_game(tmp_path: Path) -> None:
    """A distribution on the path with a ``backroom.games`` entry point: its game is known."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "custom_game.py").write_text((ROOT / "examples" / "custom_game.py").read_text())
    info = site / "sealed_bid_game-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sealed-bid-game\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[backroom.games]\nsealed_bid = custom_game:SealedBid\nbroken = no_such_module\n"
    )
    code = textwrap.dedent(
        """
        import json
        from backroom.games import make_game, registered_games
        from backroom.games.testing import check_game
        names = registered_games()
        check_game("sealed_bid", players=3)
        try:
            make_game("broken")
        except ValueError as exc:
            refusal = str(exc)
        print(json.dumps([names, make_game("sealed_bid", players=4).num_players, refusal]))
        """
    )
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", str(ROOT))])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    names, players, refusal = json.loads(out.stdout.strip().splitlines()[-1])
    assert "sealed_bid" in names and "kuhn" in names and "broken" not in names
    assert players == 4
    assert "entry point 'broken' failed: no_such_module: ModuleNotFoundError" in refusal
