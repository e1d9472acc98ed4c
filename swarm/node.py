"""A multi-GPU node as one peer: ``torchrun --nproc-per-node K -m swarm.peer ...``.

Inside the node, the K ranks train data parallel (`DistributedDataParallel`: NCCL on GPUs, gloo on the
CPU), rank r on batches r, r + K, r + 2K, ... of the node's shard stream. So a node step is one inner
step on K batches at once, the same as one process taking the K batches as one (the gradients are
averaged). Outside, the node is one peer. Rank 0 alone holds the identity, the DHT, the `Trainer`,
the ledger and the event log. It counts the node's samples (K batches a step) and its throughput.

Lockstep: each step begins with a control broadcast from rank 0: whether to stop, and whether the swarm
wrote the model since the last step (a round, an overlapped landing, a loaded checkpoint). When it did,
rank 0's parameters follow in the same broadcast. The other ranks take the same inner steps as rank 0's
trainer, with the same gradients and the same warm-up factors, so every replica stays bit-identical.

Signals: under torchrun, Ctrl+C reaches every rank and torchrun sends its own signal after it. Rank 0
leaves cleanly at the first signal and ignores the second. The other ranks ignore both and stop when
rank 0 says so. If rank 0 dies, their next collective fails at once, because the connection closes.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_STOP, _CHANGED = 0, 1


def launched_size() -> int:
    """How many processes torchrun started for this node (``WORLD_SIZE``; 1 when run alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Node:
    """This process's place in a multi-process node (see the module docstring)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def leads(self) -> bool:
        """Rank 0: the node's one swarm peer."""
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device, *, timeout_s: float) -> Node | None:
        """Join the node's process group when started by torchrun with more than one process (None
        otherwise). CUDA: rank r uses GPU LOCAL_RANK over NCCL; CPU: gloo. ``timeout_s``: the longest any
        collective waits, so it must exceed rank 0's longest pause between steps (joining, a blocking round)."""
        if launched_size() <= 1:
            return None
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        node = cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
        if not node.leads:  # rank 0 tells them when to stop (module docstring)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        logger.info("rank %s of a %s-process node (%s) on %s", node.rank, node.world_size, backend, device)
        return node

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under DDP for the forward and backward passes (the trainer keeps the bare module)."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def batches(self, stream: Iterator[Any]) -> Iterator[Any]:
        """This rank's share of the node's batch stream: every ``world_size``-th batch from its rank."""
        return itertools.islice(stream, self.rank, None, self.world_size)

    def share(self, value: int | None) -> int | None:
        """Rank 0's ``value`` (a small integer or None) on every rank."""
        box = torch.tensor([-1 if value is None else value], dtype=torch.int64, device=self.device)
        dist.broadcast(box, src=0)
        return None if int(box) < 0 else int(box)

    def lead(self, params: list[torch.Tensor], *, changed: bool, stop: bool) -> None:
        """Rank 0, before each step: stop or not, and the parameters when the swarm wrote them."""
        control = torch.zeros(2, dtype=torch.int64, device=self.device)
        control[_STOP], control[_CHANGED] = int(stop), int(changed)
        dist.broadcast(control, src=0)
        if changed:
            self._broadcast(params)

    def follow(self, params: list[torch.Tensor]) -> bool:
        """Another rank, before each step: take rank 0's parameters when they changed; True: stop now."""
        control = torch.zeros(2, dtype=torch.int64, device=self.device)
        dist.broadcast(control, src=0)
        if control[_CHANGED]:
            self._broadcast(params)
        return bool(control[_STOP])

    def _broadcast(self, params: list[torch.Tensor]) -> None:
        with torch.no_grad():  # one flat message, copied back in place (DDP and the optimizers hold the tensors)
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=0)
            offset = 0
            for param in params:
                param.copy_(flat[offset : offset + param.numel()].view_as(param))
                offset += param.numel()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
