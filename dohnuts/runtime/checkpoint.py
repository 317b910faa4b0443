"""Every checkpoint folder: bases, adapter checkpoints, merged and deployable models, the
resumable training state; their manifests and fingerprints, written and verified here."""

from __future__ import annotations

import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import LoraConfig, ModelConfig, build, json_ready, to_dict
from ..inputs.pixels import PixelSettings
from ..inputs.template import Template
from ..io import MANIFEST, IntegrityError, read_json, verify_manifest, write_json, write_manifest
from ..model.adapters import adapter_state, load_adapter_state, with_lora
from ..model.base import import_backbone, load_backbone, load_image_processor, load_processors
from ..model.decision import DTYPES, HEAD_KEY, DecisionModel, new_head
from ..schema import QUESTION_TYPES
from ..scoring.calibrator import Calibrator
from .training_graphs import TrainingGraphs
from .vision_graphs import VisionGraphs

ADAPTER = "adapter.safetensors"  # unmerged LoRA + head weights in a checkpoint folder
CONFIG = "config.json"  # beside it: the run's resolved configuration, LoRA settings and base
HEAD = "head.safetensors"  # a merged folder's head
SETTINGS = "dohnuts.json"  # a merged folder's model settings and resolved configuration
CALIBRATION = "calibration.json"  # a deployable folder's calibrator (`scoring.calibrator`)
TEMPERATURES = "temperatures.json"  # what a deployable folder held before: one temperature a type
OPTIMIZER = "optimizer.pt"  # the training state's optimizer (tensors and numbers only)
PROGRESS = "progress.json"  # the training state's update count, fingerprint and log
GENERATORS = "generators.safetensors"  # torch, CUDA and noise generator states
HOST_GENERATORS = "generators.json"  # Python's and numpy's


def assemble(backbone, head: torch.nn.Linear) -> DecisionModel:
    """The decision model with the runtime's CUDA graph holders: the vision tower's graphs for
    prediction and the training buckets' graphs (each captures only on CUDA)."""
    return DecisionModel(backbone, head, vision_graphs=VisionGraphs(), training_graphs=TrainingGraphs())


# -- bases ---------------------------------------------------------------------------------


def verify_base(base: Path) -> None:
    """Check the base folder against the SHA-256 manifest prepare wrote."""
    verify_manifest(base, required=("config.json",))


def base_fingerprint(base: Path) -> str:
    """SHA-256 of a base folder's manifest entries (every file's digest): which base weights,
    tokenizer and processor an adapter was trained on."""
    files = read_json(Path(base) / MANIFEST)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


# -- adapter checkpoints (unmerged LoRA + head) ----------------------------------------------


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
    return assemble(peft_model.get_base_model(), head), peft_model


def save_adapter(path: Path, model: DecisionModel, peft_model) -> None:
    save_file(adapter_state(model, peft_model), str(path))


def load_adapter(path: Path, model: DecisionModel, peft_model) -> None:
    """Load LoRA and head weights from a file (`model.adapters.load_adapter_state` checks them).

    Raises:
        ValueError: missing, unexpected or mis-shaped keys.
    """
    load_adapter_state(model, peft_model, load_file(str(path)), str(path))


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


# -- merged and deployable checkpoints -------------------------------------------------------


def write_merged(folder: Path, backbone, head: torch.nn.Linear, tokenizer, image_processor,
                 model_config: ModelConfig, resolved: dict, calibrator: Calibrator | None = None) -> None:
    """Write a self-describing folder: HF backbone, head, tokenizer, processor, settings, manifest.

    With `calibrator` it is the deployable checkpoint `Predictor.from_checkpoint` loads.
    """
    folder = Path(folder)
    backbone.save_pretrained(folder)
    save_file({HEAD_KEY: head.weight.detach().float().cpu().contiguous()}, str(folder / HEAD))
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    write_json(folder / SETTINGS, {"model": to_dict(model_config), "resolved": json_ready(resolved)})
    if calibrator is not None:
        write_json(folder / CALIBRATION, calibrator.to_json())
    write_manifest(folder)


def load_merged(folder: Path, device: torch.device, need_calibration: bool = False):
    """Load a merged folder after checking every SHA-256.

    Returns:
        (DecisionModel in eval mode on `device`, Template, ModelConfig, Calibrator or None)
    """
    model_config, calibrator = checked_while_importing(folder, need_calibration)
    tokenizer, processor = load_processors(folder, model_config)
    return load_network(folder, model_config, device), Template.of(tokenizer, processor, model_config), \
        model_config, calibrator


def checked_while_importing(folder: Path, need_calibration: bool):
    """`read_merged` (every SHA-256 checked) on a thread while this one imports the backbone's
    code, which nothing of the folder reaches: hashing releases the interpreter's lock, so the
    two overlap. For the shape-only 0.8B on this project's CPU the 1.7 GB hash took about 1 s
    and the imports about 3 s of a 4 to 5 s read. Nothing is read from the folder's weights
    before the check has passed."""
    with ThreadPoolExecutor(1, thread_name_prefix="manifest") as pool:
        checked = pool.submit(read_merged, folder, need_calibration)
        import_backbone()
        return checked.result()


