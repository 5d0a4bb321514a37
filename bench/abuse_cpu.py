"""What a seated agent's flat-out flood costs each process, in cores: the referee's, the broker's, the attacker's.

    .venv/bin/python bench/abuse_cpu.py                 # 5 s each: control, seated flood, control
    .venv/bin/python bench/abuse_cpu.py --size 60000    # 60 KB payloads

A ``backroom referee`` process of its own on a Mosquitto of its own seats the
attacker (``mallory``) in a match that never ends (``abuse_parts.budgets.seat``),
then this process floods, flat out, first a topic the attacker may not write
(the control: the broker refuses each, nobody reads them), then the
attacker's own outbox, then the control again. For each it prints payloads
a second and the CPU each process used (``/proc/<pid>/stat``, this process's
``getrusage``), per second of wall clock. What ``referee/budgets.py`` prices
(``PAYLOAD_OVERHEAD_S``) was read off the referee's column before an identity
over budget was unsubscribed (all of the flood was received): CPU seconds
over payloads sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from abuse_parts import budgets, login

from backroom.bus import topics
from backroom.bus.broker import Broker
from backroom.bus.client import Bus, NotAuthorizedError
from backroom.bus.wire import MatchStart, parse_all


def cpu_of(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="of each flood")
    ap.add_argument("--size", type=int, default=5, help="bytes a payload (malformed JSON)")
    args = ap.parse_args()
    logging.getLogger("backroom").setLevel(logging.ERROR)  # the control's refusals
    payload = (b"{nope" + b" " * args.size)[: max(args.size, 5)]
    with tempfile.TemporaryDirectory() as d:
        broker = Broker(Path(d) / "broker").start()
        broker.credentials.add("mallory", role="agent")
        broker.credentials.add(budgets.SEATER, role="runner")
        broker.reload()
        assert broker.proc is not None
        referee = subprocess.Popen(
            [
                *(sys.executable, "-m", "backroom", "referee", "--broker", broker.url),
                *("--credentials", str(broker.dir), "--runs-dir", str(Path(d) / "runs")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        seated = asyncio.Event()

        def on_inbox(_topic: str, data: bytes) -> None:
            if any(isinstance(m, MatchStart) for m in parse_all(data)):
                seated.set()

        try:
            async with Bus(login(broker.url, broker.dir, "mallory")) as bus:
                await bus.subscribe(topics.inbox("mallory"), on_inbox)
                seater = asyncio.create_task(
                    budgets.seat(broker.url, broker.dir, "mallory", seated)
                )
                await asyncio.wait_for(seated.wait(), 60)
                seater.cancel()
                print(
                    f"{'flood':<8} {'payloads/s':>10} {'referee':>8} {'broker':>7} {'attacker':>8}  (cores)"
                )
                for name, topic in [
                    ("control", topics.inbox("nobody")),
                    ("seated", topics.outbox("mallory", "referee")),
                    ("control", topics.inbox("nobody")),
                ]:
                    r0, b0, m0 = cpu_of(referee.pid), cpu_of(broker.proc.pid), own_cpu()
                    t0, sent = time.monotonic(), 0
                    while time.monotonic() - t0 < args.seconds:
                        with contextlib.suppress(NotAuthorizedError):
                            await bus.publish(topic, payload)
                        sent += 1
                    dt = time.monotonic() - t0
                    print(
                        f"{name:<8} {sent / dt:>10.0f} {(cpu_of(referee.pid) - r0) / dt:>8.2f} "
                        f"{(cpu_of(broker.proc.pid) - b0) / dt:>7.2f} {(own_cpu() - m0) / dt:>8.2f}"
                    )
        finally:
            referee.send_signal(signal.SIGTERM)
            referee.wait()
            broker.stop()


if __name__ == "__main__":
    asyncio.run(main())
