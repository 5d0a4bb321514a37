"""Scripted agent kinds. Importing this package registers them all."""

from backroom.agents import llm as llm
from backroom.agents import local as local
from backroom.agents.scripted import basic as basic
from backroom.agents.scripted import beauty as beauty
from backroom.agents.scripted import bertrand as bertrand
from backroom.agents.scripted import cfr as cfr
from backroom.agents.scripted import ipd as ipd
from backroom.agents.scripted import kuhn_colluder as kuhn_colluder
from backroom.agents.scripted import kuhn_team as kuhn_team
from backroom.agents.scripted import poker_colluder as poker_colluder
from backroom.agents.scripted import split as split
from backroom.agents.scripted import trust_split as trust_split
