"""Which matches a training step asks for: CRN groups, self-play, buffer opponents, evaluations.

Pure planning, no I/O: the same config, step and buffer give the same
requests (every random choice comes from a generator seeded by the run's seed
and the step), so a resumed run asks for exactly what the killed one would.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from backroom.bus.wire import AdapterRef, MatchSpec
from backroom.seeds import evaluation_seed, rollout_seed
from backroom.trainer.config import TrainConfig
from backroom.trainer.opponents import Opponent, Records, draw
from backroom.trainer.store import Request


@dataclass
class AgentBuffer:
    """Earlier adapters kept as opponents: every ``every``-th version, at most ``size`` of them."""

    every: int
    size: int
    refs: deque[AdapterRef] = field(default_factory=deque)

    def offer(self, step: int, ref: AdapterRef) -> list[AdapterRef]:
        """Keep ``ref`` if ``step`` is an ``every``-th one; return the versions it pushed out."""
        left: list[AdapterRef] = []
        if step % self.every == 0:
            self.refs.append(ref)
            while len(self.refs) > self.size:
                left.append(self.refs.popleft())
        return left


def _spec(
    config: TrainConfig,
    seats: list[str],
    seed: int,
    group: str,
    adapters: list[AdapterRef | None],
    crn_index: int = 0,
) -> MatchSpec:
    """``crn_index`` keeps a CRN group's members from sampling alike (same seed, own play)."""
    return MatchSpec(
        game=config.game,
        params=config.params,
        seats=seats,
        seed=seed,
        crn_group=group,
        crn_index=crn_index,
        run=config.run,
        turn_timeout_s=config.turn_timeout_s,
        adapters=adapters,
    )


def plan_step(
    config: TrainConfig,
    step: int,
    current: AdapterRef,
    buffer: Iterable[AdapterRef],
    pool: Sequence[Opponent] = (),
    records: Records | None = None,
) -> list[Request]:
    """The rollouts of one step: ``batch_size / k`` CRN groups of ``k`` matches, one seed per group.

    Without a pool, a group plays self-play (the current adapter on every
    seat, every seat trained) or, with probability rho (by default Advantage
    Alignment only, as in the paper), the current adapter against one buffer
    adapter for the whole group. With a pool (``opponents:``) every group plays
    one pool member. Against a buffer adapter or a pool member only the
    current adapter's seat is trained, alternating between seats from group
    to group. ``buffer.sample: pfsp`` draws that opponent by ``records``.
    """
    assert config.hp is not None
    hp = config.hp
    rng = random.Random(f"{config.seed}/rollouts/{step}")
    rho = hp.rho  # 0 for the GRPO variants unless the config asks (config.py)
    refs = list(buffer)
    groups = hp.batch_size // hp.group_size
    requests = []
    for g in range(groups):
        group = f"{config.run}.s{step}.g{g}"
        seed = rollout_seed(config.seed, step, groups, g)  # one per CRN group: chance alike in it
        seats = list(config.players)
        adapters: list[AdapterRef | None] = [current] * len(config.players)
        trainable = tuple(range(len(config.players)))
        label = "self-play"
        mine = g % 2
        if pool:
            member = draw(rng, pool, [o.label for o in pool], config, records)
            seats[1 - mine] = member.agent or seats[1 - mine]
            adapters[1 - mine] = member.ref
            trainable, label = (mine,), member.label
        elif refs and rng.random() < rho:
            opponent = draw(rng, refs, [f"buffer {r.version}" for r in refs], config, records)
            adapters[1 - mine] = opponent
            trainable, label = (mine,), f"buffer {opponent.version}"
        for i in range(hp.group_size):
            requests.append(
                Request(
                    match=f"{group}.m{i}",
                    step=step,
                    group=group,
                    kind="train",
                    spec=_spec(config, seats, seed, group, adapters, i),
                    trainable=trainable,
                    label=label,
                )
            )
    return requests


def plan_evaluation(
    config: TrainConfig, step: int, current: AdapterRef, pool: Sequence[Opponent] = ()
) -> list[Request]:
    """The current adapter (seat 0) against each fixed baseline (seat 1), itself, and each pool member."""
    requests = []
    opponents: list[tuple[str, str, AdapterRef | None]] = [
        (b.id, b.id, None) for b in config.evaluation.baselines
    ]
    opponents.append(("self", config.players[1], current))  # self-play with the same adapter
    opponents += [(o.label.replace(" ", "-"), o.agent or config.players[1], o.ref) for o in pool]
    for b, (label, agent, ref) in enumerate(opponents):
        for i in range(config.evaluation.matches):
            group = f"{config.run}.e{step}.{label}"
            seed = evaluation_seed(config.seed, step, b, i)
            requests.append(
                Request(
                    match=f"{group}.m{i}",
                    step=step,
                    group=group,
                    kind="eval",
                    spec=_spec(config, [config.players[0], agent], seed, group, [current, ref]),
                    trainable=(),
                    label=label,
                )
            )
    return requests
