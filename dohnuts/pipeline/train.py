"""Training: RLCD + CE updates over seeded group-uniform microbatches, checkpoints and resume."""

from __future__ import annotations

import csv
import io
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import LoraConfig, ModelConfig, TrainConfig, to_dict
from ..data.loader import Item, prefetch, worker_batches
from ..data.records import GroupSampler, RecordReader, encode_examples, load_records, shuffled_choice
from ..inputs.template import Template
from ..io import atomic_directory, sha256_file, write_bytes, write_json
from ..model.base import load_processors
from ..runtime.checkpoint import (
    base_fingerprint,
    build_training_model,
    load_adapter,
    load_training_state,
    read_training_progress,
    run_fingerprint,
    save_training_state,
    verify_base,
    verify_parent,
    write_adapter_checkpoint,
)
from ..runtime.distributed import World, all_true, barrier, world
from ..runtime.training import build_optimizer, noise_generator, update_step
from ..scoring.objective import pack_targets
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
    a GPU: docs/design.md). Memory grows with the update's tokens instead of a microbatch's.

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
    return run_fingerprint(config, [run.data, run.base] + ([run.parent] if run.parent else []), source_digests())


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
        self.template = Template.of(tokenizer, processor, run.model)
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
                save_training_state(tmp, self.model, self.peft_model, self.optimizer,
                                    {"update": self.update, "fingerprint": self.fingerprint, "log": self.log,
                                     "processes": self.place.size})
        barrier(self.place)

    def try_resume(self) -> str | None:
        """Restore the saved state if it belongs to this run.

        Returns:
            None when resumed, else why not (no state, a damaged state, another
            configuration, or a saved run already past the step budget).
        """
        state = self.run.out / "state"
        progress, reason = read_training_progress(state)
        if reason is not None:
            return reason
        if progress["fingerprint"] != self.fingerprint:
            return "the saved state belongs to another configuration, input or code version"
        if progress["update"] > self.run.train.steps:
            return (f"the saved run reached update {progress['update']}, past train.steps = "
                    f"{self.run.train.steps} (only the budget may grow on resume)")
        load_training_state(state, self.model, self.peft_model, self.optimizer, self.device)
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
