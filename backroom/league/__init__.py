"""Leagues: who is better, and by how much (``backroom league``; docs/league.md).

A league plays every entrant against the others through the normal runner
and referees, keeps each result once in its own SQLite store, and rates the
entrants with openskill (Plackett-Luce on the ranking of rewards), beside the
head-to-head payoff matrix and, for games with a solver, each entrant's
exploitability.
"""
