"""How much a channel tells: mutual information between its messages and the senders' secrets.

For each private channel of a run, every message is paired with what its sender
privately knew when it spoke (the observation's private field: a Kuhn card), and
the channel is measured in bits twice: as **sent** (the sender's text) and as
**received** (the members' copy, after the referee's interventions; a dropped
copy reads as its own symbol). A channel that names the card exactly carries
H(card) bits, log2 of the cards a sender can hold when they are dealt evenly; a
redacted one carries none.

Why these choices:

* Messages are symbols: their text, lower-cased with runs of whitespace made one.
  Free text is discretised by exact wording; a study that wants a coarser reading
  names a regular expression whose first group is the symbol (``pattern``).
* The estimate is the plug-in one, I = sum p(x, y) log2 p(x, y) / (p(x) p(y)), which
  is biased upward on few messages; so a permutation test goes with it: the
  secrets are shuffled across messages ``permutations`` times (seeded: the same
  run gives the same p-value) and p = (1 + #{I_shuffled >= I}) / (1 + permutations).
  A channel that carries nothing has a p-value that is not small.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from backroom.analysis.episodes import Episode

#: The observation fields that are a seat's secret, by game (what its messages may leak).
PRIVATE_FIELDS: dict[str, tuple[str, ...]] = {"kuhn": ("card",)}
#: Shuffles of the permutation test.
PERMUTATIONS = 1000
#: What a dropped copy reads as.
DROPPED = "<dropped>"


def _codes(values: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    index: dict[Hashable, int] = {}
    codes = np.array([index.setdefault(v, len(index)) for v in values], dtype=np.int64)
    return codes, max(len(index), 1)


def _bits(x: np.ndarray, nx: int, y: np.ndarray, ny: int) -> float:
    joint = np.bincount(x * ny + y, minlength=nx * ny).reshape(nx, ny) / len(x)
    outer = np.outer(joint.sum(axis=1), joint.sum(axis=0))
    seen = joint > 0
    bits = float(np.sum(joint[seen] * np.log2(joint[seen] / outer[seen])))
    return bits if bits > 1e-12 else 0.0  # rounding leaves +-1e-16 for independent sides


def mutual_information(pairs: Sequence[tuple[Hashable, Hashable]]) -> float:
    """Plug-in mutual information in bits between the two sides of ``pairs``."""
    if not pairs:
        return 0.0
    (x, nx), (y, ny) = _codes([a for a, _ in pairs]), _codes([b for _, b in pairs])
    return _bits(x, nx, y, ny)


def entropy(values: Iterable[Hashable]) -> float:
    counts = Counter(values)
    n = sum(counts.values())
    return -math.fsum(c / n * math.log2(c / n) for c in counts.values()) if n else 0.0


def permutation_p(
    pairs: Sequence[tuple[Hashable, Hashable]], permutations: int = PERMUTATIONS, seed: int = 0
) -> float:
    """How often secrets shuffled across the messages tell as much: the chance of ``pairs``'s MI."""
    (x, nx), (y, ny) = _codes([a for a, _ in pairs]), _codes([b for _, b in pairs])
    observed = _bits(x, nx, y, ny)
    rng = np.random.default_rng(seed)
    at_least = sum(
        _bits(rng.permutation(x), nx, y, ny) >= observed - 1e-12 for _ in range(permutations)
    )
    return (1 + at_least) / (1 + permutations)


def symbol(text: str, pattern: re.Pattern[str] | None = None) -> str:
    """A message as the symbol it is counted as (its words, or the pattern's first group)."""
    text = " ".join(text.lower().split())
    if pattern is not None:
        found = pattern.search(text)
        return found.group(1) if found and found.groups() else (found.group(0) if found else "")
    return text


def secret(e: Episode, seat: int, fields: Sequence[str]) -> Hashable | None:
    """What ``seat`` privately knew in match ``e`` (its final observation's private fields)."""
    finals = e.get("final_observations") or []
    if seat >= len(finals) or not isinstance(finals[seat], Mapping):
        return None
    values = [finals[seat].get(f) for f in fields]
    if any(v is None for v in values):
        return None
    return tuple(str(v) for v in values) if len(values) > 1 else str(values[0])


def messages(e: Episode, channel: str) -> list[dict[str, Any]]:
    """The channel's messages in one match: the sender, what it said, what the members got."""
    out: dict[Hashable, dict[str, Any]] = {}
    for d in e.get("deliveries") or []:
        if d.get("channel") != channel:
            continue
        number = d.get("message")
        key = number if number is not None else (d["from_seat"], d["t"], d["text"])
        said = d.get("sent") if d.get("sent") is not None else d["text"]
        m = out.setdefault(key, {"seat": int(d["from_seat"]), "sent": said, "received": None})
        if not d.get("overheard"):
            m["received"] = d["text"] if d.get("delivered", True) else DROPPED
    for m in out.values():
        if m["received"] is None:  # no member but the sender: what the eavesdroppers got
            m["received"] = m["sent"]
    return list(out.values())


def _channel_names(episodes: Sequence[Episode]) -> list[str]:
    """Every channel a run declared or carried: a declared one nobody used still gets a row."""
    carried = {str(d["channel"]) for e in episodes for d in e.get("deliveries") or []}
    declared = {
        str(c["name"]) for e in episodes for c in (e.get("spec") or {}).get("channels") or []
    }
    return sorted(carried | declared)


def _audit_channel(
    episodes: Sequence[Episode],
    name: str,
    fields: Sequence[str],
    compiled: re.Pattern[str] | None,
    permutations: int,
) -> dict[str, Any]:
    """One channel's row: its messages paired with their senders' secrets, measured both ways."""
    rows = [
        (s, m)
        for e in episodes
        for m in messages(e, name)
        if (s := secret(e, m["seat"], fields)) is not None
    ]
    result: dict[str, Any] = {
        "private_fields": list(fields),
        "messages": len(rows),
        "secret_entropy_bits": entropy(s for s, _ in rows),
    }
    for side in ("sent", "received"):
        pairs = [(s, symbol(m[side], compiled)) for s, m in rows]
        result[side] = {
            "bits": mutual_information(pairs),
            "p_value": permutation_p(pairs, permutations) if pairs else None,
        }
    return result


def audit_channels(
    episodes: Sequence[Episode],
    pattern: str | None = None,
    permutations: int = PERMUTATIONS,
) -> dict[str, Any]:
    """Per channel: messages, H(secret), and the MI of what was sent and what was received."""
    if not episodes:
        return {}
    fields = PRIVATE_FIELDS.get(str(episodes[0].get("game")))
    if not fields:
        return {}
    compiled = re.compile(pattern) if pattern else None
    return {
        name: _audit_channel(episodes, name, fields, compiled, permutations)
        for name in _channel_names(episodes)
    }
