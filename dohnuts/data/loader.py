"""Data movement: batches built by worker processes in pinned memory, prefetched to the device.

Workers do the host work (records, tokenization, templating, image decoding and
preprocessing, prefix planning) and hand back pinned batches; a transfer stream copies the
next batch while the compute stream runs the current one. On a CPU the same path runs, with
no streams and no pinning.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..inputs.batch import Batch


def loader_workers(device: torch.device) -> int:
    """Worker processes for batch building: with a GPU, the cores left after the main process,
    up to 4; with the CPU as the device, none (workers would take cores from the compute:
    on 2 cores, evaluation ran at 127 rows/s with one worker and 147 without).

    The policy depends on the machine, never on the results: every batch is a pure function
    of its index.
    """
    if device.type != "cuda":
        return 0
    return max(0, min(4, (os.cpu_count() or 1) - 1))


# Batches each worker process must have to build before it starts. On the H200's host a worker
# costs about 250 ms to start and a 16,384-token evaluation batch 50 to 115 ms to build: on the
# benchmark's 2-batch evaluation set, 1 or 2 workers took 544 to 565 ms and building in the
# loop 298 ms (a857751 in docs/changelog.md).
BATCHES_PER_WORKER = 8


def workers_for(device: torch.device, batches: int) -> int:
    """Worker processes for `batches` batches: `loader_workers`, and no more than one for every
    BATCHES_PER_WORKER batches (a few batches are built in the loop)."""
    return min(loader_workers(device), batches // BATCHES_PER_WORKER)


@dataclass
class Item:
    """A batch with its host-side companions: `tensors` travel with the batch (targets),
    `meta` stays on the host (records to write results for)."""

    batch: Batch
    tensors: tuple[torch.Tensor, ...] = ()
    meta: object = None

    def pin_memory(self) -> Item:
        """Called by the DataLoader's pinning thread."""
        return Item(self.batch.pin_memory(), tuple(tensor.pin_memory() for tensor in self.tensors), self.meta)

    def to(self, device) -> Item:
        return Item(self.batch.to(device), tuple(t.to(device, non_blocking=True) for t in self.tensors), self.meta)


def _as_built(item: Item) -> Item:
    """No conversion: items are built as they should arrive (the default would walk `meta`)."""
    return item


class _Built(torch.utils.data.Dataset):
    def __init__(self, build: Callable[[object], Item], keys: Sequence):
        self.build, self.keys = build, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> Item:
        return self.build(self.keys[index])


def worker_batches(build: Callable[[object], Item], keys: Sequence, device: torch.device,
                   workers: int | None = None) -> Iterable[Item]:
    """`build(key)` for every key, in order, run by worker processes; pinned when the device is
    CUDA and workers build them. `build` must be a picklable callable (a module-level function or
    an object). No more workers start than there are keys, and by default (`workers_for`) none
    for a few batches."""
    workers = min(workers_for(device, len(keys)) if workers is None else workers, len(keys))
    # Pinned by the loader's pinning thread beside the workers; built in the loop, a batch would
    # pay for the pinning copy on the loop's own time, where the plain copy costs no more.
    # Its own generator: opening the loader draws a base seed from it, never from the global
    # generator, whose state (LoRA dropout masks) a resumed run must continue exactly.
    return torch.utils.data.DataLoader(
        _Built(build, keys), batch_size=None, shuffle=False, num_workers=workers, collate_fn=_as_built,
        generator=torch.Generator().manual_seed(0),
        pin_memory=device.type == "cuda" and workers > 0, prefetch_factor=2 if workers else None,
        multiprocessing_context="fork" if workers else None)


def prefetch(items: Iterable[Item], device: torch.device, ahead: bool = True) -> Iterator[Item]:
    """Items on `device`, in order; on CUDA each item's copy runs on a transfer stream, and with
    `ahead` the next item is taken and its copy started before the current one is yielded, so
    the copy runs while the caller computes. Without `ahead` the next item is taken only when
    the caller asks for it: right when `items` builds it in this thread (no loader workers),
    whose host work then runs while the device computes what the caller launched, instead of
    before it.

    Ordering and lifetime: the compute stream waits for the transfer that produced each item,
    and every copied tensor is marked as used by the compute stream (`record_stream`), so
    the allocator never reuses its memory while that stream may still read it.
    """
    if device.type != "cuda":
        for item in items:
            yield item.to(device)
        return
    transfer = torch.cuda.Stream(device)

    def start(item: Item):
        with torch.cuda.stream(transfer):
            moved = item.to(device)
        done = torch.cuda.Event()
        done.record(transfer)
        return moved, done

    if not ahead:
        for item in items:
            yield _ready(*start(item))
        return
    pending = None
    for item in items:
        following = start(item)
        if pending is not None:
            yield _ready(*pending)
        pending = following
    if pending is not None:
        yield _ready(*pending)


def _ready(item: Item, done: torch.cuda.Event) -> Item:
    compute = torch.cuda.current_stream()
    compute.wait_event(done)
    for tensor in _tensors(item):
        tensor.record_stream(compute)
    return item


def _tensors(item: Item) -> Iterator[torch.Tensor]:
    yield from item.tensors
    yield from item.batch.device_tensors()
