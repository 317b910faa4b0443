"""Training: RLCD + CE updates over seeded group-uniform microbatches, checkpoints and resume."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..config import LoraConfig, ModelConfig, TrainConfig, to_dict
from ..data.loader import Item, prefetch, worker_batches
from ..data.records import GroupSampler, RecordReader, encode_examples, load_records, shuffled_choice
from ..io import (
    IntegrityError,
    atomic_directory,
    read_json,
    sha256_file,
    verify_manifest,
    write_bytes,
    write_json,
    write_manifest,
)
from ..model.adapters import (
    ADAPTER,
    base_fingerprint,
    build_training_model,
    load_adapter,
    save_adapter,
    verify_base,
    verify_parent,
    write_adapter_checkpoint,
)
from ..model.base import load_processors
from ..model.decision import DecisionModel
from ..model.template import Template
from ..scoring.objective import microbatch_losses, microbatch_slices, pack_targets
from .distributed import World, all_true, barrier, mean_over_ranks, world
from .schedule import lr_factor
from .sources import executed_by, module_path, relative_file

LOG = logging.getLogger(__name__)
RUN_MARKER = "dohnuts-train-run.json"  # marks a folder train made, so a fresh start may clear it
LOG_FIELDS = ("step", "loss", "reward", "cross_entropy", "accuracy", "lr", "grad_norm", "seconds")


@dataclass(frozen=True)
class TrainRun:
    """Everything one training run depends on."""

    model: ModelConfig
    lora: LoraConfig
    train: TrainConfig
    seed: int
    base: Path
    data: Path
    out: Path
    parent: Path | None = None  # verified unmerged LoRA/head weights to start from


class TrainingBatches:
    """Builds microbatch `index` (runs in loader workers): a pure function of the index."""

    def __init__(self, template: Template, reader: RecordReader, sampler: GroupSampler, max_tokens: int):
        self.template, self.reader, self.sampler, self.max_tokens = template, reader, sampler, max_tokens

    def parts(self, index: int, images: list | None = None, seen: dict | None = None):
        """Microbatch `index` before packing: (rows, images, targets [B, K], ordinal [B]);
        `images` and `seen` extend those of other microbatches (see `encode_examples`)."""
        records, rng = self.sampler.draw(index)
        examples = [shuffled_choice(self.reader.example(row), rng) for _, row in records.iterrows()]
        rows, images, targets = encode_examples(self.template, examples, self.max_tokens, images, seen)
        return rows, images, targets, torch.tensor([row.question.kind == "score" for row in rows])

    def __call__(self, index: int) -> Item:
        rows, images, targets, ordinal = self.parts(index)
        return Item(self.template.collate(rows, images), (targets, ordinal))


class TrainingUpdates:
    """Builds update `index` (runs in loader workers): its microbatches' rows packed into one
    batch, so the update runs one forward and one backward instead of one per microbatch.

    Each microbatch stays one unit of the objective (its own exploration noise and advantage
    normalisation; see `microbatch_losses`), so the gradient is the one of running them one
    after another (LoRA dropout aside, whose masks are drawn differently); only the number of
    launches changes (a quarter with four microbatches, which is what bounds a training step on
    a GPU: docs/runtime.md). Memory grows with the update's tokens instead of a microbatch's.

    Under several processes, rank `rank` of `ranks` builds its own share of the update's
    microbatches, each by its absolute index in the one seeded stream.

    Returns Item(batch, (targets [R, K], ordinal [R]), (sizes, indices)): `sizes` holds each
    microbatch's (rows, candidate width) in order and `indices` their absolute indices; an image
    seen in several microbatches is encoded once.
    """

    def __init__(self, microbatches: TrainingBatches, per_update: int, rank: int = 0, ranks: int = 1):
        if per_update % ranks:
            raise ValueError(f"train.microbatches_per_update = {per_update} does not divide among "
                             f"{ranks} processes: each process takes an equal share of an update")
        self.microbatches, self.per_update = microbatches, per_update
        self.share = per_update // ranks
        self.first = rank * self.share

    def indices(self, index: int) -> range:
        """The absolute microbatch indices this rank builds for update `index`."""
        start = index * self.per_update + self.first
        return range(start, start + self.share)

    def __call__(self, index: int) -> Item:
        rows, images, seen, targets, ordinals = [], [], {}, [], []
        for micro in self.indices(index):
            own_rows, images, own_targets, ordinal = self.microbatches.parts(micro, images, seen)
            rows += own_rows
            targets.append(own_targets)
            ordinals.append(ordinal)
        padded, sizes = pack_targets(targets)
        return Item(self.microbatches.template.collate(rows, images), (padded, torch.cat(ordinals)),
                    (sizes, list(self.indices(index))))


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def resolved_config(run: TrainRun) -> dict:
    """The configuration written beside every checkpoint, with the fingerprint of its base."""
    return {"model": to_dict(run.model), "lora": to_dict(run.lora), "train": to_dict(run.train),
            "seed": run.seed, "init": "checkpoint" if run.parent else "base", "base": base_fingerprint(run.base)}


def source_digests() -> dict[str, str]:
    """SHA-256 of every module training executes (`dohnuts.pipeline.sources`), by file: an edit
    to what training runs starts a new run, an edit elsewhere (the benchmark, say) does not."""
    return {relative_file(name): sha256_file(module_path(name)) for name in executed_by(__name__)}


def _fingerprint(run: TrainRun) -> str:
    """Identity of a run for resuming: config but the step budget (which may grow), input
    manifests, and the source of what training runs, so changed code never continues an old run."""
    config = resolved_config(run)
    config["train"] = {key: value for key, value in config["train"].items() if key != "steps"}
    inputs = [read_json(run.data / "manifest.json")["files"], read_json(run.base / "manifest.json")["files"]]
    if run.parent:
        inputs.append(read_json(run.parent / "manifest.json")["files"])
    return hashlib.sha256(json.dumps([config, inputs, source_digests()], sort_keys=True).encode()).hexdigest()


def build_optimizer(model: DecisionModel, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable weights in two groups: LoRA at `lora_lr`, the head at `head_lr`.

    The fused implementation: one kernel for all the weights of a group, where the default
    launches several per step for the hundreds of small LoRA matrices (host time, which bounds
    a training update on a GPU: docs/runtime.md)."""
    lora_params = [p for p in model.backbone.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": lora_params, "lr": config.lora_lr}, {"params": [model.head.weight], "lr": config.head_lr}],
        weight_decay=config.weight_decay, fused=True)


