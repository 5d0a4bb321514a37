"""Ask an agent its policy at every information state of a small game: exact exploitability.

A league's empirical exploitability (``exploit.py``) is a best response to the
decisions an agent happened to make, with every state it never reached played
uniformly: the CFR equilibrium read 0.055 from 195 decisions in classic Kuhn
(its own policy: about 0). Where the policy can be *asked*, there is no need to
sample it. The game's tree is enumerated once (``solvers.tree.build_tree``);
at each information state the turn the referee would send there (observation,
prompt, legal actions: ``Turn``, taken from one history that reaches it) is put
to the agent, which answers with a probability for every legal action:

* ``random``: uniform over the legal choices;
* ``always``: all mass on what it plays (its ``act`` is deterministic);
* ``table`` and ``cfr``: the table's row, by the agent's own rules (a name or
  a JSON key; a state missing from the table, or an all-zero row, is uniform);
* ``local``: the model scores every legal action's reply as a completion of the
  prompt it would be given, and the policy is the softmax of those scores at
  the agent's temperature, the distribution its ``act`` samples from: one
  scoring call per information state, no sampling. Only the defaults of its
  memory options make the prompt a function of the information state alone
  (``recall``, ``plan_every``, a ``system``/``persona`` are fine; ``recall``
  and ``plan_every`` add the match's own history), and a game with talk makes
  the prompt depend on what was said: both are refused with the reason;
* any other kind that defines ``action_probabilities(turn) -> list[float]``
  (one probability per ``turn.legal["choices"]``): that function.

The rest (``llm`` over an API without log-probs, people, ``kuhn-team`` whose
play depends on its partner's messages) cannot be asked: ``policy_of`` says why
and the league keeps their empirical number. (A ``kuhn-team`` *pair*'s joint
policy can be, on the team game's tree: ``coalition.py``.) A league asks
``local`` models at its end only where its config says so (``exact_models``):
their processes have stopped, so each model is loaded once more, here.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from backroom.agents.base import Agent
from backroom.bus.wire import Turn
from backroom.games import make_game
from backroom.games.base import State

log = logging.getLogger("backroom.league")

#: Histories the exact evaluation enumerates at most (Kuhn classic: 58; Leduc: about 10^4).
MAX_NODES = 200_000
#: Kinds whose policy is a function of the turn alone, asked without a model.
SCRIPTED = ("random", "always", "table", "cfr")
#: Kinds whose policy a loaded model gives (``_local_policy``): asked at a league's end only
#: where its config says so (``exact_models``), since each model is loaded there once more.
MODELS = ("local",)

PolicyFn = Callable[[Turn], Awaitable[list[float]]]


class NotAskable(ValueError):
    """This agent's policy cannot be asked at an information state (the reason is the message)."""


@dataclass
class InfoStates:
    """A game's tree and, for each information-state key, the turn the referee would send."""

    tree: Any
    turns: dict[str, Turn]


def info_states(game_name: str, params: dict[str, Any], max_nodes: int = MAX_NODES) -> InfoStates:
    """Enumerate the game once, keeping one referee turn per information state."""
    from backroom.solvers.tree import build_tree

    turns: dict[str, Turn] = {}

    def capture(state: State, seat: int) -> str:
        key = state.information_state(seat)
        if key not in turns:
            turns[key] = Turn(
                match=f"eval-{len(turns)}",
                turn=0,
                seat=seat,
                phase="act",
                observation=state.observation(seat),
                prompt=state.prompt(seat),
                legal=state.action_spec(seat).to_json(),
                deadline_s=3600.0,
            )
        return ""

    game = make_game(game_name, **params)
    tree = build_tree(game, max_nodes=max_nodes, features=capture)
    return InfoStates(tree, turns)


def _table_row(agent: Any, turn: Turn) -> list[float]:
    legal = list(turn.legal.get("choices", []))
    names = turn.legal.get("names", [])
    probs = agent.table.get(str(turn.observation.get("info_state")))
    if not probs:
        return [1.0] * len(legal)
    weights = []
    for i, a in enumerate(legal):
        w = probs.get(json.dumps(a), probs.get(names[i], 0.0) if i < len(names) else 0.0)
        weights.append(max(0.0, float(w)))
    return weights if sum(weights) > 0 else [1.0] * len(legal)


