"""One match, step by step, from its episode record and traces: what each seat saw and heard.

The episode record (``EpisodeRecord``) holds the moves, every delivery of a
chat message (channel, sender, recipient, overheard or not), the rewards and
the end; it does not hold what each seat was shown at each turn. That is
derived here the way the referee made it: the game is rebuilt from the match
seed (``game.new_initial_state(seed)`` deals the same cards) and the recorded
moves are applied in turn order, so ``state.observation(seat)`` before a turn
is the observation that turn's ``Turn`` message carried (games are pure and
deterministic from the seed and the moves: ``backroom.games.base``).

Which turns were talk on a side channel and which were the game's own talk
phase follows ``Match``'s loop (``backroom.referee.match``): first the
``opens: start`` channels' turns, ``max_messages`` each; then, while the game
is in a talk phase, one game-talk turn per step; otherwise each
``before_act`` channel with a member to move, ``max_messages`` turns each,
then the move. Anything the replay cannot rebuild (a record of an older engine,
a move the rules now refuse) ends the derived views there, marked as a gap,
and the recorded moves and messages are still shown.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from backroom.bus.wire import ChannelSpec, EpisodeRecord
from backroom.games import State, make_game
from backroom.replay.words import Words

TABLE = "table"  # the referee's implicit all-seats channel (``referee.routing.TABLE``)


def channels_of(record: EpisodeRecord, players: int) -> list[ChannelSpec]:
    """The match's channels in the referee's order, with the implicit table where it adds one."""
    channels = list(record.spec.channels)
    names = {c.name for c in channels}
    if TABLE not in names and not any(c.opens == "game" for c in channels):
        channels.append(
            ChannelSpec(name=TABLE, members=list(range(players)), opens="game", max_messages=1000)
        )
    return channels


def schedule(state: State, channels: list[ChannelSpec]) -> Iterator[tuple[str, str | None, bool]]:
    """(phase, channel, game talk?) of each turn, in the referee's order; ``state`` is advanced
    by the caller between turns, as the match's moves are applied."""
    for c in channels:
        if c.opens == "start" and not state.is_terminal():
            for _ in range(c.max_messages):
                yield "talk", c.name, False
    game_channel = next((c.name for c in channels if c.opens == "game"), TABLE)
    while not state.is_terminal():
        players = state.current_players()
        if state.phase == "talk":
            yield "talk", game_channel, True
            continue
        for c in channels:
            if c.opens == "before_act" and any(p in c.members for p in players):
                for _ in range(c.max_messages):
                    yield "talk", c.name, False
        yield "act", None, False


def action_name(state: State, seat: int, action: Any) -> str | None:
    try:
        spec = state.action_spec(seat)
    except Exception:  # a seat not to move, a finished game: no name to give
        return None
    if spec.names and action in spec.choices:
        return str(spec.names[spec.choices.index(action)])
    return None


def decision(trace: dict[str, Any]) -> dict[str, Any]:
    """What a model agent's trace says of one decision, in the viewer's terms.

    The prompt is the chat the agent sent its model (``request.messages``; an
    API model's requests each hold theirs), the completion its reply text, and
    for a choice among the legal actions each candidate's summed log-prob and
    probability; token log-probs are per completion token.
    """
    request, reply = trace.get("request"), trace.get("reply")
    requests = request if isinstance(request, list) else [request]
    prompts = [r["messages"] for r in requests if isinstance(r, dict) and "messages" in r]
    # one request (a local model's) or a list (an API model's); a reply is a dict: either
    # may be something else in a trace of an older schema, read then as saying nothing
    asked: dict[str, Any] = request if isinstance(request, dict) else {}
    answered: dict[str, Any] = reply if isinstance(reply, dict) else {}
    completion = answered.get("text")
    return {
        "agent": trace.get("agent"),
        "adapter_version": trace.get("adapter_version"),
        "temperature": trace.get("temperature"),
        "prompt": prompts[-1] if prompts else None,
        "planning": asked.get("planning"),
        "repair": asked.get("repair"),
        "completion": completion if completion is not None else answered.get("message"),
        "outcome": answered.get("outcome"),
        # a fallback's reason and what went wrong, in words (docs/agents.md, traces)
        "reason": answered.get("reason") or None,
        "detail": answered.get("detail") or None,
        "candidates": _candidates(trace, asked.get("candidates"), answered.get("probs")),
        "tokens": [
            {"id": t, "logprob": lp}
            for t, lp in zip(
                trace.get("completion_ids") or [], trace.get("logprobs") or [], strict=False
            )
        ],
        "prompt_tokens": len(trace.get("prompt_ids") or []),
        "request": request,
        "reply": reply,
    }


