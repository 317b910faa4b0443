"""Several processes, one per GPU, through torch.distributed: the same mathematics as one process.

A stage reads `distributed.processes`. With more than one and not yet under torchrun, `relaunch`
starts torchrun (`--standalone`) on the same command and waits for it. Under torchrun, `world()`
joins the process group: NCCL on CUDA, gloo on the CPU, chosen by the device and nothing else.
Rank 0 alone writes; evaluation shards whole batches over the ranks and gathers them on rank 0 in
the original order.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=10)  # a collective waiting longer than this on a dead rank fails


class DistributedError(RuntimeError):
    """Another rank failed, or the processes were launched inconsistently."""


@dataclass(frozen=True)
class World:
    """This process's place: rank and size (1 and 0 without torchrun) and the device it uses."""

    rank: int
    size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """The process group torchrun set up (joined on first use), or a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise DistributedError(f"local rank {local} has no GPU: {torch.cuda.device_count()} visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return World(rank, size, device)


def relaunch(processes: int, module: str) -> int | None:
    """With `processes` > 1 outside torchrun, run `python -m module` (this command's arguments)
    under torchrun on this node and return its exit status; else None (go on in this process)."""
    if processes <= 1 or "WORLD_SIZE" in os.environ:
        return None
    from torch.distributed.run import main as torchrun

    try:
        torchrun(["--standalone", "--nproc-per-node", str(processes), "-m", module, *sys.argv[1:]])
    except Exception as error:  # noqa: BLE001 - torchrun's ChildFailedError names the failed rank
        print(f"distributed run failed: {error}", file=sys.stderr)
        return 1
    return 0


def barrier(place: World) -> None:
    if place.distributed:
        dist.barrier()


def all_true(place: World, value: bool) -> bool:
    """Whether `value` holds on every rank (so all ranks take the same branch together)."""
    if not place.distributed:
        return value
    flag = torch.tensor([1 if value else 0], device=place.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def mean_over_ranks(place: World, values: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over the ranks (every rank gets it)."""
    if not place.distributed:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values / place.size


def gathered(place: World, items: list) -> list | None:
    """Every rank's `items` joined on rank 0 (None on the others), rank by rank."""
    if not place.distributed:
        return items
    parts = [None] * place.size if place.main else None
    dist.gather_object(items, parts, dst=0)
    return [item for part in parts for item in part] if place.main else None


def shard(place: World, count: int) -> list[int]:
    """The indices of `count` work items this rank takes: every size-th from its rank."""
    return list(range(place.rank, count, place.size))