def noise_generator(seed: int, microbatch: int, device) -> torch.Generator:
    """The generator of a microbatch's exploration noise, seeded by (run seed, absolute microbatch
    index): the same draw whichever process runs it, and after a resume."""
    mixed = hashlib.sha256(f"noise:{seed}:{microbatch}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(mixed[:8], "big") >> 1)


def update_step(model, optimizer: torch.optim.Optimizer, batch, targets: torch.Tensor, ordinal: torch.Tensor,
                sizes: list[tuple[int, int]], config: TrainConfig, noise: list[torch.Generator] | None,
                update: int = 0, place: World | None = None) -> dict:
    """One update: several microbatches at one parameter snapshot, averaged, clipped once, one
    optimizer step; run in one packed forward and backward (`TrainingUpdates`). Training and
    the benchmark both run it. Under several processes each rank runs its share of the
    microbatches; `model` is then wrapped in DistributedDataParallel, which averages the
    gradients over the ranks (equal shares: the mean over all microbatches), and the clip acts
    once on that global gradient.

    Args:
        model: the DecisionModel (or its DistributedDataParallel), in training mode, on the
            batch's device.
        batch: the update's packed batch; targets [R, K], ordinal [R] and `sizes` (each
            microbatch's rows and candidate width) as `TrainingUpdates` builds them.
        noise: one generator of exploration noise per microbatch (`noise_generator`).
        update: the update's index, for error messages.
        place: this process's `World` (None: one process).

    Returns:
        The means over microbatches of loss, reward, cross_entropy and accuracy, and grad_norm.

    Raises:
        FloatingPointError: a non-finite loss or gradient norm (before the optimizer step).
    """
    place = place or World(0, 1, batch.input_ids.device)
    logits = model(batch)
    outputs = microbatch_losses(logits, batch.candidate_mask, targets, ordinal, sizes, config.objective, noise)
    losses = torch.stack([out.loss for out in outputs])
    # The checks below read the device once, after the backward: a read between the forward
    # and the backward would stall the host, whose launches bound the update, until the device
    # caught up. A non-finite loss still aborts before the optimizer step.
    losses.mean().backward()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
    with torch.no_grad():
        accuracy = []
        for rows, width in microbatch_slices(sizes):
            mask = batch.candidate_mask[rows, :width]
            predicted = logits[rows, :width].masked_fill(~mask, float("-inf")).argmax(-1)
            accuracy.append((predicted == targets[rows, :width].argmax(-1)).float().mean())
        means = mean_over_ranks(place, torch.stack([losses, torch.stack([out.reward_mean for out in outputs]),
                                                    torch.stack([out.cross_entropy for out in outputs]),
                                                    torch.stack(accuracy)]).mean(1))
        # (clip_grad_norm_ returns a host zero when no weight has a gradient.)
        norm = grad_norm.reshape(1).float().to(losses.device)
        report = torch.cat([torch.isfinite(losses).float(), norm, means]).tolist()
    finite, norm = [flag == 1.0 for flag in report[:len(outputs)]], report[len(outputs)]
    if not all_true(place, all(finite)):  # every rank aborts together, none waits in a collective
        micro = finite.index(False) if not all(finite) else None
        where = f"microbatch {micro} of this process" if micro is not None else "another process"
        raise FloatingPointError(f"non-finite loss at update {update}, {where}: aborting before the optimizer step")
    if not math.isfinite(norm):
        raise FloatingPointError(f"non-finite gradient norm {norm} at update {update}: "
                                 f"aborting before the optimizer step")
    totals = dict(zip(("loss", "reward", "cross_entropy", "accuracy"), report[len(outputs) + 1:]))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**totals, "grad_norm": norm}


