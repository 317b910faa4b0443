"""The training update: the optimizer over LoRA and the head, exploration noise per microbatch,
and one update of packed microbatches. Training and the benchmark both run it."""

from __future__ import annotations

import hashlib
import math

import torch

from ..config import TrainConfig
from ..model.decision import DecisionModel
from ..scoring.objective import microbatch_losses, microbatch_slices
from .distributed import World, all_true, mean_over_ranks


def build_optimizer(model: DecisionModel, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable weights in two groups: LoRA at `lora_lr`, the head at `head_lr`.

    The fused implementation: one kernel for all the weights of a group, where the default
    launches several per step for the hundreds of small LoRA matrices (host time, which bounds
    a training update on a GPU: docs/design.md)."""
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
