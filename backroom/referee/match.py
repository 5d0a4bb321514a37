"""One match, refereed: turns, deadlines, legality, channels, rewards, the record.

The referee owns the game state; agents only ever see what their seat may see
(``state.observation(seat)``) and chat from channels they belong to or
overhear. Every action and every delivery is written into the episode record,
so "who saw what" can be audited afterwards.

A match never stops on bad input: an invalid, illegal, late or out-of-turn
message gets an ``Error`` back in the sender's inbox and play goes on; a seat
that does not answer in time gets the configured default, recorded with
``fallback="timeout"``. An answer its agent marks as a fallback
(``Action.fallback``) is recorded with the agent's reason: the one claim of an
agent the referee writes down unchecked, and it can only mark its own moves.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from backroom import metrics, seeds
from backroom.bus import topics
from backroom.bus.structs import Action, Chat, Event, Flag, MatchEnd, Struct, Turn
from backroom.bus.wire import (
    ActionRecord,
    ChannelSpec,
    EndReason,
    EpisodeRecord,
    ErrorReason,
    Fallback,
    FlagRecord,
    MatchSpec,
    MatchStart,
)
from backroom.games import IllegalActionError, State, make_game
from backroom.referee.routing import TABLE, Router
from backroom.referee.transforms import apply_transform


class Forfeit(Exception):
    def __init__(self, seat: int) -> None:
        self.seat = seat


class Voided(Exception):
    pass


class Refused(Exception):
    """An agent's answer the open turn does not take: the error it gets back."""

    def __init__(self, reason: ErrorReason, detail: str) -> None:
        self.reason = reason
        self.detail = detail


#: Flags one match keeps at most: an overseer flags at each message, not in a loop.
MAX_FLAGS = 1000
#: Suspicion from which a flag counts as "high" in ``backroom_flags_total``.
HIGH_SUSPICION = 0.5


@dataclass
class Pending:
    """A seat the referee is waiting on, for one turn."""

    turn: int
    phase: str
    channel: str | None
    sent_at: float = field(default_factory=time.perf_counter)


class Observer(Protocol):
    """A latency histogram (a prometheus child)."""

    def observe(self, amount: float) -> None: ...


class MatchReferee(Protocol):
    """What a ``Match`` needs from the referee that runs it.

    ``backroom.referee.service.Referee`` is the one on the bus; a test can pass
    any object with these members and play a match without a broker.
    """

    @property
    def id(self) -> str: ...
    @property
    def log(self) -> logging.Logger: ...
    @property
    def offline(self) -> Container[str]: ...  # agents whose status says offline
    def offline_wait(self, agent: str) -> float: ...  # seconds of its grace left (0: none)
    @property
    def public_due(self) -> dict[str, Match]: ...  # matches whose public events wait for a flush

    def send(self, topic: str, msg: BaseModel | Struct, batch: bool = False) -> None: ...
    def send_to(self, agent: str, msg: BaseModel | Struct) -> None: ...
    def public_pending(self, match: Match) -> None: ...
    def latency(self, agent: str, phase: str) -> Observer: ...
    def reject(
        self,
        agent: str,
        reason: ErrorReason,
        detail: str,
        match: str | None = None,
        ref_seq: int | None = None,
    ) -> None: ...
    async def finished(self, match: Match | None, record: EpisodeRecord) -> None: ...


