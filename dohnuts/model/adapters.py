"""LoRA adapters: injection, the unmerged LoRA + head file of a checkpoint, and its verification."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import LoraConfig, to_dict
from ..io import MANIFEST, read_json, verify_manifest, write_json, write_manifest
from .base import load_backbone
from .decision import DTYPES, HEAD_KEY, DecisionModel, new_head

ADAPTER = "adapter.safetensors"  # unmerged LoRA + head weights in a checkpoint folder
CONFIG = "config.json"  # beside it: the run's resolved configuration, LoRA settings and base


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


def base_fingerprint(base: Path) -> str:
    """SHA-256 of a base folder's manifest entries (every file's digest): which base weights,
    tokenizer and processor an adapter was trained on."""
    files = read_json(Path(base) / MANIFEST)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_adapter_checkpoint(folder: Path, model: DecisionModel, peft_model, config: dict,
                             manifest: dict | None = None) -> None:
    """An unmerged checkpoint in `folder` (which must exist, empty): adapter.safetensors,
    config.json (`config`, which must hold the "lora" settings and the "base" fingerprint the
    loaders check) and a SHA-256 manifest (with `manifest`'s entries)."""
    missing = {"lora", "base"} - set(config)
    if missing:
        raise ValueError(f"an adapter checkpoint's config must state {sorted(missing)}")
    save_adapter(Path(folder) / ADAPTER, model, peft_model)
    write_json(Path(folder) / CONFIG, config)
    write_manifest(folder, manifest)


def load_adapter_model(base: Path, dtype: str, lora: LoraConfig, folder: Path, device):
    """The base with LoRA and head from a checkpoint folder, after `verify_adapter_checkpoint`.

    Returns:
        (DecisionModel in eval mode on `device`, peft model)
    """
    verify_adapter_checkpoint(folder, lora, base)
    model, peft_model = build_training_model(base, dtype, lora, head_std=0.01, seed=0)
    load_adapter(Path(folder) / ADAPTER, model, peft_model)
    return model.to(device).eval(), peft_model


def verify_base(base: Path) -> None:
    """Check the base folder against the SHA-256 manifest prepare wrote."""
    verify_manifest(base, required=("config.json",))


def verify_adapter_checkpoint(folder: Path, lora: LoraConfig, base: Path) -> Path:
    """Check an unmerged checkpoint before loading it: every SHA-256 of its manifest, no file
    beside them that the manifest does not list, the LoRA settings it states (alpha or dropout
    differences keep every shape yet change what the weights mean) and the base it was trained
    on (by `base_fingerprint`). Returns its adapter file.

    Raises:
        IntegrityError: a missing, changed or unlisted file; ValueError: a missing or differing
            setting, or another base, each named.
    """
    folder = Path(folder)
    verify_manifest(folder, required=(ADAPTER, CONFIG), complete=True)
    saved = read_json(folder / CONFIG)
    if not isinstance(saved.get("lora"), dict):
        raise ValueError(f"{folder}/{CONFIG} does not state its LoRA settings (no 'lora' mapping): it cannot be "
                         f"checked against the params, so it is refused")
    wanted = to_dict(lora)
    differ = {key: (saved["lora"].get(key), wanted[key]) for key in wanted if saved["lora"].get(key) != wanted[key]}
    if differ:
        details = ", ".join(f"lora.{key}: checkpoint {a!r}, params {b!r}" for key, (a, b) in differ.items())
        raise ValueError(f"{folder} was trained with other LoRA settings ({details})")
    expected = base_fingerprint(base)
    if saved.get("base") != expected:
        raise ValueError(f"{folder} was trained on another base (fingerprint {saved.get('base')!r}; this base "
                         f"{base} is {expected!r}): its LoRA weights would not mean what they meant")
    return folder / ADAPTER


def verify_parent(parent: Path, lora: LoraConfig, base: Path) -> Path:
    """The parent's adapter file for `init: checkpoint`, after `verify_adapter_checkpoint`.

    Raises:
        FileNotFoundError: no parent checkpoint there; IntegrityError, ValueError: as
            `verify_adapter_checkpoint`.
    """
    parent = Path(parent)
    if not (parent / ADAPTER).is_file():
        raise FileNotFoundError(
            f"init: checkpoint needs a parent checkpoint in {parent}, but it holds no {ADAPTER}; "
            f"publish one first (python -m stages.publish --source runs/select/adapter --target {parent})"
        )
    return verify_adapter_checkpoint(parent, lora, base)