def _candidates(trace: dict[str, Any], texts: Any, probs: Any) -> list[dict[str, Any]]:
    """Each legal choice the model was asked to score: its text, summed log-prob, probability."""
    texts = texts if isinstance(texts, list) else []
    probs = probs if isinstance(probs, list) else []
    return [
        {
            "text": texts[i] if i < len(texts) else f"#{i}",
            "logprob": total,
            "prob": probs[i] if i < len(probs) else None,
            "chosen": i == trace.get("chosen"),
        }
        for i, total in enumerate(trace.get("candidate_logprobs") or [])
    ]


def _messages(record: EpisodeRecord) -> list[dict[str, Any]]:
    """Deliveries grouped into messages: one per (time, channel, sender, text), with its recipients."""
    out: list[dict[str, Any]] = []
    index: dict[tuple[float, str, int, str], dict[str, Any]] = {}
    for d in record.deliveries:
        key = (d.t, d.channel, d.from_seat, d.text)
        msg = index.get(key)
        if msg is None:
            msg = index[key] = {
                "t": d.t,
                "channel": d.channel,
                "sender_seat": d.from_seat,
                "sender": _agent(record, d.from_seat),
                "text": d.text,
                "to": [],
            }
            out.append(msg)
        msg["to"].append(
            {"seat": d.to_seat, "agent": _agent(record, d.to_seat), "overheard": d.overheard}
        )
    return out


def _agent(record: EpisodeRecord, seat: int) -> str:
    return record.seats[seat] if 0 <= seat < len(record.seats) else f"seat {seat}"


def _views(
    state: State | None, players: int, asked: set[int], words: Words
) -> list[dict[str, Any]]:
    """Each seat's view: the observation as sent (``observation``) and in words (``rows``)."""
    views = []
    for seat in range(players):
        view: dict[str, Any] = {"seat": seat, "asked": seat in asked}
        if state is not None:
            view["observation"] = state.observation(seat)
            view["rows"] = words.rows(view["observation"])
            if seat in asked:
                view["prompt"] = state.prompt(seat)
        views.append(view)
    return views


class _Replay:
    """The game rebuilt from the seed and walked beside the record, turn by turn.

    ``state`` and ``plan`` (the referee's loop, :func:`schedule`) go None at the
    first turn they cannot follow, with a gap saying why; from there each step
    shows what the record holds and no seat's view.
    """

    def __init__(
        self,
        record: EpisodeRecord,
        channels: list[ChannelSpec],
        traces: dict[tuple[int, int], dict[str, Any]],
        traced_agents: set[str],
    ) -> None:
        self.players = len(record.seats)
        self.traces, self.traced_agents = traces, traced_agents
        self.gaps: list[str] = []
        self.state: State | None
        try:
            game = make_game(record.spec.game, **record.spec.params)
            self.state = game.new_initial_state(record.seed)
        except Exception as exc:  # an engine or parameter this version does not know
            self.state = None
            self.gaps.append(f"the game could not be rebuilt ({exc}): no seat's view is shown")
        self.plan = schedule(self.state, channels) if self.state is not None else None
        self.words = Words(record.seats, self.state)

    def start(self) -> dict[str, Any]:
        """The step before the first turn: every seat's first view."""
        views = _views(self.state, self.players, set(), self.words)
        return {"kind": "start", "views": views, "messages": [], "public": []}

    def step(self, turn: int, moves: list[Any]) -> dict[str, Any]:
        """One turn: its seats' views, moves and decisions; the game then moves on."""
        phase, channel, game_talk = self._follow(turn, moves[0].phase)
        step: dict[str, Any] = {
            "kind": "turn",
            "turn": turn,
            "round": moves[0].round,
            "phase": moves[0].phase,
            "channel": channel,
            "game_talk": game_talk,
            "views": _views(self.state, self.players, {a.seat for a in moves}, self.words),
            "moves": [self._move(a) for a in moves],
            "decisions": [d for a in moves if (d := self._decision(turn, a)) is not None],
            "messages": [],
            "public": [],
            "t": min(a.t for a in moves),
        }
        if phase == "act" and step["moves"]:
            step["public"] = [f"{m['agent']}: {m['name']}" for m in step["moves"]]
        if self.state is not None:
            self.state = _advance(self.state, moves, phase, game_talk, self.gaps, turn)
            if self.state is None:
                self.plan = None
        return step

    def _follow(self, turn: int, recorded: str) -> tuple[str, str | None, bool]:
        """The turn's (phase, channel, game talk?) by the referee's loop; a turn it does not
        have there ends the rebuilt views, with a gap."""
        if self.plan is None:
            return recorded, None, False
        phase, channel, game_talk = "", None, False
        try:
            phase, channel, game_talk = next(self.plan)
        except StopIteration:
            self.plan = None
        if phase != recorded:
            self.gaps.append(
                f"turn {turn}: a {recorded} turn where the referee's loop has "
                f"{phase or 'the end'}: no seat's view is shown from here"
            )
            self.state, self.plan = None, None
            return recorded, None, game_talk
        return phase, channel, game_talk

    def _move(self, a: Any) -> dict[str, Any]:
        """One recorded move, named in the game's words where the rebuilt state can name it."""
        state = self.state
        name = action_name(state, a.seat, a.action) if state and a.phase == "act" else None
        return {
            "seat": a.seat,
            "agent": a.agent,
            "action": a.action,
            "name": self.words.move(a.phase, a.action, name),
            "fallback": a.fallback,
            "timed_out": a.timed_out,
        }

    def _decision(self, turn: int, a: Any) -> dict[str, Any] | None:
        """What the mover's trace says of its move; a traced agent's missing trace is a gap."""
        trace = self.traces.get((turn, a.seat))
        if trace is not None:
            return {"seat": a.seat, **decision(trace), "fallback": a.fallback}
        if a.agent in self.traced_agents and not a.fallback:
            self.gaps.append(f"turn {turn}: no trace of {a.agent}'s decision (seat {a.seat})")
            return {"seat": a.seat, "agent": a.agent, "gap": "trace missing"}
        return None