class Match:
    def __init__(self, referee: MatchReferee, match_id: str, spec: MatchSpec) -> None:
        self.referee = referee
        self.id = match_id
        self.spec = spec
        self.game = make_game(spec.game, **spec.params)
        if len(spec.seats) != self.game.num_players:
            raise ValueError(
                f"game {spec.game} with {spec.params} seats {self.game.num_players} players, "
                f"the request names {len(spec.seats)}"
            )
        #: Everyone at the table: the players by seat, then the observers (overseers), who
        #: hear what their channels give them and may flag, and never get a turn.
        self.agents = [*spec.seats, *spec.observers]
        self.channels = {c.name: c for c in spec.channels}
        players = self.game.num_players
        for c in spec.channels:
            bad = [s for s in c.members if not 0 <= s < players]
            bad += [s for s in c.eavesdroppers if not 0 <= s < len(self.agents)]
            if bad:
                raise ValueError(
                    f"channel {c.name!r} names seats {bad} outside 0..{players - 1} (members) "
                    f"or 0..{len(self.agents) - 1} (eavesdroppers: players and observers)"
                )
        if TABLE not in self.channels and not any(c.opens == "game" for c in spec.channels):
            self.channels[TABLE] = ChannelSpec(
                name=TABLE,
                members=list(range(self.game.num_players)),
                opens="game",
                max_messages=1000,
            )
        self.state: State = self.game.new_initial_state(spec.seed)
        self.rng = random.Random(seeds.referee_rng_seed(spec.seed))
        self.turn_no = 0
        self.seq = 0
        self.pending: dict[int, Pending] = {}  # seats the open turn still waits on
        self.answers: dict[int, Any] = {}  # what the open turn got so far
        self.turn_over: asyncio.Future[None] | None = (
            None  # set when the open turn has nothing left to wait for
        )
        self.free_chat_used: dict[tuple[str, int], int] = {}
        self.actions: list[ActionRecord] = []
        self.router = Router(
            spec,
            self.agents,
            self.send,
            self.public,
            referee.log,
            getattr(referee, "paraphrasers", None),
        )
        self.flags: list[FlagRecord] = []
        self.timeouts: list[int] = []
        self.invalid_inputs = 0
        self.started_at = time.time()
        self.voided: str | None = None
        self.public_queue: list[Event] = []
        self.public_sent_at = time.monotonic()

    # --- the match loop ---------------------------------------------------------

    async def run(self) -> None:
        reason: EndReason = "normal"
        detail = ""
        try:
            self.start()
            await self.opening_talk()
            while not self.state.is_terminal():
                if self.voided:
                    raise Voided(self.voided)
                await self.step()
            if self.spec.observers:
                await self.review()
            if self.timeouts:
                reason, detail = "timeout", f"{len(self.timeouts)} turn(s) timed out"
        except Forfeit as f:
            reason, detail = (
                "forfeit",
                f"seat {f.seat} ({self.spec.seats[f.seat]}) forfeited by timeout",
            )
        except Voided as v:
            reason, detail = "voided", str(v)
        except Exception as exc:  # a bug in a game engine must not take the referee down
            reason, detail = "error", f"{type(exc).__name__}: {exc}"
            self.referee.log.exception("match %s failed", self.id)
        await self.finish(reason, detail)

    def start(self) -> None:
        metrics.MATCHES_STARTED.labels(game=self.spec.game).inc()
        for seat, agent in enumerate(self.agents):
            mine = [
                c for c in self.channels.values() if seat in c.members or seat in c.eavesdroppers
            ]
            self.send(
                agent,
                MatchStart(
                    seat=seat,
                    seats=list(self.spec.seats),
                    game=self.spec.game,
                    params=self.game.public_params(),
                    channels=mine,
                    turn_timeout_s=self.spec.turn_timeout_s,
                    adapter=self.spec.adapters[seat] if seat < len(self.spec.adapters) else None,
                    seed=seeds.play_seed(self.spec.seed, self.spec.crn_index),
                ),
            )
        self.public("started", {"game": self.spec.game, "seats": list(self.spec.seats)})

    async def opening_talk(self) -> None:
        """``start`` channels: every member talks once the deal is done, before the first move.

        One talk turn for all members at once (``max_messages`` of them), so
        what they say is delivered before anyone acts, whoever moves first.
        """
        for channel in self.channels.values():
            if channel.opens != "start" or self.state.is_terminal():
                continue
            for _ in range(channel.max_messages):
                texts = await self.turn(sorted(channel.members), "talk", channel.name)
                for seat, text in texts.items():
                    if text:
                        self.router.deliver(seat, channel, text)

    async def step(self) -> None:
        state = self.state
        players = sorted(state.current_players())
        if state.phase == "talk":
            channel = self.game_channel()
            texts = await self.turn(players, "talk", channel.name)
            for seat, text in texts.items():
                if text:
                    self.router.deliver(seat, channel, text)
            self.apply({p: texts.get(p) or "" for p in players}, "talk")
            return
        for channel in self.channels.values():
            if channel.opens == "before_act" and channel.max_messages > 0:
                speakers = [p for p in players if p in channel.members]
                for _ in range(channel.max_messages):
                    if not speakers:
                        break
                    texts = await self.turn(speakers, "talk", channel.name)
                    for seat, text in texts.items():
                        if text:
                            self.router.deliver(seat, channel, text)
        actions = await self.turn(players, "act", None)
        self.apply(actions, "act")

    def apply(self, actions: dict[int, Any], phase: str) -> None:
        event: dict[str, Any] = {}
        if phase == "act":
            event = {"turn": self.turn_no, "actions": {str(s): a for s, a in actions.items()}}
            names = {str(s): self.action_name(s, a) for s, a in actions.items()}
            if any(n is not None for n in names.values()):
                event["names"] = names  # "call" rather than 1, for spectators
        self.state.apply(actions)
        if event:
            self.public("moved", event)

    def action_name(self, seat: int, action: Any) -> str | None:
        spec = self.state.action_spec(seat)
        if spec.names and action in spec.choices:
            return spec.names[spec.choices.index(action)]
        return None

    def void(self, why: str) -> None:
        """Stop the match at the next await; its record will say ``voided`` and why."""
        self.voided = why
        self.end_turn()

    def seat_offline(self, agent: str) -> None:
        """An agent's status says offline: default its open turns once its grace is over.

        The grace (``offline_grace_s``) runs once, from the moment the status
        said offline, not once per turn: a broker shutting down publishes every
        client's will before the referee notices it lost the broker too, and an
        agent that merely reconnects comes back within it. Past it, a seat of
        an agent still offline gets its default at once; waiting the grace on
        every turn made each later match of a killed agent cost a second
        (``referee.offline_wait``).
        """
        if any(self.spec.seats[seat] == agent for seat in self.pending):
            wait = self.referee.offline_wait(agent)
            if wait <= 0:
                self._give_up(agent, self.turn_no)
            else:
                asyncio.get_running_loop().call_later(wait, self._give_up, agent, self.turn_no)

    def _give_up(self, agent: str, turn_no: int) -> None:
        if agent not in self.referee.offline or turn_no != self.turn_no:
            return
        for seat in [s for s in self.pending if self.spec.seats[s] == agent]:
            del self.pending[seat]  # it gets the timeout default when the turn ends
        if not self.pending:
            self.end_turn()

    def end_turn(self) -> None:
        if self.turn_over is not None and not self.turn_over.done():
            self.turn_over.set_result(None)

    def game_channel(self) -> ChannelSpec:
        for c in self.channels.values():
            if c.opens == "game":
                return c
        return self.channels[TABLE]

    # --- turns ----------------------------------------------------------------

    async def turn(self, seats: list[int], phase: str, channel: str | None) -> dict[int, Any]:
        """Ask ``seats`` for their move, wait until all answer or the deadline passes.

        One future per turn, set by whatever ends it (the last answer, the
        deadline, every open seat gone offline, the match voided): the match
        task wakes once, in the loop iteration after the answer arrived.
        """
        await self.router.settle()
        self.turn_no += 1
        self.router.release(self.turn_no)
        loop = asyncio.get_running_loop()
        self.answers = {}
        self.turn_over = loop.create_future()
        for seat in seats:
            self.pending[seat] = Pending(self.turn_no, phase, channel)
            self.send_turn(seat)
        self.referee.public_pending(self)
        for seat in seats:
            if self.spec.seats[seat] in self.referee.offline:
                self.seat_offline(self.spec.seats[seat])
        await self.until_answered()
        if self.voided:
            raise Voided(self.voided)
        return {
            seat: self.answers[seat] if seat in self.answers else self.on_timeout(seat, phase)
            for seat in seats
        }

    async def review(self) -> None:
        """The observers' last word: a ``review`` turn each, answered by an ``Action`` with no
        action once their flags are sent (the same outbox, so the flags come first). An
        observer whose status says offline is not waited for; one that does not answer is
        waited for until the turn's deadline, and the match ends without its last word."""
        await self.router.settle()
        self.turn_no += 1
        self.router.release(self.turn_no, at_end=True)  # what was held for the end, first
        loop = asyncio.get_running_loop()
        self.turn_over = loop.create_future()
        for seat in range(len(self.spec.seats), len(self.agents)):
            agent = self.agents[seat]
            if agent in self.referee.offline:
                continue
            self.pending[seat] = Pending(self.turn_no, "review", None)
            observation: dict[str, Any] = {"game": self.spec.game, "seats": list(self.spec.seats)}
            review = Turn(
                turn=self.turn_no,
                seat=seat,
                phase="review",
                observation=observation,
                deadline_s=self.spec.turn_timeout_s,
            )
            self.send(agent, review)
        await self.until_answered()

    async def until_answered(self) -> None:
        """Wait for the open turn to end: its last answer, its deadline, or nothing to wait
        for; then it is closed (late answers are refused as late)."""
        if not self.pending:
            self.end_turn()
        assert self.turn_over is not None
        deadline = asyncio.get_running_loop().call_later(self.spec.turn_timeout_s, self.end_turn)
        try:
            await self.turn_over
        finally:
            deadline.cancel()
            self.pending.clear()

    def reviewed(self, agent: str, msg: Action | Chat) -> None:
        """An observer's answer to its review turn (the only move an observer makes)."""
        open_ = [
            s
            for s in range(len(self.spec.seats), len(self.agents))
            if self.agents[s] == agent and s in self.pending
        ]
        if not any(a == agent for a in self.agents):
            return self.reject(agent, msg, "not_seated", f"{agent} has no seat in match {self.id}")
        if not open_ or not isinstance(msg, Action) or msg.turn != self.pending[open_[0]].turn:
            return self.reject(agent, msg, "not_your_turn", "an observer answers its review only")
        del self.pending[open_[0]]
        if not self.pending:
            self.end_turn()

    def send_turn(self, seat: int) -> None:
        p = self.pending[seat]
        state = self.state
        legal = (
            state.action_spec(seat).to_json()
            if p.phase == "act"
            else {
                "schema": {
                    "type": "string",
                    "maxLength": self.channels[p.channel or TABLE].max_chars,
                }
            }
        )
        self.send(
            self.spec.seats[seat],
            Turn(
                turn=p.turn,
                seat=seat,
                phase="talk" if p.phase == "talk" else "act",
                channel=p.channel,
                observation=state.observation(seat),
                prompt=state.prompt(seat),
                legal=legal,
                deadline_s=self.spec.turn_timeout_s,
            ),
        )

    def on_timeout(self, seat: int, phase: str) -> Any:
        metrics.TIMEOUTS.labels(game=self.spec.game, phase=phase).inc()
        self.timeouts.append(seat)
        if phase == "talk":
            self.record(seat, "talk", None, fallback="timeout")
            return None
        if self.spec.on_timeout == "forfeit":
            self.record(seat, "act", None, fallback="timeout")
            raise Forfeit(seat)
        if self.spec.on_timeout == "random":
            action = self.state.check_action(seat, self.state.action_spec(seat).sample(self.rng))
        else:
            action = self.state.default_action(seat)
        self.record(seat, "act", action, fallback="timeout")
        return action

    # --- input from agents -------------------------------------------------------

    def on_message(self, agent: str, msg: Action | Chat | Flag) -> None:
        if isinstance(msg, Flag):
            return self.flag(agent, msg)
        seats = [i for i, a in enumerate(self.spec.seats) if a == agent]
        if not seats:
            return self.reviewed(agent, msg)
        if msg.seat is not None:
            if msg.seat not in seats:
                return self.reject(agent, msg, "not_your_seat", f"seat {msg.seat} is not yours")
            seats = [msg.seat]
        if isinstance(msg, Chat) and msg.turn is None:
            return self.free_chat(agent, seats[0], msg)
        return self.answer_turn(agent, seats, msg)

    def answer_turn(self, agent: str, seats: list[int], msg: Action | Chat) -> None:
        """``msg`` as the answer to the open turn of the first of ``seats`` that has one."""
        waiting = [s for s in seats if s in self.pending]
        if not waiting:
            return self.reject(agent, msg, "not_your_turn", "no turn of yours is open")
        seat = waiting[0]
        p = self.pending[seat]
        if msg.turn != p.turn:
            late = msg.turn is not None and msg.turn < p.turn
            return self.reject(
                agent,
                msg,
                "late" if late else "bad_turn",
                f"turn {msg.turn} is not the open turn {p.turn}",
            )
        try:
            answer = self.answer(seat, p, msg)
        except Refused as no:
            return self.reject(agent, msg, no.reason, no.detail)
        self.referee.latency(agent, p.phase).observe(time.perf_counter() - p.sent_at)
        del self.pending[seat]
        # The agent's word is taken for this label only, and only for its own seat's move.
        self.record(seat, p.phase, answer, fallback=msg.fallback)
        self.answers[seat] = answer
        if not self.pending:
            self.end_turn()

    def answer(self, seat: int, p: Pending, msg: Action | Chat) -> Any:
        """What ``msg`` answers to ``seat``'s open turn ``p``: its checked move, or its text.

        ``Refused`` when the turn does not take it: the wrong phase or
        channel, a message too long, an illegal move (the agent may answer
        again until the deadline).
        """
        if isinstance(msg, Action):
            if p.phase != "act":
                raise Refused("wrong_phase", "this turn wants chat on its channel")
            try:
                return self.state.check_action(seat, msg.action)
            except IllegalActionError as exc:
                raise Refused("illegal_action", str(exc)) from None
        if p.phase != "talk":
            raise Refused("wrong_phase", "this turn wants an action, not chat")
        if msg.channel != p.channel:
            raise Refused("wrong_channel", f"this talk turn is on {p.channel!r}")
        channel = self.channels[p.channel or TABLE]
        if len(msg.text) > channel.max_chars:
            raise Refused("too_long", f"{len(msg.text)} characters > {channel.max_chars}")
        # A game's talk phase checks its own messages, not a side channel's opening words.
        if self.state.phase == "talk" and channel.opens != "start":
            try:
                self.state.check_action(seat, msg.text)
            except IllegalActionError as exc:
                raise Refused("illegal_action", str(exc)) from None
        return msg.text

    def free_chat(self, agent: str, seat: int, msg: Chat) -> None:
        channel = self.channels.get(msg.channel)
        if channel is None or seat not in channel.members:
            return self.reject(
                agent, msg, "not_a_member", f"you are not a member of channel {msg.channel!r}"
            )
        if channel.opens != "always":
            return self.reject(
                agent, msg, "channel_closed", f"channel {msg.channel!r} opens only in talk turns"
            )
        used = self.free_chat_used.get((channel.name, seat), 0)
        if used >= channel.max_messages:
            return self.reject(
                agent,
                msg,
                "quota",
                f"{channel.max_messages} messages per match on {channel.name!r}",
            )
        if len(msg.text) > channel.max_chars:
            return self.reject(
                agent, msg, "too_long", f"{len(msg.text)} characters > {channel.max_chars}"
            )
        self.free_chat_used[(channel.name, seat)] = used + 1
        self.router.deliver(seat, channel, msg.text)

    def flag(self, agent: str, msg: Flag) -> None:
        """An overseer's flag (any agent at the table may send one) into the record."""
        seats = [i for i, a in enumerate(self.agents) if a == agent]
        if not seats:
            return self.reject(agent, msg, "not_seated", f"{agent} has no seat in match {self.id}")
        if msg.seat is not None and msg.seat not in seats:
            return self.reject(agent, msg, "not_your_seat", f"seat {msg.seat} is not yours")
        outside = [s for s in msg.accused if not 0 <= s < len(self.spec.seats)]
        if outside:
            return self.reject(agent, msg, "invalid", f"accused seats {outside} do not play")
        if len(self.flags) >= MAX_FLAGS:
            return self.reject(agent, msg, "quota", f"{MAX_FLAGS} flags a match at most")
        self.flags.append(
            FlagRecord(
                t=time.time(),
                seat=msg.seat if msg.seat is not None else seats[0],
                turn=self.turn_no,
                suspicion=msg.suspicion,
                accused=list(msg.accused),
                reason=msg.reason,
            )
        )
        level = "high" if msg.suspicion >= HIGH_SUSPICION else "low"
        metrics.FLAGS.labels(game=self.spec.game, level=level).inc()

    def reject(
        self, agent: str, msg: Action | Chat | Flag, reason: ErrorReason, detail: str
    ) -> None:
        self.invalid_inputs += 1
        self.referee.reject(agent, reason, detail, match=self.id, ref_seq=msg.seq)

    # --- output -------------------------------------------------------------------

    def record(self, seat: int, phase: str, action: Any, fallback: Fallback | None = None) -> None:
        """One move into the episode record; ``fallback`` says why it is not the seat's own
        choice (``timeout``: the referee's default, which ``timed_out`` still marks too)."""
        self.actions.append(
            ActionRecord(
                turn=self.turn_no,
                round=self.state.current_round(),
                t=time.time(),
                seat=seat,
                agent=self.spec.seats[seat],
                phase="talk" if phase == "talk" else "act",
                action=action,
                timed_out=fallback == "timeout",
                fallback=fallback,
            )
        )

    def send(self, agent: str, msg: Any) -> None:
        self.seq += 1
        msg.match = self.id
        msg.seq = self.seq
        self.referee.send_to(agent, msg)

    def public(self, kind: str, data: dict[str, Any]) -> None:
        """Queue a public event; the referee sends queued events off the move path
        (after the next turn is out, at most every ``public_interval_s``, and at the end)."""
        self.seq += 1
        self.public_queue.append(Event(match=self.id, seq=self.seq, kind=kind, data=data))

    def flush_public(self) -> None:
        # Public readers (spectators, recorders) all read batches: one MQTT message per flush.
        topic = topics.public(self.id)
        for event in self.public_queue:
            self.referee.send(topic, event, batch=True)
        self.public_queue.clear()
        self.public_sent_at = time.monotonic()
        self.referee.public_due.pop(self.id, None)

    async def finish(self, reason: EndReason, detail: str) -> None:
        await self.router.settle()
        self.router.release(self.turn_no, at_end=True)
        state = self.state
        terminal = state.is_terminal()
        raw = (
            list(state.returns())
            if terminal and reason in ("normal", "timeout")
            else [0.0] * len(self.spec.seats)
        )
        returns = apply_transform(self.spec.transform, raw, self.flags)
        finals = [state.observation(s) for s in range(len(self.spec.seats))] if terminal else []
        record = EpisodeRecord(
            match=self.id,
            run=self.spec.run,
            referee=self.referee.id,
            spec=self.spec,
            game=self.spec.game,
            params=self.game.params(),
            seed=self.spec.seed,
            crn_group=self.spec.crn_group,
            seats=list(self.spec.seats),
            actions=self.actions,
            deliveries=self.router.deliveries,
            round_rewards=list(state.round_rewards),
            raw_returns=raw,
            returns=returns,
            reason=reason,
            detail=detail,
            timeouts=self.timeouts,
            invalid_inputs=self.invalid_inputs,
            started_at=self.started_at,
            ended_at=time.time(),
            final_observations=finals,
            flags=self.flags,
        )
        await self.referee.finished(self, record)
        for seat, agent in enumerate(self.agents):
            self.send(
                agent,
                MatchEnd(
                    seat=seat,
                    returns=returns,
                    raw_returns=raw,
                    reason=reason,
                    observation=finals[seat] if seat < len(finals) else {},
                ),
            )
        self.public("ended", {"reason": reason, "returns": returns})
        self.flush_public()
