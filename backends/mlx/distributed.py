"""mx.distributed's ring backend for tensor parallel: where the ranks meet (one "ip:port" a rank, written to the
hostfile MLX reads from MLX_HOSTFILE, with MLX_RANK), the graph's collectives, and rank 0's messages to the workers
(pickled bytes summed over the ring, the workers adding zeros: the ring has no broadcast).

MLX makes its global group once a process and never leaves it, so a process is a rank of one group in its life."""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from backends.mlx.runtime import mx

_GROUP = None


@dataclass(frozen=True)
class Ring:
    """One rank's place in the ring and every rank's addresses (rank r listens at hosts[r], each "ip:port")."""

    rank: int
    hosts: tuple[tuple[str, ...], ...]

    @property
    def world(self) -> int:
        return len(self.hosts)

    @classmethod
    def local(cls, rank: int, addresses: list[str]) -> Ring:
        """One address a rank, e.g. "127.0.0.1:port"."""
        return cls(rank, tuple((a,) for a in addresses))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Ring | None:
        """mlx.launch's MLX_RANK and MLX_HOSTFILE (its JSON: each rank's list of "ip:port"); None when this process
        was not launched as one rank of a ring."""
        rank, path = env.get("MLX_RANK"), env.get("MLX_HOSTFILE")
        if rank is None or not path:
            return None
        try:
            with open(path) as f:
                hosts = json.load(f)
            return cls(int(rank), tuple(tuple(str(a) for a in h) for h in hosts))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"mlx.launch's MLX_RANK {rank!r} and MLX_HOSTFILE {path} (a JSON list of each rank's "
                             f"\"ip:port\" list) do not make a ring: {e}") from None

    def where(self, rank: int | None = None) -> str:
        return ",".join(self.hosts[self.rank if rank is None else rank])


def init(ring: Ring) -> None:
    """Join the ring (blocks until every rank has); a clear error when it cannot start or was joined before."""
    global _GROUP
    if _GROUP is not None:
        raise RuntimeError(f"this process is already rank {_GROUP.rank()} of an MLX ring of {_GROUP.size()}: MLX "
                           "makes its group once a process, so start tensor parallel in a fresh one")
    if not mx.distributed.is_available():
        raise RuntimeError("this MLX build has no mx.distributed (tensor parallel needs its ring backend)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="mlx-ring-", delete=False) as f:
        json.dump([list(h) for h in ring.hosts], f)
    saved = {k: os.environ.get(k) for k in ("MLX_RANK", "MLX_HOSTFILE")}
    os.environ.update(MLX_RANK=str(ring.rank), MLX_HOSTFILE=f.name)
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:
        errno = re.search(r"error: (\d+)", str(e))  # MLX gives the socket's errno as a number
        why = f"{e} ({os.strerror(int(errno[1])).lower()})" if errno else str(e)
        raise RuntimeError(f"MLX's ring could not start: rank {ring.rank} at {ring.where()} of "
                           f"{' '.join(map(ring.where, range(ring.world)))}: {why}") from None
    finally:
        os.unlink(f.name)
        for k, v in saved.items():  # read by init only: later processes this one starts must not inherit them
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if (group.rank(), group.size()) != (ring.rank, ring.world):
        raise RuntimeError(f"MLX's ring made rank {group.rank()} of {group.size()}, not {ring.rank} of {ring.world}")
    _GROUP = group


def all_reduce(x: mx.array) -> mx.array:
    """The sum over the ranks."""
    return mx.distributed.all_sum(x, group=_GROUP)


def all_gather(x: mx.array, world: int) -> mx.array:
    """Every rank's x along the last dim, in rank order (MLX gathers along the first)."""
    parts = mx.distributed.all_gather(x, group=_GROUP).reshape(world, *x.shape)
    return mx.moveaxis(parts, 0, -2).reshape(*x.shape[:-1], world * x.shape[-1])


def broadcast(message: object) -> None:
    """Rank 0's side of receive."""
    data = pickle.dumps(message)
    mx.eval(all_reduce(mx.array([len(data)], dtype=mx.int64)))
    mx.eval(all_reduce(mx.array(memoryview(data), dtype=mx.uint8)))


def receive() -> object:
    """A worker's: rank 0's next message (its length, then its bytes)."""
    n = all_reduce(mx.zeros((1,), dtype=mx.int64)).item()
    data = all_reduce(mx.zeros((n,), dtype=mx.uint8))
    mx.eval(data)
    return pickle.loads(memoryview(data))
