"""Scripted agent kinds. Importing this package registers them all."""

from backroom.agents.scripted import basic as basic
from backroom.agents.scripted import kuhn_colluder as kuhn_colluder
