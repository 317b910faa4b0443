"""The decision model: Qwen3.5 backbone without an LM head, LoRA, a float32 head at markers."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .base import load_backbone
from .decoder import Prefixes, Segments, packed_forward
from .features import ImageFeatureCache
from .config import LoraConfig, to_dict
from .io import read_json, verify_manifest
from .batch import Batch

ADAPTER = "adapter.safetensors"  # unmerged LoRA + head weights in a checkpoint folder
HEAD_KEY = "head.weight"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    """CUDA when present, else the CPU: the one execution policy picks the device, not a flag."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def image_features(visual, pixel_values, grid_thw) -> torch.Tensor:
    """Frozen vision tower: the merged features of every image, concatenated [tokens, D]."""
    with torch.no_grad():
        output = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw)
    # transformers >= 5 returns a model output whose pooler_output holds the merged features.
    return getattr(output, "pooler_output", output)


class DecisionModel(nn.Module):
    """Scores every candidate of every row with one scalar logit.

    `backbone` is a Hugging Face `Qwen3_5Model` (LoRA may be injected into its language
    model); `head` is Linear(hidden, 1) in float32.
    """

    def __init__(self, backbone, head: nn.Linear, activation_checkpointing: bool = False):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.activation_checkpointing = activation_checkpointing  # recompute layers in training
        self.backbone.visual.requires_grad_(False)
        self.image_cache = ImageFeatureCache()  # new and empty for every model
        self.generation = 0  # bumped whenever parameters may have moved (see `changed`)

    def changed(self) -> None:
        """Say that parameters moved or modules were replaced (e.g. LoRA injected): captured
        CUDA graphs and cached image features no longer apply."""
        self.image_cache.clear()
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
        features = self.image_cache.features(batch.image_keys, batch.pixel_values, batch.image_grid_thw_cpu,
                                             batch.image_has_pixels,
                                             lambda pixels, grid: image_features(visual, pixels, grid),
                                             visual.spatial_merge_size**2)
        return embeds.index_put((batch.image_slots,), features[batch.image_sources].to(embeds.dtype))

    def language(self, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Final hidden states of the rows' own tokens [S, D], packed one row after another.

        Shared prefixes (`batch.fork`) run once, in the same pass as the rows, and every row
        continues its prefix's states.
        """
        prefixes = None
        if batch.fork is not None:
            prefixes = Prefixes(batch.prefix_tokens, Segments.of(batch.prefix_cu_seqlens, batch.prefix_cu_seqlens_cpu,
                                                                 batch.prefix_chunk_indices), batch.fork)
        return packed_forward(self.backbone.language_model, embeds, batch.position_ids, batch.cu_seqlens,
                              self.activation_checkpointing and self.training, prefixes, batch.cu_seqlens_cpu,
                              batch.chunk_indices)

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """Final hidden states of the rows' own tokens [S, D] (see `language`)."""
        return self.language(self.embeddings(batch), batch)

    def scores(self, embeds: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Logits [B, K] float32 (0 where masked) from the input embeddings: the part of the
        forward with no host-side decisions, which a CUDA graph can replay."""
        picked = self.language(embeds, batch)[batch.markers]  # [B, K, D]
        logits = self.head(picked.to(self.head.weight.dtype)).squeeze(-1)  # [B, K], the head in float32
        return logits.masked_fill(~batch.candidate_mask, 0.0)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch on the model's device. Returns: logits [B, K] float32 (0 where masked)."""
        return self.scores(self.embeddings(batch), batch)


def new_head(hidden_size: int, std: float, generator: torch.Generator | None = None) -> nn.Linear:
    head = nn.Linear(hidden_size, 1, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.normal_(0.0, std, generator=generator)
    return head


def lora_target_pattern(targets) -> str:
    """peft target regex: the listed projections of the language model only, never vision."""
    return rf".*language_model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.({'|'.join(targets)})"


def with_lora(backbone, lora: LoraConfig, seed: int):
    """Inject LoRA adapters into the language model (in place); returns the peft model."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(seed)  # LoRA A matrices are initialised from the global generator
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                            target_modules=lora_target_pattern(lora.targets))
    return get_peft_model(backbone, config)


def build_training_model(base: Path, dtype: str, lora: LoraConfig, head_std: float, seed: int):
    """A fresh trainable model: base backbone (verify it once per run with `verify_base`), new
    LoRA, new head.

    Returns:
        (model, peft_model)
    """
    backbone = load_backbone(base, DTYPES[dtype])
    peft_model = with_lora(backbone, lora, seed)
    generator = torch.Generator().manual_seed(seed)
    head = new_head(backbone.config.text_config.hidden_size, head_std, generator)
    return DecisionModel(peft_model.get_base_model(), head), peft_model


def adapter_state(model: DecisionModel, peft_model) -> dict[str, torch.Tensor]:
    """The trainable weights (LoRA and head) under stable names."""
    from peft import get_peft_model_state_dict

    state = {f"lora.{key}": value.detach().float().contiguous()
             for key, value in get_peft_model_state_dict(peft_model).items()}
    state[HEAD_KEY] = model.head.weight.detach().float().contiguous()
    return state


def save_adapter(path: Path, model: DecisionModel, peft_model) -> None:
    save_file(adapter_state(model, peft_model), str(path))


def load_adapter(path: Path, model: DecisionModel, peft_model) -> None:
    """Load LoRA and head weights, refusing a file whose keys or shapes differ from the model's.

    Raises:
        ValueError: missing, unexpected or mis-shaped keys.
    """
    from peft import set_peft_model_state_dict

    loaded = load_file(str(path))
    expected = adapter_state(model, peft_model)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    wrong = sorted(key for key in set(expected) & set(loaded) if expected[key].shape != loaded[key].shape)
    if missing or unexpected or wrong:
        shapes = [f"{key}: {tuple(loaded[key].shape)} vs {tuple(expected[key].shape)}" for key in wrong[:3]]
        raise ValueError(
            f"{path} does not fit this model: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}, mis-shaped {shapes}"
        )
    lora = {key[len("lora."):]: value for key, value in loaded.items() if key.startswith("lora.")}
    result = set_peft_model_state_dict(peft_model, lora)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{path}: peft rejected keys {result.unexpected_keys[:3]}")
    with torch.no_grad():
        model.head.weight.copy_(loaded[HEAD_KEY])


def load_adapter_model(base: Path, dtype: str, lora: LoraConfig, folder: Path, device):
    """The base with LoRA and head from a checkpoint folder whose manifest is verified first.

    Returns:
        (DecisionModel in eval mode on `device`, peft model)
    """
    verify_manifest(folder, required=(ADAPTER,))
    check_adapter_config(folder, lora)
    model, peft_model = build_training_model(base, dtype, lora, head_std=0.01, seed=0)
    load_adapter(Path(folder) / ADAPTER, model, peft_model)
    return model.to(device).eval(), peft_model


def verify_base(base: Path) -> None:
    """Check the base folder against the SHA-256 manifest prepare wrote."""
    verify_manifest(base, required=("config.json",))


def check_adapter_config(folder: Path, lora: LoraConfig) -> None:
    """Refuse a checkpoint trained with other LoRA settings: alpha or dropout differences keep
    every shape yet change what the weights mean.

    Raises:
        ValueError: naming each differing setting.
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    saved = read_json(path).get("lora")
    if saved is None:
        return
    wanted = to_dict(lora)
    differ = {key: (saved.get(key), wanted[key]) for key in wanted if saved.get(key) != wanted[key]}
    if differ:
        details = ", ".join(f"lora.{key}: checkpoint {a!r}, params {b!r}" for key, (a, b) in differ.items())
        raise ValueError(f"{folder} was trained with other LoRA settings ({details})")
