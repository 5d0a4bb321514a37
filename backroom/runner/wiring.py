"""Moved to ``play.wiring`` (a batch on the bus, for every caller); re-exported here."""

from backroom.play.wiring import SLOW_START_S, Wiring, waiting_notice

__all__ = ["SLOW_START_S", "Wiring", "waiting_notice"]
