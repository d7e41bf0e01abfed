"""torch.distributed for tensor parallel: where the ranks meet (given, or torchrun's and MPI launchers' environment),
the process group (NCCL on GPUs, gloo on CPU tensors), the graph's collectives, and the group that carries rank 0's
messages to the workers (gloo: small pickled objects, on every launch)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from backends.cuda.runtime import torch

dist = torch.distributed
log = logging.getLogger(__name__)
# A collective that waits this long for a peer has lost it (a dead or stuck rank): it fails instead of hanging.
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Rendezvous:
    """One rank's place in the group and where the group meets (rank 0 listens at addr:port)."""

    rank: int
    world: int
    addr: str = "127.0.0.1"
    port: int = 29500
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Rendezvous | None:
        """torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (or Open MPI's OMPI_COMM_WORLD_*);
        None when this process was not launched as one rank of several."""
        rank = env.get("RANK", env.get("OMPI_COMM_WORLD_RANK"))
        world = env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE"))
        if rank is None or world is None:
            return None
        local = env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        try:
            return cls(int(rank), int(world), env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                       int(local))
        except ValueError as e:
            raise ValueError(f"the launcher's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT are not numbers: {e}") from None


def init(rv: Rendezvous, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the group: NCCL for GPU tensors (NVLink SHARP multicast off: NCCL_NVLS_ENABLE=0), gloo for CPU ones."""
    if dist.is_initialized():
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{rv.addr}:{rv.port}",
                            rank=rv.rank, world_size=rv.world, timeout=timedelta(seconds=timeout_s), **kw)
    messages_group()  # made by every rank at once (a new group is a collective)


_MESSAGES = None


def messages_group():
    """The group rank 0's messages travel in: the default one where it is gloo, else a gloo group beside NCCL's."""
    global _MESSAGES
    if _MESSAGES is None:
        _MESSAGES = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _MESSAGES


def shutdown() -> None:
    """Leave the group (a later start makes a new one)."""
    global _MESSAGES
    _MESSAGES = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError as e:  # a group already aborted (a rank died)
            log.warning("leaving the tensor-parallel group: %s", e)


def abort() -> None:
    """Fail the collectives in flight now that a rank is gone: gloo notices the closed socket itself, but NCCL would
    wait out COLLECTIVE_TIMEOUT_S."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort_group is not None:
            abort_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks, in place (the graph's all_reduce reads a value nothing else reads)."""
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's x along the last dim, in rank order."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
