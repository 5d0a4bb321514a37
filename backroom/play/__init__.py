"""One way to play a batch of matches, for ``backroom run``, the league and the trainer.

``batch.play(plan, bus, sink, options)`` is the operation: ``plan.MatchPlan``
(the matches, in order), ``plan.PlayOptions`` (window, waits, whom to wait
for, stop) and the caller's ``plan.Sink`` (what it keeps). ``wiring`` feeds
``ledger.MatchLedger``, which keeps the fault rules (what is done when
requests are lost, referees die or revive, a stop voids what was in play:
docs/architecture.md, "One batch, three callers"), from the bus;
``faults.Faults`` counts what it did. The trainer drives the ledger from its
own session (``trainer.batch``).
"""
