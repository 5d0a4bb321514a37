"""Every seed backroom derives, in one place: same config and seed, same play.

A run's config gives one seed; every random choice of a match derives from
the match's seed and the seat, and every match's seed from the run's. One
primitive does the mixing (``derive_seed``, BLAKE2b over the parts' text);
the other functions say which parts each seed is made of. Some keep the
arithmetic they were first recorded with (a changed formula would change the
play of every recorded run): each says so, and why it cannot collide where it
matters. Games receive plain integers and import none of this.
"""

from __future__ import annotations

import hashlib

#: What the referee's own generator mixes into the match seed (``referee_rng_seed``).
REFEREE_SALT = 0x5EED
#: The trainer's rollout seeds: run seed times this, plus the group's index (``rollout_seed``).
RUN_STRIDE = 1_000_003


def derive_seed(*parts: object, bits: int = 63) -> int:
    """A seed from ``parts`` that is the same in every process, run and Python version.

    Not Python's ``hash()`` (salted per process for strings), and not a sum
    (``(1, 2)`` and ``(2, 1)`` must differ): the BLAKE2b digest of the parts'
    text, joined by the unit separator. ``bits`` bounds the result: 63 for
    ``random`` and torch, 31 for HTTP servers that take a 32-bit seed.
    """
    text = "\x1f".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - bits)


def match_seed(first: int, group: int) -> int:
    """The seed of a ``backroom run`` match in CRN group ``group``: ``seed + group``.

    Consecutive, as docs/agents.md (*Seeds*) and docs/games.md promise (a
    config's ``seed`` is its first group's); the members of a CRN group share it.
    """
    return first + group


def play_seed(seed: int, crn_index: int) -> int:
    """The seed a match's agents sample from (``MatchStart.seed``): its own, rerun after rerun.

    A CRN group's members share ``seed`` so they deal alike; if their agents
    sampled alike too, the group would play one match k times (and a GRPO
    group would have no spread to learn from). So past the group's first
    match, the seed is mixed with ``crn_index``: one part, ``"{seed}/crn/{i}"``
    (the text it was recorded with), non-negative and within a signed 64-bit int.
    """
    return seed if crn_index == 0 else derive_seed(f"{seed}/crn/{crn_index}")


def referee_rng_seed(seed: int) -> int:
    """The referee's own generator of a match (``on_timeout: random`` moves): the match seed
    XOR ``REFEREE_SALT``, as recorded, so that it does not draw what the deal drew."""
    return seed ^ REFEREE_SALT


def rollout_seed(run_seed: int, step: int, groups: int, group: int) -> int:
    """The seed of a training step's CRN group: ``run_seed * RUN_STRIDE + step * groups + group``.

    As recorded: within a run it is one seed per (step, group) and never the
    same twice, since ``groups`` is fixed by the config.
    """
    return run_seed * RUN_STRIDE + step * groups + group


def evaluation_seed(run_seed: int, step: int, opponent: int, match: int) -> int:
    """The seed of evaluation match ``match`` of ``step`` against opponent ``opponent``.

    Derived, not arithmetic: ``2**31 + run_seed * RUN_STRIDE + step * 1000 +
    opponent * 100 + match`` repeated another opponent's seeds once
    ``evaluation.matches`` passed 100 (and another step's past 1000).
    """
    return derive_seed("backroom", "evaluation", run_seed, step, opponent, match)
