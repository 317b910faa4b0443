"""The RLCD + cross-entropy objective on candidate logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ObjectiveConfig
from .metrics import masked_log_softmax, ranked_probability_score, soft_nll


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, differentiable in the logits
    reward_mean: torch.Tensor  # scalar, no grad
    cross_entropy: torch.Tensor  # scalar, no grad


def rlcd_loss(logits: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, ordinal: torch.Tensor,
              config: ObjectiveConfig, generator: torch.Generator | None = None) -> ObjectiveOutput:
    """RLCD with a cross-entropy term for one microbatch.

    Args:
        logits: mu [B, K] float32.
        mask: [B, K] bool, valid candidates (a prefix of each row).
        targets: [B, K] distributions over valid candidates, or [B] class indices.
        ordinal: [B] bool, rows whose candidates are ordered levels (score questions).
        config: the objective constants.
        generator: source of the exploration noise (the global one when None); the noise
            is exactly one randn((samples, B, K)) draw, before anything else.

    Returns:
        loss, reward mean and the cross-entropy term.
    """
    samples, sigma = config.samples, config.sigma
    if targets.dim() == 1:
        targets = torch.nn.functional.one_hot(targets, logits.shape[-1]).to(logits.dtype)
    targets = targets.to(logits.dtype) * mask
    valid = mask.to(logits.dtype)
    noise = torch.randn((samples, *logits.shape), generator=generator, device=logits.device,
                        dtype=logits.dtype) * sigma * valid
    # Centre the noise over each row's valid candidates: a shift of all logits is no action.
    noise = noise - noise.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True) * valid
    actions = (logits.detach() + noise).detach()  # [G, B, K]

    with torch.no_grad():
        log_p = masked_log_softmax(actions, mask)
        p = log_p.exp()
        log_score = (targets * log_p.clamp(min=config.log_floor)).sum(-1)
        spherical = (targets * p).sum(-1) / p.norm(dim=-1)
        reward = config.log_weight * log_score + config.spherical_weight * spherical
        reward = reward - config.ordinal_weight * ordinal.to(logits.dtype) * ranked_probability_score(p, mask, targets)
        advantage = reward - reward.mean(0, keepdim=True)
        advantage = advantage / (advantage.std() + 1e-6)

    log_pi = -0.5 * (((actions - logits) / sigma) ** 2 * valid).sum(-1)  # [G, B]
    policy = -(advantage * log_pi).mean()
    cross_entropy = soft_nll(logits, mask, targets)
    loss = policy + config.ce_weight * cross_entropy
    return ObjectiveOutput(loss, reward.mean(), cross_entropy.detach())


def pack_targets(targets: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Per-microbatch targets [B_i, K_i] as one [sum B_i, max K_i] tensor (zero-padded), with
    each microbatch's (rows, candidate width): the `sizes` of `microbatch_slices`."""
    width = max(target.shape[1] for target in targets)
    padded = torch.cat([torch.nn.functional.pad(target, (0, width - target.shape[1])) for target in targets])
    return padded, [tuple(target.shape) for target in targets]


def microbatch_slices(sizes: list[tuple[int, int]]):
    """(rows, width) of each microbatch of a packed update: its slice of the rows, in order,
    and its own candidate width."""
    start = 0
    for count, width in sizes:
        yield slice(start, start + count), width
        start += count


def microbatch_losses(logits: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, ordinal: torch.Tensor,
                      sizes: list[tuple[int, int]], objective: ObjectiveConfig,
                      generators: list[torch.Generator | None] | None = None) -> list[ObjectiveOutput]:
    """The objective of each microbatch of a packed update, in order, each cut to its own rows
    and candidate width, its exploration noise drawn from its own generator (the global one when
    None), so the noise is exactly the draw of that microbatch run alone."""
    generators = generators or [None] * len(sizes)
    return [rlcd_loss(logits[rows, :width], mask[rows, :width], targets[rows, :width], ordinal[rows], objective,
                      generator) for (rows, width), generator in zip(microbatch_slices(sizes), generators)]
