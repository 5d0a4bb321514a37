"""Measures for the Keynesian beauty contest ("Shall We Team Up", Table 2 and Figure 2).

A "run" in the paper is one round of the game; here every round of every
episode is one run.

* cooperation rate: the share of runs whose discussion contains a proposal
  that players choose the same number (``proposes_common_choice``: a
  documented keyword heuristic, to be spot-checked against the transcripts);
* RSD: the relative standard deviation (population standard deviation over
  the mean) of a run's choices;
* winners per run;
* the choice distribution plot: choices per run as dots, 2/3 of the mean as a
  red point (the shape of the paper's Figure 2); players who chose the same
  number share a dot, sized by their count and labelled with it
  (``choice_points``, also in the result).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from backroom.analysis.episodes import Episode
from backroom.analysis.measures import GameMeasures, cell
from backroom.analysis.plotting import figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_SENTENCE = re.compile(r"[^.!?\n]+")
_COLLECTIVE = re.compile(
    r"\b(we|us|everyone|everybody|all of us|all players|every player|each of us|all)\b", re.I
)
_CHOOSE = re.compile(
    r"\b(choose|chose|choosing|pick|picking|select|selecting|go with|go for|guess|submit|"
    r"stick to|stick with|aim for|settle on|agree on)\b",
    re.I,
)
_NUMBER = re.compile(r"\b\d{1,3}\b")
_SHARED = re.compile(
    r"\b(same (number|choice|guess|value)|win together|all win|all be winners|everyone wins|"
    r"all become winners|share the (win|victory|reward))\b",
    re.I,
)


def proposes_common_choice(text: str) -> bool:
    """Does a message propose that players choose the same number?

    True when one sentence has a collective subject ("we", "everyone",
    "all of us") with a choosing verb and a number ("we should all choose 33"),
    or speaks of a shared choice or shared win ("the same number", "we can all
    be winners"). A first-person plan ("I will select 22") is not a proposal.
    The heuristic also counts negated or warning sentences ("if we all pick the
    same number nobody wins"), which the paper's Exclusive-rule reading treats
    as coordination talk too.
    """
    for sentence in _SENTENCE.findall(text or ""):
        if _SHARED.search(sentence):
            return True
        if _COLLECTIVE.search(sentence) and _CHOOSE.search(sentence) and _NUMBER.search(sentence):
            return True
    return False


def _discussions(ep: Episode, n_rounds: int) -> list[list[str]]:
    """Talk-phase messages of each round, from the action log (acts close a round)."""
    rounds: list[list[str]] = [[] for _ in range(n_rounds)]
    current, last_act_turn = 0, None
    for a in sorted(ep.get("actions", []), key=lambda a: (a["turn"], a.get("t", 0.0))):
        if a["phase"] == "act":
            if last_act_turn is not None and a["turn"] != last_act_turn:
                current += 1
            last_act_turn = a["turn"]
            continue
        if last_act_turn is not None:
            # The first talk after a round's choices opens the next round.
            current += 1
            last_act_turn = None
        if current < n_rounds and isinstance(a.get("action"), str) and a["action"]:
            rounds[current].append(a["action"])
    return rounds


def _rsd(choices: list[int]) -> float | None:
    mean = statistics.fmean(choices)
    sd = statistics.pstdev(choices)
    if mean == 0:
        return 0.0 if sd == 0 else None
    return sd / mean


def runs_of(ep: Episode) -> list[dict[str, Any]]:
    results = ep["final_observations"][0]["results"]
    talks = _discussions(ep, len(results))
    out = []
    for r, messages in zip(results, talks, strict=True):
        proposals = [m for m in messages if proposes_common_choice(m)]
        out.append(
            {
                "match": ep["match"],
                "round": r["round"],
                "choices": r["choices"],
                "target": r["target"],
                "winners": len(r["winners"]),
                "rsd": _rsd(r["choices"]),
                "messages": len(messages),
                "proposals": len(proposals),
                "cooperative": bool(proposals),
                "unanimous": len(set(r["choices"])) == 1,
            }
        )
    return out


def _setting(ep: Episode) -> str:
    p = ep.get("params", {})
    talk = "discussion" if p.get("discussion", True) else "no discussion"
    return f"{p.get('rule', 'amplified')}, {talk}"


def _setting_measures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's runs summed up: cooperation where they talked, spread, winners."""
    rsds = [r["rsd"] for r in runs if r["rsd"] is not None]
    with_talk = [r for r in runs if r["messages"]]
    return {
        "runs": len(runs),
        "cooperation_rate": (
            sum(r["cooperative"] for r in with_talk) / len(with_talk) if with_talk else None
        ),
        "mean_rsd": statistics.fmean(rsds) if rsds else None,
        "winners_per_run": [r["winners"] for r in runs],
        "mean_winners": statistics.fmean(r["winners"] for r in runs) if runs else None,
        "unanimous_runs": sum(r["unanimous"] for r in runs),
        "choice_points": choice_points(runs),
        "per_run": runs,
    }


def analyze(episodes: list[Episode], out_dir: Path | None = None) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ep in episodes:
        groups[_setting(ep)].extend(runs_of(ep))
    settings = {name: _setting_measures(runs) for name, runs in groups.items()}
    result: dict[str, Any] = {
        "game": "beauty_contest",
        "episodes": len(episodes),
        "settings": settings,
        "plots": [],
    }
    if out_dir is not None:
        for name, runs in groups.items():
            if runs:
                result["plots"].append(_plot(name, runs, out_dir))
    return result


#: Chosen numbers closer than this have their count labels in different slots.
LABEL_GAP = 5
#: Where a count label goes, in points from its dot (times 7), in order of preference.
SLOTS = (1, -1, 3, -3)


def choice_points(runs: list[dict[str, Any]]) -> list[dict[str, int]]:
    """The dots of the choice plot: one per distinct number of a run, with how many chose it.

    Players who chose the same number would be one dot drawn over itself; the
    count is what the plot shows of them (dot area, and the number beside the
    dot when more than one chose it). ``run`` counts from 1, as the x axis.
    """
    points = []
    for i, r in enumerate(runs, start=1):
        for choice, count in sorted(Counter(r["choices"]).items()):
            points.append({"run": i, "choice": choice, "count": count})
    return points


def choice_figure(name: str, runs: list[dict[str, Any]]) -> Figure:
    """Figure 2's shape: each run's choices (sized and labelled by count), 2/3 of the mean in red."""
    fig = figure(max(6.5, 0.6 * len(runs) + 2), 4.0)
    ax = fig.add_subplot()
    points = choice_points(runs)
    ax.scatter(
        [p["run"] for p in points],
        [p["choice"] for p in points],
        s=[18 + 14 * p["count"] for p in points],
        color="tab:blue",
        alpha=0.7,
        label="choices (× players, when several)",
    )
    last: dict[tuple[int, int], int] = {}  # (run, slot) -> the choice last labelled there
    for p in points:
        if p["count"] <= 1:
            continue
        # A label goes right of its dot; when a close number's label is there (0 and 1 each
        # chosen by several players), left of it, then further out on either side.
        slot = next(
            (k for k in SLOTS if p["choice"] - last.get((p["run"], k), -LABEL_GAP) >= LABEL_GAP),
            SLOTS[0],
        )
        last[(p["run"], slot)] = p["choice"]
        ax.annotate(
            f"×{p['count']}",
            (p["run"], p["choice"]),
            xytext=(7 * slot, 0),
            textcoords="offset points",
            ha="left" if slot > 0 else "right",
            va="center",
            fontsize="x-small",
        )
    ax.scatter(
        range(1, len(runs) + 1),
        [r["target"] for r in runs],
        color="red",
        marker="o",
        s=40,
        zorder=3,
        label="2/3 of the mean",
    )
    ax.set_xlabel("run")
    ax.set_ylabel("chosen number")
    ax.set_ylim(-3, 103)
    ax.set_xticks(range(1, len(runs) + 1))
    ax.set_xlim(0.4, len(runs) + 0.6)  # room for the count labels of the first and last runs
    ax.set_title(f"beauty contest choices ({name})")
    ax.legend(loc="upper right", fontsize="small")
    return fig


def _plot(name: str, runs: list[dict[str, Any]], out_dir: Path) -> str:
    return save(choice_figure(name, runs), out_dir, f"beauty_contest_{name}")


def tables(run: str, r: dict[str, Any]) -> list[Table]:
    """One row per setting (with or without talk, ...): cooperation, spread, winners."""
    t = Table(title=f"{run} beauty contest: {r['episodes']} episodes".strip())
    for col in ("setting", "runs", "cooperation rate", "mean RSD", "winners per run", "unanimous"):
        t.add_column(col)
    for name, s in r["settings"].items():
        t.add_row(
            name,
            str(s["runs"]),
            cell(s["cooperation_rate"]),
            cell(s["mean_rsd"]),
            " ".join(str(w) for w in s["winners_per_run"]),
            str(s["unanimous_runs"]),
        )
    return [t]


MEASURES = {"beauty_contest": GameMeasures(analyze, tables)}
