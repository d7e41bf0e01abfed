"""Tensor parallel over processes, one a device. Rank 0 is the engine's process: it keeps the scheduler and samples.
It starts ranks 1.. as fresh interpreters (`python -m backends.cuda.tensor_parallel`), each loading the model and
holding its rank's shard (ir.sharding), and sends them every call that runs the graph (set_limits, allocate_kv, and
forward with the step's Batch, the core.batch contract) over a gloo group; each rank then runs the same graph, its
collectives meeting the others'. Under torchrun (or an MPI launcher) the launcher starts the ranks instead.

A worker that exits fails rank 0's next call, or the collective waiting for it (WorkerDied, or the group's error),
and the engine stops (CUDABackend.is_fatal): an error, never a hang."""

from __future__ import annotations

import atexit
import base64
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from backends.cuda import distributed
from backends.cuda.backend import CUDABackend
from backends.cuda.distributed import Rendezvous, dist
from backends.cuda.runtime import torch
from ir.loader import LoadedModel, load_model
from ir.sharding import check_world, shard

log = logging.getLogger(__name__)

WORKER_ENV = "LLM_ENGINE_TP_WORKER"  # a worker's spec, pickled and base64-encoded
STOP_WAIT_S = 10


class WorkerDied(RuntimeError):
    pass


class Workers:
    """Ranks 1.. as rank 0 sees them: their processes (none under torchrun) and the channel to them."""

    def __init__(self, procs: dict[int, subprocess.Popen]):
        self.procs = procs
        self.stopped = self.closing = False

    def check(self) -> None:
        for rank, p in self.procs.items():
            if p.poll() is not None:
                raise WorkerDied(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.returncode}")

    def watch(self, every_s: float = 0.1) -> None:
        """In the background: a worker that exits aborts the group at once (NCCL's collectives would wait)."""
        def run() -> None:
            while not self.closing:
                try:
                    self.check()
                except WorkerDied as e:
                    if not self.closing:
                        log.error("%s; aborting the tensor-parallel group", e)
                        distributed.abort()
                    return
                time.sleep(every_s)

        if self.procs:
            threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def explain(self, error: BaseException, wait_s: float = 1.0) -> None:
        """WorkerDied from `error` (a failed collective) if a worker exits within wait_s; else nothing."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check()
            except WorkerDied as died:
                raise WorkerDied(f"{died} during a step") from error
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def send(self, method: str, *args, **kwargs) -> None:
        """Every worker runs backend.method(*args, **kwargs), as rank 0 is about to."""
        if self.stopped:
            raise WorkerDied("the tensor-parallel workers were stopped")
        self.check()
        dist.broadcast_object_list([(method, args, kwargs)], src=0, group=distributed.messages_group())

    def close(self) -> None:
        """Stop the workers (told to, then killed after STOP_WAIT_S)."""
        if self.stopped:
            return
        self.closing = True  # the workers' exits that follow are expected (watch)
        try:
            self.send("stop")
        except Exception:  # noqa: BLE001  (a worker already gone: the rest are killed below)
            pass
        self.stopped = True
        for p in self.procs.values():
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        distributed.shutdown()


def start(model: LoadedModel, devices: Sequence[str], rendezvous: Rendezvous | None = None,
          **options) -> CUDABackend:
    """Rank 0's backend over len(devices) ranks, rank r on devices[r]; its workers are spawned here, unless a
    launcher started them (`rendezvous`: this process's place, from Rendezvous.from_env)."""
    world = rendezvous.world if rendezvous is not None else len(devices)
    check_world(world)
    shard(model.graph, 0, world)  # heads that do not split: refused before any process starts
    if rendezvous is None:
        rendezvous = Rendezvous(0, world, "127.0.0.1", distributed.free_port())
        procs = {r: _spawn(model, Rendezvous(r, world, rendezvous.addr, rendezvous.port, r), devices[r], options)
                 for r in range(1, world)}
    else:
        procs = {}
    workers = Workers(procs)
    atexit.register(workers.close)
    device = torch.device(devices[0])
    try:
        _join(rendezvous, device, workers)
        backend = CUDABackend(model, device=device, rank=0, world=world, **options)
    except BaseException:
        workers.close()
        raise
    backend.mirror, backend.workers = workers.send, workers
    workers.watch()
    return backend


def _spawn(model: LoadedModel, rv: Rendezvous, device: str, options: dict) -> subprocess.Popen:
    spec = base64.b64encode(pickle.dumps({"model": str(model.path), "isq": model.isq, "rendezvous": rv,
                                          "device": device, "options": options})).decode()
    root = str(Path(__file__).resolve().parents[2])  # the package root: the worker imports this code, not another
    env = {**os.environ, WORKER_ENV: spec, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen([sys.executable, "-m", "backends.cuda.tensor_parallel"], env=env, cwd=root,
                            stdin=subprocess.DEVNULL)


def _join(rv: Rendezvous, device: torch.device, workers: Workers) -> None:
    """Join the group, watching the workers: one that dies before it joins fails this at once."""
    done, error = threading.Event(), []

    def run() -> None:
        try:
            distributed.init(rv, device)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="tp-join", daemon=True).start()
    while not done.wait(0.1):
        workers.check()
    if error:
        raise error[0]


def serve(backend: CUDABackend) -> None:
    """A worker's loop: rank 0's calls, in order, until it says stop (or the group fails: rank 0 is gone)."""
    group = distributed.messages_group()
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        method, args, kwargs = box[0]
        if method == "stop":
            return
        getattr(backend, method)(*args, **kwargs)


def worker_main(spec: dict) -> None:
    rv, device = spec["rendezvous"], torch.device(spec["device"])
    distributed.init(rv, device)
    model = load_model(spec["model"], progress=False, isq=spec.get("isq"))  # rank 0's --isq: the same bytes
    serve(CUDABackend(model, device=device, rank=rv.rank, world=rv.world, **{"progress": False, **spec["options"]}))
    distributed.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s tp-worker pid %(process)d %(name)s: %(message)s")
    worker_main(pickle.loads(base64.b64decode(os.environ[WORKER_ENV])))