GENERATORS = "generators.safetensors"  # torch, CUDA and noise generator states
HOST_GENERATORS = "generators.json"  # Python's and numpy's


def save_generators(folder: Path) -> None:
    """Every global random generator's state (LoRA dropout draws from them), as tensors and JSON:
    nothing a load would unpickle. The exploration noise needs none: it is seeded per microbatch."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{index}": state for index, state in enumerate(torch.cuda.get_rng_state_all())})
    save_file(tensors, str(folder / GENERATORS))
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    write_json(folder / HOST_GENERATORS, {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)]})


def load_generators(folder: Path) -> None:
    """Restore what `save_generators` wrote."""
    tensors = load_file(str(folder / GENERATORS))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{index}"] for index in range(len(tensors)) if f"cuda.{index}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    host = read_json(folder / HOST_GENERATORS)
    version, internal, gauss = host["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = host["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


class Trainer:
    """Owns the model, optimizer, samplers and RNG of one run; `run()` trains to the budget."""

    def __init__(self, run: TrainRun, place: World | None = None):
        self.run = run
        self.place = place or world()
        self.device = self.place.device
        torch.manual_seed(run.seed)
        verify_base(run.base)
        self.model, self.peft_model = build_training_model(
            run.base, run.model.dtype, run.lora, run.train.head_init_std, run.seed)
        if run.parent:
            load_adapter(verify_parent(run.parent, run.lora, run.base), self.model, self.peft_model)
        self.model.to(self.device)
        self.model.activation_checkpointing = run.train.activation_checkpointing
        tokenizer, processor = load_processors(run.base, run.model)
        self.template = Template(tokenizer, processor, run.model.marker_token)
        self.reader = RecordReader(run.data)
        self.sampler = GroupSampler(load_records(run.data), run.seed,
                                    run.train.rows_per_microbatch, run.train.group_cap)
        self.builder = TrainingBatches(self.template, self.reader, self.sampler, run.train.max_tokens)
        self.updates = TrainingUpdates(self.builder, run.train.microbatches_per_update, self.place.rank,
                                       self.place.size)
        self.stream = None  # updates from loader workers, opened at the first update
        config = run.train
        self.optimizer = build_optimizer(self.model, config)
        self.base_lrs = [config.lora_lr, config.head_lr]
        # Under several processes the gradients are averaged by DDP during the backward pass.
        self.forward = self.model
        if self.place.distributed:
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        self.update = 0
        self.log: list[dict] = []
        self.config = resolved_config(run)
        self.fingerprint = _fingerprint(run)

    # -- persistence -------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """The checkpoint of this update (rank 0 writes; every rank waits for it)."""
        if self.place.main:
            folder = self.run.out / "checkpoints" / checkpoint_name(self.update)
            with atomic_directory(folder) as tmp:
                write_adapter_checkpoint(tmp, self.model, self.peft_model, self.config,
                                         {"step": self.update, "fingerprint": self.fingerprint})
        barrier(self.place)

    def save_state(self) -> None:
        """Everything needed to continue exactly: weights, optimizer, RNG, update count, log
        (rank 0 writes; every rank can resume from it, with any process count)."""
        if self.place.main:
            with atomic_directory(self.run.out / "state") as tmp:
                save_adapter(tmp / ADAPTER, self.model, self.peft_model)
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")  # tensors and numbers only
                save_generators(tmp)
                write_json(tmp / "progress.json", {"update": self.update, "fingerprint": self.fingerprint,
                                                   "log": self.log, "processes": self.place.size})
                write_manifest(tmp)
        barrier(self.place)

    def try_resume(self) -> str | None:
        """Restore the saved state if it belongs to this run.

        Returns:
            None when resumed, else why not (no state, a damaged state, another
            configuration, or a saved run already past the step budget).
        """
        state = self.run.out / "state"
        if not (state / "progress.json").is_file():
            return f"no saved state in {state}"
        try:
            verify_manifest(state)
        except IntegrityError as error:
            return f"the saved state is damaged ({error})"
        progress = read_json(state / "progress.json")
        if progress["fingerprint"] != self.fingerprint:
            return "the saved state belongs to another configuration, input or code version"
        if progress["update"] > self.run.train.steps:
            return (f"the saved run reached update {progress['update']}, past train.steps = "
                    f"{self.run.train.steps} (only the budget may grow on resume)")
        load_adapter(state / ADAPTER, self.model, self.peft_model)
        self.optimizer.load_state_dict(torch.load(state / "optimizer.pt", map_location=self.device,
                                                  weights_only=True))
        load_generators(state)
        self.update, self.log = progress["update"], progress["log"]
        return None

    def write_log(self) -> None:
        if not self.place.main:
            return
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(self.log)
        write_bytes(self.run.out / "log.csv", buffer.getvalue().encode())

    # -- training ----------------------------------------------------------------------

    def set_lr(self) -> float:
        config = self.run.train
        factor = lr_factor(self.update, config.steps, config.horizon_cap, config.warmup_fraction, config.lr_floor)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return factor

    def microbatch(self, index: int):
        """Microbatch `index` on the device, built here: (batch, targets [B, K], ordinal [B])."""
        item = self.builder(index).to(self.device)
        return item.batch, *item.tensors

    def noise(self, index: int) -> torch.Generator:
        """The exploration-noise generator of microbatch `index` (`noise_generator`)."""
        return noise_generator(self.run.seed, index, self.device)

    def next_update(self):
        """This rank's share of this update's microbatches, built by loader workers and
        prefetched: (batch, targets [R, K], ordinal [R], (sizes, microbatch indices))."""
        if self.stream is None:
            # As many as the run asks for: the workers run a few updates ahead, no more.
            indices = range(self.update, self.update + 2**40)
            self.stream = prefetch(worker_batches(self.updates, indices, self.device), self.device)
        item = next(self.stream)
        return item.batch, *item.tensors, item.meta

    def step(self) -> dict:
        """One update (`update_step`) on the next prefetched update batch, at the scheduled rate."""
        started = time.perf_counter()
        factor = self.set_lr()
        self.model.train()
        batch, targets, ordinal, (sizes, indices) = self.next_update()
        totals = update_step(self.forward, self.optimizer, batch, targets, ordinal, sizes, self.run.train,
                             [self.noise(index) for index in indices], self.update, self.place)
        self.update += 1
        return {"step": self.update, **totals, "lr": factor * self.run.train.lora_lr,
                "seconds": time.perf_counter() - started}

    def run_to_budget(self, on_update=None) -> None:
        """Train until `train.steps` updates, checkpointing at 0, every `eval_every` and the end.

        Args:
            on_update: optional callback(update) after each update (progress, tests).
        """
        config = self.run.train
        if self.update == 0:
            self.save_checkpoint()
            self.save_state()
        bar = tqdm(total=config.steps, initial=self.update, desc="train", unit="update", dynamic_ncols=True,
                   disable=not self.place.main)
        while self.update < config.steps:
            record = self.step()
            self.log.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.2f}")
            if self.update % config.eval_every == 0 or self.update == config.steps:
                self.save_checkpoint()
                self.save_state()
                self.write_log()
            if on_update is not None:
                on_update(self.update)
        bar.close()
        self.write_log()
        self.close()

    def close(self) -> None:
        """Stop the loader workers (a later `step` opens a new stream from the current update)."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None


