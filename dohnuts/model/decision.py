"""The decision model: Qwen3.5 backbone without an LM head, LoRA, a float32 head at markers."""

from __future__ import annotations

import torch
from torch import nn

from ..inputs.batch import Batch
from .decoder import Prefixes, Segments, forget_stacked, packed_forward
from .features import ImageFeatureCache
from .vision import VisionPlans, image_features, linear_patch_projection

HEAD_KEY = "head.weight"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    """CUDA when present, else the CPU: the one execution policy picks the device, not a flag."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class DecisionModel(nn.Module):
    """Scores every candidate of every row with one scalar logit.

    `backbone` is a Hugging Face `Qwen3_5Model` (LoRA may be injected into its language
    model); `head` is Linear(hidden, 1) in float32. The runtime hands it its CUDA graph
    holders (`runtime.checkpoint.assemble`): `vision_graphs` replays the vision tower outside
    training (`runtime.vision_graphs.VisionGraphs`), `training_graphs(model, batch)` runs a
    training forward on CUDA (`runtime.training_graphs.TrainingGraphs`). Without them the
    model runs eagerly.
    """

    def __init__(self, backbone, head: nn.Linear, activation_checkpointing: bool = False,
                 vision_graphs=None, training_graphs=None):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.activation_checkpointing = activation_checkpointing  # recompute layers in training
        self.backbone.visual.requires_grad_(False)
        linear_patch_projection(self.backbone.visual)
        self.image_cache = ImageFeatureCache()  # new and empty for every model
        self.vision_plans = VisionPlans()  # image grids -> the vision tower's positions and plan
        self.vision_graphs = vision_graphs  # image grids -> the tower's CUDA graph (not in training)
        self.training_graphs = training_graphs  # training buckets -> forward and backward graphs
        self.generation = 0  # bumped whenever parameters may have moved (see `changed`)

    def changed(self) -> None:
        """Say that parameters moved or modules were replaced (e.g. LoRA injected): captured
        CUDA graphs and cached image features no longer apply."""
        self.image_cache.clear()
        self.vision_plans.clear()
        for graphs in (self.vision_graphs, self.training_graphs):
            if graphs is not None:
                graphs.clear()
        forget_stacked()
        self.generation += 1

    def _apply(self, fn, *args, **kwargs):
        # .to(), .double(), .cuda() give parameters new storage or dtype.
        self.changed()
        return super()._apply(fn, *args, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.visual.eval()  # the vision tower is frozen and always in eval mode
        return self

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def embeddings(self, batch: Batch) -> torch.Tensor:
        """Input embeddings [P + S, D] of the batch's tokens, image features in place (through
        the frozen image-feature cache)."""
        embeds = self.backbone.language_model.get_input_embeddings()(batch.input_ids)
        if not batch.image_keys:
            return embeds
        visual = self.backbone.visual
        features = self.image_cache.features(batch.image_keys, batch.patches(), batch.image_grid_thw_cpu,
                                             batch.image_has_pixels,
                                             lambda pixels, grid: image_features(
                                                 visual, pixels, grid, self.vision_plans,
                                                 None if self.training else self.vision_graphs),
                                             visual.spatial_merge_size**2)
        return embeds.index_put((batch.image_slots,), features[batch.image_sources].to(embeds.dtype))

    def language(self, embeds: torch.Tensor, batch: Batch, picked: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the rows' own tokens [S, D], packed one row after another, or
        [M, D] at `picked` [M] of them (`decoder.packed_forward`).

        Shared prefixes (`batch.fork`) run once, in the same pass as the rows, and every row
        continues its prefix's states.
        """
        rows, prefixes = plan_segments(batch)
        return packed_forward(self.backbone.language_model, embeds, batch.position_ids, batch.cu_seqlens,
                              self.activation_checkpointing and self.training, prefixes, batch.cu_seqlens_cpu,
                              batch.chunk_indices, rows.max_seqlen, picked, rows.lone)

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """Final hidden states of the rows' own tokens [S, D] (see `language`)."""
        return self.language(self.embeddings(batch), batch)

    def scores(self, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Logits [B, K] float32 (0 where masked) from the input embeddings: the part of the
        forward with no host-side decisions, which a CUDA graph can replay. The last layer's
        output side runs at the markers only (`decoder.packed_forward`'s `picked`)."""
        return self.logits(self.language(embeds, batch, batch.markers.flatten()), batch.candidate_mask)

    def logits(self, at_markers: torch.Tensor, candidate_mask: torch.Tensor) -> torch.Tensor:
        """The head at the rows' final hidden states at their markers, [B * K, D] in the order
        of `markers` [B, K]: [B, K] float32, 0 where masked."""
        logits = self.head(at_markers.to(self.head.weight.dtype)).view(candidate_mask.shape)  # the head in float32
        return logits.masked_fill(~candidate_mask, 0.0)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch on the model's device. Returns: logits [B, K] float32 (0 where masked).

        In training with gradients on CUDA, through `training_graphs` when the model has them
        (the same logits and gradients, replayed from CUDA graphs where the batch's bucket has
        them)."""
        if (self.training_graphs is not None and self.training and torch.is_grad_enabled()
                and self.device.type == "cuda"):
            return self.training_graphs(self, batch)
        return self.scores(self.embeddings(batch), batch)


def plan_segments(batch: Batch) -> tuple[Segments, Prefixes | None]:
    """The rows' `Segments` and the shared `Prefixes` (None without) of a batch's plan."""
    # Padded to a bucket (prediction's or training's): its sequence counts are the padding's.
    bucket = batch.rows_bound is not None
    rows = Segments.of(batch.cu_seqlens, batch.cu_seqlens_cpu, batch.chunk_indices, batch.rows_bound, bucket,
                       batch.lone_row)
    prefixes = None
    if batch.fork is not None:
        prefixes = Prefixes(batch.prefix_tokens, Segments.of(batch.prefix_cu_seqlens, batch.prefix_cu_seqlens_cpu,
                                                             batch.prefix_chunk_indices, routed=bucket), batch.fork)
    return rows, prefixes


def new_head(hidden_size: int, std: float, generator: torch.Generator | None = None) -> nn.Linear:
    head = nn.Linear(hidden_size, 1, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.normal_(0.0, std, generator=generator)
    return head
