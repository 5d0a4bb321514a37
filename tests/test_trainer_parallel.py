"""Data-parallel steps through torch.distributed (gloo, two processes on the CPU).

Two ranks that split a batch (rank 0 leading, rank 1 following, as ``backroom
train --nproc 2`` runs them) end with the same adapter weights as one process
that takes the whole batch.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from backroom.model.spec import ModelSpec
from backroom.trainer.learner import Learner, LoraSettings, Sample, StepSettings

SETTINGS = StepSettings(lr=1e-2, micro_batch_tokens=200, kl_coef=0.05)
LORA = LoraSettings(rank=4, alpha=8)


def batch() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    head = torch.randint(10, 5000, (30,), generator=g).tolist()
    out = []
    for i in range(7):  # odd: the ranks get different numbers of samples
        tail = torch.randint(10, 5000, (3 + i,), generator=g).tolist()
        cands = [torch.randint(10, 5000, (2 + i % 2,), generator=g).tolist() for _ in range(2)]
        out.append(Sample(head + tail, cands, i % 2, [-0.7], True, 1.0, (-1.0) ** i))
        text = torch.randint(10, 5000, (4,), generator=g).tolist()
        out.append(Sample(head + tail, [text], 0, [-9.0] * 4, False, 1.0, 0.5 * i))
    return out


def lora_state(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n}


def rank_main(rank: int, world: int, port: int, model: str, out: str) -> None:
    import torch.distributed as dist

    from backroom.trainer.parallel import finish, follow, lead_step, sync_parameters

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    learner = Learner(
        ModelSpec(path=model, device="cpu"), lora=LORA, step=SETTINGS, seed=rank
    )  # different inits...
    sync_parameters(learner)  # ...made equal
    if rank == 0:
        stats = [lead_step(learner, batch()) for _ in range(2)]
        finish()
        torch.save({"state": lora_state(learner), "loss": [s.loss for s in stats]}, out)
    else:
        assert follow(learner) == 2
    dist.destroy_process_group()


def test_two_ranks_take_the_same_step_as_one_process(tiny_qwen_model: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    mp.spawn(rank_main, args=(2, port, str(tiny_qwen_model), str(out)), nprocs=2, join=True)
    parallel = torch.load(out)
    single = Learner(
        ModelSpec(path=str(tiny_qwen_model), device="cpu"), lora=LORA, step=SETTINGS, seed=0
    )
    losses = [single.step(batch()).loss for _ in range(2)]
    assert parallel["loss"] == [pytest_approx(x) for x in losses]
    for name, value in lora_state(single).items():
        torch.testing.assert_close(parallel["state"][name], value, atol=2e-6, rtol=1e-4)


def pytest_approx(x: float) -> object:
    import pytest

    return pytest.approx(x, rel=1e-4)
