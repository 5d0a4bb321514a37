"""One way to play a batch of matches, for ``backroom run``, the league and the trainer.

``batch.play(plan, bus, sink, options)`` is the operation: ``plan.MatchPlan``
(the matches, in order), ``plan.PlayOptions`` (window, waits, whom to wait
for, stop) and the caller's ``plan.Sink`` (what it keeps). It opens its own
connection (``wiring.Wiring``: subscriptions, presence, the identity claim)
and plays a ``loop.Batch`` on it. A caller with a session of its own (the
trainer's persistent one) plays a ``loop.Batch`` there directly: its receive
callbacks tell the batch what arrived, and the sink keeps each kept episode
in that callback. The batch keeps its ``ledger.MatchLedger``, which keeps the
fault rules (what is done when requests are lost, referees die or revive, a
stop voids what was in play: docs/architecture.md, "One batch, three
callers"); ``faults.Faults`` counts what it did.
"""