def _local_policy(agent: Any) -> PolicyFn:
    from backroom.agents.parsing import answer_format, choice_names, legal_choices, render_choice
    from backroom.model.backend import softmax

    options = agent.prompts.options
    if options.recall or options.plan_every:
        raise NotAskable(
            f"{agent.id}: recall/plan_every put the match's history in the prompt, so the "
            "policy is not a function of the information state"
        )

    async def ask(turn: Turn) -> list[float]:
        mm = agent.match_memory(turn.match, turn)
        prompt_ids = agent.backend.encode_chat(agent.prompts.act_messages(mm, turn))
        choices = legal_choices(turn.legal)
        fmt = answer_format(turn.prompt)
        texts = [render_choice(n, fmt) for n in choice_names(turn.legal, choices)]
        cands = [agent.backend.completion_ids(t) for t in texts]
        adapter = agent.current[0]
        scored = await agent.backend.score(prompt_ids, cands, adapter)
        return list(softmax([s.total for s in scored], agent.temperature))

    return ask


def policy_of(agent: Agent) -> PolicyFn:
    """The agent's policy as a function of the turn; ``NotAskable`` says why there is none."""
    declared = getattr(agent, "action_probabilities", None)
    if callable(declared):

        async def call(turn: Turn) -> list[float]:
            out = declared(turn)
            return list(await out) if inspect.isawaitable(out) else list(out)

        return call
    kind = getattr(agent, "kind", type(agent).__name__)
    if kind == "random":

        async def uniform(turn: Turn) -> list[float]:
            return [1.0] * len(turn.legal.get("choices", []))

        return uniform
    if kind == "always":

        async def always(turn: Turn) -> list[float]:
            played = await agent.act(turn)
            return [1.0 if a == played else 0.0 for a in turn.legal.get("choices", [])]

        return always
    if kind in ("table", "cfr"):

        async def table(turn: Turn) -> list[float]:
            return _table_row(agent, turn)

        return table
    if kind == "local":
        return _local_policy(agent)
    raise NotAskable(
        f"{agent.id}: the {kind!r} kind declares no policy function (action_probabilities): "
        "its exploitability can only be estimated from its play"
    )


async def ask_policy(agent: Agent, states: InfoStates) -> dict[str, dict[str, float]]:
    """``{information state: {action JSON: probability}}`` at every state of the tree, asked once
    each (states of every seat: the agent's policy is played at every seat)."""
    ask = policy_of(agent)
    out: dict[str, dict[str, float]] = {}
    for key, turn in states.turns.items():
        choices = list(turn.legal.get("choices", []))
        if not choices:
            raise NotAskable(f"{agent.id}: {key!r} has no finite list of legal actions")
        weights = [max(0.0, float(w)) for w in await ask(turn)]
        total = sum(weights)
        if len(weights) != len(choices) or total <= 0:
            raise NotAskable(f"{agent.id}: its policy gave no distribution at {key!r}")
        out[key] = {json.dumps(a): w / total for a, w in zip(choices, weights, strict=True)}
    return out


@dataclass(frozen=True)
class Exact:
    """An agent's exact exploitability: its asked policy at every seat, against best responses."""

    agent: str
    value: float  # (sum_i BR_i - sum_i u_i) / n, OpenSpiel's exploitability for zero-sum games
    nash_conv: float
    states: int  # information states asked
    openspiel: float | None  # OpenSpiel's exploitability of the same table, where it has the game
    policy: dict[str, dict[str, float]]


def exact_exploitability(
    agent_id: str, policy: dict[str, dict[str, float]], states: InfoStates
) -> Exact:
    """Exploitability and NashConv of ``policy`` on the tree (and OpenSpiel's, where it has a twin)."""
    from backroom.solvers.evaluate import exploitability, nash_conv

    tree = states.tree
    sigma = tree.sigma_from_policy(policy)
    return Exact(
        agent_id,
        exploitability(tree, sigma),
        nash_conv(tree, sigma),
        len(policy),
        openspiel_exploitability(tree, sigma),
        policy,
    )


