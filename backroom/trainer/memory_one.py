"""The trainer's credit on a policy small enough for the paper's number of steps.

An LLM run on a CPU affords a few dozen steps; the paper's Advantage
Alignment run took 3000. This module asks, in seconds, what the *credit*
(``advantages.py``, imported, not copied) does over hundreds of steps when the
policy is not the bottleneck: the classic memory-one IPD policy, five logits
for P(A) in the first round and after each of (AA, AB, BA, BB) (own move, then
the other's). The rest is what ``backroom train`` does with ``preset: ipd``:
rewards over 5, discount 0.9, the leave-one-out baseline over the batch
(k = 1), equation 1 with gamma 0.9, REINFORCE with an entropy bonus, the loss
over the number of decisions, Adam, gradient norm 1, and an agent buffer of
earlier policies played with probability rho (a buffer seat is not trained;
its advantage is still the A^2 of equation 1). Play is on-policy, so the TIS
weights of ``learner.py`` would all be 1 and are left out.

Tit-for-tat here is P(A) high first and after (., A), low after (., B). It is
what Advantage Alignment reaches from a cooperative start and what naive GRPO
does not (``tests/test_trainer_memory_one.py``; ``bench/ipd_memory_one.py``
runs seeds and draws the curves). A credit variant that fails this check will
not do better on an LLM.

An LLM's states are not five free logits: a LoRA step that teaches one IPD
state moves the others 90-100% as far (``bench/ipd_state_transfer.py``).
``Settings.tied_features`` ties the states that way, to ask how many steps
the credit then needs (hundreds; docs/training.md).

``backroom train`` runs it from a training config with a ``memory_one:``
block (``examples/ipd_memory_one.yaml``): ``settings_for`` reads the same
fields a LoRA run reads, and ``run`` writes a run directory that ``backroom
analyze`` reads like a LoRA run's.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from backroom.agents.scripted.ipd import MEMORY_ONE_STATES
from backroom.trainer.advantages import (
    Baseline,
    Trajectory,
    discounted_returns,
    loo_advantages,
)
from backroom.trainer.algorithms import credited
from backroom.trainer.tracking import open_tracking

if TYPE_CHECKING:
    from backroom.trainer.config import TrainConfig

#: Called after every step with the step and its log row (``train_log.csv``'s columns).
StepHook = Callable[[int, dict[str, float]], None]

#: The row player's payoff, index 0 = A (cooperate), 1 = B: the paper's R 3, T 5, S 0, P 1.
PAYOFF = np.array([[3.0, 0.0], [5.0, 1.0]])
#: A memory-one state: the first round, or (own last move, the other's last move); the
#: ``memory-one`` agent kind plays a final policy by the same names (``memory_one.json``).
STATES = MEMORY_ONE_STATES
#: Fixed opponents as logits per state (a large logit is a sure A).
SURE = 30.0
BASELINES = {
    "always-a": np.full(5, SURE),
    "always-b": np.full(5, -SURE),
    "tft": np.array([SURE, SURE, -SURE, SURE, -SURE]),
}


@dataclass
class Settings:
    """The paper's IPD column (section 11) where it applies; lr is for five raw logits."""

    algorithm: str = "adalign"  # or "grpo", "grpo_sum": an entry of algorithms.ALGORITHMS
    rounds: int = 10
    batch: int = 8  # matches per step
    steps: int = 150
    lr: float = 0.2
    beta: float = 0.5
    aa_gamma: float = 0.9
    discount: float = 0.9
    reward_norm: float = 5.0
    entropy: float = 0.01
    rho: float = 0.5
    buffer_every: int = 10
    buffer_size: int = 64
    init_coop: float = 0.97  # SmolLM2-135M's P(A) on the paper's prompt
    #: 0: one logit per state. m > 0: the states share m weights w, the logit of
    #: state s is logit0 + w . phi_s with unit features phi_s ~ u + spread * v_s
    #: (u, v_s standard normal, drawn from the seed). A step on one state then
    #: moves the others almost as far, as a LoRA step on SmolLM2 does.
    tied_features: int = 0
    #: 0.3: one Adam step on a state moves the others 0.87-0.98 as far (SmolLM2:
    #: 0.9-1.0 between the states after a round, bench/ipd_state_transfer.py).
    tied_spread: float = 0.3
    #: "per_seat" (the paper's) or "pooled_other_matches" (advantages.loo_advantages)
    baseline: Baseline = "per_seat"

    def __post_init__(self) -> None:
        # Checked here, not in ``train``: every learner built from Settings (also
        # memory_one_exploit's) would otherwise train plain GRPO on a typo.
        credited(self.algorithm)


