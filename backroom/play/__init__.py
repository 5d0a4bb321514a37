"""One way to play a batch of matches, for ``backroom run``, the league and the trainer.

``ledger.MatchLedger`` keeps the fault rules (what is done when requests are
lost, referees die or revive, a stop voids what was in play: docs/architecture.md,
"One batch, three callers"); ``faults.Faults`` counts what it did. It talks to
no broker: each caller wires it to the bus (``runner.wiring``, ``trainer.batch``).
"""