def match_view(
    record_data: dict[str, Any],
    traces: dict[tuple[int, int], dict[str, Any]],
    traced_agents: set[str],
) -> dict[str, Any]:
    """The match as steps: a start, one step per turn, an end; every gap marked in ``gaps``."""
    record = EpisodeRecord.model_validate(record_data)
    channels = channels_of(record, len(record.seats))
    replay = _Replay(record, channels, traces, traced_agents)
    by_turn: dict[int, list[Any]] = {}
    for a in record.actions:
        by_turn.setdefault(a.turn, []).append(a)
    steps = [replay.start(), *(replay.step(turn, by_turn[turn]) for turn in sorted(by_turn))]
    _place_messages(steps, _messages(record))
    steps.append(_end(record, replay.words))
    return {
        "match": record.match,
        "run": record.run,
        "game": record.game,
        "params": record.params,
        "seed": record.seed,
        "crn_group": record.crn_group,
        "seats": record.seats,
        "channels": [c.model_dump() for c in channels],
        "reason": record.reason,
        "detail": record.detail,
        "returns": record.returns,
        "raw_returns": record.raw_returns,
        "steps": steps,
        "gaps": replay.gaps,
        "traced": len(traces),
    }


def _advance(
    state: State, moves: list[Any], phase: str, game_talk: bool, gaps: list[str], turn: int
) -> State | None:
    """Apply one turn's moves as the referee did; None (and a gap) when the rules refuse them."""
    try:
        if phase == "act":
            if any(m.action is None for m in moves):  # a forfeit: the match ended here
                return state
            state.apply({m.seat: m.action for m in moves})
        elif game_talk:
            texts = {m.seat: m.action for m in moves}
            state.apply({p: texts.get(p) or "" for p in state.current_players()})
    except Exception as exc:
        gaps.append(f"turn {turn}: the recorded moves could not be replayed ({exc})")
        return None
    return state


def _place_messages(steps: list[dict[str, Any]], messages: list[dict[str, Any]]) -> None:
    """Each message into the last step that began at or before it was delivered.

    The referee delivers a talk turn's messages right after that turn's last
    answer, before the next turn is sent, so the message belongs to the turn
    whose first record precedes it; free chat (``opens: always``) lands in the
    turn it arrived during.
    """
    turns = [s for s in steps if s["kind"] == "turn"]
    for msg in messages:
        home = steps[0]
        for s in turns:
            if s["t"] <= msg["t"]:
                home = s
            else:
                break
        home["messages"].append(msg)
        if msg["channel"] == TABLE:
            home["public"].append(f"{msg['sender']} (table): {msg['text']}")


def _end(record: EpisodeRecord, words: Words) -> dict[str, Any]:
    finals = record.final_observations
    lines = words.result(record)
    return {
        "kind": "end",
        "reason": record.reason,
        "detail": record.detail,
        "returns": record.returns,
        "raw_returns": record.raw_returns,
        "round_rewards": record.round_rewards,
        "timeouts": record.timeouts,
        "invalid_inputs": record.invalid_inputs,
        "lines": lines,
        "views": [
            {
                "seat": s,
                "asked": False,
                "observation": finals[s] if s < len(finals) else None,
                "rows": words.rows(finals[s] if s < len(finals) else None),
            }
            for s in range(len(record.seats))
        ],
        "messages": [],
        "public": [f"ended: {record.reason}; {lines[0]}"],
    }
