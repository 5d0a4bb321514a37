"""The identity claim (``bus.claim``): agents, referees and runners are told alike that their
name is held, and nothing else (a broker away, a refused subscription) reads as that.

Each test logs in under one name twice on a real Mosquitto: a plain ``Bus`` as the
process holding the name, and a ``Bus`` claiming it as a starting process does.
"""

from __future__ import annotations

import asyncio
import time

import aiomqtt
import pytest

from backroom.bus import topics
from backroom.bus.auth import Role
from backroom.bus.broker import Broker
from backroom.bus.claim import IDENTITY_WINDOW_S, IdentityClaim, IdentityInUse, in_use
from backroom.bus.client import Bus, BusConfig
from backroom.bus.errors import NotAuthorizedError
from tests.conftest import identity, load_factor

#: Long, so that an error inside it comes from the takeover and not from the window running
#: out (after which a claim passes): the claim must not wait it out to say so.
LONG_WINDOW_S = 20.0

NAMES: dict[str, Role] = {"alice": "agent", "referee-7": "referee", "runner": "runner"}


def _claiming(
    config: BusConfig, role: Role, window_s: float = IDENTITY_WINDOW_S, used_before: bool = False
) -> tuple[IdentityClaim, Bus]:
    """A claim, and the bus that runs its hook: what a starting process makes."""
    claim = IdentityClaim(config, role, window_s=window_s, used_before=used_before)
    return claim, Bus(config, on_disconnect=[claim.thrown_off], role=role)


@pytest.mark.parametrize(("name", "role"), list(NAMES.items()))
async def test_a_second_process_under_a_held_name_is_told_it_is_in_use(
    broker: Broker, name: str, role: Role
) -> None:
    """The newcomer stops within the window, with the message of its role, and stays off;
    the holder, thrown off once (or twice: the newcomer's clean-start pre-login), keeps it."""
    config = identity(broker, name, role)
    async with Bus(config) as holder:
        await holder.subscribe(topics.inbox(name), lambda *_: None)
        claim, bus = _claiming(config, role, window_s=LONG_WINDOW_S, used_before=True)
        t0 = time.monotonic()
        await bus.open()
        try:
            with pytest.raises(IdentityInUse) as err:
                async with claim.on(bus):
                    await claim.hold()
            assert time.monotonic() - t0 < LONG_WINDOW_S
        finally:
            await bus.close()
        assert str(err.value) == str(in_use(role, name))
        assert f"{role} identity {name!r} is in use" in str(err.value)
        assert f"`backroom credentials add NAME --role {role}`" in str(err.value)
        # The newcomer stays off (its bus closed for good, no login to come), and the
        # holder, back, keeps the name.
        assert bus.closing and not claim.claiming
        await asyncio.wait_for(holder.connected.wait(), 10 * load_factor())
        assert 1 <= holder.reconnects <= 2


def test_each_role_is_told_what_it_is_and_how_to_get_a_name_of_its_own() -> None:
    assert str(in_use("agent", "alice")) == (
        "agent identity 'alice' is in use: another process logged in as 'alice' took the "
        "connection back while this agent was starting. Stop that process, or start this "
        "agent under an identity of its own (`backroom credentials add NAME --role agent`)."
    )
    runner = str(in_use("runner", "runner"))
    assert "while this run was starting (another `backroom run` on this broker?)" in runner
    assert "--role runner" in runner


async def test_a_claim_on_a_name_nobody_holds_passes(broker: Broker) -> None:
    """Never used: no wait at all. Used before but nobody holds it now: the window, then start."""
    config = identity(broker, "alice")
    claim, bus = _claiming(config, "agent", window_s=LONG_WINDOW_S)
    async with bus:
        t0 = time.monotonic()
        async with claim.on(bus):
            await claim.hold()
        assert time.monotonic() - t0 < LONG_WINDOW_S / 2
        assert bus.connected.is_set() and not claim.taken.is_set()
    claim, bus = _claiming(config, "agent", window_s=0.5, used_before=True)
    async with bus:
        t0 = time.monotonic()
        async with claim.on(bus):
            await claim.hold()
        assert time.monotonic() - t0 >= 0.5
        assert bus.connected.is_set() and bus.reconnects == 0 and not claim.taken.is_set()


async def test_a_broker_away_during_the_claim_is_no_takeover(broker: Broker) -> None:
    """A connection lost while the broker does not answer is the broker's: the bus comes back
    with it and the claim passes; a step cut short by it is raised as it is."""
    config = identity(broker, "alice")
    # No window to wait: the outage below falls inside the claim all the same.
    claim = IdentityClaim(config, "agent", window_s=0.0, used_before=True)
    probed = asyncio.Event()

    async def thrown_off() -> None:
        await claim.thrown_off()
        probed.set()

    bus = Bus(config, on_disconnect=[thrown_off])
    async with bus:
        async with claim.on(bus):
            await asyncio.to_thread(broker.stop)
            await asyncio.wait_for(probed.wait(), 10 * load_factor())  # it looked: nobody there
            await asyncio.to_thread(broker.start)
            await asyncio.wait_for(bus.connected.wait(), 15 * load_factor())
            await claim.hold()
        assert not claim.taken.is_set() and bus.reconnects >= 1
    claim, bus = _claiming(config, "agent", used_before=True)
    async with bus:
        with pytest.raises(aiomqtt.MqttError):
            async with claim.on(bus):
                await asyncio.to_thread(broker.stop)
                raise aiomqtt.MqttError("cut off mid-subscribe")
        assert not claim.taken.is_set()


async def test_a_publish_the_acl_refuses_is_not_a_name_in_use(broker: Broker) -> None:
    """The broker is up, but it refused: the error says so, not that someone holds the name."""
    config = identity(broker, "alice")
    claim, bus = _claiming(config, "agent", used_before=True)
    async with bus:
        with pytest.raises(NotAuthorizedError):
            async with claim.on(bus):
                await bus.publish(topics.inbox("bob"), b"{}")  # awaited: its PUBACK says no
        assert not claim.taken.is_set() and bus.connected.is_set()


async def test_a_step_cut_short_by_the_takeover_says_in_use(broker: Broker) -> None:
    """Thrown off in the middle of a subscription: ``IdentityInUse``, not a raw ``MqttError``
    (the runner's clash once ended in a traceback)."""
    config = identity(broker, "runner", "runner")
    claim, bus = _claiming(config, "runner", window_s=LONG_WINDOW_S, used_before=True)
    async with bus:
        with pytest.raises(IdentityInUse, match="runner identity 'runner' is in use"):
            async with claim.on(bus):
                raise aiomqtt.MqttError("the connection was taken while subscribing")
        assert claim.taken.is_set() and bus.closing
