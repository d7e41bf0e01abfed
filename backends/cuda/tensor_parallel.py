"""Tensor parallel over processes, one a device. Rank 0 is the engine's process: it keeps the scheduler and samples.
It starts ranks 1.. as fresh interpreters (`python -m backends.cuda.tensor_parallel`), each loading the model and
holding its rank's shard (ir.sharding), and sends them every call that runs the graph (set_limits, allocate_kv, and
forward with the step's Batch, the core.batch contract) over a gloo group; each rank then runs the same graph, its
collectives meeting the others'. Under torchrun (or an MPI launcher) the launcher starts the ranks instead. The
processes themselves (spawning, watching, the workers' loop) are backends.tp_processes', shared with MLX.

A worker that exits fails rank 0's next call, or the collective waiting for it (WorkerDied, or the group's error),
and the engine stops (CUDABackend.is_fatal): an error, never a hang."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence

from backends import tp_processes
from backends.cuda import distributed
from backends.cuda.backend import CUDABackend
from backends.cuda.distributed import Rendezvous, dist
from backends.cuda.runtime import torch
from backends.tp_processes import Channel, WorkerDied, Workers
from ir.loader import LoadedModel, load_model, synthetic_model
from ir.sharding import check_world, shard

__all__ = ["WorkerDied", "Workers", "start", "worker_main"]
log = logging.getLogger(__name__)


def _broadcast(message: object) -> None:
    dist.broadcast_object_list([message], src=0, group=distributed.messages_group())


def _receive() -> object:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=distributed.messages_group())
    return box[0]


CHANNEL = Channel(_broadcast, distributed.shutdown, distributed.abort)


def start(model: LoadedModel, devices: Sequence[str], rendezvous: Rendezvous | None = None,
          **options) -> CUDABackend:
    """Rank 0's backend over len(devices) ranks, rank r on devices[r]; its workers are spawned here, unless a
    launcher started them (`rendezvous`: this process's place, from Rendezvous.from_env)."""
    world = rendezvous.world if rendezvous is not None else len(devices)
    check_world(world)
    shard(model.graph, 0, world)  # heads that do not split: refused before any process starts
    if rendezvous is None:
        rendezvous = Rendezvous(0, world, "127.0.0.1", tp_processes.free_port())
        # random weights have no file: each worker builds the graph from the config and makes its own slice
        source = {"config": model.config} if options.get("random_weights") is not None else {
            "model": str(model.path), "isq": model.isq, "task": model.task}
        procs = {r: tp_processes.spawn("backends.cuda.tensor_parallel", {
            **source, "device": devices[r], "options": options,
            "rendezvous": Rendezvous(r, world, rendezvous.addr, rendezvous.port, r)}) for r in range(1, world)}
    else:
        procs = {}
    workers = Workers(procs, CHANNEL)
    atexit.register(workers.close)
    device = torch.device(devices[0])
    try:
        tp_processes.join(lambda: distributed.init(rendezvous, device), workers)
        backend = CUDABackend(model, device=device, rank=0, world=world, **options)
    except BaseException:
        workers.close()
        raise
    backend.mirror, backend.workers = workers.send, workers
    workers.watch()
    return backend


def worker_main(spec: dict) -> None:
    rv, device = spec["rendezvous"], torch.device(spec["device"])
    distributed.init(rv, device)
    if "config" in spec:  # a synthetic model (random_weights): the same graph, no file
        model = synthetic_model(spec["config"])
    else:  # rank 0's --isq and --task: the same bytes, the same graph
        model = load_model(spec["model"], progress=False, isq=spec.get("isq"), task=spec.get("task", "auto"))
    tp_processes.serve(CUDABackend(model, device=device, rank=rv.rank, world=rv.world,
                                   **{"progress": False, **spec["options"]}), _receive)
    distributed.shutdown()


if __name__ == "__main__":
    tp_processes.worker_logging()
    worker_main(tp_processes.worker_spec())
