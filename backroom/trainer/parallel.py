"""Data-parallel training steps through ``torch.distributed`` (torchrun starts the ranks).

Rank 0 is the trainer everyone sees: it talks to the bus, stores, credits,
saves and announces. Every other rank only holds a copy of the learner: for
each step rank 0 broadcasts the batch (``lead_step``), every rank runs
``Learner.step`` on its share, the gradients are summed across ranks inside
it, and the Adam steps stay identical. ``finish`` tells the followers to stop.
One process on one device (no ``WORLD_SIZE`` in the environment) is the
default, and then nothing here does anything.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from backroom.trainer.learner import Learner, Sample, StepStats


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; (rank, world size)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _world() -> int:
    """The ranks in the process group; 1 with none.

    Read from ``sys.modules``, never imported here: a group exists only if
    ``init_from_env`` imported the module, and ``finish`` runs in the cleanup
    of a run cancelled mid-start, when a worker thread may still be importing
    torch's modules (loading the model): importing torch.distributed beside
    it aborted the process (``terminate called after throwing an instance of
    'python_error'``, tests/test_train_quick.py under load).
    """
    dist = sys.modules.get("torch.distributed")
    # absent: not available, or half-imported by another thread
    is_initialized = getattr(dist, "is_initialized", None)
    if dist is None or is_initialized is None or not is_initialized():
        return 1
    return int(dist.get_world_size())


def sync_parameters(learner: Learner) -> None:
    """Every rank starts from rank 0's adapter weights (LoRA init is random)."""
    if _world() > 1:
        import torch.distributed as dist

        for p in learner.model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


def lead_step(learner: Learner, samples: Sequence[Sample]) -> StepStats:
    """Rank 0: hand the batch to every rank, then take the step together."""
    if _world() > 1:
        import torch.distributed as dist

        dist.broadcast_object_list([list(samples)], src=0)
    return learner.step(samples)


def follow(learner: Learner) -> int:
    """Ranks > 0: take every step rank 0 leads, until it says stop; the number of steps."""
    import torch.distributed as dist

    steps = 0
    while True:
        box: list[list[Sample] | None] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return steps
        learner.step(box[0])
        steps += 1


def finish() -> None:
    """Rank 0: release the followers."""
    if _world() > 1:
        import torch.distributed as dist

        dist.broadcast_object_list([None], src=0)