def openspiel_exploitability(tree: Any, sigma: Any) -> float | None:
    """OpenSpiel's ``exploitability`` of the same profile, for its own games and classic Kuhn;
    None where OpenSpiel is missing, has no twin of the game, or the game is not zero-sum."""
    try:
        from open_spiel.python.algorithms.exploitability import exploitability

        from backroom.solvers.openspiel_compat import openspiel_game, to_tabular_policy
    except ImportError:
        return None
    try:
        game = openspiel_game(tree)
        return float(exploitability(game, to_tabular_policy(tree, sigma, game)))
    except (ValueError, RuntimeError):  # no twin; OpenSpiel refuses a general-sum game
        return None


async def _ask_all(
    entrants: list[tuple[str, str, dict[str, Any]]], states: InfoStates
) -> dict[str, Exact]:
    from backroom.agents.kinds import make_agent

    out = {}
    for agent_id, kind, options in entrants:
        try:
            agent = make_agent(kind, agent_id, **options)
            await agent.setup()
            try:
                policy = await ask_policy(agent, states)
            finally:
                await agent.close()
        except (NotAskable, ValueError, TypeError, OSError) as e:
            # its empirical number stands; the league's end must not fail on one entrant
            log.warning("%s: policy not asked (%s); its exploitability is empirical", agent_id, e)
            continue
        out[agent_id] = exact_exploitability(agent_id, policy, states)
    return out


def exact_for(
    entrants: list[tuple[str, str, dict[str, Any]]], game_name: str, params: dict[str, Any]
) -> dict[str, Exact]:
    """Exact numbers for ``(id, kind, options)`` entrants, from synchronous code that may run
    inside an event loop (the league's): the agents are set up and asked on a loop of their
    own, in a worker thread (a ``cfr`` agent without a file solves in its setup). A game past
    ``MAX_NODES`` (``backroom eval``'s bound) asks no one: every number stays empirical."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from backroom.solvers.tree import TreeTooLargeError

    if not entrants:
        return {}
    try:  # the bound `backroom eval` refuses a game past (MAX_NODES histories)
        states = info_states(game_name, params)
    except TreeTooLargeError as e:
        log.warning("%s: too large to ask policies at every state (%s); empirical", game_name, e)
        return {}
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _ask_all(entrants, states)).result()


def exact_metagame(policies: dict[str, dict[str, dict[str, float]]], states: InfoStates) -> Any:
    """``M[i][j]``: agent i's expected return against j in a two-seat game, the mean of its two
    seats (both seat orders, as a league's CRN group plays them), from the tree: no matches."""
    import numpy as np

    tree = states.tree
    if tree.num_players != 2:
        raise ValueError("an exact meta-game needs a two-seat game")
    sigmas = [tree.sigma_from_policy(p) for p in policies.values()]
    n = len(sigmas)
    m = np.full((n, n), np.nan)
    for i in range(n):
        for j in range(n):
            m[i, j] = pair_value(tree, sigmas[i], sigmas[j])
    return m


def pair_value(tree: Any, mine: Any, theirs: Any) -> float:
    """The expected return of profile ``mine`` against ``theirs`` in a two-seat tree, the mean
    of its two seats (both seat orders, as a CRN group plays them)."""
    from backroom.solvers.evaluate import expected_seat_returns

    lo, hi = tree.player_bounds[0]
    first = theirs.copy()
    first[lo:hi] = mine[lo:hi]  # mine in seat 0
    second = mine.copy()
    second[lo:hi] = theirs[lo:hi]  # theirs in seat 0, mine in seat 1
    return float(
        (expected_seat_returns(tree, first)[0] + expected_seat_returns(tree, second)[1]) / 2
    )


#: CFR+ iterations behind the equilibrium the grounded scores compare with (Kuhn: ~1e-5).
EQUILIBRIUM_ITERATIONS = 10_000


def equilibrium(tree: Any) -> Any:
    """An approximate Nash equilibrium of a two-player zero-sum tree (CFR+'s average policy)."""
    from backroom.solvers.cfr import solve

    return solve(tree, EQUILIBRIUM_ITERATIONS, "cfr+").average
