"""What an OpenSpiel game may cost before backroom builds it: time, size and files.

OpenSpiel builds a game in C++ that holds the GIL and cannot be interrupted:
``blotto(coins=1000, fields=10)`` enumerates every split of the coins and never
returns, and takes the referee (or ``backroom run``, or ``analyze`` of a record
naming it) with it. Its parameters arrive from match requests, start messages
and records, which anyone on the bus, or anyone who sent a file, may write. So
before a game is built in a process that matters, it is vetted:

* **Files**: a parameter that names a file (``efg_game``'s ``filename``,
  ``bargaining``'s ``instances_file``, ...) is refused unless the operator
  allowed that very file for this process (:func:`allow_file`: a run config may
  name one beside it; ``backroom run`` passes the list on in
  ``BACKROOM_OPENSPIEL_FILES`` to the processes it starts). A record or a
  request cannot make a reader read ``/etc/passwd`` into an observation.
* **Estimates** (``ESTIMATES``): where OpenSpiel's constructor enumerates the
  actions, their number is worked out from the parameters and a game past
  ``MAX_ACTIONS`` is refused at once, without building anything.
* **A probe**: any other parameters than the game's defaults are built first in
  a child process (:func:`vet`), killed at ``MAX_BUILD_S``, which also plays a
  few seeded moves and refuses a state whose legal actions or observations take
  over ``MAX_STEP_S`` or are past ``MAX_ACTIONS`` / ``MAX_TEXT``. Only a game the
  probe passed is built here; verdicts are kept per process, so a run of 200
  matches of one game probes it once. The defaults of every game the adapter
  seats build in under a second, so they are not probed.

Every refusal names the bound it broke, in one line.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

#: A game that does not build (with a first state) in this long is refused. Short: a game
#: the probe passes is then built in the process that asked (the referee, a browser's
#: server, an agent), in C++ that holds the GIL, so a longer build would stall that
#: process's every match (a referee stalled for long loses its broker connection). Each
#: process builds a game once (``openspiel.load``'s cache).
MAX_BUILD_S = 2.0
#: A state's legal actions, or one observation of it, taking longer than this: refused.
MAX_STEP_S = 1.0
#: Distinct actions of a game, or legal actions of a state, at most (a turn lists them all).
MAX_ACTIONS = 100_000
#: Characters of an observation or information-state string at most (a turn carries it).
MAX_TEXT = 1_000_000
#: Moves of the probe's seeded playout after the first state.
PROBE_MOVES = 12
#: Seconds the probe's process may take to start (Python and pyspiel) beyond ``MAX_BUILD_S``.
PROBE_START_S = 5.0
#: Environment variable: files OpenSpiel games may read here, ``os.pathsep``-separated.
FILES_ENV = "BACKROOM_OPENSPIEL_FILES"
#: Games that are only a file's contents: refused without an allowed file.
FILE_GAMES = ("efg_game", "nfg_game")
#: Parameters that name a file or a folder to read.
FILE_PARAM = re.compile(r"file|path|root|dir", re.IGNORECASE)

#: Distinct actions of a game whose constructor enumerates them, from its parameters
#: (defaults filled in): Blotto's actions are the splits of ``coins`` over ``fields``.
ESTIMATES: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "blotto": lambda p: math.comb(int(p["coins"]) + int(p["fields"]) - 1, int(p["fields"]) - 1),
}

_allowed: set[str] = set()
#: Verdicts by (name, params): None when the game passed, else why it is refused.
_verdicts: dict[str, str | None] = {}
_MAX_VERDICTS = 1024


def allow_file(path: str | Path) -> str:
    """Let OpenSpiel games read ``path`` here and in the processes started from here.

    For the operator's own configuration only (a run config naming a file beside it);
    returns the absolute path the game's parameter must then hold.
    """
    absolute = str(Path(path).resolve())
    _allowed.add(absolute)
    os.environ[FILES_ENV] = os.pathsep.join(sorted(allowed_files()))
    return absolute


def allowed_files() -> set[str]:
    """The files the operator allowed for this process (``allow_file``, ``FILES_ENV``)."""
    inherited = [p for p in os.environ.get(FILES_ENV, "").split(os.pathsep) if p]
    return _allowed | set(inherited)


def files_beside(params: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """``params`` with each file parameter naming a file in ``folder`` (a run config's own),
    as its absolute path, allowed here (``allow_file``); ``ValueError`` for any other file."""
    out = dict(params)
    for key, value in params.items():
        if not (isinstance(value, str) and value and FILE_PARAM.search(key)):
            continue
        target = (folder / value).resolve()
        if target.parent != folder or not target.is_file():
            raise ValueError(
                f"params.{key}: {value!r} is not a file beside the config ({folder}); "
                "an OpenSpiel game reads only such a file"
            )
        out[key] = allow_file(target)
    return out


def file_params(spec: Mapping[str, Any]) -> list[str]:
    """The parameters of a game (its ``parameter_specification``) that name a file."""
    return [k for k, v in spec.items() if isinstance(v, str) and FILE_PARAM.search(k)]


def precheck(name: str, spec: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """The checks that need no building: files, and the estimated size. ``ValueError`` says why."""
    allowed = allowed_files()
    for key in file_params(spec):
        value = params.get(key, spec[key])
        if value in allowed or not (value or name in FILE_GAMES):
            continue
        raise ValueError(
            f"OpenSpiel game {name}: parameter {key!r} names a file ({value!r:.80}); a game "
            "reads only a file its operator allowed: a run config may name one beside it"
        )
    estimate = ESTIMATES.get(name)
    if estimate is not None:
        actions = estimate({**spec, **params})
        if actions > MAX_ACTIONS:
            raise ValueError(
                f"OpenSpiel game {name} {dict(params)} has {actions:.3g} distinct actions, "
                f"over the bound of {MAX_ACTIONS:,} (MAX_ACTIONS): refused before building"
            )


def verdict_key(name: str, params: Mapping[str, Any]) -> str:
    """What a verdict is kept under: the game and its typed parameters."""
    return json.dumps([name, params], sort_keys=True, default=str)


def probe_command(
    name: str, spec: Mapping[str, Any], params: Mapping[str, Any]
) -> list[str] | None:
    """The child process that vets ``name(params)``; None when nothing needs probing.

    Defaults need none, and a verdict kept from an earlier probe is reused (a refusal
    raised again as ``ValueError``).
    """
    if all(spec.get(k) == v for k, v in params.items()):
        return None
    key = verdict_key(name, params)
    if key in _verdicts:
        if (why := _verdicts[key]) is not None:
            raise ValueError(why)
        return None
    root = str(Path(__file__).resolve().parents[2])
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from backroom.games.openspiel_bounds import main; main()"
    )
    return [sys.executable, "-c", code, json.dumps({"name": name, "params": dict(params)})]


def judge(
    name: str, params: Mapping[str, Any], returncode: int | None, stdout: bytes, stderr: bytes
) -> None:
    """Keep the probe's verdict (``returncode`` None: killed at the bound); raise if refused."""
    said = f"OpenSpiel game {name} {dict(params)}"
    why: str | None
    if returncode is None:
        why = f"{said} did not build within {MAX_BUILD_S:g} s (MAX_BUILD_S): refused"
    else:
        try:
            verdict = json.loads(stdout.decode(errors="replace").strip().splitlines()[-1])
            why = None if verdict.get("ok") else f"{said}: {verdict.get('refused')}"
        except (ValueError, IndexError, AttributeError):
            lines = stderr.decode(errors="replace").strip().splitlines() or ["no output"]
            why = f"OpenSpiel refused {name} {dict(params)}: {lines[-1][:300]}"
    if len(_verdicts) >= _MAX_VERDICTS:
        _verdicts.pop(next(iter(_verdicts)))
    _verdicts[verdict_key(name, params)] = why
    if why is not None:
        raise ValueError(why)


def vet(name: str, spec: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """Refuse ``name(params)`` (``ValueError`` naming the bound) unless it is safe to build here."""
    precheck(name, spec, params)
    command = probe_command(name, spec, params)
    if command is None:
        return
    try:
        done = subprocess.run(
            command, capture_output=True, timeout=MAX_BUILD_S + PROBE_START_S, check=False
        )
    except subprocess.TimeoutExpired:
        judge(name, params, None, b"", b"")
        return
    judge(name, params, done.returncode, done.stdout, done.stderr)


# --- the probe's own process -----------------------------------------------------------


def _timed(what: str, call: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = call()
    took = time.perf_counter() - start
    if took > MAX_STEP_S:
        raise _Refused(f"{what} took {took:.1f} s, over the bound of {MAX_STEP_S:g} s (MAX_STEP_S)")
    if isinstance(out, str) and len(out) > MAX_TEXT:
        raise _Refused(
            f"{what} is {len(out):,} characters, over the bound of {MAX_TEXT:,} (MAX_TEXT)"
        )
    if isinstance(out, list) and len(out) > MAX_ACTIONS:
        raise _Refused(f"{what}: {len(out):,}, over the bound of {MAX_ACTIONS:,} (MAX_ACTIONS)")
    return out


class _Refused(Exception):
    """A bound the probed game broke; the message names it."""


def _look(state: Any, game: Any, rng: random.Random) -> Any:
    """Everything a turn reads of ``state``, each timed and sized; the next action, if any."""
    gtype = game.get_type()
    for player in range(game.num_players()):
        if gtype.provides_observation_string:
            _timed("an observation", partial(state.observation_string, player))
        if gtype.provides_information_state_string:
            _timed("an information state", partial(state.information_state_string, player))
    if state.is_chance_node():
        outcomes = _timed("a chance node's outcomes", state.chance_outcomes)
        return rng.choice(outcomes)[0]
    if state.is_simultaneous_node():
        return [
            rng.choice(_timed("a state's legal actions", partial(state.legal_actions, p)))
            for p in range(game.num_players())
        ]
    player = state.current_player()
    legal = _timed("a state's legal actions", lambda: state.legal_actions(player))
    _timed("a state's action names", lambda: [state.action_to_string(player, a) for a in legal])
    return rng.choice(legal)


def probe(name: str, params: Mapping[str, Any]) -> str | None:
    """Build ``name(params)`` and play a few seeded moves: None, or the bound it broke."""
    import pyspiel

    try:
        start = time.perf_counter()
        game = pyspiel.load_game(name, dict(params))
        actions = game.num_distinct_actions()
        if actions > MAX_ACTIONS:
            return f"{actions:,} distinct actions, over the bound of {MAX_ACTIONS:,} (MAX_ACTIONS)"
        state = game.new_initial_state()
        if (took := time.perf_counter() - start) > MAX_BUILD_S:
            return f"it builds in {took:.1f} s, over the bound of {MAX_BUILD_S:g} s (MAX_BUILD_S)"
        rng = random.Random(0)
        for _ in range(PROBE_MOVES + 1):
            if state.is_terminal():
                break
            action = _look(state, game, rng)
            if isinstance(action, list):
                state.apply_actions(action)
            else:
                state.apply_action(action)
    except _Refused as exc:
        return str(exc)
    except Exception as exc:  # pyspiel's SpielError / RuntimeError: the game's own refusal
        return f"OpenSpiel refused it: {str(exc).strip().splitlines()[-1][:300]}"
    return None


def main() -> None:
    """The probe process: read ``{name, params}`` from argv, print its verdict as JSON."""
    asked = json.loads(sys.argv[1])
    why = probe(asked["name"], asked["params"])
    print(json.dumps({"ok": why is None, "refused": why}))
