"""The command line's parallel flags (--d's GPU ids, --tp's process count) and the rank a launcher (torchrun or an
MPI launcher for the CUDA backend, mlx.launch for MLX) gave this process, each held to the sharding pass's rule of
ranks and refused with argparse's message."""

from __future__ import annotations

import argparse
import os

from ir.sharding import check_world


def device_ids(ap: argparse.ArgumentParser, text: str) -> list[int]:
    ids = [x.strip() for x in text.split(",")]
    if not ids or not all(i.isdigit() for i in ids) or len(set(ids)) != len(ids):
        ap.error(f"--d takes GPU ids separated by commas, each once (0 or 0,1,2,3), got {text!r}")
    check_flag_world(ap, "--d", len(ids), "GPUs")
    return [int(i) for i in ids]


def check_flag_world(ap: argparse.ArgumentParser, flag: str, n: int, unit: str) -> None:
    try:
        check_world(n, unit)  # the rule the sharding pass holds ranks to
    except ValueError as e:
        ap.error(f"{flag}: {e}")


def launcher_rank(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """This process's Rendezvous when torchrun or an MPI launcher started it as one rank of several, else None."""
    def place():
        from backends.cuda.distributed import Rendezvous
        return Rendezvous.from_env()

    return _launched(ap, args, ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), place, "cuda", args.d is not None,
                     "under torchrun or an MPI launcher each rank takes the GPU of its LOCAL_RANK; --d is not for it")


def mlx_launch_rank(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """This process's Ring when mlx.launch started it as one rank of a ring (MLX_RANK, MLX_HOSTFILE), else None."""
    def place():
        from backends.mlx.distributed import Ring
        return Ring.from_env()

    if args.launch is not None:
        return None
    return _launched(ap, args, ("MLX_RANK",), place, "mlx",
                     args.d is not None or args.tp is not None or args.backend == "cuda",
                     "under mlx.launch the ranks are its processes on the MLX backend; --d, --tp and --backend cuda "
                     "are not for it")


def _launched(ap: argparse.ArgumentParser, args: argparse.Namespace, markers: tuple[str, ...], place,
              backend: str, refused: bool, refusal: str):
    """A launcher's rank (place(), read when one of `markers` is set) of more than one, on `backend`; the flags
    that `refused` says were given are an error."""
    if not any(m in os.environ for m in markers):
        return None
    try:
        rank = place()
    except ValueError as e:
        ap.error(str(e))
    if rank is None or rank.world == 1:
        return None
    if refused:
        ap.error(refusal)
    # refused by every rank here, before any joins a group that rank 0 would never join
    check_flag_world(ap, "the launcher's world size", rank.world, "processes")
    if not 0 <= rank.rank < rank.world:
        ap.error(f"the launcher gave this process rank {rank.rank}, not one of 0..{rank.world - 1}")
    if args.on_engine_death == "restart":  # the other ranks are the launcher's: a new engine could not rejoin them
        ap.error("--on-engine-death restart: under a launcher the other ranks end with the engine and a new one "
                 "could not rejoin them; leave it at exit and let the launcher start the job again")
    args.backend = backend
    return rank
