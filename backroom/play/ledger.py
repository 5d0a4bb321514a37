"""What a run does when referees die, revive or answer late: the ``MatchLedger``.

A run asks for its matches, referees accept them, and one episode per match
comes back. In between, a referee can die with matches it accepted, come back
after it was given up, answer after the news of its death, stop and void its
matches, or finish a match whose episode reaches nobody. Each of those has a
rule (docs/operations.md, "Faults"), and each rule is a method here with the
rule in its docstring.

The ledger talks to no broker: it is told what arrived (``accepted``,
``episode``, ``referee_offline``, ...) and what time it is (``clock``), and
asks for matches through ``publish``. ``runner.wiring`` wires it to the bus
for ``backroom run`` and the league, ``trainer.batch`` for the trainer, and
``tests/test_dispatch.py`` drives it by hand, one rule a test.

Ids: a match keeps its own id for the run's result; each request goes out
under an *attempt* id, the match's own at first, then ``<id>.r<n>`` each time
it is asked for under a new id (agents drop a turn they answered before, by
match, turn and seat, so a rerun under the old id would time out).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from backroom.bus.wire import (
    ACCEPTED,
    FORGOTTEN,
    RUNNING,
    SHUTTING_DOWN,
    EpisodeRecord,
    Event,
    MatchRequest,
    WireError,
    parse_all,
)
from backroom.play.faults import Departure, Faults, clock_text, defaulted

#: Seconds a referee whose status says offline has to come back before the runner asks
#: again for the matches it accepted. Not at once: a broker shutting down sends every
#: client's will, and a referee that reconnects voids those matches itself (their
#: episodes say so); its reconnect backoff reaches 2 s (times 0.5 to 1.5), so it may
#: take 3 s once the broker is back. The time counts from the runner's own reconnect
#: at the latest. A referee process of the run's own that died is not waited for.
REFEREE_GRACE_S = 5.0
#: Times a match voided because its referee stopped is asked for again; then the void stands.
RERUNS = 3
#: Seconds an acknowledged match may go without its episode, or word from its referee,
#: before the runner asks again (``MatchRequest.again``): an episode published while the
#: runner's session was lost (a broker killed) reaches nobody. Its referee publishes the
#: episode again, or says it is still running the match.
EPISODE_WAIT_S = 10.0
#: Times such a match is asked again with no answer before it is asked for under a new
#: id (its referee no longer keeps the episode, or the asks reached other referees).
AGAIN_TRIES = 3


class MatchLedger:
    """Who was asked for what, who took it, who is gone, and what came back.

    ``publish`` sends a request (first asks, asks under a new id, resends and
    asks ``again``); ``notice`` hears what a user should hear (a referee lost
    or revived, an agent gone or back); ``faults`` gets the counts. ``clock``
    is ``time.monotonic`` (tests pass their own), ``wall`` the ``time.time``
    that departures are stamped with.
    """

    def __init__(
        self,
        match_ids: Iterable[str],
        publish: Callable[[MatchRequest], None],
        faults: Faults | None = None,
        notice: Callable[[str], None] | None = None,
        *,
        agents: Iterable[str] = (),
        on_timeout: str = "default",
        referee_grace_s: float = REFEREE_GRACE_S,
        episode_wait_s: float = EPISODE_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.match_ids = list(match_ids)
        self.publish = publish
        self.faults = faults if faults is not None else Faults()
        self.notice = notice or (lambda _msg: None)
        self.agents = set(agents)
        self.on_timeout = on_timeout
        self.referee_grace_s = referee_grace_s
        self.episode_wait_s = episode_wait_s
        self.clock = clock
        self.wall = wall
        #: Kept episodes, by the match's own id: the first that came back, under any attempt.
        self.episodes: dict[str, EpisodeRecord] = {}
        self.slot_of: dict[str, str] = {m: m for m in self.match_ids}  # attempt -> match
        self.current: dict[str, str] = {}  # match -> the attempt asked for last
        self.requests: dict[str, MatchRequest] = {}  # by attempt
        self.sent: dict[str, float] = {}  # attempt -> when asked; no acknowledgement yet
        self.first_asked: dict[str, float] = {}  # attempt -> when first asked
        self.owner: dict[str, str] = {}  # attempt -> the referee that accepted it (no episode yet)
        self.heard: dict[str, float] = {}  # accepted attempt -> its referee's last word
        self.unanswered: Counter[str] = Counter()  # accepted attempt -> silent asks again
        self.tries: Counter[str] = Counter()  # match -> attempts after the first
        self.voids: Counter[str] = Counter()  # match -> times voided because its referee stopped
        self.referees_up: set[str] = set()  # referees whose status says online
        self.referees_down: dict[str, float] = {}  # referee -> when its status said offline
        self.lost: dict[str, float] = {}  # referee given up on -> when it was
        self.away: dict[str, Departure] = {}  # agents of the run offline now
        #: Departures are reported only once play began (``start``).
        self.playing = False
        #: Why the run cannot go on (a referee could not write its file), or None.
        self.failure: str | None = None
        self._no_referee_since: float | None = None

    # --- asking -----------------------------------------------------------------------

    def ask(self, request: MatchRequest) -> None:
        """Ask for a match for the first time, under its own id."""
        self.requests[request.match] = request
        self.current[request.match] = request.match
        self._send(request.match)

    def restore(self, match: str, attempts: list[str], request: MatchRequest) -> None:
        """A resumed caller's earlier attempts at ``match`` (its own id first, as stored):
        their episodes still count as the match's, and the next new id follows the last.
        ``request`` is the last attempt's, current now; ``send`` asks for it again."""
        for attempt in attempts:
            self.slot_of[attempt] = match
        self.tries[match] = max(0, len(attempts) - 1)
        self.requests[request.match] = request
        self.current[match] = request.match

    def send(self, match: str) -> None:
        """Ask for ``match`` under its current attempt id (a resumed caller's resend)."""
        self._send(self.current[match])

    def _send(self, attempt: str) -> None:
        now = self.clock()
        self.sent[attempt] = now
        self.first_asked.setdefault(attempt, now)
        self.publish(self.requests[attempt])

    def ask_again(self, match: str, why: str) -> str:
        """Ask for ``match`` under a new attempt id (``<match>.r<n>``); the old attempt is forgotten.

        Forgotten means: its acknowledgement, owner and silence no longer
        count; its episode, should it come, is still the match's (the first
        episode under any attempt is kept). ``why`` is counted in
        ``Faults.rerequest_reasons``. Returns the new attempt id.
        """
        self.faults.rerequest_reasons[why] += 1
        self.tries[match] += 1
        old = self.current[match]
        attempt = f"{match}.r{self.tries[match]}"
        self.requests[attempt] = self.requests[old].model_copy(update={"match": attempt})
        self.current[match] = attempt
        self.slot_of[attempt] = match
        self.faults.reruns[attempt] = match
        self._forget(old)
        self._send(attempt)
        return attempt

    def _forget(self, attempt: str) -> None:
        self.sent.pop(attempt, None)
        self.owner.pop(attempt, None)
        self.heard.pop(attempt, None)

    def resend(self, ack_timeout_s: float) -> int:
        """Send again, under the same id, each request no referee acknowledged in ``ack_timeout_s``.

        A broker restart can drop a request. Safe: referees drop requests for
        matches they run or ran. With several referees, a request lost *after*
        one referee took it but before its acknowledgement got out could run
        twice (the first episode is kept). Counted in ``Faults.resubmitted``.
        """
        now = self.clock()
        resent = 0
        for attempt, at in list(self.sent.items()):
            if now - at > ack_timeout_s and self.slot_of[attempt] not in self.episodes:
                self.faults.resubmitted += 1
                self._send(attempt)
                resent += 1
        return resent

    def ask_silent_again(self) -> None:
        """Ask again (``MatchRequest.again``) for accepted matches silent ``episode_wait_s``.

        An episode published while the runner's session was lost reaches
        nobody. Its referee publishes the episode again, says ``running``
        (``running``), or says ``forgotten`` (``forgotten``: asked under a new
        id at once). An ask reaches one referee of the shared group, not
        always the owner, which alone answers: so only after ``AGAIN_TRIES``
        silent asks per live referee is the match asked for under a new id,
        ``no episode``. Counting per referee kept a long match under two
        referees from running twice while it was still playing. Call it only
        while connected: an ask sent to no broker is no ask.
        """
        now = self.clock()
        limit = AGAIN_TRIES * max(1, len(self.live_referees))
        for attempt in list(self.owner):
            if now - self.heard.get(attempt, now) < self.episode_wait_s:
                continue
            match = self.slot_of[attempt]
            if self.unanswered[attempt] >= limit:
                if self.current[match] == attempt:
                    self.ask_again(match, "no episode")
                continue
            self.unanswered[attempt] += 1
            self.heard[attempt] = now
            self.faults.asked_again += 1
            self.publish(self.requests[attempt].model_copy(update={"again": True}))

    # --- what referees answer -----------------------------------------------------

    def acknowledged(self, attempt: str) -> None:
        """Any word of a referee on ``attempt`` in the runner's inbox: it need not be resent."""
        self.sent.pop(attempt, None)

    def accepted(self, attempt: str, referee: str) -> None:
        """``referee`` took ``attempt``: it owns the match until its episode comes.

        Only the match's current attempt counts, and only while it has no
        episode. The causality rule: a referee given up (``lose``) that takes
        a request first sent *after* it was given up is alive after all
        (``revive``), and owns it. One that takes a request sent *before* may
        have done so before it died, its acknowledgement trailing the news of
        its death: that match is asked for again, ``accepted by a lost
        referee``.
        """
        self.acknowledged(attempt)
        match = self.slot_of.get(attempt)
        if match is None or match in self.episodes or self.current.get(match) != attempt:
            return
        if referee in self.lost and self.first_asked[attempt] > self.lost[referee]:
            self.revive(referee, attempt)
        if referee in self.lost:
            self.ask_again(match, "accepted by a lost referee")
        else:
            self.owner[attempt] = referee
            self.heard[attempt] = self.clock()

    def running(self, attempt: str) -> None:
        """Its owner says it still plays ``attempt`` (asked ``again``): the silence starts over."""
        self.acknowledged(attempt)
        if attempt in self.owner:
            self.heard[attempt] = self.clock()
            self.unanswered.pop(attempt, None)

    def forgotten(self, attempt: str) -> None:
        """Its owner finished ``attempt`` and no longer keeps the episode: ask under a new id now."""
        self.acknowledged(attempt)
        match = self.slot_of.get(attempt, "")
        if (
            attempt in self.owner
            and self.current.get(match) == attempt
            and match not in self.episodes
        ):
            self.ask_again(match, "no episode")

    def episode(self, record: EpisodeRecord) -> bool:
        """An episode arrived; True when it is the first of its match (kept).

        Later ones, under any attempt id, are counted (``Faults.duplicates``).
        A match voided because its referee stopped (``SHUTTING_DOWN``) is no
        result: it is asked for again, up to ``RERUNS`` times, then the void
        stands. An ``error`` episode saying the referee could not write the
        run's file is kept and sets ``failure``: every later match would go
        the same way. An episode of another run is ignored (False).
        """
        match = self.slot_of.get(record.match)
        if match is None:
            return False
        self.owner.pop(record.match, None)
        self.heard.pop(record.match, None)
        if match in self.episodes:
            self.faults.duplicates += 1  # a redelivery, or a match asked for again that ran twice
            return False
        stopped = record.reason == "voided" and record.detail == SHUTTING_DOWN
        if stopped and self.voids[match] < RERUNS:
            self.voids[match] += 1
            if record.match == self.current.get(match):  # not asked for again already
                self.ask_again(match, "voided")
            return False
        if record.not_written:
            self.failure = (
                f"referee {record.referee} could not write match {match}: {record.detail}"
            )
        self.episodes[match] = record
        self.sent.pop(record.match, None)
        self.sent.pop(self.current.get(match, match), None)
        return True

    @property
    def done(self) -> bool:
        """Every match has its episode, or the run cannot go on (``failure``)."""
        return self.failure is not None or len(self.episodes) == len(self.match_ids)

    # --- referees ------------------------------------------------------------------

    @property
    def live_referees(self) -> set[str]:
        """Referees online and not given up."""
        return self.referees_up - self.lost.keys()

    def referee_online(self, referee: str) -> None:
        """Its status says online: it counts, its grace stops, and it is no longer lost.

        Back from lost, what it takes from now on is its own again; what it
        had was asked for elsewhere when it was lost.
        """
        self.referees_up.add(referee)
        self.referees_down.pop(referee, None)
        self.lost.pop(referee, None)

    def referee_offline(self, referee: str) -> None:
        """Its status says offline: its grace (``referee_grace_s``) starts, if the run knew it.

        Only a referee this run counted on, or one that owns a match: a shared
        broker keeps the retained ``offline`` of every referee that ever ran
        there, other runs' included.
        """
        if referee in self.referees_up or referee in self.owner.values():
            self.referees_up.discard(referee)
            self.referees_down.setdefault(referee, self.clock())

    def reconnected(self) -> None:
        """The runner is back on the broker: every referee's grace starts over.

        A broker that goes down sends everyone's will, and referees can say
        ``online`` again only once it is back. A broker restarting again and
        again (the chaos soak) kept the runner away longer than the grace, and
        it gave up referees that were fine.
        """
        now = self.clock()
        for referee in self.referees_down:
            self.referees_down[referee] = now

    def expire(self, connected: bool) -> None:
        """Lose each referee offline for ``referee_grace_s``; the grace runs only while connected.

        Disconnected, the runner sees no status, so no one's grace runs: each
        starts over (as in ``reconnected``).
        """
        if not connected:
            self.reconnected()
            return
        now = self.clock()
        for referee, since in list(self.referees_down.items()):
            if now - since >= self.referee_grace_s:
                self.lose(referee, f"offline for {self.referee_grace_s:.0f}s")

    def lose(self, referee: str, why: str) -> list[str]:
        """Give ``referee`` up: ask again, under new ids, for every match it accepted and did not finish.

        At once for a referee process of the run's own that died; after the
        grace (``expire``) for one whose status says offline. Said once per
        loss (``referee X is gone (why); asked again for its N unfinished
        matches``) and listed in ``Faults.referees_lost``. Returns the
        matches asked for again.
        """
        if referee in self.lost:
            return []
        self.lost[referee] = self.clock()
        self.referees_up.discard(referee)
        self.referees_down.pop(referee, None)
        self.faults.referees_lost.append(referee)
        mine = [a for a, r in self.owner.items() if r == referee]
        again = []
        for attempt in mine:
            del self.owner[attempt]
            match = self.slot_of[attempt]
            if self.current[match] == attempt:
                self.ask_again(match, "referee lost")
                again.append(match)
        n = len(mine)
        told = f"asked again for its {n} unfinished match{'' if n == 1 else 'es'}"
        self.notice(
            f"referee {referee} is gone ({why}); {told if mine else 'it had no unfinished matches'}"
        )
        return again

    def revive(self, referee: str, attempt: str) -> None:
        """``referee``, given up, took a request sent after that: it is alive, count on it.

        A live referee can be given up: after a broker restart a stale
        ``offline`` of it can arrive after its fresh ``online`` (the runner's
        session hands over what it queued), and a referee announces itself
        only when it connects. Given up for good, every match it went on
        taking was asked for again and ran twice: 2,403 requests for 1,266 of
        20,000 matches in one chaos soak. Listed in ``Faults.referees_revived``.
        """
        self.referee_online(referee)
        self.faults.referees_revived.append(referee)
        self.notice(f"referee {referee} is alive after all (it took {attempt}): counted on again")

    def without_referee(self) -> float | None:
        """Seconds the run has had no live referee (0 at the first call that finds none), or None.

        The caller fails the run past its limit. The first call without one
        says so (``no referee is online``); a live referee resets it.
        """
        if self.live_referees:
            self._no_referee_since = None
            return None
        now = self.clock()
        if self._no_referee_since is None:
            self._no_referee_since = now
        return now - self._no_referee_since

    @property
    def unfinished(self) -> int:
        """Matches without an episode yet."""
        return len(self.match_ids) - len(self.episodes)

    # --- agents ------------------------------------------------------------------------

    def agent_status(self, agent: str, online: bool) -> None:
        """An agent of the run went offline or came back while the run plays: say so now.

        Its seats play the timeout default meanwhile (the referee's doing);
        ``Faults.departures`` keeps when it went and came back, and ``result``
        counts the matches it was defaulted in.
        """
        if not self.playing or agent not in self.agents:
            return
        if not online and agent not in self.away:
            self.away[agent] = departure = Departure(agent, self.wall())
            self.faults.departures.append(departure)
            self.notice(
                f"agent {agent} went offline at {clock_text(departure.at)}: its seats get the "
                f"timeout default ({self.on_timeout}) until it is back"
            )
        elif online and agent in self.away:
            departure = self.away.pop(agent)
            departure.back_at = self.wall()
            self.notice(f"agent {agent} is back online at {clock_text(departure.back_at)}")

    def result(self) -> list[EpisodeRecord]:
        """The kept episodes in the run's order; each departure's defaulted matches counted and said."""
        kept = [self.episodes[m] for m in self.match_ids if m in self.episodes]
        for departure in self.faults.departures:
            departure.defaulted = defaulted(kept, departure)
            self.notice(departure.line())
        return kept


def feed_acks(ledger: MatchLedger, payload: bytes) -> None:
    """What referees answer in a requester's inbox, told to its ledger (the runner's, the trainer's)."""
    for msg in parse_all(payload):
        if isinstance(msg, WireError) or not msg.match:
            continue
        if not isinstance(msg, Event):
            ledger.acknowledged(msg.match)
        elif msg.kind == ACCEPTED:
            ledger.accepted(msg.match, _referee_identity(msg.data))
        elif msg.kind == RUNNING:
            ledger.running(msg.match)
        elif msg.kind == FORGOTTEN:
            ledger.forgotten(msg.match)
        else:
            ledger.acknowledged(msg.match)


def _referee_identity(data: dict[str, object]) -> str:
    """The identity of the referee that sent an ``accepted`` event: its status topic's name."""
    identity = data.get("identity")
    if isinstance(identity, str):
        return identity
    referee = str(data.get("referee", ""))  # a referee before "identity": "<name>@<host>:<pid>"
    return referee.split("@", 1)[0]
