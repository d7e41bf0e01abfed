"""Tensor parallel on MLX: `world` local processes joined by mx.distributed's ring (TCP on 127.0.0.1), as the CUDA
backend's over torch.distributed. Rank 0 is the engine's process: it keeps the scheduler and samples, spawns ranks
1.. (`python -m backends.mlx.tensor_parallel`), each loading the model and holding its rank's shard (ir.sharding),
and sends them every call that runs the graph (allocate_kv, forward with the step's Batch) over the ring itself
(backends.mlx.distributed.broadcast). The processes are backends.tp_processes', shared with the CUDA backend.

A ring that cannot start (a port taken, a worker that dies before joining) fails start with the reason; a worker
that exits later fails the step that needs it, and the engine stops (MLXBackend.is_fatal)."""

from __future__ import annotations

import atexit
import logging

from backends import tp_processes
from backends.mlx import distributed
from backends.mlx.backend import MLXBackend
from backends.mlx.distributed import Ring
from backends.tp_processes import Channel, Workers
from ir.loader import LoadedModel, load_model
from ir.sharding import check_world, shard

log = logging.getLogger(__name__)
CHANNEL = Channel(distributed.broadcast, lambda: None)  # MLX's group lasts as long as its process


def start(model: LoadedModel, world: int, hosts: list[str] | None = None, ring: Ring | None = None,
          **options) -> MLXBackend:
    """Rank 0's backend over `world` local ranks, its workers spawned here; `hosts` ("ip:port", one a rank) where
    the ranks listen, by default free ports on 127.0.0.1. Or, given `ring` (Ring.from_env: mlx.launch started
    every rank, on one host or several), rank 0 of that ring, spawning nothing."""
    if ring is None:
        ring = Ring.local(0, hosts or [f"127.0.0.1:{tp_processes.free_port()}" for _ in range(world)])
        spawned = range(1, ring.world)
    else:
        spawned = range(0)
    if ring.world != world:
        raise ValueError(f"{world} ranks need {world} ring addresses, not {ring.world}")
    check_world(world)
    shard(model.graph, 0, world)  # heads that do not split: refused before any process starts
    procs = {r: tp_processes.spawn("backends.mlx.tensor_parallel", {
        "model": str(model.path), "isq": model.isq, "task": model.task, "options": options,
        "ring": Ring(r, ring.hosts)})
        for r in spawned}
    workers = Workers(procs, CHANNEL)
    atexit.register(workers.close)
    try:
        tp_processes.join(lambda: distributed.init(ring), workers)
    except BaseException:
        workers.close(joined=False)  # a ring that never formed: the workers wait to connect, not for messages
        raise
    try:
        backend = MLXBackend(model, rank=0, world=world, **options)
    except BaseException:
        workers.close()
        raise
    backend.mirror, backend.workers = workers.send, workers
    workers.watch()
    log.info("mlx tensor parallel: %d ranks over the ring at %s", world, " ".join(map(ring.where, range(world))))
    return backend


def worker_main(spec: dict) -> None:
    """A rank other than 0: join the ring, load its shard, run rank 0's calls until told to stop."""
    ring = spec["ring"]
    distributed.init(ring)
    # rank 0's --isq and --task: the same bytes, the same graph
    model = load_model(spec["model"], progress=False, isq=spec.get("isq"), task=spec.get("task", "auto"))
    backend = MLXBackend(model, rank=ring.rank, world=ring.world, **{"progress": False, **spec["options"]})
    tp_processes.serve(backend, distributed.receive)


if __name__ == "__main__":
    tp_processes.worker_logging()
    worker_main(tp_processes.worker_spec())
