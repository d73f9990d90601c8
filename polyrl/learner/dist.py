"""Process groups for the FSDP2 learner: start one as ``torchrun`` describes it, stop it, and the row collectives.

``torchrun --nproc-per-node N`` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process;
``init_from_env()`` joins the group they describe (NCCL on one GPU per process when CUDA is available, else gloo on
the CPU) and ``close()`` leaves it. Tests start processes themselves and set the same variables.

Row collectives: a batch of B rows is split into ``world`` equal contiguous shards of ceil(B / world) rows, the last
shard padded by repeating the batch's last row, so that every rank runs the same number of forward passes; the
shards are all-gathered back and the padding dropped, giving every rank the identical full [B, ...] result.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from polyrl.errors import ConfigError


def pick_device(setting: str, processes: int = 1) -> torch.device:
    """The device that ``--device`` (``ScaleConfig.device``) names for ``processes`` training processes on this
    machine: cuda needs a GPU for each (ConfigError naming the setting otherwise), cpu is the CPU, and auto is cuda
    where torch sees enough GPUs, else the CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "cpu" or (setting == "auto" and gpus < processes):
        return torch.device("cpu")
    if gpus < processes:
        need = f"{processes} training processes need a GPU each" if processes > 1 else "it needs a CUDA GPU"
        raise ConfigError(f"device = 'cuda' is not allowed here: {need} and torch sees {gpus} "
                          f"(torch {torch.__version__}); use --device cpu or auto")
    return torch.device("cuda")


def init_from_env(timeout_s: float = 4 * 3600.0, *, cuda: bool | None = None) -> tuple[int, int] | None:
    """Join the process group that torchrun's variables describe; return (rank, world size), or None when
    WORLD_SIZE is unset (a plain single-process run). Idempotent: an initialised group is kept. ``cuda``: NCCL with
    a GPU per process, else gloo on the CPU (None: NCCL wherever CUDA is available).

    The timeout is long on purpose: while rank 0 generates and evaluates alone (rollout workers included), the
    other ranks wait in a broadcast of the batch, and a long step must not read as a dead rank."""
    if "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        cuda = torch.cuda.is_available() if cuda is None else cuda
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def close() -> None:
    """Leave the process group (no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def leave() -> None:
    """Meet every rank, then leave the process group (no-op without one): a rank that tears gloo down while a peer
    is still in a collective takes the peer down with SIGABRT, and NCCL warns of a group never destroyed."""
    barrier()
    close()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def device() -> torch.device:
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: Tensor) -> Tensor:
    """Sum of ``values`` over ranks, on the device and with the dtype it came with (identity without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    buf = values.detach().to(device(), copy=True)
    dist.all_reduce(buf)
    return buf.to(values.device)


def row_shard(n: int) -> tuple[Tensor, Tensor]:
    """This rank's rows of an n-row batch: (indices [ceil(n / world)], real [same] bool); padding repeats row n-1."""
    rank, world = rank_world()
    per = -(-n // world)
    positions = torch.arange(rank * per, (rank + 1) * per)
    return positions.clamp(max=max(n - 1, 0)), positions < n


def gather_rows(local: Tensor | None, n: int) -> Tensor | None:
    """All-gather every rank's equal-size row shard (``row_shard``) into the full [n, ...] tensor, on the CPU."""
    if local is None:
        return None
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local.cpu()[:n]
    buf = local.detach().to(device()).contiguous()
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buf)
    return torch.cat(parts).cpu()[:n]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
