"""Which matches a league plays: pairings, seat orders, seeds (common random numbers).

A *pairing* is a set of ``group`` entrants (sorted ids, so it does not
depend on the order entrants are listed or added). A *CRN group* is one
pairing and one seed index ``k``: it plays the pairing in every seat order
with the same seed, so the deal (the game's chance) is the same in every
order and cancels out of the comparison. The seed depends on the league's
seed, the game and ``k`` only, so every pairing at index ``k`` shares it too,
and an entrant added later meets the same deals the others met.

Each match has a key (``game|pairing|k|order``) that the store keeps once;
the key is what makes a match "the same match" across a resumed league.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from backroom.bus.wire import ChannelSpec, MatchSpec, RewardTransform
from backroom.league.config import MAX_PERMUTATIONS, LeagueConfig, LeagueGame
from backroom.runner.config import build_game
from backroom.seeds import derive_seed


@dataclass(frozen=True)
class Slot:
    """One scheduled match."""

    game: str  # the league game's key
    pairing: tuple[str, ...]  # sorted agent ids
    index: int  # seed index k
    order: tuple[str, ...]  # the pairing in seat order (seat i: order[i % group])

    @property
    def group(self) -> str:
        """The CRN group: what every seat order of this pairing and seed shares."""
        return f"{self.game}|{','.join(self.pairing)}|{self.index}"

    @property
    def key(self) -> str:
        return f"{self.group}|{','.join(self.order)}"

    @classmethod
    def from_key(cls, key: str) -> Slot:
        """The slot a stored key names (``key`` read back)."""
        game, pairing, index, order = key.split("|")
        return cls(game, tuple(pairing.split(",")), int(index), tuple(order.split(",")))


def group_pairing(group: str) -> tuple[str, tuple[str, ...]]:
    """A CRN group's game and pairing (``Slot.group`` read back)."""
    game, pairing, _index = group.split("|")
    return game, tuple(pairing.split(","))


def crn_seed(league_seed: int, game: str, index: int) -> int:
    """The seed of every match at seed index ``index`` of ``game`` (every seat order plays it)."""
    return derive_seed("backroom", "league", league_seed, game, index, bits=31)


def players_of(game: LeagueGame) -> int:
    return build_game(game.game, game.params).num_players


def orders(pairing: Sequence[str], mode: str) -> list[tuple[str, ...]]:
    """Every seat order of a pairing, or its rotations (``auto``: all up to MAX_PERMUTATIONS)."""
    n_perm = 1
    for i in range(2, len(pairing) + 1):
        n_perm *= i
    if mode == "all" or (mode == "auto" and n_perm <= MAX_PERMUTATIONS):
        return list(itertools.permutations(pairing))
    return [tuple(pairing[i:]) + tuple(pairing[:i]) for i in range(len(pairing))]


def pairings(agents: Iterable[str], group: int) -> list[tuple[str, ...]]:
    return [tuple(sorted(c)) for c in itertools.combinations(sorted(agents), group)]


def group_slots(game: LeagueGame, pairing: tuple[str, ...], index: int) -> list[Slot]:
    """The matches of one CRN group: the pairing in each seat order, one seed."""
    return [Slot(game.key, pairing, index, o) for o in orders(pairing, game.seat_orders)]


def group_size(game: LeagueGame) -> int:
    return game.group or players_of(game)


def round_robin(config: LeagueConfig, agents: Iterable[str] | None = None) -> list[Slot]:
    """Every match of a round robin among ``agents`` (default: all), game by game.

    Seed index first, then pairing: a league stopped early has played every
    pairing about equally often.
    """
    ids = [a.id for a in config.agents()] if agents is None else list(agents)
    out: list[Slot] = []
    for game in config.games:
        playing = set(config.game_agents(game))
        pairs = pairings([a for a in ids if a in playing], group_size(game))
        for k in range(game.seeds):
            for p in pairs:
                out += group_slots(game, p, k)
    return out


def adaptive_pick(
    config: LeagueConfig,
    agents: Sequence[str],
    sigma: Mapping[str, float],
    played: Mapping[tuple[str, tuple[str, ...]], int],
    budget_left: int,
    batch: int,
) -> list[Slot]:
    """The next CRN groups to play: the pairings whose entrants' ratings are least certain.

    A pairing's priority is the sum of its entrants' sigma squared (the
    variance a match would shrink), divided by one plus the groups it has
    played, so one uncertain entrant does not monopolise the league. Each pick
    is a whole CRN group (every seat order), taken only while it fits in
    ``budget_left``; the next seed index of the pairing is played.
    """
    scored: list[tuple[float, str, tuple[str, ...], LeagueGame]] = []
    for game in config.games:
        playing = set(config.game_agents(game))
        for p in pairings([a for a in agents if a in playing], group_size(game)):
            n = played.get((game.key, p), 0)
            score = sum(sigma[a] ** 2 for a in p) / (1 + n)
            scored.append((-score, game.key, p, game))
    scored.sort(key=lambda s: (s[0], s[1], s[2]))
    out: list[Slot] = []
    for _, _, p, game in scored[:batch]:
        slots = group_slots(game, p, played.get((game.key, p), 0))
        if len(out) + len(slots) > budget_left:
            break
        out += slots
    return out


def channels(game: LeagueGame, seats: Sequence[str]) -> list[ChannelSpec]:
    """The game's channels in one seating: those with two members seated, by their seats."""
    out = []
    for c in game.channels:
        members = [i for i, a in enumerate(seats) if a in c.members]
        if len({seats[i] for i in members}) < 2:
            continue  # a channel of one member seated is no channel
        out.append(
            ChannelSpec(
                name=c.name,
                members=members,
                eavesdroppers=[i for i, a in enumerate(seats) if a in c.eavesdroppers],
                opens=c.opens,
                max_messages=c.max_messages,
                max_chars=c.max_chars,
            )
        )
    return out


def match_spec(config: LeagueConfig, game: LeagueGame, slot: Slot, players: int) -> MatchSpec:
    group = len(slot.order)
    seats = [slot.order[i % group] for i in range(players)]
    return MatchSpec(
        game=game.game,
        params=game.params,
        seats=seats,
        channels=channels(game, seats),
        transform=RewardTransform(kind="none", members=[]),
        turn_timeout_s=config.turn_timeout_s,
        on_timeout=config.on_timeout,
        seed=crn_seed(config.seed, game.key, slot.index),
        # The CRN group as the record's label; crn_index 0 in every order, so an agent
        # in a seat samples as the agent in that seat did in the other orders.
        crn_group=slot.group,
        crn_index=0,
        run=config.league,
    )