def train(run: TrainRun, resume: bool, on_update=None) -> Trainer:
    """Train a run; with `resume`, continue from its saved state when that state is this run's.

    A fresh start clears the output folder first, so no checkpoint of another run survives; it
    clears only a folder a training run made (one holding RUN_MARKER), never another one.

    Raises:
        FileExistsError: `run.out` holds files but is not a training run's folder.
    """
    marker = run.out / RUN_MARKER
    if run.out.is_dir() and any(run.out.iterdir()) and not marker.is_file():
        raise FileExistsError(f"{run.out} is not empty and holds no {RUN_MARKER}: it is not a training run's "
                              f"folder, so train will not clear it; empty it or choose another output folder")
    trainer = Trainer(run)
    place = trainer.place
    reason = trainer.try_resume() if resume else "resume not asked for"
    if not all_true(place, reason is None):  # every rank resumes, or every rank starts afresh
        if place.main:
            if run.out.exists():
                LOG.warning("starting %s afresh and clearing it: %s", run.out, reason or "another process's state")
                shutil.rmtree(run.out)
            run.out.mkdir(parents=True)
            write_json(marker, {"written_by": "dohnuts train",
                                "note": "train clears this folder when a run starts afresh"})
        barrier(place)
        trainer = Trainer(run, place) if reason is None else trainer  # a rank that had resumed starts over
    elif place.main:
        LOG.info("resuming %s at update %d of %d", run.out, trainer.update, run.train.steps)
    trainer.run_to_budget(on_update)
    return trainer