@dataclass
class Result:
    p_a: dict[str, float]  # final P(A) per state
    returns: dict[str, float]  # learner's mean return per match against each opponent
    #: the share of A played by seat 0 (always the live policy) in each step's rollouts
    coop_by_step: list[float] = field(default_factory=list)
    #: the final logit per state: the policy itself, to play or freeze (memory_one_exploit.py)
    logits: list[float] = field(default_factory=list)

    @property
    def is_tit_for_tat(self) -> bool:
        p = self.p_a
        return p["first"] > 0.8 and p["AA"] > 0.8 and p["AB"] < 0.2 and p["BB"] < 0.2

    @property
    def is_always_a(self) -> bool:
        return all(v > 0.8 for v in self.p_a.values())

    @property
    def is_always_b(self) -> bool:
        return all(v < 0.2 for v in self.p_a.values())

    @property
    def verdict(self) -> str:
        if self.is_tit_for_tat:
            return "tit-for-tat"
        return "always-A" if self.is_always_a else "always-B" if self.is_always_b else "other"


def play(
    seat0: np.ndarray, seat1: np.ndarray, n: int, rounds: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n matches between logit tables, one (5,) or one per match (n, 5).

    Returns states, actions (0 = A) and rewards, each (n, 2, rounds).
    """
    tables = tuple(np.broadcast_to(t, (n, len(STATES))) for t in (seat0, seat1))
    states = np.zeros((n, 2, rounds), dtype=np.int64)
    actions = np.zeros((n, 2, rounds), dtype=np.int64)
    rewards = np.zeros((n, 2, rounds))
    for t in range(rounds):
        for seat in (0, 1):
            if t:  # 1 + 2 * own + other: AA 1, AB 2, BA 3, BB 4
                states[:, seat, t] = 1 + 2 * actions[:, seat, t - 1] + actions[:, 1 - seat, t - 1]
            p_a = 1 / (1 + np.exp(-tables[seat][np.arange(n), states[:, seat, t]]))
            actions[:, seat, t] = rng.random(n) >= p_a
        rewards[:, 0, t] = PAYOFF[actions[:, 0, t], actions[:, 1, t]]
        rewards[:, 1, t] = PAYOFF[actions[:, 1, t], actions[:, 0, t]]
    return states, actions, rewards


def credit(rewards: np.ndarray, s: Settings, trained: np.ndarray | None = None) -> np.ndarray:
    """(n, 2, rounds) credit per decision, as ``assign_credit`` computes it for k = 1.

    ``trained`` (n, 2) marks the seats being trained (default: all); a buffer
    seat is played, not trained, and kept out of the trained seats' baselines.
    """
    n, seats, rounds = rewards.shape
    method = credited(s.algorithm)
    assert method.credit is not None
    rewards = np.stack([method.pay(r) for r in rewards])  # grpo_sum: both players' rewards
    per_seat = rewards.reshape(-1, rounds).tolist()
    g = np.stack([discounted_returns(r, s.discount, s.reward_norm) for r in per_seat])
    mask = np.ones((n, seats), dtype=bool) if trained is None else trained
    # k = 1: every match its own CRN group, so the baseline runs over the other matches
    who = [Trajectory(i, i, j, bool(mask[i, j])) for i in range(n) for j in range(seats)]
    adv = loo_advantages(g, who, s.baseline).reshape(n, seats, rounds)
    return np.stack(
        [
            [method.credit(adv[i, j], adv[i, 1 - j], s.beta, s.aa_gamma) for j in (0, 1)]
            for i in range(n)
        ]
    )


def evaluate(
    theta: np.ndarray, rounds: int, rng: np.random.Generator, matches: int = 256
) -> dict[str, float]:
    """The learner's mean return per match against the paper's baselines and itself."""
    opponents = {**BASELINES, "self": theta}
    return {
        name: float(play(theta, other, matches, rounds, rng)[2][:, 0].sum(axis=1).mean())
        for name, other in opponents.items()
    }


class Learner:
    """The policy being trained: five logits (free, or tied as ``Settings`` says) and Adam.

    ``memory_one_exploit`` trains one or two of these against frozen or
    co-trained tables with the same step.
    """

    def __init__(self, s: Settings, seed: int) -> None:
        self.s = s
        self.logit0 = float(np.log(s.init_coop / (1 - s.init_coop)))
        if s.tied_features:
            features = np.random.default_rng([seed, 1])  # its own stream: play stays the same
            u = features.standard_normal(s.tied_features)
            phi = u + s.tied_spread * features.standard_normal((len(STATES), s.tied_features))
            self.phi: torch.Tensor | None = torch.as_tensor(
                phi / np.linalg.norm(phi, axis=1, keepdims=True)
            )
            self.theta = torch.zeros(s.tied_features, dtype=torch.float64, requires_grad=True)
        else:
            self.phi = None
            self.theta = torch.full(
                (len(STATES),), self.logit0, dtype=torch.float64, requires_grad=True
            )
        self.opt = torch.optim.Adam([self.theta], lr=s.lr)

    def logits(self) -> torch.Tensor:
        return self.theta if self.phi is None else self.logit0 + self.phi @ self.theta

    def table(self) -> np.ndarray:
        """The current logits, detached: the policy to play (or freeze)."""
        return self.logits().detach().numpy().copy()

    def step(
        self,
        states: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        trained_seats: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One update from a batch; only the decisions of ``trained_seats`` (batch, 2) enter
        the loss. Returns the loss, each decision's entropy and the trained mask, for the log."""
        c = torch.as_tensor(credit(rewards, self.s, trained_seats))
        logit = self.logits()[torch.as_tensor(states)]
        logp_a, logp_b = F.logsigmoid(logit), F.logsigmoid(-logit)
        logp = torch.where(torch.as_tensor(actions) == 0, logp_a, logp_b)
        entropy = -(logp_a.exp() * logp_a + logp_b.exp() * logp_b)
        trained = torch.as_tensor(trained_seats, dtype=logp.dtype)[:, :, None].expand_as(logp)
        # loss = sum_i [ -credit_i * log pi(a_i) - ent_coef * H_i ] / N over trained decisions
        loss = ((-c * logp - self.s.entropy * entropy) * trained).sum() / trained.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([self.theta], 1.0)
        self.opt.step()
        return loss, entropy, trained


def train(s: Settings, seed: int, on_step: StepHook | None = None) -> Result:
    """One run: every random choice from ``seed``, like a match's from its seed and seat.

    ``on_step`` sees each step's row: the behaviour policy's P(A) per state, the
    share of A, mean returns per seat, loss and entropy; it draws no random number.
    """
    rng = np.random.default_rng(seed)
    learner = Learner(s, seed)
    buffer: list[np.ndarray] = []
    coop: list[float] = []
    for step in range(s.steps):
        now = learner.table()
        if step % s.buffer_every == 0:
            buffer = [*buffer, now][-s.buffer_size :]
        # Each match is self-play (both seats trained) or, with probability rho,
        # against a buffer policy in seat 1 that is played but not trained.
        vs_buffer = rng.random(s.batch) < s.rho
        opponents = np.stack([buffer[rng.integers(len(buffer))] if b else now for b in vs_buffer])
        states, actions, rewards = play(now, opponents, s.batch, s.rounds, rng)
        trained_seats = np.ones((s.batch, 2), dtype=bool)
        trained_seats[vs_buffer, 1] = False
        loss, entropy, trained = learner.step(states, actions, rewards, trained_seats)
        coop.append(float((actions[:, 0] == 0).mean()))
        if on_step is not None:
            on_step(step, _row(now, coop[-1], rewards, loss, entropy, trained))
    final = learner.table()
    p_a = {k: float(1 / (1 + np.exp(-v))) for k, v in zip(STATES, final, strict=True)}
    return Result(
        p_a=p_a,
        returns=evaluate(final, s.rounds, rng),
        coop_by_step=coop,
        logits=final.tolist(),
    )


def _row(
    now: np.ndarray,
    coop: float,
    rewards: np.ndarray,
    loss: torch.Tensor,
    entropy: torch.Tensor,
    trained: torch.Tensor,
) -> dict[str, float]:
    return {
        "cooperation_rate": coop,
        "reward_seat0": float(rewards[:, 0].sum(axis=1).mean()),
        "reward_seat1": float(rewards[:, 1].sum(axis=1).mean()),
        "loss": float(loss.detach()),
        "entropy": float((entropy.detach() * trained).sum() / trained.sum()),
        **{f"p_{k}": float(1 / (1 + np.exp(-v))) for k, v in zip(STATES, now, strict=True)},
    }


def settings_for(config: TrainConfig) -> Settings:
    """The run a training config with a ``memory_one:`` block asks for (validated there)."""
    from backroom.games import make_game

    assert config.memory_one is not None and config.hp is not None
    hp, spec = config.hp, config.memory_one
    return Settings(
        algorithm=config.algorithm,
        rounds=int(make_game(config.game, **config.params).rounds),  # type: ignore[attr-defined]
        batch=hp.batch_size,
        steps=config.steps,
        lr=hp.lr,
        beta=hp.beta,
        aa_gamma=hp.aa_gamma,
        discount=hp.discount,
        reward_norm=hp.reward_norm,
        entropy=hp.entropy_coef,
        rho=hp.rho,
        buffer_every=config.buffer.every,
        buffer_size=config.buffer.size,
        init_coop=spec.init_coop,
        tied_features=spec.tied_features,
        tied_spread=spec.tied_spread,
        baseline=hp.baseline,
    )


def holds_run(run_dir: Path) -> bool:
    return (run_dir / "train_log.csv").exists() or (run_dir / "memory_one.json").exists()


def run(config: TrainConfig, run_dir: Path, on_step: StepHook | None = None) -> Result:
    """``backroom train`` for a memory-one config: the run, and its directory.

    ``train_log.csv`` (a row per step), ``evaluations.jsonl`` (the final policy
    against the fixed opponents and itself, as the LoRA run's evaluations
    record them) and ``memory_one.json`` (settings, the final P(A) per state,
    the returns, the verdict). A directory that holds a run is refused: the
    run takes seconds, so there is nothing to resume.
    """
    settings = settings_for(config)
    log_path, summary_path = run_dir / "train_log.csv", run_dir / "memory_one.json"
    if holds_run(run_dir):
        raise FileExistsError(f"{run_dir} already holds a run; pass another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    # opened first: a tracker that cannot start stops the run before it trains
    tracking = open_tracking(config.tracking, run_dir, config.model_dump(mode="json"))
    try:
        t0 = time.perf_counter()
        with log_path.open("w", newline="") as f:
            writer: csv.DictWriter[str] | None = None

            def logged(step: int, row: dict[str, float]) -> None:
                nonlocal writer
                line: dict[str, Any] = {"step": step, **row}
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(line))
                    writer.writeheader()
                writer.writerow(line)
                if on_step is not None:
                    on_step(step, row)

            result = train(settings, config.seed, logged)
        seconds = time.perf_counter() - t0
        evaluation = {
            "step": config.steps - 1,
            "version": "final",
            "missing": 0,
            "against": {name: {"learner": ret} for name, ret in result.returns.items()},
        }
        (run_dir / "evaluations.jsonl").write_text(json.dumps(evaluation) + "\n")
        summary = {
            "settings": asdict(settings),
            "seed": config.seed,
            "seconds": seconds,
            "policy": result.verdict,
            "p_a": result.p_a,
            "returns": result.returns,
        }
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        tracking.catch_up(run_dir)  # the rows all at once: the run took seconds
    finally:
        tracking.close(sys.exc_info()[1])
    return result
