"""Measures over finished runs: numbers per game, PNG plots, rich tables.

``analyze_run(runs/<run>)`` reads the episodes.jsonl of the run's latest
directory (``runs/<run>/latest``: one run, never several together), measures every
game it finds (IPD, Split No-Comm, Trust-and-Split, beauty contest, Bertrand,
Kuhn poker against its CFR solutions)
and returns a JSON-able dict; ``render_tables`` turns that dict into tables for
the terminal. The measures themselves are pure functions over EpisodeRecord
dicts, in one module per family (``social``, ``beauty``, ``bertrand``, ``kuhn``),
each exporting its ``MEASURES`` (``analysis.measures.GameMeasures``: the measures
and the tables of each of its games); ``MEASURES`` here is all of them, and a
game without an entry (an OpenSpiel or PettingZoo game, one of your own) gets
``generic``'s: per-seat and per-agent means with standard errors, a coalition's
advantage, its channels.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rich.table import Table

from backroom.analysis import beauty, bertrand, generic, kuhn, social
from backroom.analysis.audit import audit_channels
from backroom.analysis.episodes import PLAYED, Episode, by_game, load_episodes, played
from backroom.analysis.measures import GameMeasures, cell
from backroom.analysis.oversight import oversight
from backroom.games.base import make_game, registered_games
from backroom.records import (
    count_fallbacks,
    has_fallback,
    record_moves,
    warning_lines,
)
from backroom.records import reasons as fallback_reasons
from backroom.runs import LATEST, resolve_run_dir

__all__ = ["MEASURES", "analyze_episodes", "analyze_run", "load_episodes", "notes", "render_tables"]

#: The modules that measure games; a new game's measures are one module named here.
GAME_MODULES = (social, beauty, bertrand, kuhn)
#: Game -> its measures and tables.
MEASURES: dict[str, GameMeasures] = {
    game: measures for module in GAME_MODULES for game, measures in module.MEASURES.items()
}
#: What a game without measures of its own gets (``analysis.generic``).
GENERIC = GameMeasures(generic.analyze, generic.tables)


def analyze_episodes(
    episodes: list[Episode],
    out_dir: Path | None = None,
    exclude_fallbacks: bool = False,
    one_game: bool = False,
) -> dict[str, Any]:
    """Measures per game; plots go to ``out_dir`` when given. Unknown games are only counted.

    Only played matches are measured (``played``): voided and failed ones are
    counted in ``outcomes`` and left out. ``fallbacks`` counts, per agent, the
    moves of the played matches that were not its own choice
    (``records``); with ``exclude_fallbacks`` the measures leave out
    every match holding one (``excluded_fallback_matches`` says how many).
    """
    games: dict[str, Any] = {}
    episodes, skipped = foreign_records(episodes, one_game)
    usable = played(episodes)
    fallbacks = count_fallbacks(m for e in usable for m in record_moves(e))
    measured = [e for e in usable if not has_fallback(e)] if exclude_fallbacks else usable
    outcomes: dict[str, int] = {}
    for e in episodes:
        reason = str(e.get("reason", "normal"))
        outcomes[reason] = outcomes.get(reason, 0) + 1
    for game, eps in sorted(by_game(measured).items()):
        games[game] = MEASURES.get(game, GENERIC).analyze(eps, out_dir)
    return {
        "episodes": len(episodes),
        "unplayed": len(episodes) - len(usable),
        "outcomes": dict(sorted(outcomes.items())),
        "voided": outcomes.get("voided", 0),
        "fallbacks": fallbacks,
        "fallback_warnings": warning_lines(fallbacks),
        "exclude_fallbacks": exclude_fallbacks,
        "excluded_fallback_matches": len(usable) - len(measured),
        "measured": len(measured),
        "skipped_records": skipped,
        "games": games,
        "oversight": {
            game: found
            for game, eps in sorted(by_game(measured).items())
            if (found := oversight(eps))
        },
        "channel_audits": {
            game: audit
            for game, eps in sorted(by_game(measured).items())
            if (audit := audit_channels(eps))
        },
    }


def foreign_records(
    episodes: list[Episode], one_game: bool = True
) -> tuple[list[Episode], dict[str, int]]:
    """The records that belong to the run, and how many were skipped, by why.

    A run plays one game, but its episodes.jsonl takes whatever a referee was
    asked to write there: a well-formed record of another game, or one whose
    seats do not fit its game, would crash the measures (``KeyError``,
    ``IndexError``). With ``one_game`` (a run's own directory) the run's game
    is the game of most records (the first one's on a tie) and records of any
    other game are skipped (``other_game``); a list of several runs' records
    keeps every game. Records whose seats or returns do not number the players
    their game and params make (``wrong_seats``; a game this version does not
    know is taken as it is). ``backroom analyze`` says how many.
    """
    skipped: Counter[str] = Counter()
    games = Counter(str(e.get("game")) for e in episodes)
    run_game = max(games, key=lambda g: games[g], default=None) if one_game else None
    players: dict[tuple[str, str], int | None] = {}  # (game, params) -> players (None: unknown)
    kept: list[Episode] = []
    for e in episodes:
        game = str(e.get("game"))
        if run_game is not None and game != run_game:
            skipped["other_game"] += 1
            continue
        params = e.get("params")
        key = repr(sorted(params.items())) if isinstance(params, dict) else repr(params)
        if (game, key) not in players:
            players[game, key] = _players(game, params)
        n = players[game, key]
        fields = (e.get("seats"), e.get("returns"), e.get("raw_returns"))
        if n is not None and not all(isinstance(x, list) and len(x) == n for x in fields):
            skipped["wrong_seats"] += 1
            continue
        kept.append(e)
    return kept, dict(sorted(skipped.items()))


def _players(game: str, params: object) -> int | None:
    """Players of ``game`` under ``params``: -1 when those params make no game, None when
    the game is unknown here (its records are taken as they are)."""
    if game not in registered_games():
        return None  # nothing to check its records against
    if not isinstance(params, dict):
        return -1
    try:
        return make_game(game, **params).num_players
    except Exception:  # any params a game's constructor refuses: no such game
        return -1


def analyze_run(
    run_dir: Path, out_dir: Path | None = None, exclude_fallbacks: bool = False
) -> dict[str, Any]:
    """Measure one run; PNGs go to ``out_dir`` (default ``<run_dir>/plots``).

    ``run_dir`` is a run's own directory (``runs/<run>/<UTC time>``), or
    ``runs/<run>``, which stands for the run ``runs/<run>/latest`` points to;
    the result's ``run_dir`` says which directory was read. A ``backroom
    train`` run directory (it has ``train_log.csv``) gets its training curves;
    its rollouts' episodes live in the store, not in a file.
    """
    run_dir = resolve_run_dir(run_dir)
    plots = Path(out_dir) if out_dir else run_dir / "plots"
    if (run_dir / "train_log.csv").exists():
        from backroom.analysis.training import analyze_training

        return {"run": run_dir.name, "training": analyze_training(run_dir, plots), "games": {}}
    stats: dict[str, int] = {}
    result = analyze_episodes(
        load_episodes(run_dir, stats), plots, exclude_fallbacks, one_game=True
    )
    # Skipped lines are said, not hidden: `backroom analyze` prints them.
    result["unreadable_lines"] = stats.get("unreadable_lines", 0)
    result["episodes_file"] = str(run_dir / "episodes.jsonl" if run_dir.is_dir() else run_dir)
    # Titles name the config's run, and the run directory when it is one of several.
    stamped = (run_dir.parent / LATEST).is_symlink()
    result["run"] = f"{run_dir.parent.name}/{run_dir.name}" if stamped else run_dir.name
    result["run_dir"] = str(run_dir)
    return result


def grounded_scores(run_dir: Path) -> dict[str, Any]:
    """The solver-grounded scores of a run's played matches, per game (``analysis.grounded``);
    a game the solvers do not hold is named with None."""
    from backroom.analysis.grounded import grounded

    eps = played(foreign_records(load_episodes(resolve_run_dir(run_dir)))[0])
    return {game: grounded(found) for game, found in sorted(by_game(eps).items())}


def render_tables(result: dict[str, Any]) -> list[Table]:
    """Rich tables of an ``analyze_run`` result, one or two per game."""
    tables: list[Table] = []
    run = result.get("run", "")
    if training := result.get("training"):
        tables.append(_training_table(run, training))
    for game, r in result.get("games", {}).items():
        tables.extend(MEASURES.get(game, GENERIC).tables(run, r))
    for game, audit in (result.get("channel_audits") or {}).items():
        tables.append(_audit_table(run, game, audit))
    for game, found in (result.get("oversight") or {}).items():
        tables.append(_oversight_table(run, game, found))
    for game, scores in (result.get("grounded") or {}).items():
        tables.extend(_grounded_tables(run, game, scores))
    counts = result.get("fallbacks") or {}
    if any(c["fallbacks"] for c in counts.values()):
        tables.append(_fallback_table(run, counts))
    return tables


def notes(result: dict[str, Any]) -> list[str]:
    """What the tables leave out, said under them: matches not measured (voided, failed,
    excluded for a fallback) and agents whose moves were often not their own choice."""
    if "training" in result:
        return []
    lines: list[str] = []
    if against := result.get("against"):
        lines.append(str(against["line"]))
    for game, scores in (result.get("grounded") or {}).items():
        if scores is None:
            lines.append(
                f"--grounded: no solver-grounded scores for {game} (the solvers hold no such game)"
            )
    outcomes = result.get("outcomes", {})
    total = result.get("episodes", 0)
    if unplayed := result.get("unplayed", 0):
        why = ", ".join(f"{n} {reason}" for reason, n in outcomes.items() if reason not in PLAYED)
        lines.append(
            f"left out: {unplayed} of {total} matches did not finish ({why or 'no final state'}); "
            "the measures are over the other "
            f"{total - unplayed}"
        )
    if skipped := result.get("skipped_records"):
        why = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in skipped.items())
        lines.append(
            f"skipped {sum(skipped.values())} records that are not this run's game's ({why}); "
            f"the counts above are over the other {total}"
        )
    lines.extend(result.get("fallback_warnings", []))
    if result.get("exclude_fallbacks"):
        excluded = result.get("excluded_fallback_matches", 0)
        lines.append(
            f"--exclude-fallbacks: left out {excluded} matches with a fallback; "
            f"the measures are over the other {result.get('measured', 0)}"
        )
    elif result.get("fallback_warnings"):
        lines.append("(backroom analyze --exclude-fallbacks measures without those matches)")
    return lines


def _fallback_table(run: str, counts: dict[str, Any]) -> Table:
    t = Table(title=f"{run} fallbacks: moves that were not the agent's own choice".strip())
    for col in ("agent", "moves", "fallbacks", "share", "by reason"):
        t.add_column(col, justify="left" if col in ("agent", "by reason") else "right")
    for agent, c in counts.items():
        t.add_row(
            agent, str(c["moves"]), str(c["fallbacks"]), f"{c['share']:.1%}", fallback_reasons(c)
        )
    return t


def _audit_table(run: str, game: str, audit: dict[str, Any]) -> Table:
    """What each channel told of its senders' secrets, in bits (``analysis.audit``)."""
    t = Table(title=f"{run} {game}: what each channel tells of its senders' secrets".strip())
    for col in (
        "channel",
        "secret",
        "messages",
        "H(secret)",
        "sent: bits (p)",
        "received: bits (p)",
    ):
        t.add_column(col, justify="left" if col in ("channel", "secret") else "right")
    for name, a in audit.items():
        sides = [
            f"{a[side]['bits']:.3f} ({cell(a[side]['p_value'])})" if a["messages"] else "-"
            for side in ("sent", "received")
        ]
        t.add_row(
            name,
            ", ".join(a["private_fields"]),
            str(a["messages"]),
            f"{a['secret_entropy_bits']:.3f}",
            *sides,
        )
    t.caption = "mutual information, plug-in, bits; p: permutation test over the secrets"
    return t


def _oversight_table(run: str, game: str, found: dict[str, Any]) -> Table:
    """Each overseer against who the coalition transform says colludes (``analysis.oversight``)."""
    t = Table(title=f"{run} {game}: overseers against the coalition".strip())
    for col in ("overseer", "threshold", "detection", "false alarms", "ROC area", "cases"):
        t.add_column(col, justify="left" if col == "overseer" else "right")
    for agent, o in found["overseers"].items():
        rate = [
            "-" if o[k] is None else f"{o[k]:.1%}" for k in ("detection_rate", "false_alarm_rate")
        ]
        cases = f"{o['colluder_cases']} colluding, {o['honest_cases']} not"
        t.add_row(agent, f"{o['threshold']:.2f}", *rate, cell(o["roc_area"]), cases)
    t.caption = "truth: the coalition the reward transform names (none named: nobody colludes)"
    return t


def _grounded_tables(run: str, game: str, scores: dict[str, Any] | None) -> list[Table]:
    """Exploitability, gains over the equilibrium, coalitions' gains (``analysis.grounded``)."""
    if scores is None:
        return []  # said in ``notes``
    tables = [_exploit_table(run, game, scores["exploitability"])]
    if scores["gains"]:
        tables.append(_gains_table(run, game, scores["gains"]))
    if scores["coalitions"]:
        tables.append(_coalitions_table(run, game, scores["coalitions"]))
    return tables


def _interval(ci: list[float] | None, sign: str = "") -> str:
    return f"[{ci[0]:{sign}.3f}, {ci[1]:{sign}.3f}]" if ci else "-"


def _exploit_table(run: str, game: str, rows: list[dict[str, Any]]) -> Table:
    t = _wide(f"{run} {game}: exploitability from each agent's decisions".strip())
    for col in ("agent", "exploitability", "95% interval", "states visited", "decisions"):
        t.add_column(col, justify="left" if col == "agent" else "right")
    for e in rows:
        shown = e["shown"] is not None
        t.add_row(
            e["agent"],
            f"{e['value']:.4f}" if shown else "n/a",
            _interval(e["ci"]) if shown else "-",
            f"{e['visited']} of {e['states']}",
            str(e["decisions"]),
        )
    t.caption = (
        "n/a below half the states visited (docs/league.md); backroom eval asks a policy exactly"
    )
    return t


def _gains_table(run: str, game: str, rows: list[dict[str, Any]]) -> Table:
    t = _wide(f"{run} {game}: gain over the equilibrium against the field met".strip())
    for col in ("agent", "gain", "95% interval", "equilibrium vs the field"):
        t.add_column(col, justify="left" if col == "agent" else "right")
    for r in rows:
        t.add_row(
            r["agent"],
            f"{r['gain']:+.4f}",
            _interval(r["ci"], "+"),
            f"{r['equilibrium_vs_field']:+.4f}",
        )
    return t


def _coalitions_table(run: str, game: str, rows: list[dict[str, Any]]) -> Table:
    t = _wide(f"{run} {game}: coalitions against the team game's value".strip())
    for col in ("coalition", "gain", "95% interval", "team value", "matches"):
        t.add_column(col, justify="left" if col == "coalition" else "right")
    for r in rows:
        value = ", ".join(f"{v:+.4f}" for v in r["team_values"].values())
        t.add_row(
            r["coalition"], f"{r['gain']:+.4f}", _interval(r["ci"], "+"), value, str(r["matches"])
        )
    return t


def _wide(title: str) -> Table:
    """A table at least as wide as its title: rich would wrap a long title into the columns."""
    return Table(title=title, min_width=len(title) + 4)


def _training_table(run: str, r: dict[str, Any]) -> Table:
    t = Table(title=f"{run}: {r['steps']} training steps")
    t.add_column("")
    for col in ("first step", "last step"):
        t.add_column(col, justify="right")
    first, last = r.get("first") or {}, r.get("last") or {}
    for key in [
        *sorted(k for k in last if k.startswith("reward_seat")),
        "cooperation_rate",
        "loss",
        "kl",
        "entropy",
    ]:
        t.add_row(key, cell(first.get(key)), cell(last.get(key)))
    if r["evaluations"]:
        final = r["evaluations"][-1]
        t.caption = f"evaluation after step {final['step']} ({final['version']}): " + "; ".join(
            f"vs {opp} {cell(v['learner'])}" for opp, v in final["against"].items()
        )
    return t