def read_merged(folder: Path, need_calibration: bool, unread: tuple[str, ...] = ()):
    """A merged folder's settings after checking its SHA-256 manifest (the files ending in one of
    `unread` only for being there: a caller that will not read them).

    Returns:
        (ModelConfig, Calibrator or None): the calibrator of its calibration.json, or of an older
        folder's temperatures.json (one temperature a type, no abstention)

    Raises:
        ValueError: a merged model without a calibrator where one is needed, or a bad one.
        IntegrityError: a missing or changed file.
    """
    folder = Path(folder)
    calibrated = next((name for name in (CALIBRATION, TEMPERATURES) if (folder / name).is_file()), None)
    if need_calibration and (folder / SETTINGS).is_file() and calibrated is None:
        raise ValueError(f"{folder} is a merged model without calibration: run the calibrate stage and "
                         f"load its output (runs/calibrate/checkpoint)")
    required = (HEAD, SETTINGS) + ((calibrated or CALIBRATION,) if need_calibration else ())
    verify_manifest(folder, required=required, unread=unread)
    settings = read_json(folder / SETTINGS)
    # A checkpoint from before `choice_order` existed was trained and served in the given order;
    # one from before `image_layout`, with its image's block before the state.
    model = {"choice_order": "given", "image_layout": "front", **settings["model"]}
    model_config = build(ModelConfig, model, f"{folder}/{SETTINGS} model")
    if calibrated == CALIBRATION:
        return model_config, Calibrator.from_json(read_json(folder / CALIBRATION), f"{folder}/{CALIBRATION}")
    if calibrated == TEMPERATURES:
        temperatures = {kind: float(value) for kind, value in read_json(folder / TEMPERATURES).items()}
        bad = {kind: value for kind, value in temperatures.items() if not value > 0}
        if set(temperatures) != set(QUESTION_TYPES) or bad:
            raise ValueError(f"{folder}/{TEMPERATURES} must give a positive temperature for each of "
                             f"{QUESTION_TYPES}, got {json.dumps(temperatures)}")
        return model_config, Calibrator.per_type(temperatures)
    return model_config, None


def load_network(folder: Path, model_config: ModelConfig, device: torch.device) -> DecisionModel:
    """A merged folder's model in eval mode on `device`, its graph holders handed in (verify the
    folder first: `read_merged`)."""
    backbone = load_backbone(folder, DTYPES[model_config.dtype])
    head = torch.nn.Linear(backbone.config.text_config.hidden_size, 1, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(load_file(str(folder / HEAD))[HEAD_KEY])
    model = assemble(backbone, head).to(device).eval()
    model.requires_grad_(False)
    return model


def load_front(folder: Path) -> tuple[Template, ModelConfig, Calibrator]:
    """What a server's front end reads of a deployable folder: its template (tokenizer and image
    processor), settings and calibrator, every file's SHA-256 checked but the weights' (the
    engine, which reads them, checks those).

    Raises:
        as `read_merged`.
    """
    model_config, calibrator = read_merged(folder, need_calibration=True, unread=(".safetensors",))
    tokenizer, processor = load_processors(folder, model_config)
    return Template.of(tokenizer, processor, model_config), model_config, calibrator


def load_engine(folder: Path, device: torch.device):
    """What a server's engine reads of a deployable folder (every SHA-256 checked): the model and
    the pixel settings its images' bytes become patches under; no tokenizer.

    Returns:
        (DecisionModel in eval mode on `device`, ModelConfig, PixelSettings or None)
    """
    model_config, _ = checked_while_importing(folder, need_calibration=True)
    return (load_network(folder, model_config, device), model_config,
            PixelSettings.of(load_image_processor(folder, model_config)))


# -- the resumable training state --------------------------------------------------------------


def run_fingerprint(config: dict, manifests: list[Path], sources: dict[str, str]) -> str:
    """Identity of a training run for resuming: its configuration, the file digests of its
    inputs' manifests (`manifests`: folders) and `sources` (module -> SHA-256 of what it runs)."""
    inputs = [read_json(Path(folder) / MANIFEST)["files"] for folder in manifests]
    return hashlib.sha256(json.dumps([config, inputs, sources], sort_keys=True).encode()).hexdigest()


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


def save_training_state(folder: Path, model: DecisionModel, peft_model, optimizer: torch.optim.Optimizer,
                        progress: dict) -> None:
    """Everything needed to continue a run exactly, into `folder` (new and empty, e.g. an
    `io.atomic_directory`): LoRA and head weights, the optimizer, every random generator,
    `progress` (update count, fingerprint, log) and a SHA-256 manifest."""
    folder = Path(folder)
    save_adapter(folder / ADAPTER, model, peft_model)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER)  # tensors and numbers only
    save_generators(folder)
    write_json(folder / PROGRESS, progress)
    write_manifest(folder)


def read_training_progress(folder: Path) -> tuple[dict | None, str | None]:
    """The progress of a saved training state after checking its manifest.

    Returns:
        (progress, None), or (None, why not: no state, or a damaged one).
    """
    folder = Path(folder)
    if not (folder / PROGRESS).is_file():
        return None, f"no saved state in {folder}"
    try:
        verify_manifest(folder)
    except IntegrityError as error:
        return None, f"the saved state is damaged ({error})"
    return read_json(folder / PROGRESS), None


def load_training_state(folder: Path, model: DecisionModel, peft_model, optimizer: torch.optim.Optimizer,
                        device) -> None:
    """Restore weights, optimizer and generators from what `save_training_state` wrote (check it
    first with `read_training_progress`)."""
    folder = Path(folder)
    load_adapter(folder / ADAPTER, model, peft_model)
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER, map_location=device, weights_only=True))
    load_generators(folder)
